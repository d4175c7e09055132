"""Saving, loading and checking trained models and training checkpoints.

A model directory (`final/`) holds `model.safetensors` and `config.json`; nothing here unpickles
to load a model. Writes are atomic (a temporary directory renamed into place), so an interrupted
save never leaves a half-written model where a reader would find it; `remove_orphans` deletes
the temporary directories such an interruption leaves behind.

Every problem with a file on disk (missing, truncated, garbled, not JSON, weights that do not fit
the config, non-finite weights) raises `CheckpointError`, whose message is one line naming the
file and what is wrong, so entry points can print it instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import CEDModel
from .quant import parse_kv_override

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.bin"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


class CheckpointError(ValueError):
    """A checkpoint or model file that cannot be used; the message is one line naming it."""


class StorageFull(RuntimeError):
    """A write that ran out of space (or quota); the message is one line naming the path, the
    free space and about how much was needed. Its temporary files are already removed."""


# What torch's zip writer says when a write came up short (it raises RuntimeError, not OSError).
_SHORT_WRITE = ("unexpected pos", "file write failed", "No space left")


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) \
        if Path(path).exists() else 0


@contextmanager
def guarded_write(tmp: Path, final: Path, need_bytes: int) -> Iterator[None]:
    """Around the writes that fill the temporary directory `tmp` of `final`: a write that
    runs out of space removes `tmp` and raises StorageFull (one line); anything older, the
    last good checkpoint included, is untouched because nothing but `tmp` was written.
    need_bytes: about what the whole write takes, for the message."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        free = free_bytes(final.parent)
        full = ((isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
                or any(hint in str(exc) for hint in _SHORT_WRITE) or free < need_bytes)
        if not full:
            raise
        raise StorageFull(f"no space left on the device writing {final}: {free / 2**20:.1f} "
                          f"MiB free, about {need_bytes / 2**20:.1f} MiB needed; the "
                          f"unfinished write is removed") from None


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint whose weights do not fit the model being trained or built (a
    different shape). Unlike damage, an older checkpoint of the same run would not help."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def atomic_directory(final: Path) -> Path:
    """A fresh temporary directory beside `final`; `commit_directory` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))


def commit_directory(tmp: Path, final: Path) -> None:
    """Rename a fully written temporary directory to `final`, replacing an older one."""
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def remove_orphans(directory: Path) -> list[Path]:
    """Delete the temporary and replaced directories an interrupted save left in `directory`
    (`.tmp-*`, `.old-*`); returns what was removed. Only call it while no save is running."""
    removed = []
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.is_dir() and path.name.startswith((TMP_PREFIX, OLD_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Name of the first floating tensor holding a NaN or an infinity, else None."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def check_weights(path: Path, expected: Mapping[str, torch.Size],
                  optional: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Load a safetensors file and check it against the expected shapes: readable (not
    truncated or garbled), the same tensor names (those in `optional` may be absent, e.g. a
    tied head), the same shapes, every value finite. Returns the tensors."""
    try:
        state = load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:   # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{path}: damaged, cannot be read ({_first_line(exc)})") from None
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - optional)
    if unexpected or missing:
        raise CheckpointMismatch(f"{path}: weights do not fit the model config: missing "
                                 f"{missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointMismatch(f"{path}: {name} has shape {tuple(tensor.shape)}, the "
                                     f"model config gives {tuple(expected[name])}")
    bad = first_non_finite(state)
    if bad is not None:
        raise CheckpointError(f"{path}: tensor {bad} holds NaN or infinite values")
    return state


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({_first_line(exc)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object; got {type(value).__name__}")
    return value


def _model_shapes(model: CEDModel) -> tuple[dict[str, torch.Size], frozenset[str]]:
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    optional = frozenset({"lm_head.weight"}) if model.cfg.tie_embeddings else frozenset()
    return shapes, optional


def check_training_checkpoint(directory: Path, model: CEDModel) -> int:
    """Check a `checkpoints/step_*` directory before accelerate loads it: the trainer state
    (the step), the weights (readable, the model's shapes, finite) and the optimizer state
    (readable). Returns the step. Raises CheckpointMismatch when the weights have other
    shapes than `model`, CheckpointError for anything missing or damaged."""
    directory = Path(directory)
    state = read_json(directory / TRAINER_STATE)
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{directory / TRAINER_STATE}: 'step' must be an int >= 0; "
                              f"got {step!r}")
    shapes, optional = _model_shapes(model)
    check_weights(directory / WEIGHTS, shapes, optional)
    optimizer = directory / OPTIMIZER
    try:
        # weights_only: an optimizer state is tensors, numbers and lists; nothing to execute.
        loaded = torch.load(optimizer, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{optimizer}: missing") from None
    except Exception as exc:   # torch raises several types for truncated/garbled archives
        raise CheckpointError(f"{optimizer}: damaged, cannot be read ({_first_line(exc)})") \
            from None
    if not isinstance(loaded, dict) or "state" not in loaded:
        raise CheckpointError(f"{optimizer}: not an optimizer state")
    tensors = {f"{pid}.{key}": value for pid, entry in loaded["state"].items()
               for key, value in entry.items() if isinstance(value, torch.Tensor)}
    bad = first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"{optimizer}: state {bad} holds NaN or infinite values")
    if not any(directory.glob("random_states_*.pkl")):
        raise CheckpointError(f"{directory}: missing random_states_*.pkl (RNG state)")
    return step


def save_model(model: CEDModel, directory: str | Path) -> Path:
    """Write model weights and config atomically to `directory`. Refuses (CheckpointError)
    weights holding NaN or infinite values, so a saved model is always a usable one."""
    final = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    bad = first_non_finite(state)
    if bad is not None:
        raise CheckpointError(f"{final}: not saved, weight {bad} holds NaN or infinite values")
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    tmp = atomic_directory(final)
    with guarded_write(tmp, final, sum(t.nbytes for t in state.values()) + 2**16):
        save_file(state, str(tmp / WEIGHTS))
        (tmp / CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=2))
        commit_directory(tmp, final)
    return final


def load_config(path_or_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory (its `config.json`) or of a config JSON file
    given directly, or a one-line CheckpointError naming the file."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / CONFIG
    elif not path.is_file():
        # A model directory is what callers usually pass; say so when it is missing.
        raise CheckpointError(f"{path_or_dir}: no such checkpoint directory")
    raw = read_json(path)
    try:
        return ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid model config ({_first_line(exc)})") from None


def stated_override(value: int | str | None) -> str | None:
    """An evaluation-time override (`topk`, `kv`) as a run records it: its text, or None
    where it leaves the model as trained (None, "", "none" or "null")."""
    if value is None or str(value).lower() in ("", "none", "null"):
        return None
    return str(value)


DECODER_GLOBAL = ("on", "off")


def evaluation_overrides(cfg: ModelConfig, topk: int | str | None = None,
                         kv: str | None = None,
                         decoder_global: str | None = None) -> ModelConfig:
    """`cfg` with the evaluation-time overrides applied, the one place they are read:
    `topk` (None, "" or "none": as trained; an int; or "all": read every visible global entry,
    i.e. top-k = max_seq_len), `kv` (storage formats, `ced.quant.parse_kv_override`, e.g.
    "global:fp4_block16") and `decoder_global` ("off": the decoder layers lose their global
    read, the path ablation of docs/semantics.md 4.6; "on" or None: as trained). None changes
    a parameter's shape, so any checkpoint's weights load into the result. A ValueError names
    `topk`, `decoder_global` or the bad `kv` part."""
    changes: dict = {}
    if stated_override(decoder_global) is not None:
        value = str(decoder_global).lower()
        if value not in DECODER_GLOBAL:
            raise ValueError(f"decoder_global: one of {DECODER_GLOBAL} (or none: as trained); "
                             f"got {decoder_global!r}")
        if value == "off" and not cfg.traits.decoder_windows:
            raise ValueError(f"decoder_global=off: only for variant 'ced', whose decoder keeps "
                             f"a window without its global read; this checkpoint is "
                             f"{cfg.variant!r}")
        if value == "off":
            changes["decoder_global_read"] = False
    if stated_override(topk) is not None:
        all_entries = str(topk).lower() == "all"
        try:
            k = cfg.max_seq_len if all_entries else int(topk)
        except ValueError:
            raise ValueError(f"topk: an int >= 1 or 'all'; got {topk!r}") from None
        if cfg.topk is None and not all_entries:
            raise ValueError(f"topk={topk}: this checkpoint has no lightning indexer (it was "
                             "trained with topk=None, reading every entry); only topk=all")
        if cfg.topk is not None and k != cfg.topk:
            changes["topk"] = k
    if stated_override(kv) is not None:
        changes.update(parse_kv_override(kv))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def load_model(directory: str | Path, map_location: str | torch.device = "cpu", *,
               topk: int | str | None = None, kv: str | None = None,
               decoder_global: str | None = None) -> CEDModel:
    """Rebuild a CEDModel from a directory written by `save_model` (eval mode), optionally
    read back with another top-k, KV storage formats or without the decoder's global read
    (`evaluation_overrides`). A missing, damaged or mismatched file raises CheckpointError (a
    ValueError) naming it; a bad override, a ValueError naming it."""
    directory = Path(directory)
    cfg = evaluation_overrides(load_config(directory), topk, kv, decoder_global)
    try:
        model = CEDModel(cfg)
    except ValueError as exc:
        raise CheckpointError(f"{directory / CONFIG}: {_first_line(exc)}") from None
    shapes, optional = _model_shapes(model)
    state = check_weights(directory / WEIGHTS, shapes, optional)
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model.to(map_location).eval()

