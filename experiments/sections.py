"""The evaluation sections of a study file as the built-in tools (`experiments.tools`) read
them: the schemas of the typed ones (`SuiteSpec`, `RealTextSpec`), their checks, and how each
section becomes one step's options (`suite_options` and `suite_computed`, `erf_options`,
`divergence_options`, `real_text_options`). Also the key check every part of a study file goes
through (`check_keys` for a dataclass schema, `check_config_keys` for a section of a tool's
config keys), so a misspelt key is one line naming it and the allowed keys."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional, Union, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced import ModelConfig, exact_replay_length
from ced.config import is_window_form, replay_length
from ced.presets import StudyError
from ced.quant import parse_kv_override
from evals.cli import unknown_keys

# the metadata of a schema field the loader sets, not the file (a file that names it is refused)
SET_BY_LOADER = {"set_by_loader": True}


def check_keys(node: Any, schema: Any, where: str) -> None:
    """Raise for the first key of the mapping `node` that the dataclass `schema` lacks (or sets
    by its loader: `SET_BY_LOADER`); recurses into nested dataclasses, lists of them and dicts
    of them."""
    if not isinstance(node, dict):
        return
    allowed = get_type_hints(schema)
    for f in fields(schema):
        if f.metadata.get("set_by_loader"):
            allowed.pop(f.name)
    for key, value in node.items():
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.') or 'a study'}: {sorted(allowed)}")
        sub = _dataclass_of(allowed[key])
        if sub is None or value is None:
            continue
        kind, cls = sub
        if kind == "one":
            check_keys(value, cls, f"{where}{key}.")
        elif kind == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                check_keys(item, cls, f"{where}{key}[{i}].")
        elif kind == "dict" and isinstance(value, dict):
            for name, item in value.items():
                check_keys(item, cls, f"{where}{key}.{name}.")


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


def check_config_keys(spec: dict, config: type, driven: tuple[str, ...], where: str) -> None:
    """The keys of a section written as a tool's config keys: fields of the dataclass `config`
    less those the driver sets (`driven`), and the keys of a field that is itself a dataclass
    (`evals.divergence`'s prompts and wandb) against its fields."""
    allowed = {f.name: f for f in fields(config) if f.name not in driven}
    for key, value in spec.items():
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.')}: {sorted(allowed)}")
        factory = allowed[key].default_factory
        default = factory() if callable(factory) else None
        if is_dataclass(default) and isinstance(value, dict):
            inner = {f.name for f in fields(default)}
            for sub in value:
                if sub not in inner:
                    raise StudyError(f"{where}{key}.{sub}: unknown key; allowed keys of "
                                     f"{where}{key}: {sorted(inner)}")


def resolve_lengths(values: list, cfg) -> list:
    """Replay lengths written as ints or as 'W', 'W/4', '2W', 'R_exact' (any form of
    `ced.config.replay_length`) -> ints, for `cfg`: a ModelConfig, or a checkpoint's
    config.json as a dict. 'exact' stays as written; 'R_exact' is dropped for a model without a
    decoder; duplicates dropped, order kept."""
    model = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    out = []
    for v in values:
        if isinstance(v, str) and v.strip().isdigit():
            v = max(1, int(v))      # a length that came as a string (a command-line override)
        elif isinstance(v, str) and v != "exact":
            if v.replace(" ", "") == "R_exact" and not model.has_decoder:
                continue
            v = replay_length(model, v, name=f"replay length {v!r}")
        if v not in out:
            out.append(v)
    return out


# ---- suite -----------------------------------------------------------------------------------

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


# the SuiteConfig fields the driver sets itself, from the spec's own fields or per step; the
# eval-time overrides of the model as trained (topk, kv, decoder_global) are the driver's too:
# a study reads a model under one as a step of its own (decoder_global is not offered as a
# study variant yet: `python -m evals.suites --decoder-global off`, or evals.paths), so none
# is a default that every suite step's hash covers
SUITE_DRIVEN = ("checkpoint", "out", "replays", "examples", "families", "turns", "distances",
                "sweep_replays", "topk", "kv", "decoder_global", "threads", "wandb",
                "wandb_project", "wandb_group", "overwrite")


def check_suite_values(suite: SuiteSpec, where: str) -> None:
    """The suite's distances (ints, W forms, R_exact), its `options` (SuiteConfig fields the
    driver does not set, each value against its type) and KV overrides, before any model;
    `where` prefixes every error (e.g. 'study x: suite.')."""
    for i, d in enumerate(suite.distances):
        text = d.replace(" ", "") if isinstance(d, str) else None
        if not ((type(d) is int and d >= 1) or text == "R_exact"
                or (text is not None and is_window_form(text))):
            raise StudyError(f"{where}distances[{i}]: expected an int >= 1, a W form "
                             f"(W, W/4, 2W) or R_exact; got {d!r}")
    # lazy: evals.suites.runner costs ~0.3 s to import (its families, pandas); the study
    # driver's start-up does not need it
    from evals.suites.runner import SuiteConfig
    bad = unknown_keys(SuiteConfig, list(suite.options)) + sorted(
        set(suite.options) & set(SUITE_DRIVEN))
    if bad:
        allowed = sorted(f for f in SuiteConfig.__dataclass_fields__ if f not in SUITE_DRIVEN)
        raise StudyError(f"{where}options: {bad} cannot be set here; allowed: "
                         f"{', '.join(allowed)} (replays, turns, distances, top-k and kv have "
                         "their own suite keys)")
    try:                    # each value against its field's type, before any model
        OmegaConf.merge(OmegaConf.structured(SuiteConfig), dict(suite.options))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise StudyError(f"{where}options.{key}: {str(exc).splitlines()[0]}") from None
    for i, spec in enumerate(suite.kv):
        if spec is not None:
            try:
                parse_kv_override(spec)
            except ValueError as exc:
                raise StudyError(f"{where}kv[{i}]: {exc}") from None


def suite_overrides(spec: SuiteSpec, own) -> list[dict[str, Any]]:
    """The eval-time overrides one model's suite runs under, one step each ({topk, kv}, None:
    as trained): top-k overrides only for the variant the top-k study is about."""
    return [{"topk": topk, "kv": kv} for topk in (list(spec.topk) or [None])
            for kv in (list(spec.kv) or [None])
            if topk is None or own.traits.topk_study]


def suite_options(spec, ref, own, topk: Any = None, kv: Any = None) -> dict[str, Any]:
    """The `evals.suites.runner.SuiteConfig` fields of one suite step (all but checkpoint, out,
    threads and wandb): a study's `suite:` spec (`SuiteSpec`) with its replay lengths and
    turns resolved against the checkpoint's own config `own` (W forms and R_exact mean its own
    window and R_exact, so a study over several W reads each model at its own N = W), its
    distances against the reference config `ref` (every model of a study read at the same
    distances), its `options`, and one eval-time top-k / KV storage override."""
    # A model without a decoder is run in `full` only; its replays (a required option) are
    # the reference's, as its own would drop R_exact.
    replays = [v for v in resolve_lengths(list(spec.replay), own if own.has_decoder else ref)
               if v != "exact"]
    if spec.below_exact and own.has_decoder:
        replays = [v for v in replays if v < exact_replay_length(own)] or replays[:1]
    options: dict[str, Any] = {**spec.options, "replays": [str(v) for v in replays],
                               "examples": spec.examples}
    if spec.families:
        options["families"] = list(spec.families)
    if spec.turns:
        options["turns"] = resolve_lengths(list(spec.turns), own)
    if spec.sweep_replay:
        options["sweep_replays"] = [str(v) for v in resolve_lengths(
            list(spec.sweep_replay), own if own.has_decoder else ref) if v != "exact"]
    if spec.distances:
        options["distances"] = [d for d in resolve_lengths(list(spec.distances), ref)
                                if d != "exact"]
    if topk is not None:
        options["topk"] = str(topk)
    if kv is not None:
        options["kv"] = str(kv)
    return options


def suite_computed(options: dict[str, Any], own) -> dict[str, Any]:
    """What a suite step computes that its options leave to the code, for its hash: the
    registered families when the study names none, and the multi-turn policies when a family
    it reads has turn modes on a model with a decoder (the suite runs every policy of
    `ced.inference.POLICIES`). Without them a new policy or family would leave a finished
    suite fresh, never read; each key is present only where it changes what is computed, so
    a step it does not touch keeps its hash."""
    # lazy: evals.suites.families costs ~0.3 s to import, which the study driver's start-up
    # does not need; and both registries are read as they are when this is called
    from ced.inference import POLICIES
    from evals.suites.families import FAMILIES
    named = options.get("families")
    computed: dict[str, Any] = {} if named else {"families": list(FAMILIES)}
    families = named or list(FAMILIES)
    if own.has_decoder and any(f in FAMILIES and FAMILIES[f].turn_modes for f in families):
        computed["policies"] = list(POLICIES)
    return computed


# ---- erf -------------------------------------------------------------------------------------

# the fields of evals.erf.ErfConfig the driver sets per model, not the study file
ERF_DRIVEN = ("out", "source", "checkpoint", "divergence")


def check_erf_params(spec: dict, where: str) -> None:
    """An `erf:` section's `params` must map task -> mapping."""
    params = spec.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise StudyError(f"{where}params: a mapping of task to generator params, e.g. "
                         f"{{running_state: {{window_len: 3W/2}}}}; got {params!r}")


def erf_options(spec: dict[str, Any], own) -> dict[str, Any]:
    """The `evals.erf.ErfConfig` fields of one model's erf step (all but `ERF_DRIVEN`): the
    study's `erf:` keys with `length` and every value in `params` written as a W form or
    R_exact resolved for the model `own` (its W, its R_exact), `params` as the JSON the tool
    takes, and the prompt lengthened to R_exact + W where the given length would cut the
    decoder's reach (influence from beyond the prompt would go unmeasured, and the share beyond
    W read low)."""
    # lazy: evals.erf loads matplotlib (~0.5 s with its own imports); the study driver's
    # start-up does not need it
    from evals.erf import ErfConfig

    def resolve(value: Any, key: str) -> Any:
        text = value.replace(" ", "") if isinstance(value, str) else None
        if text is not None and (text == "R_exact" or is_window_form(text)):
            return replay_length(own, text, name=f"erf.{key}")
        return value
    defaults = {f.name: f.default for f in fields(ErfConfig)}
    options = {k: v for k, v in spec.items() if k != "params"}
    length = resolve(spec.get("length", defaults["length"]), "length")
    options["length"] = max(int(length), exact_replay_length(own) + own.window)
    params = {task: {k: resolve(v, f"params.{task}.{k}") for k, v in values.items()}
              for task, values in (spec.get("params") or {}).items()}
    options["params"] = json.dumps(params, sort_keys=True)
    return options


# ---- divergence ------------------------------------------------------------------------------

def divergence_options(spec: dict[str, Any], reference, checkpoints: list[str]) -> dict:
    """The `evals.divergence.DivergenceConfig` fields of the divergence step over
    `checkpoints` (all but out_dir and wandb): the study's keys, its replays without `exact`
    and digit strings as ints. W forms and R_exact stay as written: evals.divergence resolves
    them per checkpoint (each model's own W), after they are checked here against the
    `reference` model."""
    config = dict(spec)
    written = [v for v in config.get("replays", [1, 4, 16]) if v != "exact"]
    resolve_lengths(written, reference)
    config["replays"] = [int(v) if isinstance(v, str) and v.strip().isdigit() else v
                         for v in written]
    config["checkpoints"] = checkpoints
    return config


# ---- real text -------------------------------------------------------------------------------

# The fields of RealTextSpec that are `evals.real_text.RealTextConfig` fields, handed to the
# reading under the same name with the same defaults (tests/unit/test_cli_options.py checks
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


def real_text_options(spec: RealTextSpec) -> dict[str, Any]:
    """The `evals.real_text.RealTextConfig` fields of the real-text reading (all but
    checkpoint, out and wandb): the spec's `REAL_TEXT_READING` fields, replay lengths and the
    continuation as the strings the reading resolves per model."""
    settings = {name: getattr(spec, name) for name in REAL_TEXT_READING}
    settings.update(replays=[str(v) for v in spec.replays], continuation=str(spec.continuation))
    return settings
