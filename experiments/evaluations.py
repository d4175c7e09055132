"""The evaluation steps of a study: suites, divergence, erf, the real-text reading and lm-eval, each a
step skipped by the hash of its inputs (`experiments.freshness`) and run by one skeleton
(`EvaluationSteps.execute`: skip when fresh, clear what a previous run wrote, run, stamp and
record). A mixin of `experiments.run.Study`, which owns the study (`spec`, `out`, `wandb`,
`project`, `group`, `env`, `repair`) and its bookkeeping (`record`, `checkpoints`, `run_job`).
Also how a study's `suite:` spec becomes one suite step's options (`suite_options`), and its
`erf:` section one model's erf options (`erf_options`)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from .freshness import STAMP, plain, step_decision
from .steps import banner, step_record, stream, write_stamp
from .study import REAL_TEXT_READING, config_hash


def resolve_lengths(values: list, cfg) -> list:
    """Replay lengths written as ints or as 'W', 'W/4', '2W', 'R_exact' (any form of
    `ced.config.replay_length`) -> ints, for `cfg`: a ModelConfig, or a checkpoint's
    config.json as a dict. 'exact' stays as written; 'R_exact' is dropped for a model without a
    decoder; duplicates dropped, order kept."""
    from ced import ModelConfig
    from ced.config import replay_length
    model = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    out = []
    for v in values:
        if isinstance(v, str) and v.strip().isdigit():
            v = max(1, int(v))      # a length that came as a string (a command-line override)
        elif isinstance(v, str) and v != "exact":
            if v.replace(" ", "") == "R_exact" and not model.has_decoder:
                continue
            v = replay_length(model, v, name=f"replay length {v!r}")
        if v not in out:
            out.append(v)
    return out


def suite_options(spec, ref, own, topk: Any = None, kv: Any = None) -> dict[str, Any]:
    """The `evals.suites.runner.SuiteConfig` fields of one suite step (all but checkpoint, out,
    threads and wandb): a study's `suite:` spec (`experiments.study.SuiteSpec`) with its
    replay lengths and turns resolved against the checkpoint's own config `own` (W forms and
    R_exact mean its own window and R_exact, so a study over several W reads each model at its
    own N = W), its distances against the reference config `ref` (every model of a study read
    at the same distances), its `options`, and one eval-time top-k / KV storage override."""
    # A model without a decoder is run in `full` only; its replays (a required option) are
    # the reference's, as its own would drop R_exact.
    replays = [v for v in resolve_lengths(list(spec.replay), own if own.has_decoder else ref)
               if v != "exact"]
    if spec.below_exact and own.has_decoder:
        from ced import exact_replay_length
        replays = [v for v in replays if v < exact_replay_length(own)] or replays[:1]
    options: dict[str, Any] = {**spec.options, "replays": [str(v) for v in replays],
                               "examples": spec.examples}
    if spec.families:
        options["families"] = list(spec.families)
    if spec.turns:
        options["turns"] = resolve_lengths(list(spec.turns), own)
    if spec.sweep_replay:
        options["sweep_replays"] = [str(v) for v in resolve_lengths(
            list(spec.sweep_replay), own if own.has_decoder else ref) if v != "exact"]
    if spec.distances:
        options["distances"] = [d for d in resolve_lengths(list(spec.distances), ref)
                                if d != "exact"]
    if topk is not None:
        options["topk"] = str(topk)
    if kv is not None:
        options["kv"] = str(kv)
    return options


def suite_computed(options: dict[str, Any], own) -> dict[str, Any]:
    """What a suite step computes that its options leave to the code, for its hash: the
    registered families when the study names none, and the multi-turn policies when a family
    it reads has turn modes on a model with a decoder (the suite runs every policy of
    `ced.inference.POLICIES`). Without them a new policy or family would leave a finished
    suite fresh, never read; each key is present only where it changes what is computed, so
    a step it does not touch keeps its hash."""
    from ced.inference import POLICIES
    from evals.suites.families import FAMILIES
    named = options.get("families")
    computed: dict[str, Any] = {} if named else {"families": list(FAMILIES)}
    families = named or list(FAMILIES)
    if own.has_decoder and any(f in FAMILIES and FAMILIES[f].turn_modes for f in families):
        computed["policies"] = list(POLICIES)
    return computed


def erf_options(spec: dict[str, Any], own) -> dict[str, Any]:
    """The `evals.erf.ErfConfig` fields of one model's erf step (all but the driver's: out,
    checkpoint, source, divergence): the study's `erf:` keys with `length` and every value in
    `params` written as a W form or R_exact resolved for the model `own` (its W, its R_exact),
    `params` as the JSON the tool takes, and the prompt lengthened to R_exact + W where the
    given length would cut the decoder's reach (influence from beyond the prompt would go
    unmeasured, and the share beyond W read low)."""
    from dataclasses import fields

    from ced import exact_replay_length
    from ced.config import is_window_form, replay_length
    from evals.erf import ErfConfig

    def resolve(value: Any, key: str) -> Any:
        text = value.replace(" ", "") if isinstance(value, str) else None
        if text is not None and (text == "R_exact" or is_window_form(text)):
            return replay_length(own, text, name=f"erf.{key}")
        return value
    defaults = {f.name: f.default for f in fields(ErfConfig)}
    options = {k: v for k, v in spec.items() if k != "params"}
    length = resolve(spec.get("length", defaults["length"]), "length")
    options["length"] = max(int(length), exact_replay_length(own) + own.window)
    params = {task: {k: resolve(v, f"params.{task}.{k}") for k, v in values.items()}
              for task, values in (spec.get("params") or {}).items()}
    options["params"] = json.dumps(params, sort_keys=True)
    return options


def mode_slug(mode: str) -> str:
    """A directory name for an evals.modes string: replay=W/2 -> replay=W_2, commas -> +."""
    return mode.replace("/", "_").replace(",", "+")


class EvaluationSteps:
    """`Study`'s evaluation steps (see the module's docstring for what they need)."""

    def _reference_config(self, checkpoints: dict[str, tuple[Path, str]]):
        """The ModelConfig of the first checkpoint with a decoder (or the first one; None
        without checkpoints)."""
        from ced.checkpoint import load_config
        configs = [load_config(p) for p, _ in checkpoints.values()]
        with_decoder = [c for c in configs if c.has_decoder]
        return (with_decoder or configs or [None])[0]

    def _fresh(self, label: str, step: dict) -> bool:
        """True if `step` (a prepared evaluation step) is done with these inputs (skip it);
        says so, or says what changed and that the step is rerun (`step_decision`)."""
        action, reason = step_decision(step, self.repair)
        if action == "skip":
            print(f"[study] {label}: {reason}, skipped", flush=True)
        elif action == "rerun":
            print(f"[study] {label}: {reason}; rerunning", flush=True)
        return action == "skip"

    def execute(self, step: dict, label: str, run: Callable[[], tuple[int, str]],
                stamp: dict, title: str | None = None, clear: Iterable[Path] = (),
                **failure: Any) -> bool:
        """The skeleton of every evaluation step. `step`: its key, out, done (the file whose
        presence says it finished), hash and inputs. Skipped (and recorded so) when fresh;
        else the old stamp and `clear` are removed, `title` announced, `run()` run (return
        code, last lines), and the step stamped (`step_record` with `stamp`) and recorded ok
        when it exits 0 and `done` exists, recorded failed otherwise (with `failure`'s extra
        fields). True when the step is done (skipped or ok)."""
        key, out, digest = step["key"], step["out"], step["hash"]
        if self._fresh(label, step):
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
            write_stamp(out, step_record(step, **stamp))
            self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
            return True
        print(f"[study] {label}: FAILED (exit {code}); continuing", flush=True)
        self.record(key, "failed", returncode=code, tail=tail, seconds=secs, **failure)
        return False

    # divergence
    def _divergence_step(self) -> tuple[dict | None, str]:
        """The divergence step as it would run now (out, done, hash, inputs, config), or None
        and why there is none."""
        spec = self.spec.divergence
        checkpoints = self.checkpoints(all_jobs=True)
        from ced.checkpoint import load_config
        usable = {label: (p, h) for label, (p, h) in checkpoints.items()
                  if load_config(p).has_decoder}
        if not usable:
            return None, "no trained checkpoint with a decoder"
        out = self.out / "divergence"
        config = dict(spec)
        # W forms and R_exact stay as written: evals.divergence resolves them per checkpoint
        # (each model's own W), after they are checked here against one of them.
        written = [v for v in config.get("replays", [1, 4, 16]) if v != "exact"]
        resolve_lengths(written, self._reference_config(usable))
        config["replays"] = [int(v) if isinstance(v, str) and v.strip().isdigit() else v
                             for v in written]
        config["checkpoints"] = sorted(str(p) for p, _ in usable.values())
        inputs = {"config": dict(config), "trained": sorted(h for _, h in usable.values())}
        return {"key": "divergence", "out": out, "done": out / "summary.json",
                "hash": config_hash(inputs), "inputs": inputs, "config": config,
                "usable": usable}, ""

    def divergence(self) -> None:
        """`evals.divergence` over every trained checkpoint with a decoder, rerun when one of
        them or a setting changes."""
        if self.spec.divergence is None:
            return
        step, why = self._divergence_step()
        if step is None:
            self.record("divergence", "skipped", reason=why)
            return
        out, config = step["out"], step["config"]
        config["out_dir"] = str(out)
        config["wandb"] = {"enabled": self.wandb, "group": self.group, "project": self.project,
                           **(config.get("wandb") or {})}
        out.mkdir(parents=True, exist_ok=True)
        self.execute(step, "divergence", lambda: self.run_job(
            "divergence", config, out / "config.json", self.out / "logs" / "divergence.log"),
            {"checkpoints": config["checkpoints"]},
            title=(f"divergence: {len(step['usable'])} checkpoints, N={config['replays']}, "
                   f"T={config.get('lengths')}"))

    # real text
    def _real_text_step(self) -> dict | None:
        """The real-text step as it would run now, or None without a trained checkpoint."""
        spec, checkpoints = self.spec.real_text, self.checkpoints(all_jobs=True)
        if not checkpoints:
            return None
        out = self.out / "real_text"
        settings = {name: getattr(spec, name) for name in REAL_TEXT_READING}
        settings.update(replays=[str(v) for v in spec.replays],
                        continuation=str(spec.continuation))
        inputs = {"real_text": settings,
                  "trained": sorted(h for _, h in checkpoints.values())}
        return {"key": "real_text", "out": out, "done": out / "baselines.csv",
                "hash": config_hash(inputs), "inputs": inputs, "settings": settings,
                "paths": sorted(str(p) for p, _ in checkpoints.values())}

    def real_text(self) -> None:
        """`python -m evals.real_text` over every trained checkpoint of the study (every job,
        as the divergence step): one invocation, rerun when a checkpoint or a setting changes."""
        spec = self.spec.real_text
        if spec is None:
            return
        step = self._real_text_step()
        if step is None:
            self.record("real_text", "skipped", reason="no trained checkpoint")
            return
        out, paths = step["out"], step["paths"]
        job = {**step["settings"], "checkpoint": paths, "out": str(out), "wandb": self.wandb,
               "wandb_project": self.project, "wandb_group": self.group}
        # what a previous reading wrote (not lm_eval/, which lives here too): a rerun that
        # writes fewer tables must not leave old ones beside its stamp
        from evals.real_text import OUTPUTS
        self.execute(step, "real_text", lambda: self.run_job(
            "real_text", job, self.out / "logs" / "real_text.json",
            self.out / "logs" / "real_text.log"), {"checkpoints": paths},
            title=f"real text: {len(paths)} checkpoints, N={list(spec.replays)}",
            clear=[out / name for name in OUTPUTS])

    def lm_eval(self) -> None:
        """lm-eval's CLI (`python -m evals.lmeval`) over the code tasks, per checkpoint and mode
        (each a step skipped by hash), then `analysis.real_text.write_lm_eval` over all of them."""
        spec = self.spec.real_text
        if spec is None or not (spec.lm_eval_modes or spec.lm_eval_turn_modes):
            return
        current: list[Path] = []        # the runs of this spec and these checkpoints only
        unknown = sorted(set(spec.lm_eval_jobs or []) - {j.name for j in self.spec.jobs})
        if unknown:
            self.record("lm_eval", "failed", error=f"real_text.lm_eval_jobs: no job(s) "
                        f"{unknown} in study {self.spec.name}")
            return
        for tasks_step, runs in self._lm_eval_steps():
            if not self._code_tasks(tasks_step):
                continue
            for step in runs:
                current.append(step["out"])
                self._lm_eval_run(step)
        from analysis.real_text import write_lm_eval
        try:
            written = write_lm_eval(self.out / "real_text" / "lm_eval", self.out / "real_text",
                                    runs=current)
            self.record("lm_eval", "ok", out=str(written["lm_eval"]))
        except (FileNotFoundError, ValueError) as exc:
            self.record("lm_eval", "failed", error=str(exc))

    def _lm_eval_steps(self):
        """Per checkpoint lm-eval reads, as they would run now: (its code-tasks step, its
        lm-eval run steps, one per mode and task group)."""
        from ced.checkpoint import load_config
        spec, root = self.spec.real_text, self.out / "real_text" / "lm_eval"
        args = ["--examples", str(spec.lm_eval_examples), "--context",
                str(spec.lm_eval_context), "--min-distance", str(spec.lm_eval_min_distance),
                *(["--max-files", str(spec.max_files)] if spec.max_files else [])]
        for label, (final, trained) in self.checkpoints(all_jobs=True).items():
            if spec.lm_eval_jobs is not None and label.split("/")[0] not in spec.lm_eval_jobs:
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

    # suite
    def _suite_steps(self, checkpoints: dict[str, tuple[Path, str]]):
        """The suite steps of these checkpoints as they would run now, one per checkpoint and
        eval-time top-k / KV override: key, label, out, done, hash, inputs, written, final."""
        from ced.checkpoint import load_config
        spec = self.spec.suite
        ref = self._reference_config(checkpoints)
        overrides = [(topk, kv) for topk in (list(spec.topk) or [None])
                     for kv in (list(spec.kv) or [None])]
        written = {"suite": plain(spec)}
        for run_label, (final, trained) in checkpoints.items():
            own = load_config(final)
            for topk, kv in overrides:
                if topk is not None and not own.traits.topk_study:
                    continue    # top-k overrides apply to the variant the top-k study is about
                label = (run_label + ("" if topk is None else f"@topk={topk}")
                         + ("" if kv is None else f"@kv={kv}"))
                out = self.out / "suite" / label
                options = suite_options(spec, ref, own, topk=topk, kv=kv)
                inputs = {"suite": options, **suite_computed(options, own), "trained": trained}
                yield {"key": f"suite/{label}", "label": label, "run": run_label, "out": out,
                       "done": out / "summary.json", "hash": config_hash(inputs),
                       "inputs": inputs, "written": written, "final": final}

    def suite(self) -> None:
        """`evals.suites` per checkpoint of the `jobs=` jobs and eval-time override, each step
        rerun when its checkpoint or its resolved settings change."""
        if self.spec.suite is None:
            return
        checkpoints = self.checkpoints()
        if not checkpoints:
            self.record("suite", "skipped", reason="no trained checkpoint")
            return
        for step in self._suite_steps(checkpoints):
            label, options, final = step["label"], step["inputs"]["suite"], step["final"]
            # the driver decides reruns itself (by hash), so it may replace what is there
            job = {**options, "checkpoint": str(final), "out": str(step["out"]),
                   "overwrite": True, "wandb": self.wandb, "wandb_project": self.project,
                   "wandb_group": self.group}
            log = self.out / "logs" / f"suite_{label.replace('/', '_')}.log"
            self.execute(step, f"suite {label}", lambda: self.run_job(
                "suite", job, log.with_suffix(".json"), log), {"checkpoint": str(final)},
                title=f"suite {label}: N={options['replays']}", log=str(log))

    # erf
    def _erf_steps(self, checkpoints: dict[str, tuple[Path, str]]):
        """The erf steps of these checkpoints as they would run now, one per model with decoder
        windows (the others have no window state to measure): key, label, out, done, hash,
        inputs (the resolved options and the training hash), written, final."""
        from ced.checkpoint import load_config
        written = {"erf": plain(self.spec.erf)}
        for label, (final, trained) in checkpoints.items():
            own = load_config(final)
            if not own.traits.decoder_windows:
                continue
            out = self.out / "erf" / label
            inputs = {"erf": erf_options(self.spec.erf, own), "trained": trained}
            yield {"key": f"erf/{label}", "label": label, "out": out,
                   "done": out / "summary.json", "hash": config_hash(inputs), "inputs": inputs,
                   "written": written, "final": final}

    def erf(self) -> None:
        """`evals.erf` per checkpoint of the `jobs=` jobs (the decoder's influence by distance:
        the share beyond W that `analysis.archive` and `analysis.reach` read), each step rerun
        when its checkpoint or its resolved options change."""
        if self.spec.erf is None:
            return
        checkpoints = self.checkpoints()
        if not checkpoints:
            self.record("erf", "skipped", reason="no trained checkpoint")
            return
        for step in self._erf_steps(checkpoints):
            label, options, out = step["label"], step["inputs"]["erf"], step["out"]
            job = {**options, "checkpoint": [str(step["final"])], "out": str(out)}
            log = self.out / "logs" / f"erf_{label.replace('/', '_')}.log"
            self.execute(step, f"erf {label}", lambda: self.run_job(
                "erf", job, log.with_suffix(".json"), log), {"checkpoint": str(step["final"])},
                title=f"erf {label}: T={options['length']}",
                clear=[out / name for name in ("erf.csv", "erf.md", "erf.png")], log=str(log))
