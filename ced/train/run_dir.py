"""A training run's directory and its lifecycle: what a run leaves there, where a new or resumed
run starts (`plan_run`: every file a resume depends on checked before anything is written),
what a resume may change of the config (`config_changes`), metrics.jsonl read back, and
checkpoints saved atomically and only when finite (`check_finite`, `save_checkpoint`). The
training loop (`ced.train`) drives it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..checkpoint import (TRAINER_STATE, CheckpointError, CheckpointMismatch,
                          atomic_directory, check_training_checkpoint, commit_directory,
                          directory_bytes, first_non_finite, guarded_write)
from ..model import CEDModel
from ..train_config import ConfigError, TrainConfig

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
CONFIG_YAML = "config.yaml"
CONFIG_CHANGES = "config_changes.jsonl"    # every allowed change of config at a resume
FINAL = "final"
# What a run leaves in its directory; any of them means the directory already holds a run.
RUN_FILES = (CONFIG_YAML, METRICS, CHECKPOINTS, FINAL)


class TrainingDiverged(RuntimeError):
    pass


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (incomplete ones are hidden .tmp-* directories)."""
    root = run_dir / CHECKPOINTS
    return sorted(root.glob("step_*")) if root.exists() else []


@dataclass
class RunPlan:
    """Where a run starts, decided (and every file it depends on checked) before anything in
    the run directory is written. resume_from: the checkpoint to load (None: step 0);
    discard: the directory holds another run to delete first (train.overwrite=true);
    metrics: the lines of metrics.jsonl to keep; warnings: printed once the plan is taken."""

    resume_from: Path | None
    start_step: int
    discard: bool
    metrics: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Checkpoints newer than resume_from: damaged ones are set aside (renamed .damaged-*, kept
    # for inspection), abandoned ones of an explicit rewind deleted; either way they must not
    # outrank the new run's checkpoints in pruning or in a later resume=auto.
    set_aside: list[Path] = field(default_factory=list)
    delete: list[Path] = field(default_factory=list)
    # keys a resume changes, allowed by train.allow_config_change: {key: [old, new]}
    changes: dict = field(default_factory=dict)


def existing_run(run_dir: Path) -> list[str]:
    """The files of an earlier run in `run_dir` (Hydra's own `.hydra/` does not count)."""
    found = []
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def check_resumable(run_dir: Path) -> None:
    """train.resume=auto continues the run in `run_dir`; a directory that holds none (a typo, a
    run that never started) is a ConfigError, since starting a new run there from the default
    config would pass for a resumed one."""
    if not existing_run(run_dir):
        raise ConfigError(f"train.resume=auto: nothing to resume in {run_dir} (no "
                          f"{', '.join(RUN_FILES)}); drop train.resume to start a new run there")


def _refuse_existing(run_dir: Path, found: list[str]) -> ConfigError:
    return ConfigError(f"{run_dir} already holds a run ({', '.join(found)}); continue it with "
                       f"train.resume=auto, choose a new hydra.run.dir, or replace it with "
                       f"train.overwrite=true")


def plan_run(t, run_dir: Path, model: CEDModel) -> RunPlan:
    """Decide where the run starts; raises ConfigError / CheckpointError (one line) instead.

    resume=never: the directory must not hold a run, unless train.overwrite=true.
    resume=auto: the newest checkpoint that is intact (readable, finite, with this model's
    shapes) and its step; damaged newer ones are skipped with a warning. A checkpoint with other
    shapes is an error (an older one of the same run would have them too), and so is a
    directory that holds no run (`check_resumable`).
    resume=<path>: that checkpoint, which must be intact; into a directory holding another
    run only with train.overwrite=true."""
    found = existing_run(run_dir)
    if t.resume == "never":
        if found and not t.overwrite:
            raise _refuse_existing(run_dir, found)
        return RunPlan(None, 0, discard=bool(found))
    if t.resume == "auto":
        check_resumable(run_dir)
        warnings, newest_problem = [], None
        candidates = checkpoint_dirs(run_dir)[::-1]
        for candidate in candidates:
            try:
                step = check_training_checkpoint(candidate, model)
            except CheckpointMismatch as exc:
                raise CheckpointError(f"train.resume=auto: {exc}") from None
            except CheckpointError as exc:
                newest_problem = newest_problem or str(exc)
                warnings.append(f"skipping a damaged checkpoint: {exc}")
                continue
            damaged = [c for c in candidates if c.name > candidate.name]
            if damaged:
                warnings.append(f"resuming from {candidate}, the newest intact checkpoint; the "
                                f"damaged ones are renamed .damaged-step_*")
            return RunPlan(candidate, step, False, read_metrics(run_dir / METRICS, step, warnings),
                           warnings, set_aside=damaged)
        if candidates:
            raise CheckpointError(f"train.resume=auto: none of the {len(candidates)} "
                                  f"checkpoints in {run_dir / CHECKPOINTS} is intact; the "
                                  f"newest: {newest_problem}")
        # stopped before its first checkpoint: the same run starts over in its directory
        return RunPlan(None, 0, False)
    path = Path(t.resume)
    if not (path / TRAINER_STATE).exists():
        raise ConfigError(f"train.resume: {t.resume!r} is not a checkpoint directory (no "
                          f"{TRAINER_STATE}); use 'never', 'auto' or a checkpoints/step_* path")
    step = check_training_checkpoint(path, model)
    inside = run_dir.resolve() in path.resolve().parents
    if found and not inside and not t.overwrite:
        raise _refuse_existing(run_dir, found)
    warnings: list[str] = []
    newer = [c for c in checkpoint_dirs(run_dir) if inside and c.name > path.name]
    if newer and not t.overwrite:
        raise ConfigError(f"train.resume: {path} is older than this run's newest checkpoint "
                          f"{newer[-1].name}; continuing from it would mix two runs' "
                          f"checkpoints; use train.resume=auto, or train.overwrite=true to "
                          f"delete the {len(newer)} newer one(s)")
    metrics = read_metrics(run_dir / METRICS, step, warnings) if inside else []
    return RunPlan(path, step, bool(found) and not inside, metrics, warnings, delete=newer)


# Keys that say how a run goes or where it reports, not what it computes: a resume may change
# them freely. Every other key (model, data, optim, the schedule and batch, the seed, the
# replay simulation, ...) must match the run's config.yaml unless train.allow_config_change
# names it (or a prefix of it, e.g. `data`).
HOW_NOT_WHAT = ("train.resume", "train.overwrite", "train.threads", "train.progress",
                "train.eval_every", "train.eval_batches", "train.save_every", "train.keep_last",
                "train.signal_checkpoint", "train.signal_exit_code", "train.allow_config_change",
                "train.device", "logging.")


def config_changes(cfg: TrainConfig, run_dir: Path) -> dict[str, list]:
    """What a resume into `run_dir` changes against the config the run was trained with
    (its config.yaml): {key: [old, new]} of the keys train.allow_config_change allows;
    ConfigError (one line naming the keys) for any other change of what the run computes.
    {} when the run has no config.yaml (nothing to compare)."""
    path = run_dir / CONFIG_YAML
    if not path.exists():
        return {}
    try:
        old = flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    except Exception as exc:     # a damaged config.yaml: name it
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__})") from None
    new = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    changed = {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new))
               if old.get(key) != new.get(key)
               and not any(key == h or (h.endswith(".") and key.startswith(h))
                           for h in HOW_NOT_WHAT)}
    # train.extend_to is itself the request to change what the run computes: allowed, and
    # recorded like any allowed change
    allowed = list(cfg.train.allow_config_change) + ["train.extend_to"]
    refused = [k for k in changed if not any(k == a or k.startswith(a + ".") for a in allowed)]
    if refused:
        shown = ", ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused[:4])
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise ConfigError(f"train.resume: the run in {run_dir} was trained with another config "
                          f"({shown}{more}); resuming would mix two runs. Pass the run's own "
                          f"values, or allow the change with "
                          f"train.allow_config_change=[{','.join(refused)}]")
    return changed


def read_metrics(path: Path, step: int, warnings: list[str]) -> list[str]:
    """The lines of metrics.jsonl up to `step` (later ones were logged by a killed run after its
    last checkpoint, and are redone); see `metrics_records` for damaged lines."""
    if step == 0 or not path.exists():
        return []
    return [line for line, record in metrics_records(path, warnings) if record["step"] <= step]


def metrics_records(path: Path, warnings: list[str]) -> list[tuple[str, dict]]:
    """(line, record) of every line of a metrics.jsonl. A half-written last line (what a crash
    or a full disk leaves) is dropped with a warning; a damaged line before it is an error
    naming it."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__})") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            record["step"]
        except (json.JSONDecodeError, TypeError, KeyError):
            if number == len(lines):
                warnings.append(f"{path}: dropped its half-written last line {number}")
                break
            raise CheckpointError(f"{path}: line {number} is not a JSON record with a 'step'; "
                                  f"repair or delete that line") from None
        records.append((line, record))
    return records


def discard_run(run_dir: Path) -> None:
    """train.overwrite=true: delete an earlier run's files (and its wandb logs)."""
    for name in (*RUN_FILES, "wandb"):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def last_good_checkpoint(run_dir: Path, model: CEDModel) -> str:
    """The newest checkpoint that is intact and finite, for messages; checked, not assumed."""
    for candidate in checkpoint_dirs(run_dir)[::-1]:
        try:
            check_training_checkpoint(candidate, model)
            return str(candidate)
        except CheckpointError:
            continue
    return "none (nothing intact saved yet)"


def check_finite(accelerator, model, optimizer, step: int, run_dir: Path) -> None:
    """Raise TrainingDiverged on every process if any process's weights or optimizer state
    hold NaN or infinity: a checkpoint must never be named good or saved in that state."""
    bad = first_non_finite(dict(accelerator.unwrap_model(model).named_parameters()))
    if bad is None:
        moments = {f"{id(p)}.{k}": v for p, entry in optimizer.optimizer.state.items()
                   for k, v in entry.items() if isinstance(v, torch.Tensor)}
        bad = "optimizer state" if first_non_finite(moments) else None
    flag = torch.tensor(0 if bad is None else 1, device=accelerator.device)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    if int(flag):
        raise TrainingDiverged(
            f"non-finite weights ({bad or 'on another process'}) after step {step}, so they "
            f"were not saved; the last good checkpoint is "
            f"{last_good_checkpoint(run_dir, accelerator.unwrap_model(model))}")


def save_checkpoint(accelerator, model, run_dir: Path, step: int, keep_last: int,
                    state: dict | None = None) -> Path:
    """accelerate's full state into a temporary directory, renamed once complete. `state`
    (e.g. the wandb run id) goes into trainer_state.json beside the step. The caller checks the
    weights finite first (`check_finite`). A full disk raises StorageFull with the temporary
    directory removed and every older checkpoint untouched."""
    final = run_dir / CHECKPOINTS / f"step_{step:08d}"
    tmp = None
    if accelerator.is_main_process:
        tmp = atomic_directory(final)
    tmp = Path(broadcast(accelerator, str(tmp) if tmp else None))
    previous = checkpoint_dirs(run_dir)
    # weights and two AdamW moments, or what the last checkpoint took
    need = max(directory_bytes(previous[-1]) if previous else 0,
               3 * sum(p.nbytes for p in accelerator.unwrap_model(model).parameters()))
    with guarded_write(tmp, final, need):
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / TRAINER_STATE).write_text(json.dumps({**(state or {}), "step": step}))
            commit_directory(tmp, final)
    if accelerator.is_main_process:
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def broadcast(accelerator, value):
    """`value` as process 0 has it, on every process (itself with one process)."""
    if accelerator.num_processes == 1:
        return value
    # lazy: accelerate costs ~0.1 s to import, and only a run of several processes gets here
    from accelerate.utils import broadcast_object_list
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested config dict as {"a.b.c": value}: the dotted keys an override names."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
