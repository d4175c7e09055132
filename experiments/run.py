"""Run a named study: train its jobs (once per seed), evaluate them, write the report.

    python -m experiments.run study=<name> [out=DIR] [scale=demo|full] [seeds=[0,1,2]]
                              [threads=2] [wandb=true] [group=G] [on_change=refuse|rerun|continue]
                              [only=train|eval|report|plan] [jobs=[A,B]] [tools=[suite,erf]]

`only=plan` prints the resolved study and what would happen to every step (each training
run: skip, train, resume, refuse, rerun, continue, reuse; each evaluation: skip, run, rerun; the
report), and why, without running anything (`experiments.plan`); it exits 2 if a step would
be refused. `reuse=[DIR, ...]`
names other study directories: a run whose training hash (every training override and the
seed) matches a finished run there is copied instead of retrained, so studies that share a
job (replay_length's no_sim is variants' ced, topk's k16 and multi_turn's no_sim) train it
once.
    python -m experiments.run --help | --cfg job study=<name> | -m study=a,b

A Hydra app over `conf/study.yaml` (keys: `DriverConfig`). A study is
`conf/experiment/<name>.yaml`, checked against `experiments.study.StudyConfig` (see docs/studies.md,
"Studies"): training jobs as Hydra override lists for `python -m ced.train`, the seeds each
job is trained with, and the sections of the evaluation tools it runs (`experiments.tools`:
divergence, suite, erf, real_text and any tool registered). Layout of the study directory:

    runs/<job>/seed<k>/        each training run's Hydra directory (metrics.jsonl, final/, wandb/)
    divergence/                evals.divergence over every trained checkpoint with a decoder
    suite/<job>/seed<k>[@topk=K]/   evals.suites per checkpoint (and eval-time top-k override)
    erf/<job>/seed<k>/         evals.erf per checkpoint with decoder windows (the study's erf:)
    real_text/                 evals.real_text over every trained checkpoint (data=stdlib
                               studies: per-byte KL of bounded replay on held-out files),
                               merged from real_text/<job>/seed<k>/ (each model read once)
                               and real_text/lm_eval/<job>/seed<k>/ (lm-eval runs)
    <tool>[/<job>/seed<k>]/    any other registered tool: a folder per model, or one over all
    logs/<step>.log            the full output of every subprocess
    report/                    report.md, report.html, PNG plots (analysis.report)
    summary.json               the status of every step (ok / skipped / reused / failed /
                               refused, with its seconds) and every invocation of the driver
                               here (command, git commit, wall time)

Every step records the hash of its inputs (`study_step.json` in its directory: for training,
the normalised overrides and seed; for evaluations, their settings and the hashes of the
checkpoints they read). A step whose outputs exist with the same hash is skipped. A training
run whose config changed is refused (`on_change=refuse`, the default: the step fails, the old
run stays) or moved aside to `<run>.old-<hash>` and trained again (`on_change=rerun`); with
`on_change=continue` a run whose only change is a raised `train.steps` trains on from where it
ended, on its own schedule (`experiments.continuation`), and any other change is refused; an
evaluation whose inputs changed is rerun. A training run interrupted with the same config
resumes from its last checkpoint. A failed step is recorded (return code, last lines of
output) and the others go on; the exit code is 1 if anything failed (in a multirun, the job
raises instead, so that the other jobs run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import OmegaConf

from ced.presets import known_studies
from ced.records import DamagedRecord, read_json, write_json
from ced.run_id import RunId
from ced.runlock import DirectoryLocked, directory_lock
from ced.signals import Interrupted, StopSignals, continue_command, stop_point
from ced.writable import OutputDirError, check_output_dir

from .evaluations import LM_EVAL, EvaluationSteps
from .freshness import STAMP
from .freshness import read_stamp as _read_stamp
from .plan import plan_study
from .steps import ROOT, banner, stream
from .study import StudyConfig, StudyError, config_hash, load_study
from .tools import TOOLS, EvaluationTool, tools
from .training_runs import TrainingRuns

CONF_DIR = str(ROOT / "conf")

# exit codes of a step stopped with everything kept (75: SIGTERM or a full disk; 130: SIGINT;
# negative: killed by SIGTERM/SIGINT before it could handle them): recorded as interrupted
INTERRUPTED_CODES = (75, 130, -15, -2)

@dataclass
class DriverConfig:
    """The driver's own options (conf/study.yaml)."""

    study: str = "???"
    out: Optional[str] = None
    scale: str = "demo"
    seeds: Optional[List[int]] = None
    threads: Optional[int] = None
    wandb: bool = True
    project: str = "ced"
    group: Optional[str] = None
    only: str = "all"
    on_change: str = "refuse"
    reuse: Optional[List[str]] = None
    jobs: Optional[List[str]] = None
    tools: Optional[List[str]] = None

    def check(self) -> None:
        if self.study in ("???", "", None):
            raise StudyError(f"study: required (study=<name>); known studies: "
                             f"{known_studies()}")
        if self.only not in ("all", "train", "eval", "report", "plan"):
            raise StudyError(f"only: must be all, train, eval, report or plan; got "
                             f"{self.only!r}")
        for path in self.reuse or []:
            if not (Path(path) / "runs").is_dir():
                raise StudyError(f"reuse: {path} is not a study directory (no runs/ in it)")
        if self.on_change not in ON_CHANGE:
            raise StudyError(f"on_change: must be one of {', '.join(ON_CHANGE)}; got "
                             f"{self.on_change!r}")
        if self.threads is not None and self.threads < 1:
            raise StudyError(f"threads: must be null or >= 1; got {self.threads}")


# what the driver does with a finished training run whose config changed (DriverConfig.on_change)
ON_CHANGE = ("refuse", "rerun", "continue")
DRIVER_KEYS = sorted(f.name for f in fields(DriverConfig))


def check_driver_overrides(argv: list[str]) -> None:
    """Unknown driver keys as one line (Hydra's own message spans several)."""
    for item in argv:
        if item.startswith("-") or "=" not in item or item.startswith(("hydra", "+hydra")):
            continue
        key = item.split("=", 1)[0].lstrip("+~")
        if key not in DRIVER_KEYS:
            raise StudyError(f"{key}: unknown driver key; allowed: {DRIVER_KEYS} (study "
                             f"settings belong in conf/experiment/<study>.yaml)")


def source_version() -> dict[str, Any]:
    """The git commit of the code that runs (and whether tracked files differ from it), so a
    number in FINDINGS.md can name the commit that produced it; {} outside a git checkout."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        if done.returncode != 0:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def _describe_source(source: dict) -> str:
    """'commit 1a2b3c4' or 'commit 1a2b3c4 with uncommitted edits', for a warning."""
    commit = str(source.get("commit") or "?")[:7]
    return f"commit {commit}" + (" with uncommitted edits" if source.get("dirty") else "")


# ---- the study --------------------------------------------------------------------------------

class Study(TrainingRuns, EvaluationSteps):
    """One invocation of the driver over a study directory: its bookkeeping (summary.json,
    the runs and their checkpoints) here, its training step in `experiments.training_runs`,
    its evaluation steps in `experiments.evaluations`."""

    def __init__(self, spec: StudyConfig, out: Path, threads: int, wandb: bool = True,
                 group: str | None = None, project: str = "ced", on_change: str = "refuse",
                 reuse: list[Path] | None = None, jobs: list[str] | None = None,
                 tools: list[str] | None = None):
        self.spec, self.out, self.threads, self.wandb = spec, out, threads, wandb
        # tools=[...]: run only these evaluation tools (and lm_eval, the real_text section's
        # lm-eval runs, only if named); None: every one the study has a section for
        allowed = [*TOOLS, LM_EVAL]
        if tools is not None and not tools:
            raise StudyError("tools: name at least one tool, or leave it null for every one")
        if set(tools or []) - set(allowed):
            raise StudyError(f"tools: no tool(s) {sorted(set(tools) - set(allowed))}; allowed: "
                             f"{allowed}")
        self.selected_tools = list(tools) if tools else None
        known = [j.name for j in spec.jobs]
        unknown = sorted(set(jobs or []) - set(known))
        if unknown:
            raise StudyError(f"jobs: no job(s) {unknown} in study {spec.name}; its jobs: {known}")
        # jobs=[...]: train these and run the per model evaluation steps on them only (a step
        # over every model, such as divergence, and the report cover every finished run)
        self.jobs = list(jobs) if jobs else None
        self.reuse = [Path(p).resolve() for p in reuse or []]
        self.group, self.project, self.on_change = group or spec.name, project, on_change
        self.status: dict[str, dict] = {}
        # whether damaged records found are set aside (False for only=plan: it writes nothing)
        self.repair = True
        self._composed: dict[str, dict] | None = None    # composed_training's cache
        self.started = time.time()
        # every invocation of the driver on this directory: its command, commit and wall time
        self.invocations: list[dict] = []
        self.invocation = {"command": " ".join(["python -m experiments.run", *sys.argv[1:]]),
                           **source_version(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.env = {"WANDB_RUN_GROUP": self.group, "WANDB_PROJECT": project,
                    "WANDB_SILENT": "true", "OMP_NUM_THREADS": str(threads),
                    "PYTHONUNBUFFERED": "1",
                    # offline unless the user's environment chose otherwise (as ced.train does)
                    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
                    "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE", "1")}
        os.environ.setdefault("WANDB_MODE", "offline")

    # bookkeeping
    def record(self, key: str, state: str, **info: Any) -> None:
        """Set one step's entry in summary.json. A step that ran (ok or failed) also records
        the commit of the code it ran: each step is a fresh process that imports the checkout
        as it is at that moment, so a commit or an edit made while a study runs changes what
        its later steps run. Such a step is flagged `source_changed` and announced."""
        if state in ("ok", "failed"):
            source = source_version()
            info = {**info, "source": source}
            started = {k: self.invocation.get(k) for k in ("commit", "dirty")}
            if source and source != started:
                info["source_changed"] = True
                banner(f"warning: {key} ran {_describe_source(source)}, but this study started "
                       f"at {_describe_source(started)}: the checkout changed while it ran "
                       "(run long studies from a checkout nobody edits: docs/studies.md)")
        if state == "failed" and info.get("returncode") in INTERRUPTED_CODES:
            state = "interrupted"       # stopped by a signal (or a full disk), not failed
        # which invocation (index into summary.json's invocations) set this entry
        self.status[key] = {"state": state, **info, "invocation": len(self.invocations)}
        self.write_summary()
        stop_point()      # a SIGTERM/SIGINT to the driver stops it here, between steps

    def failed(self, earlier: bool | None = None) -> list[str]:
        """Steps whose entry is failed, refused or interrupted; earlier=False: only those this
        invocation set, True: only those an earlier invocation set and this one did not
        redo."""
        now = len(self.invocations)
        return [k for k, v in self.status.items()
                if v["state"] in ("failed", "refused", "interrupted")
                and (earlier is None or (v.get("invocation", -1) != now) == earlier)]

    def write_summary(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / "summary.json", {
            "study": self.spec.name, "scale": self.spec.scale,
            "description": self.spec.description, "seeds": list(self.spec.seeds),
            "out": str(self.out), "steps": self.status, "failed": self.failed(),
            "elapsed_s": round(time.time() - self.started, 1),
            "invocations": [*self.invocations, {**self.invocation, "elapsed_s": round(
                time.time() - self.started, 1)}]})

    def runs(self, all_jobs: bool = False) -> list[tuple[str, int, str]]:
        """(job, seed, label) of every training run, label = '<job>/seed<k>' (`RunId.model`);
        only the jobs of `jobs=` unless `all_jobs`."""
        return [(job.name, seed, RunId(job.name, seed).model)
                for job in self.spec.jobs for seed in self.spec.seeds_of(job)
                if all_jobs or self.jobs is None or job.name in self.jobs]

    def run_ids(self, all_jobs: bool = False) -> dict[str, RunId]:
        """label -> RunId of every training run (see `runs`)."""
        return {label: RunId(job, seed) for job, seed, label in self.runs(all_jobs)}

    def run_job(self, tool: EvaluationTool, config: dict, config_file: Path,
                log: Path, merge: list[str] | None = None) -> tuple[int, str]:
        """Write `config` (the fields of `tool`'s config dataclass) to `config_file` and run it
        as `python -m experiments.job` in a subprocess, which imports the tool's module (where
        a tool registered outside `experiments.tools` registers itself); with `merge` (the
        folders of its steps), the tool's merge of them; (return code, last lines)."""
        config_file.parent.mkdir(parents=True, exist_ok=True)
        payload = config if merge is None else {"config": config, "readings": merge}
        config_file.write_text(json.dumps(payload, indent=1))
        return stream([sys.executable, "-m", "experiments.job", tool.name, str(config_file),
                       str(self.threads), "--module", tool.module,
                       *(["--merge"] if merge is not None else [])], log, self.env)

    def run_dir(self, label: str) -> Path:
        return self.out / "runs" / label

    def checkpoints(self, all_jobs: bool = False) -> dict[str, tuple[Path, str]]:
        """label -> (final/, its training hash) of every run that finished training (of the
        `jobs=` jobs unless `all_jobs`)."""
        out = {}
        for job, seed, label in self.runs(all_jobs):
            run_dir = self.run_dir(label)
            final = run_dir / "final"
            stamp = _read_stamp(run_dir)
            weights = final / "model.safetensors"
            if weights.exists():
                # A run trained outside the driver (e.g. a SLURM array placed here) has no
                # record: its identity is the checkpoint itself.
                out[label] = (final, stamp["hash"] if stamp else config_hash(
                    {"external": (final / "config.json").read_text(),
                     "weights": weights.stat().st_mtime_ns}))
        return out

    def plan(self) -> list[dict]:
        """What `only=all` would do, step by step, without doing it (`experiments.plan`)."""
        return plan_study(self)

    # report
    def report(self) -> Path | None:
        banner("report")
        path = self.out / "report" / "report.html"
        self.record("report", "ok", path=str(path))     # what the report shows about itself
        try:
            # imported inside the try: a report that fails even to import must not fail the
            # study whose results are already written
            from analysis.report import build_report
            path = build_report(self.out, wandb=self.wandb, group=self.group,
                                project=self.project)
        except Exception as exc:    # a broken report must not hide the study's results
            traceback.print_exc()
            self.record("report", "failed", error=f"{type(exc).__name__}: {exc}")
            return None
        return path


class StudyFailed(RuntimeError):
    """Raised by a multirun job whose study had failed steps, so that Hydra records it and
    the sweep's other jobs still run."""


def run_study(opts: DriverConfig) -> int:
    """Load, run and report one study; returns the exit code (0, or 1 if a step failed). One
    driver per study directory: it holds the directory's lock (`ced.runlock`) while it runs
    (`only=plan` only reads, and takes none)."""
    spec = load_study(opts.study, opts.scale, seeds=opts.seeds)
    out = Path(opts.out or ROOT / "outputs" / "studies" / spec.name).resolve()
    if opts.only == "plan":
        return _run_study(opts, spec, out)
    try:
        check_output_dir(out, "out")
    except OutputDirError as exc:
        raise StudyError(str(exc)) from None
    try:
        with directory_lock(out, "study"), _DriverSignals():
            return _run_study(opts, spec, out)
    except DirectoryLocked as exc:
        raise StudyError(str(exc)) from None
    except Interrupted as exc:
        print(f"study {spec.name} {exc} between steps; the running step is recorded as "
              f"interrupted in {out / 'summary.json'}; to continue, run again: "
              f"{continue_command()}", file=sys.stderr, flush=True)
        sys.exit(exc.code)


class _DriverSignals(StopSignals):
    """The driver stops between steps; the step that runs gets the signal too (the same
    process group) and stops at its own boundary."""

    DOING = "stopping when the running step ends"


def earlier_record(out: Path, repair: bool = True) -> tuple[dict[str, dict], list[dict]]:
    """(steps, invocations) of the study's summary.json, so that an invocation keeps the record
    of the steps it does not redo. A damaged summary.json is named in one line and moved aside
    (`summary.json.damaged-<UTC time>`, never overwritten); the steps are then rebuilt from
    their `study_step.json` records (`rebuild_steps`) and the line says what was rebuilt and
    what is lost (the earlier invocations, and failed or refused steps, which have no
    record). `repair=False` (only=plan, which writes nothing): the damage is named, the file
    left where it is, and nothing rebuilt."""
    try:
        record = read_json(out / "summary.json", set_aside_damaged=repair)
    except DamagedRecord as exc:
        if not repair:
            print(f"[study] warning: {exc}; a run of the driver sets it aside and rebuilds it",
                  flush=True)
            return {}, []
        steps = rebuild_steps(out)
        print(f"[study] warning: {exc}; rebuilt {len(steps)} finished step(s) from their "
              f"{STAMP} records; lost: the earlier invocations (commands, commits, wall "
              "times), step times, and which steps failed or were refused", flush=True)
        return steps, []
    if record is None:
        return {}, []
    return dict(record.get("steps") or {}), list(record.get("invocations") or [])


def rebuild_steps(out: Path) -> dict[str, dict]:
    """summary.json's step entries of every step whose `study_step.json` and outputs are there
    (state ok, `rebuilt: true`, its hash and directory): training runs with final weights, the
    steps of every registered evaluation tool, lm-eval task and mode runs."""
    done_file = {"runs": "final/model.safetensors", **{tool.name: tool.done for tool in tools()}}
    steps: dict[str, dict] = {}
    for stamp_path in sorted(out.rglob(STAMP)):
        directory = stamp_path.parent
        rel = directory.relative_to(out).as_posix()
        top = rel.split("/", 1)[0]
        if ".old-" in rel or top not in done_file:
            continue
        stamp = _read_stamp(directory)       # a damaged one is named and set aside
        if stamp is None:
            continue
        if rel.startswith("real_text/lm_eval/"):
            label = rel.removeprefix("real_text/lm_eval/")
            if label.endswith("/tasks") and (directory / "ced_code.yaml").exists():
                key = "lm_eval/" + label.removesuffix("/tasks")
            elif (directory / "mode.txt").exists():
                key = "lm_eval/" + label.rsplit("/", 1)[0] + "/" + (
                    directory / "mode.txt").read_text().strip()
            else:
                continue
        elif (directory / done_file[top]).exists():
            key = "train/" + rel.removeprefix("runs/") if top == "runs" else rel
        else:
            continue
        where = "run_dir" if top == "runs" else "out"
        steps[key] = {"state": "ok", where: str(directory), "hash": stamp["hash"],
                      "rebuilt": True, "invocation": -1}
    return steps


def _run_study(opts: DriverConfig, spec: StudyConfig, out: Path) -> int:
    threads = int(opts.threads or min(os.cpu_count() or 1, 8))
    study = Study(spec, out, threads, wandb=opts.wandb, group=opts.group,
                  project=opts.project, on_change=opts.on_change, reuse=opts.reuse,
                  jobs=opts.jobs, tools=opts.tools)
    # keep the record of steps this invocation does not redo
    study.repair = opts.only != "plan"
    study.status, study.invocations = earlier_record(out, repair=study.repair)
    per_job = {j.name: spec.seeds_of(j) for j in spec.jobs
               if study.jobs is None or j.name in study.jobs}
    seeds = (f"seeds {list(spec.seeds)}" if all(s == list(spec.seeds) for s in per_job.values())
             else "seeds " + ", ".join(f"{name} {s}" for name, s in per_job.items()))
    print(f"[study] {spec.name} (scale={spec.scale}): {len(per_job)} jobs x {seeds} -> {out}",
          flush=True)
    if opts.only == "plan":
        print(OmegaConf.to_yaml(spec.as_written()), flush=True)
        # a plan that would refuse a step (or a job's config) fails, as the run would
        bad = [r for r in study.plan() if r["action"] in ("config_error", "refuse")]
        return 2 if bad else 0
    if opts.only in ("all", "train"):
        study.check_configs()
        study.train()
    if opts.only in ("all", "eval"):
        study.evaluate()
    path = None
    if opts.only in ("all", "report"):
        path = study.report()
    study.write_summary()
    failed, earlier = study.failed(earlier=False), study.failed(earlier=True)
    elapsed = time.time() - study.started
    print(f"\n[study] {spec.name} finished in {elapsed:.0f}s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all steps ok"), flush=True)
    if earlier:     # still failed in summary.json, but not run by this invocation
        print(f"[study] failed in an earlier invocation and not rerun by this one: "
              f"{', '.join(earlier)}", flush=True)
    print(f"summary: {out / 'summary.json'}")
    if path is not None:
        print(f"report: {path}", flush=True)
    return 1 if failed or earlier else 0


def _hydra_task(cfg) -> int:
    # lazy: Hydra costs ~0.2 s to import, and only the console entry runs under it (the
    # tests and tools that call run_study do not)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        raw = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"}
        opts = DriverConfig(**raw)
        opts.check()
        code = run_study(opts)
    except StudyError as exc:
        print(f"study error: {exc}", file=sys.stderr, flush=True)
        if multirun:
            raise
        sys.exit(2)
    if code and multirun:
        raise StudyFailed(f"study {opts.study}: some steps failed (see its summary.json)")
    if code:
        sys.exit(code)
    return code


def main() -> None:
    """Console entry (`ced-study`): Hydra main over conf/study.yaml."""
    import hydra        # lazy: ~0.2 s, for the console entry only (see _hydra_task)
    # --help's study list (conf/study.yaml's help template) is read from conf/experiment/
    OmegaConf.register_new_resolver("ced_studies", lambda: ", ".join(known_studies()),
                                    replace=True)
    try:
        check_driver_overrides(sys.argv[1:])
    except StudyError as exc:
        print(f"study error: {exc}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="study")(_hydra_task)()


if __name__ == "__main__":
    main()
