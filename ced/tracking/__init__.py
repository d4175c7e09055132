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
import secrets
import string
import struct
from pathlib import Path
from typing import Iterable

from ced.run_id import of_checkpoint

ARTIFACT_FILE = "wandb.json"


def new_run_id() -> str:
    """A wandb-style run id (8 characters of [a-z0-9]); chosen here rather than by wandb so
    that it can be stored in the trainer state before the first checkpoint."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def log_model_artifact(run, final: Path, metadata: dict | None = None) -> str:
    """Log the directory `final` (a trained model) as a `model` artifact of `run` and record
    its name in `final/wandb.json`; returns the artifact name."""
    # lazy: wandb costs ~0.4 s to import, and only a run that logs to wandb needs it
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
    run_id = of_checkpoint(Path(path))
    if run_id is not None:
        return run_id.model
    p = Path(path)
    return (p.parent if p.name == "final" else p).name


def job_and_seed(path: str | Path) -> tuple[str, int | None]:
    """(job, training seed) of a checkpoint of a study's training run (`ced.run_id`: its
    run.json); (the parent directory's name, None) for any other path."""
    run_id = of_checkpoint(Path(str(path)))
    return (run_id.job, run_id.seed) if run_id is not None else (Path(str(path)).parent.name, None)


# ---- reading an offline run without a server --------------------------------------------------
# An offline run (`wandb/offline-run-*/run-<id>.wandb`) is a record log: wandb's LevelDB-style
# framing (a 7-byte header, then 32 KiB blocks of chunks: CRC32 (4 bytes), length (2), type (1:
# full, 2: first, 3: middle, 4: last)) around protobuf `Record`s. With the pinned wandb its
# files/ folder holds no config or summary until `wandb sync` uploads it, so this reads the
# record log directly: what the dashboard will show after the sync.
_BLOCK = 32 * 1024
_HEADER = 7


def _records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path}: not a wandb record log (no ':W&B' header)")
    records, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:                       # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:      # zero padding to the block's end
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
        else:
            raise ValueError(f"{path}: damaged record log (chunk type {kind} at byte {pos})")
    return records


def read_offline_run(run_dir: str | Path) -> dict:
    """What an offline wandb run holds (run_dir: `.../wandb/offline-run-<time>-<id>`): its id,
    `config` (key -> value), `summary` (key -> the last value), `history` (rows logged),
    `artifacts` (name: type), and `exit_code` (None if the run never finished: killed)."""
    # lazy: wandb costs ~0.4 s to import, and only reading an offline run needs its protobufs
    from wandb.proto import wandb_internal_pb2 as pb
    run_dir = Path(run_dir)
    logs = sorted(run_dir.glob("run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"{run_dir}: no run-*.wandb record log (is it a wandb "
                                f"offline-run directory?)")
    out = {"id": logs[0].stem.removeprefix("run-"), "config": {}, "summary": {}, "history": 0,
           "artifacts": {}, "exit_code": None}

    def key_of(item) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in _records(logs[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "config":
            for item in record.config.update:
                out["config"][key_of(item)] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][key_of(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"] += 1
        elif kind == "artifact":
            out["artifacts"][record.artifact.name] = record.artifact.type
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    out["config"] = {k: (v.get("value", v) if isinstance(v, dict) else v)
                     for k, v in out["config"].items()}
    return out


def offline_folders(paths: Iterable[str | Path]) -> list[Path]:
    """The offline-run folders `paths` name: a run directory (its `wandb/offline-run-*`), a
    `wandb/` directory, or offline-run folders themselves; oldest first (wandb names them
    `offline-run-<date>_<time>-<id>`). A FileNotFoundError naming a path that holds none."""
    found: list[Path] = []
    for path in map(Path, paths):
        if list(path.glob("run-*.wandb")):
            found.append(path)
            continue
        inside = sorted(path.glob("offline-run-*")) or sorted(path.glob("wandb/offline-run-*"))
        if not inside:
            raise FileNotFoundError(f"{path}: no wandb offline run in it (a run directory, its "
                                    f"wandb/ folder or a wandb/offline-run-* folder)")
        found += inside
    return sorted(dict.fromkeys(found), key=lambda p: p.name)


def read_run_history(paths: Iterable[str | Path]) -> dict:
    """One run's record from all of its offline folders (`offline_folders`): a resumed run
    writes one folder per process that ran it, under the same id, which `wandb sync` merges.
    As `read_offline_run`, with config and summary updated folder by folder in time order,
    history rows summed, artifacts joined, the last folder's exit code, and `folders`: [{name,
    exit_code, history}] in order. A ValueError when the folders hold different runs."""
    folders = offline_folders(paths)
    parts = [read_offline_run(folder) for folder in folders]
    ids = sorted({part["id"] for part in parts})
    if len(ids) > 1:
        raise ValueError(f"the offline folders hold {len(ids)} different runs (ids "
                         f"{', '.join(ids)}); pass one run's folders")
    out = {"id": ids[0], "config": {}, "summary": {}, "history": 0, "artifacts": {},
           "exit_code": parts[-1]["exit_code"], "folders": []}
    for folder, part in zip(folders, parts):
        out["config"].update(part["config"])
        out["summary"].update(part["summary"])
        out["history"] += part["history"]
        out["artifacts"].update(part["artifacts"])
        out["folders"].append({"name": folder.name, "exit_code": part["exit_code"],
                               "history": part["history"]})
    return out
