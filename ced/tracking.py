"""wandb conventions shared by every entry point (training, divergence, suite, report).

- One project (`ced` unless told otherwise) and a group option everywhere.
- A training run's id is kept in its trainer state, so a resumed run continues the same run.
- A trained model is a wandb artifact of type `model` named `model-<run id>`; its name is
  written to `final/wandb.json`, and evaluation runs declare it as their input with
  `use_artifact` (online). wandb cannot use artifacts offline, so offline evaluation runs
  record the artifact names in their config instead (the lineage is still in the dashboard
  after `wandb sync`, as a config value rather than a graph edge).
- Scalars go to the run's history and to its summary, so that a dashboard can plot them
  without parsing tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

ARTIFACT_FILE = "wandb.json"


def new_run_id() -> str:
    """A wandb-style run id (8 characters of [a-z0-9]); chosen here rather than by wandb so
    that it can be stored in the trainer state before the first checkpoint."""
    import secrets
    import string
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def log_model_artifact(run, final: Path, metadata: dict | None = None) -> str:
    """Log the directory `final` (a trained model) as a `model` artifact of `run` and record
    its name in `final/wandb.json`; returns the artifact name."""
    import wandb
    name = f"model-{run.id}"
    artifact = wandb.Artifact(name, type="model", metadata=metadata or {})
    artifact.add_dir(str(final))
    run.log_artifact(artifact, aliases=["latest", "final"])
    (Path(final) / ARTIFACT_FILE).write_text(json.dumps(
        {"run_id": run.id, "artifact": f"{name}:latest", "project": run.project}))
    return name


def artifact_of(checkpoint: str | Path) -> str | None:
    """The model artifact name recorded beside a checkpoint (None if it was trained without
    wandb)."""
    path = Path(checkpoint) / ARTIFACT_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("artifact")
    except ValueError:
        return None


def use_checkpoints(run, checkpoints: Iterable[str | Path]) -> list[str]:
    """Declare the model artifacts of `checkpoints` as inputs of `run`: `use_artifact` online;
    offline (where wandb refuses it) their names go into the run's config. Returns the
    names."""
    names = [a for a in (artifact_of(c) for c in checkpoints) if a]
    if not names:
        return names
    if run.settings._offline:
        run.config.update({"input_artifacts": names}, allow_val_change=True)
        return names
    for name in names:
        try:
            run.use_artifact(name, type="model")
        except Exception as exc:     # lineage is a convenience; never fail the evaluation
            print(f"[wandb] could not use artifact {name}: {exc}", flush=True)
    run.config.update({"input_artifacts": names}, allow_val_change=True)
    return names


def log_scalars(run, scalars: dict[str, float]) -> None:
    """Scalars into the run's history and its summary."""
    clean = {k: float(v) for k, v in scalars.items() if v is not None and v == v}
    if clean:
        run.log(clean)
        run.summary.update(clean)


def checkpoint_label(path: str | Path) -> str:
    """A short name for a checkpoint in metric keys: .../runs/<job>/seed<k>/final ->
    <job>/seed<k>; .../<run>/final -> <run>."""
    p = Path(path)
    run = p.parent if p.name == "final" else p
    return f"{run.parent.name}/{run.name}" if run.name.startswith("seed") else run.name
