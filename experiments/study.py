"""The schema of a study file (`conf/experiment/<name>.yaml`) and its loader.

A study is checked like a training config: every key against the dataclasses below (a
misspelt key such as `overides`, `exampels` or `divergance` is a one-line `StudyError` naming
the key and the allowed keys), then the values against their types through OmegaConf's
structured configs. `divergence:` keys are checked against `evals.divergence.DivergenceConfig`,
`erf:` keys against `evals.erf.ErfConfig` (less what the driver sets per model: `ERF_DRIVEN`)
and `suite:` keys against `SuiteSpec` (the options of `python -m evals.suites`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced.presets import PRESET_DIR, STUDY_DIR, StudyError, preset_overrides, study_path

__all__ = ["PRESET_DIR", "STUDY_DIR", "StudyError", "load_study", "preset_overrides",
           "study_path"]


@dataclass
class JobSpec:
    """One training job: its name (the run directory), its `ced.train` overrides and,
    optionally, its own seeds (null: the study's). A scale's `seeds` or the driver's `seeds=`
    replace every job's seeds, so a study can train 8 seeds of one job and 4 of another at
    its findings scale and one of each at its demo scale."""

    name: str = MISSING
    overrides: List[str] = field(default_factory=list)
    seeds: Optional[List[int]] = None


@dataclass
class SuiteSpec:
    """`python -m evals.suites` options. Replay lengths and turns may be written W, W/4, 2W,
    R_exact (resolved from each trained model's own config: its W, its R_exact); `distances`
    are resolved from the study's reference model (the first with a decoder)."""

    replay: List[Any] = field(default_factory=lambda: [8])
    examples: int = 20
    topk: List[Any] = field(default_factory=lambda: [None])   # eval-time top-k overrides
    # eval-time KV storage overrides (`ced.quant.parse_kv_override`, null: as trained), e.g.
    # [null, "global:fp4_block16", "window:fp8,global:fp4_block16,indexer:fp4_block32"]
    kv: List[Any] = field(default_factory=lambda: [None])
    families: Optional[List[str]] = None                       # null: every family
    turns: List[Any] = field(default_factory=list)
    # extra distances for the distance families (ints or W forms, R_exact), on top of the sweep
    # each model's own geometry gives: lets variants of different geometry share distances
    distances: List[Any] = field(default_factory=list)
    # the replay lengths (ints or W forms, resolved per model) around which the sweeps place
    # their points; empty: every `replay`. Lets a long grid of modes read one set of documents.
    sweep_replay: List[Any] = field(default_factory=list)
    # drop replay lengths at or above each model's R_exact (they are exact; replay=exact, which
    # is always run, stands for them): a grid such as W ... 16W then stops at every model's own
    # R_exact
    below_exact: bool = False
    # any other field of evals.suites.runner.SuiteConfig, as it is named there, e.g.
    # {state_length: 160, needle_distractors: 17}; checked against those fields on load
    options: Dict[str, Any] = field(default_factory=dict)


# The fields of RealTextSpec that are `evals.real_text.RealTextConfig` fields, handed to the
# reading under the same name with the same defaults (tests/unit/test_study_schema.py checks
# both), so that a setting has one meaning whether a study or the CLI sets it.
REAL_TEXT_READING = ("replays", "continuation", "passes", "context", "row_len", "max_files",
                     "dtype", "bootstrap")


@dataclass
class RealTextSpec:
    """`python -m evals.real_text` options, run over every trained checkpoint of the study
    (they must be trained on data=stdlib): replay lengths N and the continuation G as ints or
    W forms (resolved per model), readings per byte, context, row length, files, resamples."""

    replays: List[Any] = field(default_factory=lambda: ["1", "W/2", "W", "2W", "R_exact"])
    continuation: Any = "W"
    passes: int = 4
    context: int = 128
    row_len: int = 512
    max_files: Optional[int] = None     # null: every validation file
    dtype: str = "float32"
    bootstrap: int = 1000
    # lm-eval over the code tasks (evals.lmeval.code_tasks) per checkpoint and mode: the group
    # ced_code under each of `lm_eval_modes` (evals.modes strings; full is the reference), and
    # ced_code_turn under each of `lm_eval_turn_modes`; a model without a decoder, or with an
    # exact early exit (yoco), is read at full only. Empty lists: no lm-eval step.
    lm_eval_modes: List[str] = field(default_factory=lambda: [
        "full", "replay=1", "replay=W/2", "replay=W", "replay=2W"])
    lm_eval_turn_modes: List[str] = field(default_factory=list)
    lm_eval_examples: int = 500
    lm_eval_context: int = 384
    lm_eval_min_distance: Any = "2W"
    lm_eval_batch_size: int = 16
    lm_eval_jobs: Optional[List[str]] = None   # null: every job; else only these jobs' models


@dataclass
class ScaleSpec:
    """Extra settings of one scale: `train` overrides appended to the study's, `divergence`,
    `suite` and `real_text` keys replacing the study's, and `seeds` (if set) replacing the
    study's."""

    train: List[str] = field(default_factory=list)
    divergence: Dict[str, Any] = field(default_factory=dict)
    suite: Dict[str, Any] = field(default_factory=dict)
    real_text: Dict[str, Any] = field(default_factory=dict)
    erf: Dict[str, Any] = field(default_factory=dict)
    seeds: Optional[List[int]] = None   # replaces the study's seeds at this scale


@dataclass
class StudyConfig:
    """A study file. `seeds`: every job is trained once per seed (`train.seed=<k>`) into
    `runs/<job>/seed<k>/`, and every seed's checkpoint is evaluated."""

    name: str = MISSING
    description: str = ""
    seeds: List[int] = field(default_factory=lambda: [0])
    # true: a run's seed also seeds its training data (data.seed), so that seeds replicate the
    # recipe over data order as well as initial weights; false: every seed sees the same rows
    seed_data: bool = False
    presets: List[str] = field(default_factory=list)  # conf/experiment/presets/<name>.yaml
    train: List[str] = field(default_factory=list)
    jobs: List[JobSpec] = MISSING
    divergence: Optional[Dict[str, Any]] = None     # evals.divergence.DivergenceConfig keys
    suite: Optional[SuiteSpec] = None
    real_text: Optional[RealTextSpec] = None
    # evals.erf per trained model with decoder windows (evals.erf.ErfConfig keys but
    # ERF_DRIVEN); `length` and the values in `params` may be W forms, resolved per model
    erf: Optional[Dict[str, Any]] = None
    scales: Dict[str, ScaleSpec] = field(default_factory=dict)
    scale: str = "demo"             # set by the loader: the scale applied

    def seeds_of(self, job: JobSpec) -> List[int]:
        """The seeds `job` is trained with: its own, else the study's."""
        return list(job.seeds) if job.seeds is not None else list(self.seeds)


# Keys of the file itself (`scale` is the loader's, not the file's).
FILE_KEYS = sorted(f.name for f in fields(StudyConfig) if f.name != "scale")


def _check_keys(node: Any, schema: Any, where: str) -> None:
    """Raise for the first key of the mapping `node` that the dataclass `schema` lacks;
    recurses into nested dataclasses, lists of them and dicts of them."""
    if not isinstance(node, dict):
        return
    allowed = get_type_hints(schema)
    if schema is StudyConfig:
        allowed.pop("scale")
    for key, value in node.items():
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.') or 'a study'}: {sorted(allowed)}")
        sub = _dataclass_of(allowed[key])
        if sub is None or value is None:
            continue
        kind, cls = sub
        if kind == "one":
            _check_keys(value, cls, f"{where}{key}.")
        elif kind == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                _check_keys(item, cls, f"{where}{key}[{i}].")
        elif kind == "dict" and isinstance(value, dict):
            for name, item in value.items():
                _check_keys(item, cls, f"{where}{key}.{name}.")


def _dataclass_of(annotation: Any) -> tuple[str, type] | None:
    """('one'|'list'|'dict', the dataclass) for a field whose resolved type is a dataclass, a
    list of them or a dict of them (Optional around any of these), else None."""
    if get_origin(annotation) is Union:       # Optional[X]: X
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list and args and is_dataclass(args[0]):
        return "list", args[0]
    if origin is dict and len(args) == 2 and is_dataclass(args[1]):
        return "dict", args[1]
    return ("one", annotation) if isinstance(annotation, type) and is_dataclass(annotation) \
        else None


def _check_divergence(spec: dict | None, where: str) -> None:
    """divergence keys against DivergenceConfig (and its nested prompts/wandb)."""
    if not spec:
        return
    from evals.divergence import DivergenceConfig
    for key, value in spec.items():
        allowed = {f.name: f for f in fields(DivergenceConfig)}
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.')}: {sorted(allowed)}")
        default = allowed[key].default_factory() if callable(allowed[key].default_factory) else None
        if is_dataclass(default) and isinstance(value, dict):
            inner = {f.name for f in fields(default)}
            for sub in value:
                if sub not in inner:
                    raise StudyError(f"{where}{key}.{sub}: unknown key; allowed keys of "
                                     f"{where}{key}: {sorted(inner)}")


# the fields of evals.erf.ErfConfig the driver sets per model, not the study file
ERF_DRIVEN = ("out", "source", "checkpoint", "divergence")


def _check_erf(spec: dict | None, where: str) -> None:
    """erf keys against ErfConfig (less ERF_DRIVEN); `params` must map task -> mapping."""
    if not spec:
        return
    from evals.erf import ErfConfig
    allowed = sorted(f.name for f in fields(ErfConfig) if f.name not in ERF_DRIVEN)
    for key in spec:
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.')}: {allowed}")
    params = spec.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise StudyError(f"{where}params: a mapping of task to generator params, e.g. "
                         f"{{running_state: {{window_len: 3W/2}}}}; got {params!r}")


def load_study(name: str, scale: str = "demo", seeds: list[int] | None = None) -> StudyConfig:
    """conf/experiment/<name>.yaml, checked, with its `scales.<scale>` section applied (train
    overrides appended, divergence/suite keys and seeds replaced); `seeds` (the driver's
    option) replaces both."""
    path = study_path(name)
    where = f"study {path.stem}: "
    study = _read_study(path, where)
    _apply_scale(study, scale, seeds, where)
    _check_jobs_and_seeds(study, seeds, where)
    if study.suite is not None:
        _check_suite_values(study.suite, where)
    return study


def _read_study(path: Path, where: str) -> StudyConfig:
    """The file's keys checked against the schema (divergence and every scale's keys too),
    then its values through OmegaConf's structured config."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise StudyError(f"study {path.name}: must be a mapping with keys {FILE_KEYS}")
    try:
        _check_keys(raw, StudyConfig, "")
        _check_divergence(raw.get("divergence"), "divergence.")
        _check_erf(raw.get("erf"), "erf.")
        for scale_name, extra in (raw.get("scales") or {}).items():
            _check_divergence((extra or {}).get("divergence"), f"scales.{scale_name}.divergence.")
            _check_erf((extra or {}).get("erf"), f"scales.{scale_name}.erf.")
            _check_keys((extra or {}).get("suite") or {}, SuiteSpec, f"scales.{scale_name}.suite.")
            _check_keys((extra or {}).get("real_text") or {}, RealTextSpec,
                        f"scales.{scale_name}.real_text.")
    except StudyError as exc:
        raise StudyError(where + str(exc)) from None
    raw.setdefault("name", path.stem)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StudyConfig), raw))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "study"
        raise StudyError(f"{where}{key}: {str(exc).splitlines()[0]}") from None


def _apply_scale(study: StudyConfig, scale: str, seeds: list[int] | None, where: str) -> None:
    """`scales.<scale>` onto the study in place: presets and train overrides, divergence and
    suite keys, seeds; then the driver's `seeds`."""
    scales = {k: (v or ScaleSpec()) for k, v in study.scales.items()}
    if scale not in scales and scale not in ("demo", "full"):
        raise StudyError(f"scale={scale}: the study {study.name} defines "
                         f"{sorted(set(scales) | {'demo', 'full'})}")
    extra = scales.get(scale) or ScaleSpec()
    study.train = preset_overrides(study.presets, where) + list(study.train) + list(extra.train)
    if study.divergence is not None:
        study.divergence = {**study.divergence, **extra.divergence}
    if study.erf is not None:
        study.erf = {**study.erf, **extra.erf}
    if study.suite is not None and extra.suite:
        study.suite = _merged(SuiteSpec, study.suite, extra.suite)
    if study.real_text is not None and extra.real_text:
        study.real_text = _merged(RealTextSpec, study.real_text, extra.real_text)
    study.scale = scale
    if extra.seeds is not None:
        study.seeds = list(extra.seeds)
    if seeds is not None:
        study.seeds = list(seeds)
    for job in study.jobs:
        if extra.seeds is not None or seeds is not None:
            job.seeds = None          # a scale's or the driver's seeds replace the job's own


def _merged(schema: type, spec: Any, keys: dict) -> Any:
    """`spec` (a `schema` dataclass) with `keys` replacing its values."""
    merged = {**OmegaConf.to_container(OmegaConf.structured(spec)), **keys}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), merged))


def _check_jobs_and_seeds(study: StudyConfig, seeds: list[int] | None, where: str) -> None:
    for job in study.jobs:
        if job.seeds is not None and (not job.seeds or len(set(job.seeds)) != len(job.seeds)):
            raise StudyError(f"{where}jobs[{job.name}].seeds: need at least one seed and "
                             f"distinct seeds; got {job.seeds}")
    names = [j.name for j in study.jobs]
    if not names or len(set(names)) != len(names):
        raise StudyError(f"{where}jobs: need at least one job and distinct names; got {names}")
    bad = [n for n in names if not n or "/" in n or n.startswith(".")]
    if bad:
        raise StudyError(f"{where}jobs: a job name is a directory name (no '/', no leading "
                         f"'.'); got {bad}")
    if not study.seeds or len(set(study.seeds)) != len(study.seeds):
        raise StudyError(f"{where}seeds: need at least one seed and distinct seeds; "
                         f"got {study.seeds}")


def _check_suite_values(suite: SuiteSpec, where: str) -> None:
    """The suite's distances (ints, W forms, R_exact) and KV overrides, before any model."""
    from ced.config import is_window_form
    for i, d in enumerate(suite.distances):
        text = d.replace(" ", "") if isinstance(d, str) else None
        if not ((type(d) is int and d >= 1) or text == "R_exact"
                or (text is not None and is_window_form(text))):
            raise StudyError(f"{where}suite.distances[{i}]: expected an int >= 1, a W form "
                             f"(W, W/4, 2W) or R_exact; got {d!r}")
    from evals.cli import unknown_keys
    from evals.suites.runner import SuiteConfig
    # the keys the driver sets itself from the spec's own fields or per step
    driven = {"checkpoint", "out", "replays", "examples", "families", "turns", "distances",
              "sweep_replays", "topk", "kv", "threads", "wandb", "wandb_project",
              "wandb_group", "overwrite"}
    bad = unknown_keys(SuiteConfig, list(suite.options)) + sorted(set(suite.options) & driven)
    if bad:
        allowed = sorted(f for f in SuiteConfig.__dataclass_fields__ if f not in driven)
        raise StudyError(f"{where}suite.options: {bad} cannot be set here; allowed: "
                         f"{', '.join(allowed)} (replays, turns, distances, top-k and kv have "
                         "their own suite keys)")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:                    # each value against its field's type, before any model
        OmegaConf.merge(OmegaConf.structured(SuiteConfig), dict(suite.options))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise StudyError(f"{where}suite.options.{key}: {str(exc).splitlines()[0]}") from None
    from ced.quant import parse_kv_override
    for i, spec in enumerate(suite.kv):
        if spec is not None:
            try:
                parse_kv_override(spec)
            except ValueError as exc:
                raise StudyError(f"{where}suite.kv[{i}]: {exc}") from None


def normalise_overrides(overrides: list[str]) -> list[str]:
    """Overrides as Hydra applies them: the last value of each key wins; sorted, so that the
    order in which a study lists them does not change the config hash."""
    last: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        last[key] = item
    return sorted(last.values())


def config_hash(payload: Any) -> str:
    """A short stable hash of a JSON-able payload (the inputs of a study step)."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
