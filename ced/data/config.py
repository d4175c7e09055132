"""DataConfig: the schema of the `data` config group (conf/data/*.yaml), and its validation.

Only OmegaConf-compatible annotations here: the dataclass is registered with Hydra.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

KINDS = ("synthetic", "stdlib", "hf", "mixture")
SPLITS = ("train", "validation")


@dataclass
class DataConfig:
    """Where training tokens come from. See ced/data/sources.py for the row semantics.

    kind: synthetic | stdlib | hf | mixture
    tasks (synthetic): every registered task (ced.data.TASKS) takes part with its registered
      weight and defaults; an entry `<name>: {weight: float > 0, <generator params>}` overrides
      them, a null entry drops the task, and an entry under a new name with `family: <task>`
      adds a task of its own (e.g. count: {family: running_state, kind: count}). An entry's
      `from_row: R` (default 0) stages the task into training: rows before global row R
      (step * batch_size + ...) draw none of it, later rows draw it by weight; validation rows
      draw every task. A curriculum of stages, e.g. hops 0, then 1, then 2.
    only (synthetic): null (default): every task above; a list of names narrows to those, in
      that order (e.g. only: [kv_recall, count]).
    name, files, text_field, hf_split (hf): `datasets.load_dataset(name, data_files=files,
      split=hf_split)[text_field]`; name is a builder (json | parquet | text | csv) with local
      files, a local dataset path, or a hub name (online only); null name: inferred from the
      files' extension. Relative files are resolved against the original working directory.
    subset, revision, streaming, max_documents (hf): a hub dataset's configuration (subset)
      name, the git revision (branch, tag or commit) to pin, and streaming=true to read
      documents as they download instead of fetching the whole dataset; streaming needs
      max_documents (the first documents of the split are used), which also caps a
      non-streaming read.
    validation_fraction (stdlib, hf): fraction of documents (by a stable hash of their identity)
      in the validation split.
    mixture (mixture): list of component configs (the keys above) each with a `weight`; a
      component without `seed` inherits this one.
    seed: seeds every random choice (example draws, window offsets, mixture picks).
    curriculum_rows (synthetic): see the field's comment below.
    examples_per_row (synthetic): at most this many examples per row, the rest padding; None
      (default): as many as fit. 1 keeps a query from seeing other examples' facts, which
      attention otherwise does (it is not reset at BOS; findings/HISTORY.md A.0.2).
    """

    kind: str = "synthetic"
    tasks: Dict[str, Any] = field(default_factory=dict)
    only: Optional[List[str]] = None
    name: Optional[str] = None
    files: Optional[List[str]] = None
    text_field: str = "text"
    hf_split: str = "train"
    subset: Optional[str] = None
    revision: Optional[str] = None
    streaming: bool = False
    max_documents: Optional[int] = None
    validation_fraction: float = 0.05
    mixture: Optional[List[Any]] = None
    seed: int = 0
    # synthetic, training split only: a curriculum over layout difficulty. Training row r gets
    # each task's `filler` scaled by min(1, (r + 1) / curriculum_rows), so facts start next to
    # their queries and move out to the configured spread; 0: no curriculum. Rows are global
    # indices (step * batch_size + ...), so the curriculum spans curriculum_rows / batch_size
    # steps whatever the process count. Validation rows always have the full spread.
    curriculum_rows: int = 0
    examples_per_row: Optional[int] = None


FIELDS = tuple(f.name for f in dataclasses.fields(DataConfig))


def as_dict(cfg: Any, key: str = "data") -> dict[str, Any]:
    """A DataConfig, an OmegaConf node or a plain mapping -> a plain dict of every DataConfig
    field (missing keys take the defaults). Unknown keys are an error naming `key.<name>`."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        values = dataclasses.asdict(cfg)
    else:
        try:
            # lazy: OmegaConf costs ~0.1 s to import and only a config Hydra composed needs it
            from omegaconf import DictConfig, OmegaConf
            if isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:                      # pragma: no cover - omegaconf is a dependency
            pass
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{key} must be a DataConfig or a mapping of its keys, "
                             f"got {type(cfg).__name__}")
        values = dict(cfg)
    for name in values:
        if name not in FIELDS:
            raise ValueError(f"{key}.{name} is not a data config key; allowed: {', '.join(FIELDS)}")
    return {**dataclasses.asdict(DataConfig()), **values}


def plain(value: Any) -> Any:
    """OmegaConf containers (e.g. a mixture component) -> plain Python containers."""
    try:
        # lazy: OmegaConf costs ~0.1 s to import and only a config Hydra composed needs it
        from omegaconf import OmegaConf
        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:                          # pragma: no cover
        pass
    return value


def check_int(key: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def check_weight(key: str, value: Any) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{key} must be a number > 0, got {value!r}")
    return float(value)


def check_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def check_fraction(key: str, value: Any) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not 0 <= value < 1):
        raise ValueError(f"{key} must be a number in [0, 1), got {value!r}")
    return float(value)
