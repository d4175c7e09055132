"""What changed between the inputs an evaluation step recorded when it last ran and the ones
it would run with now: the reason the study driver (and its `only=plan`) gives for a rerun; and
whether a step over models would read fewer models than it last did (`Coverage`: refused)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from ced.checkpoint import WEIGHTS
from ced.records import DamagedRecord, read_json, set_aside

# the record each step leaves in its directory (the hash of its inputs, and the inputs)
STAMP = "study_step.json"
# the key of an evaluation step's inputs that holds its tool's config fields the study does not
# set, at their defaults: a default changed in code reruns the steps that ran with the old one
DEFAULTS = "defaults"


def plain(value: Any) -> Any:
    """A study spec section (a dataclass or an OmegaConf node) as plain JSON-able data."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value)
    return value


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of nested dicts (lists are leaves)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _one_change(key: str, old: Any, new: Any) -> str:
    """One key's change in words: a list names what it gained and lost."""
    if isinstance(old, list) and isinstance(new, list):
        gained = [str(v) for v in new if v not in old]
        lost = [str(v) for v in old if v not in new]
        words = ([f"gained {', '.join(gained)}"] if gained else []) + \
                ([f"lost {', '.join(lost)}"] if lost else [])
        return f"{key} {' and '.join(words) or 'reordered'}"
    return f"{key} {old!r} -> {new!r}"


def differences(old: dict, new: dict) -> list[str]:
    """The keys (dotted) whose values differ between two nested dicts, each in words."""
    a, b = leaves(old), leaves(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a:
            out.append(f"{key} added ({b[key]!r})")
        elif key not in b:
            out.append(f"{key} removed (was {a[key]!r})")
        elif a[key] != b[key]:
            out.append(_one_change(key, a[key], b[key]))
    return out


def describe_step_change(stamp: dict | None, digest: str, inputs: dict,
                         written: dict | None = None) -> str:
    """Why a step whose outputs exist is rerun: the keys of its written settings that changed
    (as the study file writes them, e.g. `suite.replay gained 3W`), whether a checkpoint it
    reads was retrained, else the keys of its resolved inputs that changed. A record written
    before steps kept their inputs can only name the hashes."""
    old_hash = (stamp or {}).get("hash", "unknown")
    if not stamp or "inputs" not in stamp:
        return (f"hash {old_hash} -> {digest}: a checkpoint was retrained or the settings "
                f"changed")
    old = stamp["inputs"]
    if DEFAULTS in inputs and DEFAULTS not in old:
        return ("its record predates the step hash covering the tool's config defaults (every "
                "config field now counts); rerunning once")
    # a record that kept no written settings names what changed in its resolved inputs
    # instead: against nothing, every key the study writes would read as added
    parts = ([] if stamp.get("written") is None else
             differences(stamp["written"], written or {}))
    if old.get("trained") != inputs.get("trained"):
        parts.append("a checkpoint it reads was retrained")
    if not parts:
        parts = differences({k: v for k, v in old.items() if k != "trained"},
                            {k: v for k, v in inputs.items() if k != "trained"})
    return "; ".join(parts) or f"hash {old_hash} -> {digest}"


def read_stamp(directory: Path, repair: bool = True) -> dict | None:
    """The step record in `directory`, or None. A damaged one (torn, not JSON, no hash) is
    named in one line and, with `repair`, moved aside to `study_step.json.damaged-<UTC
    time>` (not for only=plan, which writes nothing, nor in another study's directory): the
    step then counts as unrecorded (a finished training run is refused, not retrained; an
    evaluation is rerun)."""
    path = directory / STAMP
    try:
        stamp = read_json(path, set_aside_damaged=repair)
        if stamp is not None and "hash" not in stamp:
            raise DamagedRecord(path, "no hash in it", set_aside(path) if repair else None)
    except DamagedRecord as exc:
        print(f"[study] warning: {exc}; the step counts as unrecorded", flush=True)
        return None
    return stamp


@dataclass(frozen=True)
class Coverage:
    """The models an invocation's steps over models read: every job of the study under this
    invocation's seeds (`labels`, '<job>/seed<k>'), trained under `runs`. A step over models
    (a tool over every model, a merge of per model readings, lm-eval's tables) whose last run
    read a model outside them that is still trained there would replace a reading of every
    model with one of fewer: a narrower `seeds=`, a job taken out of the study file."""

    labels: frozenset[str]
    runs: Path

    def dropped(self, read: Iterable[str]) -> list[str]:
        """The models of `read` (labels) outside `labels` whose runs still hold weights."""
        return sorted(label for label in set(read) - self.labels
                      if (self.runs / label / "final" / WEIGHTS).exists())

    def refusal(self, read: Iterable[str]) -> str:
        """Why a step whose last run read the models `read` is refused, or "" if it is not;
        the reason names the seeds that run read and what to run instead."""
        read = sorted(set(read))
        dropped = self.dropped(read)
        if not dropped:
            return ""
        seeds = sorted({int(label.rsplit("/seed", 1)[1]) for label in read})
        return (f"its last run read {len(read)} models, and this invocation's jobs and seeds "
                f"leave out {', '.join(dropped)}, still trained here; its outputs are kept. "
                f"To read every model give the seeds it read (seeds=[{','.join(map(str, seeds))}]"
                "); to replace them with this narrower reading, run only=eval on_change=rerun")


def recorded_models(stamp: dict | None) -> list[str]:
    """The models ('<job>/seed<k>') a step over models read when it last ran: its record's
    `checkpoints` (each `.../<job>/seed<k>/final`; labels, so a study directory copied or
    moved compares alike); none for a per model step, which records one `checkpoint`."""
    paths = (stamp or {}).get("checkpoints")
    if not isinstance(paths, list):
        return []
    return [f"{Path(final).parent.parent.name}/{Path(final).parent.name}" for final in paths]


def step_decision(step: dict, repair: bool = True,
                  coverage: Coverage | None = None) -> tuple[str, str]:
    """Whether an evaluation step runs, the one decision of a run and of only=plan: (skip |
    run | rerun | refuse, reason). `step` holds its `out` directory, the `done` file its
    outputs end with, the `hash` of its `inputs` and what the study file `written` for it; it
    is done when `done` exists beside a record of the same hash, and a rerun names what
    changed. With `coverage` (the driver's, unless on_change=rerun), a step whose last run
    read a model the invocation leaves out is refused, its outputs kept (`Coverage`)."""
    stamp = read_stamp(step["out"], repair)
    if step["done"].exists() and stamp is not None and stamp.get("hash") == step["hash"]:
        return "skip", f"done before with the same inputs (hash {step['hash']})"
    if not step["done"].exists():
        return "run", "not run yet"
    refusal = "" if coverage is None else coverage.refusal(recorded_models(stamp))
    if refusal:
        return "refuse", refusal
    change = describe_step_change(stamp, step["hash"], step["inputs"], step.get("written"))
    return "rerun", f"inputs changed ({change})"
