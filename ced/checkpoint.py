"""Saving and loading trained models: safetensors weights plus the ModelConfig as JSON.

Nothing here unpickles: a checkpoint directory holds `model.safetensors` and `config.json`.
Writes are atomic (a temporary directory renamed into place), so an interrupted save never
leaves a half-written model where a reader would find it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import CEDModel

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def atomic_directory(final: Path) -> Path:
    """A fresh temporary directory beside `final`; `commit_directory` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))


def commit_directory(tmp: Path, final: Path) -> None:
    """Rename a fully written temporary directory to `final`, replacing an older one."""
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def save_model(model: CEDModel, directory: str | Path) -> Path:
    """Write model weights and config atomically to `directory`."""
    final = Path(directory)
    tmp = atomic_directory(final)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / WEIGHTS))
    (tmp / CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    commit_directory(tmp, final)
    return final


def load_model(directory: str | Path, map_location: str | torch.device = "cpu") -> CEDModel:
    """Rebuild a CEDModel from a directory written by `save_model` (eval mode)."""
    directory = Path(directory)
    if not (directory / WEIGHTS).exists() or not (directory / CONFIG).exists():
        raise FileNotFoundError(f"load_model: {directory} lacks {WEIGHTS} or {CONFIG}")
    cfg = ModelConfig.from_dict(json.loads((directory / CONFIG).read_text()))
    model = CEDModel(cfg)
    state = load_file(str(directory / WEIGHTS), device=str(map_location))
    strict = not cfg.tie_embeddings
    missing, unexpected = model.load_state_dict(state, strict=strict)
    if unexpected or (missing and set(missing) != {"lm_head.weight"}):
        raise ValueError(f"load_model: weights do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.to(map_location).eval()
