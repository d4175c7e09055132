"""Run a named study: train its jobs (once per seed), evaluate them, write the report.

    python -m experiments.run study=<name> [out=DIR] [scale=demo|full] [seeds=[0,1,2]]
                              [threads=2] [wandb=true] [group=G] [on_change=refuse|rerun|continue]
                              [only=train|eval|report|plan]

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
job is trained with, and divergence and suite settings. Layout of the study directory:

    runs/<job>/seed<k>/        each training run's Hydra directory (metrics.jsonl, final/, wandb/)
    divergence/                evals.divergence over every trained checkpoint with a decoder
    suite/<job>/seed<k>[@topk=K]/   evals.suites per checkpoint (and eval-time top-k override)
    real_text/                 evals.real_text over every trained checkpoint (data=stdlib
                               studies: per-byte KL of bounded replay on held-out files)
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
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, List, Optional

from ced.presets import known_studies
from ced.records import DamagedRecord, read_json, write_json
from ced.signals import Interrupted, StopSignals, continue_command, stop_point

from .continuation import Extension, extension
from .freshness import STAMP, plain, step_decision
from .freshness import read_stamp as _read_stamp
from .plan import plan_study
from .study import (REAL_TEXT_READING, STUDY_DIR, StudyConfig, StudyError, config_hash,
                    load_study, normalise_overrides)

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")
TAIL_BYTES = 4000

# exit codes of a step stopped with everything kept (75: SIGTERM or a full disk; 130: SIGINT;
# negative: killed by SIGTERM/SIGINT before it could handle them): recorded as interrupted
INTERRUPTED_CODES = (75, 130, -15, -2)
# Overrides that say how or where a run goes, not what it trains: not part of its config hash.
BOOKKEEPING = ("train.threads", "train.resume", "train.progress", "logging", "logging.",
               "hydra.")


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


def _is_bookkeeping(item: str) -> bool:
    key = item.split("=", 1)[0].lstrip("+~")
    return key in BOOKKEEPING or key.startswith(tuple(b for b in BOOKKEEPING if b.endswith(".")))


def training_overrides(spec: StudyConfig, job_name: str, seed: int) -> list[str]:
    """What one run of a study trains: the study's overrides, the job's, and the seed
    (normalised, without bookkeeping keys): the input of the training step's config hash, and
    what `reuse=` matches across studies."""
    job = next(j for j in spec.jobs if j.name == job_name)
    items = [*spec.train, *job.overrides, *seed_overrides(spec, seed)]
    return normalise_overrides([o for o in items if not _is_bookkeeping(o)])


def seed_overrides(spec: StudyConfig, seed: int) -> list[str]:
    """What a run's seed sets: `train.seed` (the initial weights, the replay-simulation draws)
    and, with the study's `seed_data`, `data.seed` too (the training rows)."""
    return [f"train.seed={seed}", *([f"data.seed={seed}"] if spec.seed_data else [])]


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


def describe_change(old: list[str], new: list[str]) -> str:
    """The overrides that differ between two normalised lists, as one short line."""
    removed = [o for o in old if o not in new]
    added = [o for o in new if o not in old]
    parts = [f"-{o}" for o in removed] + [f"+{o}" for o in added]
    text = " ".join(parts) or "(same overrides; code or layout changed)"
    return text if len(text) < 300 else text[:297] + "..."


def training_view(config: dict, prefix: str = "") -> dict[str, Any]:
    """A training config (nested dict) as flat dotted keys, without the bookkeeping keys (how
    or where a run goes, not what it trains): what two runs must share to be the same run."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if _is_bookkeeping(name):
            continue
        if isinstance(value, dict):
            flat.update(training_view(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def trained_view(run_dir: Path) -> dict[str, Any] | None:
    """`training_view` of the config a run trained (its config.yaml, checked as ced.train
    checks it, so keys added since with their defaults compare equal); None without one."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    import dataclasses

    from omegaconf import OmegaConf

    from ced.train_config import ConfigError, validate
    try:
        config = validate(OmegaConf.load(path))
    except (ConfigError, ValueError, OSError):
        return None
    return json.loads(json.dumps(training_view(dataclasses.asdict(config)), default=str))


def describe_config_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The keys whose values differ between two `training_view`s, as one short line."""
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    text = "; ".join(parts) or "(the same composed config)"
    return text if len(text) < 300 else text[:297] + "..."


# ---- the study config --------------------------------------------------------------------------

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


def stream(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str]:
    """Run `cmd`, copying its output (stdout and stderr) to ours and to `log` as it comes;
    returns (return code, the last lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = b""
    with open(log, "wb") as handle:
        handle.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        assert proc.stdout is not None
        while True:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            handle.write(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]
        code = proc.wait()
    text = tail.decode(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if ln.strip()][-12:]
    return code, "\n".join(lines)


def mode_slug(mode: str) -> str:
    """A directory name for an evals.modes string: replay=W/2 -> replay=W_2, commas -> +."""
    return mode.replace("/", "_").replace(",", "+")


def banner(text: str) -> None:
    print(f"\n=== [study] {text} ===", flush=True)


# ---- the steps --------------------------------------------------------------------------------

def _step_record(step: dict, **extra: Any) -> dict:
    """The record a finished evaluation step leaves in its directory: its hash, the inputs
    the hash covers and what the study file wrote for it (so a rerun can name what changed)."""
    return {"hash": step["hash"], "inputs": step["inputs"], "written": step.get("written"),
            **extra}


def _write_stamp(directory: Path, payload: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / STAMP, payload)


class Study:
    """One invocation of the driver over a study directory."""

    def __init__(self, spec: StudyConfig, out: Path, threads: int, wandb: bool = True,
                 group: str | None = None, project: str = "ced", on_change: str = "refuse",
                 reuse: list[Path] | None = None, jobs: list[str] | None = None):
        self.spec, self.out, self.threads, self.wandb = spec, out, threads, wandb
        known = [j.name for j in spec.jobs]
        unknown = sorted(set(jobs or []) - set(known))
        if unknown:
            raise StudyError(f"jobs: no job(s) {unknown} in study {spec.name}; its jobs: {known}")
        # jobs=[...]: train and suite-evaluate only these (the divergence step and the report
        # always cover every finished run of the study)
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
        """(job, seed, label) of every training run, label = '<job>/seed<k>'; only the jobs of
        `jobs=` unless `all_jobs`."""
        return [(job.name, seed, f"{job.name}/seed{seed}")
                for job in self.spec.jobs for seed in self.spec.seeds_of(job)
                if all_jobs or self.jobs is None or job.name in self.jobs]

    def run_job(self, kind: str, config: dict, config_file: Path, log: Path) -> tuple[int, str]:
        """Write `config` (the fields of tool `kind`'s config dataclass) to `config_file` and
        run it as `python -m experiments.job` in a subprocess; (return code, last lines)."""
        config_file.parent.mkdir(parents=True, exist_ok=True)
        config_file.write_text(json.dumps(config, indent=1))
        return stream([sys.executable, "-m", "experiments.job", kind, str(config_file),
                       str(self.threads)], log, self.env)

    def run_dir(self, label: str) -> Path:
        return self.out / "runs" / label

    def train_overrides(self, job_name: str, seed: int) -> list[str]:
        """What the run trains (`training_overrides`)."""
        return training_overrides(self.spec, job_name, seed)

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

    # training
    def decide(self, job_name: str, seed: int, label: str) -> tuple[str, str, str]:
        """What training run `label` needs: (action, config hash, reason), action one of
        skip (done with this config), train (never started), resume (interrupted, same
        config), continue (train on to a raised `train.steps`, `on_change=continue`), refuse /
        rerun (its config changed; which one is `on_change`). A run whose overrides changed
        but compose to the config it trained (its config.yaml) is the same run (`train` then
        gives its stamp the new hash). Changes nothing on disk."""
        run_dir = self.run_dir(label)
        wanted = self.train_overrides(job_name, seed)
        digest = config_hash(wanted)
        stamp = _read_stamp(run_dir, self.repair)
        finished = (run_dir / "final" / "model.safetensors").exists()
        started = finished or (run_dir / "checkpoints").exists()
        if stamp is not None and stamp["hash"] == digest:
            if stamp.get("extending"):
                # the old final/ is still there: only the stamp knows the run is mid-way
                to = Extension.from_record(stamp["extending"]).wanted
                return "continue", digest, (f"interrupted while continuing to step {to}; "
                                            "resuming from its last checkpoint")
            if finished:
                return "skip", digest, f"done before with the same config (hash {digest})"
            if started:
                return "resume", digest, (f"interrupted before with the same config (hash "
                                          f"{digest}); resuming from its last checkpoint")
        if not started:
            return "train", digest, "not trained yet"
        old = stamp["hash"] if stamp else "unknown"
        # the overrides are written differently (e.g. a key moved into a preset or a model
        # config): what counts is whether the composed config is the one the run trained
        trained = trained_view(run_dir)
        if stamp is not None and trained is not None:
            wanted_view = self.composed_training(label)
            if wanted_view == trained:
                same = (f"the overrides changed (hash {old} -> {digest}) but compose to the "
                        "config it trained")
                return (("skip", digest, f"done before: {same}") if finished else
                        ("resume", digest, f"interrupted before: {same}; resuming"))
            if wanted_view is not None:
                return self._changed(digest, extension(trained, wanted_view), finished,
                                     f"config changed since it was trained (hash {old} -> "
                                     f"{digest}: {describe_config_change(trained, wanted_view)})")
        change = (describe_change(stamp["overrides"], wanted) if stamp else
                  "no study_step.json: trained outside the driver; only=eval evaluates it "
                  "as it is")
        return self._changed(digest, None, finished, f"config changed since it was trained "
                                                     f"(hash {old} -> {digest}: {change})")

    def _changed(self, digest: str, steps: Extension | None, finished: bool,
                 reason: str) -> tuple[str, str, str]:
        """`decide` for a run whose config changed: `on_change` says what to do; `steps` is
        the change when it is only a matter of train.steps (None when anything else
        changed)."""
        if self.on_change == "rerun":
            return "rerun", digest, reason
        if self.on_change == "continue" and steps is not None:
            if steps.continues:
                return "continue", digest, steps.describe()
            if steps.wanted == steps.ends_at and finished:
                return "skip", digest, (f"done before: continued to step {steps.wanted} on "
                                        f"its own {steps.schedule_steps}-step schedule")
        if self.on_change == "continue":
            reason += ("; on_change=continue continues only a raised train.steps (nothing "
                       "else changed, the run not past it)")
        return "refuse", digest, reason

    def reusable(self, digest: str) -> Path | None:
        """A finished run with training hash `digest` in one of the `reuse` study directories
        (the hash covers every training override and the seed, so it trained exactly what this
        run would), or None."""
        for study in self.reuse:
            for stamp_path in sorted(study.glob(f"runs/*/seed*/{STAMP}")):
                stamp = _read_stamp(stamp_path.parent, repair=False)   # not our directory
                if (stamp and stamp.get("hash") == digest
                        and (stamp_path.parent / "final" / "model.safetensors").exists()):
                    return stamp_path.parent
        return None

    def config_errors(self) -> dict[str, str]:
        """job name -> the one-line error `ced.train` would give its config (composed and
        checked in a subprocess, `experiments.check_jobs`, for the first seed of every job of
        this invocation: the seeds differ only in `train.seed` / `data.seed`)."""
        jobs, seen = [], set()
        for job_name, seed, label in self.runs():
            if job_name in seen:
                continue
            seen.add(job_name)
            jobs.append({"label": job_name, "overrides": self.launch_overrides(job_name, seed)})
        return {r["label"]: r["error"] for r in self._check_jobs(jobs) if "error" in r}

    def launch_overrides(self, job_name: str, seed: int) -> list[str]:
        """The study's, the job's and the seed's overrides, as written (no bookkeeping)."""
        job = next(j for j in self.spec.jobs if j.name == job_name)
        return [*self.spec.train, *job.overrides, *seed_overrides(self.spec, seed)]

    def _check_jobs(self, jobs: list[dict], configs: bool = False) -> list[dict]:
        """`python -m experiments.check_jobs [--configs]` on `jobs` in a subprocess: its
        records ({"label", "error"}, and with `configs` {"label", "config"})."""
        if not jobs:
            return []
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(jobs, handle)
        try:
            done = subprocess.run([sys.executable, "-m", "experiments.check_jobs",
                                   *(["--configs"] if configs else []), handle.name],
                                  cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, **self.env})
        finally:
            os.unlink(handle.name)
        if done.returncode != 0:
            raise StudyError(f"could not check the jobs' configs: "
                             f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return [r for r in map(json.loads, done.stdout.splitlines()) if r]

    def composed_training(self, label: str) -> dict[str, Any] | None:
        """What run `label` of this invocation trains, as flat keys (`training_view` of its
        composed config; None if it does not compose). Composed for every run of the
        invocation at the first call, in one subprocess."""
        if self._composed is None:
            jobs = [{"label": lab, "overrides": self.launch_overrides(job, seed)}
                    for job, seed, lab in self.runs()]
            self._composed = {r["label"]: training_view(r["config"])
                              for r in self._check_jobs(jobs, configs=True) if "config" in r}
        return self._composed.get(label)

    def check_configs(self) -> None:
        """Refuse the whole invocation, before anything trains, if any job's config is bad:
        one line per bad job, then a StudyError naming the first."""
        errors = self.config_errors()
        for job_name, error in errors.items():
            print(f"[study] config error in job {job_name}: {error}", file=sys.stderr,
                  flush=True)
        if errors:
            first = next(iter(errors))
            raise StudyError(f"jobs[{first}]: {errors[first]} (nothing was trained; "
                             f"{len(errors)} job(s) with a bad config, listed above)")

    def plan(self) -> list[dict]:
        """What `only=all` would do, step by step, without doing it (`experiments.plan`)."""
        return plan_study(self)

    def train(self) -> None:
        runs = self.runs()
        for i, (job_name, seed, label) in enumerate(runs, 1):
            digest = self._settle_run_dir(job_name, seed, label)
            if digest is not None:
                self._launch_training(job_name, seed, label, digest, f"{i}/{len(runs)}")

    def _settle_run_dir(self, job_name: str, seed: int, label: str) -> str | None:
        """Deal with what the run's directory already holds (`decide`: skip, refuse, rerun,
        resume, or reuse a finished run of the same hash); returns the training hash when
        `ced.train` is to be launched, None when it is not."""
        key, run_dir = f"train/{label}", self.run_dir(label)
        wanted = self.train_overrides(job_name, seed)
        action, digest, reason = self.decide(job_name, seed, label)
        stamp = _read_stamp(run_dir)
        if action in ("skip", "resume") and stamp and stamp["hash"] != digest:
            # the same run under overrides written another way: it keeps the new hash
            _write_stamp(run_dir, {**stamp, "hash": digest, "overrides": wanted,
                                   "rehashed_from": stamp["hash"]})
        if action == "skip":
            print(f"[study] train {label}: {reason}, skipped", flush=True)
            self.record(key, "skipped", run_dir=str(run_dir), hash=digest)
            return None
        if action == "refuse":
            print(f"[study] train {label}: REFUSED: {reason}; the old run is kept. Pass "
                  f"on_change=rerun to retrain, or use another out=", flush=True)
            self.record(key, "refused", run_dir=str(run_dir), hash=digest, reason=reason)
            return None
        if action == "rerun":
            old = (stamp or {}).get("hash", "unknown")
            aside = run_dir.with_name(f"{run_dir.name}.old-{old}")
            shutil.rmtree(aside, ignore_errors=True)
            run_dir.rename(aside)
            print(f"[study] train {label}: {reason}; RERUNNING (on_change=rerun); the old "
                  f"run moved to {aside}", flush=True)
        elif action == "resume":
            print(f"[study] train {label}: {reason}", flush=True)
        elif action == "continue":
            print(f"[study] train {label}: CONTINUING (on_change=continue): {reason}",
                  flush=True)
            steps = (Extension.from_record(stamp["extending"]) if stamp and stamp.get(
                "extending") else extension(trained_view(run_dir), self.composed_training(label)))
            # marked before ced.train starts: an interrupted continuation still has the old
            # final/, and only this mark tells the next invocation to resume it
            _write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                                   "seed": seed, "extending": steps.record(),
                                   "extended_from_hash": (stamp or {}).get(
                                       "extended_from_hash", (stamp or {}).get("hash"))})
            return digest
        source = self.reusable(digest) if action == "train" else None
        if source is not None:
            shutil.copytree(source, run_dir, dirs_exist_ok=True)
            _write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                                   "seed": seed, "reused_from": str(source)})
            print(f"[study] train {label}: the same training run (hash {digest}) is done "
                  f"in {source}; copied, not retrained (reuse=)", flush=True)
            self.record(key, "reused", run_dir=str(run_dir), hash=digest, source=str(source))
            return None
        _write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                               "seed": seed})
        return digest

    def _launch_training(self, job_name: str, seed: int, label: str, digest: str,
                         position: str) -> None:
        """Train one run with `ced.train` (resumes from its last checkpoint) and record it."""
        key, run_dir = f"train/{label}", self.run_dir(label)
        job = next(j for j in self.spec.jobs if j.name == job_name)
        from ced.train import existing_run
        # resume=auto only continues a run: a directory that holds none starts a new one
        resume = ["train.resume=auto"] if existing_run(run_dir) else []
        stamp = _read_stamp(run_dir) or {}
        steps = Extension.from_record(stamp["extending"]) if stamp.get("extending") else None
        resume += steps.overrides() if steps else []
        overrides = [*self.launch_overrides(job_name, seed),
                     f"train.threads={self.threads}", *resume,
                     f"logging.project={self.project}", f"logging.group={self.group}",
                     f"logging.name={self.spec.name}-{job_name}-seed{seed}",
                     f"hydra.run.dir={run_dir}"]
        if not self.wandb:
            overrides.append("logging=none")
        banner(f"train {position}: {label} ({' '.join(job.overrides)})")
        log = self.out / "logs" / f"train_{job_name}_seed{seed}.log"
        t0 = time.time()
        code, tail = stream([sys.executable, "-m", "ced.train", *overrides], log, self.env)
        secs = round(time.time() - t0, 1)
        if code == 0 and (run_dir / "final" / "model.safetensors").exists():
            extra = {}
            if steps is not None:
                # done: the record says, for good, that this run was extended and how
                extra["extended"] = steps.record()
                _write_stamp(run_dir, {**{k: v for k, v in stamp.items() if k != "extending"},
                                       **extra})
            self.record(key, "ok", run_dir=str(run_dir), seconds=secs, hash=digest, **extra)
        else:
            print(f"[study] train {label}: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs,
                        log=str(log), hash=digest)

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
        key = "divergence"
        if self.spec.divergence is None:
            return
        step, why = self._divergence_step()
        if step is None:
            self.record(key, "skipped", reason=why)
            return
        out, digest, config, usable = step["out"], step["hash"], step["config"], step["usable"]
        if self._fresh("divergence", step):
            self.record(key, "skipped", out=str(out), hash=digest)
            return
        config["out_dir"] = str(out)
        config["wandb"] = {"enabled": self.wandb, "group": self.group, "project": self.project,
                           **(config.get("wandb") or {})}
        out.mkdir(parents=True, exist_ok=True)
        (out / STAMP).unlink(missing_ok=True)
        banner(f"divergence: {len(usable)} checkpoints, N={config['replays']}, "
               f"T={config.get('lengths')}")
        t0 = time.time()
        code, tail = self.run_job("divergence", config, out / "config.json",
                                  self.out / "logs" / "divergence.log")
        secs = round(time.time() - t0, 1)
        if code == 0 and (out / "summary.json").exists():
            _write_stamp(out, _step_record(step, checkpoints=config["checkpoints"]))
            self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
        else:
            print(f"[study] divergence: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs)

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
        spec, key = self.spec.real_text, "real_text"
        if spec is None:
            return
        step = self._real_text_step()
        if step is None:
            self.record(key, "skipped", reason="no trained checkpoint")
            return
        out, digest, settings, paths = step["out"], step["hash"], step["settings"], step["paths"]
        if self._fresh("real_text", step):
            self.record(key, "skipped", out=str(out), hash=digest)
            return
        # what a previous reading wrote (not lm_eval/, which lives here too): a rerun that
        # writes fewer tables must not leave old ones beside its stamp
        from evals.real_text import OUTPUTS
        for name in (STAMP, *OUTPUTS):
            (out / name).unlink(missing_ok=True)
        job = {**settings, "checkpoint": paths, "out": str(out), "wandb": self.wandb,
               "wandb_project": self.project, "wandb_group": self.group}
        banner(f"real text: {len(paths)} checkpoints, N={list(spec.replays)}")
        t0 = time.time()
        code, tail = self.run_job("real_text", job, self.out / "logs" / "real_text.json",
                                  self.out / "logs" / "real_text.log")
        secs = round(time.time() - t0, 1)
        if code == 0 and (out / "baselines.csv").exists():
            _write_stamp(out, _step_record(step, checkpoints=paths))
            self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
        else:
            print(f"[study] real_text: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs)

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
        label, tasks, digest, final = step["label"], step["out"], step["hash"], step["final"]
        if self._fresh(f"lm_eval tasks {label}", step):
            self.record(f"lm_eval/{label}", "skipped", out=str(tasks), hash=digest)
            return True
        code, tail = stream([sys.executable, "-m", "evals.lmeval", "write-code-tasks",
                             "--checkpoint", str(final), "--out", str(tasks), *step["args"]],
                            self.out / "logs" / f"lm_eval_tasks_{label.replace('/', '_')}.log",
                            self.env)
        if code != 0:
            self.record(f"lm_eval/{label}", "failed", returncode=code, tail=tail)
            return False
        _write_stamp(tasks, _step_record(step, checkpoint=str(final)))
        self.record(f"lm_eval/{label}", "ok", out=str(tasks), hash=digest)
        return True

    def _lm_eval_run(self, step: dict) -> None:
        key, out, digest, final = step["key"], step["out"], step["hash"], step["final"]
        mode, group, tasks = step["inputs"]["mode"], step["inputs"]["group"], step["tasks"]
        batch_size, label = step["inputs"]["batch_size"], step["label"]
        if self._fresh(key, step):
            self.record(key, "skipped", out=str(out), hash=digest)
            return
        if out.exists():
            shutil.rmtree(out)
        # the code tasks' contexts start mid-file: no BOS, as training rows had none there
        model_args = f"checkpoint={final},mode={mode.replace(',', ';')},bos=false"
        cmd = [sys.executable, "-m", "evals.lmeval", "--model", "ced", "--device", "cpu",
               "--model_args", model_args, "--batch_size", str(batch_size),
               "--include_path", str(tasks), "--tasks", group, "--log_samples",
               "--output_path", str(out)]
        banner(f"lm_eval {label} {mode}: {group}")
        t0 = time.time()
        code, tail = stream(cmd, self.out / "logs" / f"{key.replace('/', '_')}.log", self.env)
        secs = round(time.time() - t0, 1)
        if code == 0:
            (out / "mode.txt").write_text(mode + "\n")
            _write_stamp(out, _step_record(step, checkpoint=str(final)))
            self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
        else:
            print(f"[study] {key}: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs)

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
            key, label, out, digest = step["key"], step["label"], step["out"], step["hash"]
            options, final = step["inputs"]["suite"], step["final"]
            if self._fresh(f"suite {label}", step):
                self.record(key, "skipped", out=str(out), hash=digest)
                continue
            (out / STAMP).unlink(missing_ok=True)
            # the driver decides reruns itself (by hash), so it may replace what is there
            job = {**options, "checkpoint": str(final), "out": str(out), "overwrite": True,
                   "wandb": self.wandb, "wandb_project": self.project,
                   "wandb_group": self.group}
            banner(f"suite {label}: N={options['replays']}")
            t0 = time.time()
            log = self.out / "logs" / f"suite_{label.replace('/', '_')}.log"
            code, tail = self.run_job("suite", job, log.with_suffix(".json"), log)
            secs = round(time.time() - t0, 1)
            if code == 0 and (out / "summary.json").exists():
                _write_stamp(out, _step_record(step, checkpoint=str(final)))
                self.record(key, "ok", out=str(out), seconds=secs, hash=digest)
            else:
                print(f"[study] suite {label}: FAILED (exit {code}); continuing", flush=True)
                self.record(key, "failed", returncode=code, tail=tail, seconds=secs,
                            log=str(log))

    # report
    def report(self) -> Path | None:
        banner("report")
        path = self.out / "report" / "report.html"
        self.record("report", "ok", path=str(path))     # what the report shows about itself
        try:
            from analysis.report import build_report
            path = build_report(self.out, wandb=self.wandb, group=self.group,
                                project=self.project)
        except Exception as exc:    # a broken report must not hide the study's results
            import traceback
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
    from ced.writable import OutputDirError, check_output_dir
    try:
        check_output_dir(out, "out")
    except OutputDirError as exc:
        raise StudyError(str(exc)) from None
    from ced.runlock import DirectoryLocked, directory_lock
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
    (state ok, `rebuilt: true`, its hash and directory): training runs with final weights,
    divergence, real text, lm-eval task and mode runs, suite runs."""
    done_file = {"runs": "final/model.safetensors", "divergence": "summary.json",
                 "suite": "summary.json", "real_text": "baselines.csv"}
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
                  jobs=opts.jobs)
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
        from omegaconf import OmegaConf
        print(OmegaConf.to_yaml(OmegaConf.structured(spec)), flush=True)
        # a plan that would refuse a step (or a job's config) fails, as the run would
        bad = [r for r in study.plan() if r["action"] in ("config_error", "refuse")]
        return 2 if bad else 0
    if opts.only in ("all", "train"):
        study.check_configs()
        study.train()
    if opts.only in ("all", "eval"):
        study.divergence()
        study.suite()
        study.real_text()
        study.lm_eval()
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
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf
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
    import hydra
    from omegaconf import OmegaConf
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
