"""Which trained model, under which evaluation-time overrides, a folder of a study directory
holds: its `RunId`, written by the study driver (`experiments`) as typed fields (`run.json`)
into every training run and every per-model step it runs, and read back by whatever reads a
study (`analysis`, and the measuring tools that name a checkpoint's job and seed). Nothing else
reads a job, a seed or an override out of a folder's name: a name is for people and paths.

    runs/<job>/seed<k>/run.json                       {"job", "seed", "topk": null, "kv": null}
    <tool>/<job>/seed<k>[@topk=K][@kv=SPEC]/run.json  the same, with the step's overrides

A folder written before the driver wrote `run.json` (an older study directory or archive) is
read from its name by `legacy_run_id`, the one reader of those names.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ced.records import read_json, write_json

IDENTITY = "run.json"
# the evaluation-time overrides a per-model step may read a model under, in label order
OVERRIDES = ("topk", "kv")


@dataclass(frozen=True)
class RunId:
    """One trained model of a study (its job and training seed) and the evaluation-time
    overrides one step read it under (top-k read, KV storage; None: as trained)."""

    job: str
    seed: int
    topk: int | None = None
    kv: str | None = None

    def __post_init__(self) -> None:
        if not self.job or "/" in self.job or "@" in self.job:
            raise ValueError(f"RunId.job: a study job's name, without '/' or '@'; got "
                             f"{self.job!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"RunId.seed: an int >= 0; got {self.seed!r}")

    @property
    def overrides(self) -> dict[str, Any]:
        """The overrides that are set, in label order."""
        return {k: getattr(self, k) for k in OVERRIDES if getattr(self, k) is not None}

    @property
    def model(self) -> str:
        """`<job>/seed<k>`: the training run's folder under runs/ and the model's label."""
        return f"{self.job}/seed{self.seed}"

    @property
    def _suffix(self) -> str:
        """`[@topk=K][@kv=SPEC]`: the overrides as the label and the group write them."""
        return "".join(f"@{k}={v}" for k, v in self.overrides.items())

    @property
    def label(self) -> str:
        """`<job>/seed<k>[@topk=K][@kv=SPEC]`: the step's folder under its tool's folder."""
        return self.model + self._suffix

    @property
    def group(self) -> str:
        """`<job>[@topk=K][@kv=SPEC]`: what the statistics pool seeds under (a job read under
        an override is a group of its own)."""
        return self.job + self._suffix

    @property
    def trained(self) -> RunId:
        """The same model as trained (no overrides)."""
        return RunId(self.job, self.seed)

    def under(self, **overrides: Any) -> RunId:
        """The same model under `overrides` (names of OVERRIDES; None: as trained)."""
        unknown = sorted(set(overrides) - set(OVERRIDES))
        if unknown:
            raise ValueError(f"RunId.under: unknown override(s) {unknown}; allowed: "
                             f"{list(OVERRIDES)}")
        return replace(self, **overrides)

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_record(cls, record: dict, where: str = "") -> RunId:
        try:
            return cls(**{k: record.get(k) for k in ("job", "seed", *OVERRIDES)})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where or 'run record'}: not a run identity ({exc})") from None


def write_run_id(directory: Path, run_id: RunId) -> None:
    """Write `run_id` as `directory`'s run.json (atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / IDENTITY, run_id.record())


def read_run_id(folder: Path) -> RunId | None:
    """The RunId of a study folder: its run.json, else what an older driver meant by its name
    (`legacy_run_id`); None when it has neither (not a model folder of a study)."""
    record = read_json(Path(folder) / IDENTITY)
    if record is None:
        return legacy_run_id(Path(folder))
    return RunId.of_record(record, str(Path(folder) / IDENTITY))


def identified(root: Path, pattern: str = "*/seed*") -> list[tuple[RunId, Path]]:
    """(RunId, folder) of every model folder under `root` (a study's runs/ or a tool's
    folder) matching `pattern`, in path order; a folder set aside by a rerun (`.old-<hash>`)
    or one that is no model's is left out."""
    found = []
    for folder in sorted(Path(root).glob(pattern)):
        if folder.is_dir() and ".old-" not in folder.name:
            run_id = read_run_id(folder)
            if run_id is not None:
                found.append((run_id, folder))
    return found


def of_checkpoint(checkpoint: Path) -> RunId | None:
    """The RunId of the training run a checkpoint belongs to (`<run>/final`, `<run>` or a
    checkpoint inside `<run>/checkpoints/`): the nearest of the path and its parents that is a
    study's model folder; None for a checkpoint outside a study's runs/."""
    for folder in [Path(checkpoint), *Path(checkpoint).parents][:4]:
        run_id = read_run_id(folder)
        if run_id is not None:
            return run_id
    return None


# The folder names of a driver that did not write run.json, `<job>/seed<k>` plus `@topk=K` /
# `@kv=SPEC`: read for those folders only.
_LEGACY = re.compile(r"^(?P<job>[^/@]+)/seed(?P<seed>\d+)(?P<overrides>(?:@(?:topk|kv)=[^@/]+)*)$")


def legacy_run_id(folder: Path) -> RunId | None:
    """The RunId an old driver meant by `folder`'s name (`.../<job>/seed<k>[@...]`), None when
    the name is not of that form."""
    match = _LEGACY.match(f"{folder.parent.name}/{folder.name}")
    if match is None:
        return None
    overrides: dict[str, Any] = {}
    for item in filter(None, match["overrides"].split("@")):
        key, value = item.split("=", 1)
        overrides[key] = int(value) if key == "topk" else value
    return RunId(match["job"], int(match["seed"]), **overrides)
