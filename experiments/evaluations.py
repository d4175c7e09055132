"""The evaluation steps of a study: every registered evaluation tool (`experiments.tools`) run by
one loop (`EvaluationSteps.evaluate`, in registration order) as steps skipped by the hash of
their inputs (`experiments.freshness`), each through one skeleton (`EvaluationSteps.execute`:
skip when fresh, clear what a previous run wrote, run, stamp and record); then lm-eval, the
real_text section's two-stage sub-step (not a registered tool: see `experiments.tools`). A
mixin of `experiments.run.Study`, which owns the study (`spec`, `out`, `wandb`, `project`,
`group`, `env`, `repair`) and its bookkeeping (`record`, `checkpoints`, `run_job`)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from ced.checkpoint import load_config
from ced.run_id import IDENTITY, RunId, write_run_id

from .freshness import (DEFAULTS, STAMP, Coverage, plain, read_stamp, recorded_models,
                        step_decision)
from .steps import banner, step_record, stream, write_stamp
from .study import config_hash
from .tools import OVER_MODELS, PER_MODEL, TOOLS, EvaluationTool, JobPlace, Reading, tools


# the name `tools=` gives the real_text section's lm-eval runs (not a registered tool)
LM_EVAL = "lm_eval"


def reference_config(configs: list) -> Any:
    """The first of these model configs with a decoder (or the first; None without any): the
    model whose distances every model of a study is read at."""
    with_decoder = [c for c in configs if c.has_decoder]
    return (with_decoder or configs or [None])[0]


def mode_slug(mode: str) -> str:
    """A directory name for an evals.modes string: replay=W/2 -> replay=W_2, commas -> +."""
    return mode.replace("/", "_").replace(",", "+")


class EvaluationSteps:
    """`Study`'s evaluation steps (see the module's docstring for what they need)."""

    def _fresh(self, label: str, step: dict) -> tuple[str, str]:
        """What to do with `step` (a prepared evaluation step), said in one line
        (`step_decision`): skip (done with these inputs), run, rerun (says what changed) or
        refuse (it would drop models its last run read; on_change=rerun allows it)."""
        action, reason = step_decision(step, self.repair, self.coverage())
        if action == "skip":
            print(f"[study] {label}: {reason}, skipped", flush=True)
        elif action == "rerun":
            print(f"[study] {label}: {reason}; rerunning", flush=True)
        elif action == "refuse":
            print(f"[study] {label}: REFUSED: {reason}", flush=True)
        return action, reason

    def execute(self, step: dict, label: str, run: Callable[[], tuple[int, str]],
                stamp: dict, title: str | None = None, clear: Iterable[Path] = (),
                **failure: Any) -> bool:
        """The skeleton of every evaluation step. `step`: its key, out, done (the file whose
        presence says it finished), hash and inputs. Skipped (and recorded so) when fresh,
        refused (recorded so, its outputs kept) when it would drop models; else the old
        stamp and `clear` are removed, `title` announced, `run()` run (return
        code, last lines), and the step stamped (`step_record` with `stamp`) and recorded ok
        when it exits 0 and `done` exists, recorded failed otherwise (with `failure`'s extra
        fields). True when the step is done (skipped or ok)."""
        key, out, digest = step["key"], step["out"], step["hash"]
        run_id = step.get("run_id")
        action, reason = self._fresh(label, step)
        if action == "refuse":
            self.record(key, "refused", reason=reason, out=str(out))
            return False
        if action == "skip":
            if run_id is not None and not (out / IDENTITY).exists():
                write_run_id(out, run_id)       # a folder of an older driver, brought up to date
            self.record(key, "skipped", out=str(out), hash=digest)
            return True
        for path in (out / STAMP, *clear):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if title is not None:
            banner(title)
        t0 = time.time()
        code, tail = run()
        secs = round(time.time() - t0, 1)
        if code == 0 and step["done"].exists():
            if run_id is not None:
                write_run_id(out, run_id)
            write_stamp(out, step_record(step, **stamp))
            self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
            return True
        print(f"[study] {label}: FAILED (exit {code}); continuing", flush=True)
        self.record(key, "failed", returncode=code, tail=tail, seconds=secs, **failure)
        return False

    def selected(self, name: str) -> bool:
        """Whether the driver's `tools=` lets the tool (or lm_eval) `name` run."""
        return self.selected_tools is None or name in self.selected_tools

    def coverage(self) -> Coverage | None:
        """The models this invocation's steps over models read (every job, this invocation's
        seeds: `experiments.freshness.Coverage`); None under on_change=rerun, which lets a
        narrower reading replace a wider one."""
        if self.on_change == "rerun":
            return None
        return Coverage(frozenset(self.run_ids(all_jobs=True)), self.out / "runs")

    def narrowed(self, key: str) -> str:
        """Why the step over models in `<out>/<key>` will be refused when it runs (its last
        run read a model this invocation leaves out: `Coverage`), or "" if it will not."""
        coverage, stamp = self.coverage(), read_stamp(self.out / key, False)
        return "" if coverage is None else coverage.refusal(recorded_models(stamp))

    def evaluate(self) -> None:
        """Every registered tool's steps (`run_tool`), in registration order, then lm-eval;
        only those `tools=` names, if it names any."""
        for tool in tools():
            if self.selected(tool.name):
                self.run_tool(tool)
        if self.selected(LM_EVAL):
            self.lm_eval()

    def tool_steps(self, tool: EvaluationTool, all_jobs: bool = False) -> tuple[list[dict], str]:
        """The steps of `tool` as they would run now, or none and why. A per model step
        reads one trained checkpoint of the `jobs=` jobs, or of every job with `all_jobs`
        (under each of the tool's variants),
        a step over models every trained checkpoint of the study; either only those the tool
        applies to. Each: key, label, run (the training run it reads), out, done, hash,
        inputs (the options, what the tool computes besides, the training hashes), written,
        options, reading."""
        section = self.spec.evaluations[tool.name]
        checkpoints = self.checkpoints(all_jobs=all_jobs or tool.scope == OVER_MODELS)
        configs = {label: load_config(final) for label, (final, _) in checkpoints.items()}
        usable = {label: ckpt for label, ckpt in checkpoints.items()
                  if tool.applies(configs[label])}
        if not usable:
            return [], f"no trained checkpoint {tool.models}".rstrip()
        reference = reference_config([configs[label] for label in usable])
        if tool.scope == OVER_MODELS:
            return [self._tool_step(tool, section, tool.name,
                                    Reading(usable, configs, reference))], ""
        models = self.run_ids(all_jobs=True)
        upstream = self._upstream_steps(tool)
        if upstream is not None:
            usable = {label: ckpt for label, ckpt in usable.items() if label in upstream}
            if not usable:
                return [], f"no {tool.reads} step of a model it reads"
        return [self._tool_step(tool, section, label, Reading({label: ckpt}, configs, reference,
                                                               variant),
                                models[label].under(**variant),
                                None if upstream is None else upstream[label])
                for label, ckpt in usable.items()
                for variant in tool.variants(section, configs[label])], ""

    def _upstream_steps(self, tool: EvaluationTool) -> dict[str, dict] | None:
        """The steps `tool` reads (`EvaluationTool.reads`), by model label, as trained (no
        eval-time variant); None for a tool that reads none. (A study with the section of
        `tool` has the section it reads: `experiments.study.load_study` checks.)"""
        if not tool.reads:
            return None
        steps, _ = self.tool_steps(TOOLS[tool.reads])
        return {step["label"]: step for step in steps
                if all(value is None for value in step["reading"].variant.values())}

    def _tool_step(self, tool: EvaluationTool, section: Any, run: str,
                   reading: Reading, run_id: RunId | None = None,
                   upstream: dict | None = None) -> dict:
        """One step of `tool` (see `tool_steps`); `run`: the training run it reads (the tool's
        name for a step over models); `run_id`: a per model step's model and overrides (its
        folder's name and run.json); `upstream`: the step of the same model it reads
        (`EvaluationTool.reads`), whose hash its own covers."""
        label = run if run_id is None else run_id.label
        options = tool.options(section, reading)
        trained = sorted(digest for _, digest in reading.checkpoints.values())
        inputs = {tool.hashed_as or tool.name: options,
                  DEFAULTS: tool.defaults(exclude=options), **tool.computed(options, reading),
                  "trained": trained if tool.scope == OVER_MODELS else trained[0]}
        if upstream is not None:
            inputs["reads"] = {tool.reads: upstream["hash"]}
        key = tool.name if tool.scope == OVER_MODELS else f"{tool.name}/{label}"
        out = self.out / key
        return {"key": key, "label": label, "run": run, "run_id": run_id, "out": out,
                "done": out / tool.done,
                "hash": config_hash(inputs), "inputs": inputs, "upstream": upstream,
                "written": {tool.name: plain(section)}, "options": options, "reading": reading}

    def run_tool(self, tool: EvaluationTool) -> None:
        """Every step of `tool`, if the study has its section: each rerun when a checkpoint it
        reads or its resolved options change; none to run is recorded as skipped, with why."""
        if self.spec.evaluations.get(tool.name) is None:
            return
        steps, why = self.tool_steps(tool)
        if not steps:
            self.record(tool.name, "skipped", reason=why)
        for step in steps:
            self._run_tool_step(tool, step)
        if tool.merge and steps:
            self._merge_tool(tool)

    def merge_step(self, tool: EvaluationTool) -> tuple[dict | None, list[str], str]:
        """The merge of a per model tool's steps (`EvaluationTool.merge`) as it would run now,
        over the steps of every trained model it applies to (every job); or None, the keys of
        the steps not done with their current inputs (the merge waits for them) and why. Its
        hash covers theirs; key and folder are the tool's name."""
        steps, why = self.tool_steps(tool, all_jobs=True)
        pending = [step["key"] for step in steps if step_decision(step, False)[0] != "skip"]
        if not steps or pending:
            return None, pending, why or f"{', '.join(pending)} not done with the current inputs"
        checkpoints = {label: ckpt for step in steps
                       for label, ckpt in step["reading"].checkpoints.items()}
        first = steps[0]["reading"]
        inputs = {"merges": {step["label"]: step["hash"] for step in steps}}
        out = self.out / tool.name
        return {"key": tool.name, "label": tool.name, "out": out, "done": out / tool.done,
                "hash": config_hash(inputs), "inputs": inputs,
                "written": steps[0]["written"], "options": steps[0]["options"],
                "reading": Reading(checkpoints, first.configs, first.reference),
                "readings": [str(step["out"]) for step in steps]}, [], ""

    def _merge_tool(self, tool: EvaluationTool) -> None:
        """The merge step of `tool` (`merge_step`), run as `python -m experiments.job --merge`
        through `execute`; while a step it merges is not done, recorded skipped with why, and
        the merged files of an earlier merge removed (they no longer cover every model)."""
        step, _, why = self.merge_step(tool)
        if step is None:
            out = self.out / tool.name
            if not self.narrowed(tool.name):       # a narrower invocation keeps it
                for path in (out / STAMP, *(out / name for name in tool.cleared())):
                    path.unlink(missing_ok=True)
            print(f"[study] {tool.name}: merge waits: {why}", flush=True)
            self.record(tool.name, "skipped", reason=why)
            return
        out, readings = step["out"], step["readings"]
        place = JobPlace(out=str(out), checkpoints=step["reading"].paths, wandb=self.wandb,
                         project=self.project, group=self.group, inputs=tuple(readings),
                         merges=True)
        job = tool.job_config(step["options"], place)
        log = self.out / "logs" / f"{tool.name}_merge.log"
        self.execute(step, tool.name,
                     lambda: self.run_job(tool, job, log.with_suffix(".json"), log, readings),
                     {"checkpoints": place.checkpoints},
                     title=f"{tool.name}: merge {len(readings)} models",
                     clear=[out / name for name in tool.cleared()], log=str(log))

    def _run_tool_step(self, tool: EvaluationTool, step: dict) -> None:
        """One step of `tool` (`tool_steps`): its config written beside its log, and run as
        `python -m experiments.job` through `execute`."""
        key, out, options, upstream = step["key"], step["out"], step["options"], step["upstream"]
        if upstream is not None and step_decision(upstream, self.repair)[0] != "skip":
            # the step it reads failed, or holds what older inputs wrote: nothing to read yet
            print(f"[study] {key}: its {tool.reads} step {upstream['key']} is not done with "
                  "the current inputs; skipped", flush=True)
            self.record(key, "skipped", reason=f"{upstream['key']} not done")
            return
        place = JobPlace(out=str(out), checkpoints=step["reading"].paths, wandb=self.wandb,
                         project=self.project, group=self.group,
                         inputs=() if upstream is None else (str(upstream["out"]),))
        job = tool.job_config(options, place)
        log = self.out / "logs" / f"{key.replace('/', '_')}.log"
        label = key.replace("/", " ", 1)
        reads = ({"checkpoint": place.checkpoints[0]} if tool.scope == PER_MODEL else
                 {"checkpoints": place.checkpoints})
        shown = [f"{len(place.checkpoints)} checkpoints"] if tool.scope == OVER_MODELS else []
        shown += [f"{name}={options[name]}" for name in tool.shown if name in options]
        self.execute(step, label, lambda: self.run_job(tool, job, log.with_suffix(".json"), log),
                     reads, title=f"{label}: {', '.join(shown)}",
                     clear=[out / name for name in tool.cleared()], log=str(log))

    def lm_eval(self) -> None:
        """lm-eval's CLI (`python -m evals.lmeval`) over the code tasks, per checkpoint of the
        `jobs=` jobs and mode (each a step skipped by hash), then
        `analysis.real_text.write_lm_eval` over them and every other job's runs done with the
        current inputs (a job outside `jobs=` is not run, and its finished runs stay in the
        tables); refused, the tables kept, when they would drop a model (`lm_eval_refusal`)."""
        spec = self.spec.evaluations.get("real_text")
        if spec is None or not (spec.lm_eval_modes or spec.lm_eval_turn_modes):
            return
        unknown = sorted(set(spec.lm_eval_jobs or []) - {j.name for j in self.spec.jobs})
        if unknown:
            self.record("lm_eval", "failed", error=f"real_text.lm_eval_jobs: no job(s) "
                        f"{unknown} in study {self.spec.name}")
            return
        current, left_out = self.lm_eval_others()
        for tasks_step, runs in self._lm_eval_steps():
            if not self._code_tasks(tasks_step):
                continue
            for step in runs:
                current.append(step["out"])
                self._lm_eval_run(step)
        reason = self.lm_eval_refusal()
        if reason:
            print(f"[study] lm_eval: REFUSED: {reason}", flush=True)
            self.record("lm_eval", "refused", reason=reason)
            return
        # lazy: analysis.real_text costs ~0.3 s to import (its plots), and only a study with
        # lm-eval modes gets here
        from analysis.real_text import write_lm_eval
        try:
            written = write_lm_eval(self.out / "real_text" / "lm_eval", self.out / "real_text",
                                    runs=current)
            if left_out:        # said, as a merge says what it waits for
                print(f"[study] lm_eval tables leave out {', '.join(left_out)}: not done with "
                      "the current inputs, and outside jobs=", flush=True)
            self.record("lm_eval", "ok", out=str(written["lm_eval"]), left_out=left_out)
        except (FileNotFoundError, ValueError) as exc:
            self.record("lm_eval", "failed", error=str(exc))

    def lm_eval_others(self) -> tuple[list[Path], list[str]]:
        """The lm-eval runs of the jobs outside `jobs=` (none when it is unset): (the folders of
        those done with the current inputs, which the tables keep; the keys of the others,
        which they leave out)."""
        chosen, kept, left_out = self.run_ids(), [], []
        for tasks_step, runs in self._lm_eval_steps(all_jobs=True):
            if tasks_step["label"] in chosen:
                continue
            for step in runs:
                if step_decision(step, False)[0] == "skip":
                    kept.append(step["out"])
                else:
                    left_out.append(step["key"])
        return kept, left_out

    def lm_eval_refusal(self) -> str:
        """Why lm-eval's tables are not rewritten, or "": they last held a model (their
        outcomes' `run`) that this invocation leaves out though still trained here
        (`experiments.freshness.Coverage`, as for a step over models); on_change=rerun
        allows it."""
        # lazy, both: only a study with lm-eval gets here
        import pandas as pd
        from evals.lm_eval_outcomes import LM_EVAL_OUTCOMES
        coverage, path = self.coverage(), self.out / "real_text" / LM_EVAL_OUTCOMES
        if coverage is None or not path.exists():
            return ""
        return coverage.refusal(pd.read_csv(path, usecols=["run"])["run"])

    def _lm_eval_steps(self, all_jobs: bool = False):
        """Per checkpoint (of the `jobs=` jobs unless `all_jobs`) lm-eval reads, as they would
        run now: (its code-tasks step, its lm-eval run steps, one per mode and task group)."""
        spec, root = self.spec.evaluations["real_text"], self.out / "real_text" / "lm_eval"
        args = ["--examples", str(spec.lm_eval_examples), "--context",
                str(spec.lm_eval_context), "--min-distance", str(spec.lm_eval_min_distance),
                *(["--max-files", str(spec.max_files)] if spec.max_files else [])]
        models = self.run_ids(all_jobs=True)
        for label, (final, trained) in self.checkpoints(all_jobs).items():
            if spec.lm_eval_jobs is not None and models[label].job not in spec.lm_eval_jobs:
                continue
            cfg = load_config(final)
            replays = cfg.has_decoder and not cfg.traits.exact_early_exit
            tasks = root / label / "tasks"
            inputs = {"tasks": args, "trained": trained}
            tasks_step = {"key": f"lm_eval/{label}", "label": label, "out": tasks,
                          "done": tasks / "ced_code.yaml", "hash": config_hash(inputs),
                          "inputs": inputs, "final": final, "args": args}
            runs = [(m, "ced_code") for m in (spec.lm_eval_modes if replays else ["full"])]
            runs += [(m, "ced_code_turn") for m in (spec.lm_eval_turn_modes if replays else [])]
            steps = []
            for mode, group in runs:
                out = root / label / group / mode_slug(mode)
                inputs = {"mode": mode, "group": group, "tasks": args,
                          "batch_size": spec.lm_eval_batch_size, "trained": trained}
                steps.append({"key": f"lm_eval/{label}/{group}/{mode}", "out": out,
                              "done": out / "mode.txt", "hash": config_hash(inputs),
                              "inputs": inputs, "final": final, "tasks": tasks,
                              "label": label})
            yield tasks_step, steps

    def _code_tasks(self, step: dict) -> bool:
        """The code tasks of one checkpoint (its W, its held-out files), written once per
        settings and checkpoint; False (recorded) if writing them failed."""
        label, final = step["label"], step["final"]
        return self.execute(step, f"lm_eval tasks {label}", lambda: stream(
            [sys.executable, "-m", "evals.lmeval", "write-code-tasks", "--checkpoint",
             str(final), "--out", str(step["out"]), *step["args"]],
            self.out / "logs" / f"lm_eval_tasks_{label.replace('/', '_')}.log", self.env),
            {"checkpoint": str(final)})

    def _lm_eval_run(self, step: dict) -> None:
        """One lm-eval run of one checkpoint, mode and task group (`_lm_eval_steps`)."""
        key, out, final, tasks = step["key"], step["out"], step["final"], step["tasks"]
        mode, group = step["inputs"]["mode"], step["inputs"]["group"]
        # the code tasks' contexts start mid-file: no BOS, as training rows had none there
        model_args = f"checkpoint={final},mode={mode.replace(',', ';')},bos=false"
        cmd = [sys.executable, "-m", "evals.lmeval", "--model", "ced", "--device", "cpu",
               "--model_args", model_args, "--batch_size", str(step["inputs"]["batch_size"]),
               "--include_path", str(tasks), "--tasks", group, "--log_samples",
               "--output_path", str(out)]

        def run() -> tuple[int, str]:
            code, tail = stream(cmd, self.out / "logs" / f"{key.replace('/', '_')}.log",
                                self.env)
            if code == 0:           # step["done"]: what says this mode's run finished
                (out / "mode.txt").write_text(mode + "\n")
            return code, tail
        self.execute(step, key, run, {"checkpoint": str(final)},
                     title=f"lm_eval {step['label']} {mode}: {group}", clear=[out])
