"""The training runs of a study: what each run trains (its overrides and their hash), what
its directory already holds decides what happens to it (skip, train, resume, continue, refuse,
rerun, reuse), and the launch of `ced.train`. A mixin of `experiments.run.Study`, which owns
the study (`spec`, `out`, `jobs`, `on_change`, `reuse`, `repair`, `env`, `threads`) and its
bookkeeping (`record`, `runs`, `run_dir`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ced.run_id import RunId, write_run_id
from ced.train.run_dir import existing_run
from ced.train_config import ConfigError, validate

from .continuation import Extension, extension
from .freshness import STAMP
from .freshness import read_stamp as _read_stamp
from .steps import ROOT, banner, stream, write_stamp
from .study import StudyConfig, StudyError, config_hash, normalise_overrides

# Overrides that say how or where a run goes, not what it trains: not part of its config hash.
BOOKKEEPING = ("train.threads", "train.resume", "train.progress", "logging", "logging.",
               "hydra.")


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
    try:
        config = validate(OmegaConf.load(path))
    except (ConfigError, ValueError, OSError):
        return None
    return json.loads(json.dumps(training_view(asdict(config)), default=str))


def describe_config_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The keys whose values differ between two `training_view`s, as one short line."""
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    text = "; ".join(parts) or "(the same composed config)"
    return text if len(text) < 300 else text[:297] + "..."


class TrainingRuns:
    """`Study`'s training step, run by run (see the module's docstring for what it needs)."""

    def train_overrides(self, job_name: str, seed: int) -> list[str]:
        """What the run trains (`training_overrides`)."""
        return training_overrides(self.spec, job_name, seed)

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
            write_stamp(run_dir, {**stamp, "hash": digest, "overrides": wanted,
                                   "rehashed_from": stamp["hash"]})
        if action == "skip":
            # which model the folder holds, as fields (`analysis.layout`): an older driver's
            # finished run gets its record here
            write_run_id(run_dir, RunId(job_name, seed))
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
            write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                                   "seed": seed, "extending": steps.record(),
                                   "extended_from_hash": (stamp or {}).get(
                                       "extended_from_hash", (stamp or {}).get("hash"))})
            return digest
        source = self.reusable(digest) if action == "train" else None
        if source is not None:
            shutil.copytree(source, run_dir, dirs_exist_ok=True)
            write_run_id(run_dir, RunId(job_name, seed))    # not the source's
            write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                                   "seed": seed, "reused_from": str(source)})
            print(f"[study] train {label}: the same training run (hash {digest}) is done "
                  f"in {source}; copied, not retrained (reuse=)", flush=True)
            self.record(key, "reused", run_dir=str(run_dir), hash=digest, source=str(source))
            return None
        write_stamp(run_dir, {"hash": digest, "overrides": wanted, "job": job_name,
                               "seed": seed})
        return digest

    def _launch_training(self, job_name: str, seed: int, label: str, digest: str,
                         position: str) -> None:
        """Train one run with `ced.train` (resumes from its last checkpoint) and record it."""
        key, run_dir = f"train/{label}", self.run_dir(label)
        job = next(j for j in self.spec.jobs if j.name == job_name)
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
        write_run_id(run_dir, RunId(job_name, seed))
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
                write_stamp(run_dir, {**{k: v for k, v in stamp.items() if k != "extending"},
                                       **extra})
            self.record(key, "ok", run_dir=str(run_dir), seconds=secs, hash=digest, **extra)
        else:
            print(f"[study] train {label}: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs,
                        log=str(log), hash=digest)
