"""The evaluation tools the study driver runs, one registration each.

A tool is a module that measures (the built-ins are in `evals/`, which never imports this
floor): a config dataclass whose fields are its options, and a function that runs one config.
Its registration, an `EvaluationTool` handed to `register`, is all the driver needs to know:

- its name: the study file's section (`erf:`), checked on load (`experiments.study`); the job
  kind (`python -m experiments.job erf CONFIG.json`); the output folder (`<out>/erf/`);
- where it lives: the module, and the names of its config dataclass and run function in it;
- its scope: a step per trained model (PER_MODEL, `<out>/<name>/<job>/seed<k>/`, for the
  driver's `jobs=`) or one step over every trained model of the study (OVER_MODELS), and which
  models it reads (`applies`);
- how the section's keys become one step's options (`options`; with `variants`, several steps
  per model), what else its hash covers (`computed`), and the job's config (`job`);
- the file whose presence says a step finished (`done`), the files cleared before a rerun
  (`outputs`), whether it stops between batches on SIGTERM/SIGINT, and the config fields the
  driver sets itself (`driven`);
- the per model tool whose step of the same model it reads, if any (`reads`: `paths` reads the
  documents of the model's `suite` step): that step's folder reaches the job (`JobPlace.inputs`),
  its hash is part of this step's, and this step waits until that one is done.
- a per model tool's merge, if any (`merge`: `real_text` merges its models' readings into the
  study's tables): one more step, run once every model's step is done, whose hash covers theirs.

The driver runs every registered tool in registration order through one loop
(`experiments.evaluations.EvaluationSteps.evaluate`; the driver's `tools=` picks some);
`only=plan` lists their steps in the same order. Built in: divergence, suite, erf, real_text
(per model, with a merge: `merge`), paths. lm-eval is not a registered tool: it reads the
real_text section through lm-eval's own command line in two stages (a code-tasks step per
model, then a run per model and mode), which would need hooks no other tool has; it stays a
sub-step of real_text (`EvaluationSteps.lm_eval`; `tools=` calls it lm_eval).

The job runs in its own process, which imports this module (the built-ins) and the tool's
module by name (`module`, importable there: on PYTHONPATH). A tool registered outside this
module therefore registers itself in its own module, at import, so that the job's process
registers it too.
"""

from __future__ import annotations

import importlib
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced.presets import StudyError

from .sections import (ERF_DRIVEN, SUITE_DRIVEN, RealTextSpec, SuiteSpec, check_config_keys,
                       check_erf_params, check_keys, check_suite_values, divergence_options,
                       erf_options, real_text_options, suite_computed, suite_options,
                       suite_overrides)

PER_MODEL = "per model"          # one step per trained model of the driver's `jobs=`
OVER_MODELS = "over models"      # one step over every trained model of the study
# folders of a study directory that are the driver's own, not a tool's output folder
DRIVER_FOLDERS = ("runs", "logs", "report")


@dataclass(frozen=True)
class Reading:
    """What one step of a tool reads: its trained checkpoints (label -> (final/, training
    hash)), the model config of every trained checkpoint the tool was offered (label ->
    `ced.ModelConfig`), the reference among those it reads (the first with a decoder: every
    model is read at its distances), and the step's eval-time variant (`EvaluationTool.variants`,
    {} for most tools)."""

    checkpoints: dict[str, tuple[Path, str]]
    configs: dict[str, Any]
    reference: Any
    variant: dict[str, Any] = field(default_factory=dict)

    @property
    def own(self) -> Any:
        """The model config of a per model step's one checkpoint."""
        (label,) = self.checkpoints
        return self.configs[label]

    @property
    def paths(self) -> list[str]:
        """The checkpoints' final/ directories, sorted."""
        return sorted(str(final) for final, _ in self.checkpoints.values())


@dataclass(frozen=True)
class JobPlace:
    """Where one step's job reads (`checkpoints`, as `Reading.paths`; `inputs`, the folders of
    the steps it reads, `EvaluationTool.reads` or the steps a merge merges, one per
    checkpoint) and writes (`out`), and the study's W&B settings, for `EvaluationTool.job`."""

    out: str
    checkpoints: list[str]
    wandb: bool
    project: str
    group: str
    inputs: tuple[str, ...] = ()
    merges: bool = False        # the job is a per model tool's merge (`EvaluationTool.merge`)

    def wandb_fields(self) -> dict[str, Any]:
        """The W&B fields of a tool whose config names them wandb, wandb_project, wandb_group."""
        return {"wandb": self.wandb, "wandb_project": self.project, "wandb_group": self.group}


def every_model(config: Any) -> bool:
    """Every trained model (the default of `EvaluationTool.applies`)."""
    return True


def as_written(section: dict, reading: Reading) -> dict:
    """A section's keys as the study file wrote them (the default of `EvaluationTool.options`)."""
    return dict(section)


def one_step(section: Any, own: Any) -> list[dict]:
    """One step per model, as trained (the default of `EvaluationTool.variants`)."""
    return [{}]


def nothing_computed(options: dict, reading: Reading) -> dict:
    """No inputs but the options (the default of `EvaluationTool.computed`)."""
    return {}


@dataclass(frozen=True)
class EvaluationTool:
    """One evaluation tool as the study driver runs it (see the module's docstring); only
    the name and where it lives are required, the rest says how it differs from a tool that
    reads every model, one step each, with the section's keys as its options."""

    name: str               # its study section, job kind and output folder
    module: str             # the module that implements it, importable by name
    config: str             # the name of its config dataclass in `module`
    run: str                # the name of the function that runs one config, in `module`
    scope: str = PER_MODEL  # or OVER_MODELS
    # which trained models it reads (a `ced.ModelConfig` -> bool), and those in words, for the
    # line that says a study had none ("no trained checkpoint with decoder windows")
    applies: Callable[[Any], bool] = every_model
    models: str = ""
    # the dataclass of a typed section, whose values are checked on load; None: the section
    # holds the config's own keys less `driven`, passed as written
    section: type | None = None
    # more checks of the section at load (after the scale is applied): (it, error prefix)
    check: Callable[[Any, str], None] | None = None
    # (section, Reading) -> one step's options: the config fields the section sets
    options: Callable[[Any, Reading], dict] = as_written
    # per model: (section, the model's config) -> the eval-time variants it is read under,
    # one step each, named by their non-null items (`<job>/seed<k>@topk=2`)
    variants: Callable[[Any, Any], list[dict]] = one_step
    # (options, Reading) -> what else the step's hash covers (what the code decides for it)
    computed: Callable[[dict, Reading], dict] = nothing_computed
    hashed_as: str = ""     # the key of the options in the hashed inputs (default: the name)
    # (options, JobPlace) -> the job's config; default: the options with `checkpoint` (one
    # path per model, a list over models) and `out`
    job: Callable[[dict, JobPlace], dict] | None = None
    driven: tuple[str, ...] = ("checkpoint", "out")   # config fields a study may not set
    done: str = "summary.json"      # the file whose presence says a step finished
    # the name of `module`'s tuple of the files a run writes, removed before a rerun (so a
    # rerun that writes fewer leaves no stale one); empty: only the step's record is
    outputs: str = ""
    # whether it stops at a SIGTERM/SIGINT between batches (`ced.signals.stop_point`); the
    # others keep the signals' default effect
    stops_between_batches: bool = False
    shown: tuple[str, ...] = ()     # the options the step's banner shows
    # a per model tool registered before this one whose step of the same model (as trained)
    # this one reads; "": none
    reads: str = ""
    # a per model tool's merge: the name of `module`'s function (config, folders) that writes
    # into the tool's folder the reading of every trained model it applies to, from their
    # steps' folders, once each is done; config: the job's config over those models (every
    # checkpoint, out the tool's folder). Run in the driver, as one more step (the tool's
    # name) whose hash covers theirs. "": none
    merge: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name in DRIVER_FOLDERS:
            raise ValueError(f"EvaluationTool.name: a study section and a folder name (an "
                             f"identifier, none of {DRIVER_FOLDERS}); got {self.name!r}")
        if self.scope not in (PER_MODEL, OVER_MODELS):
            raise ValueError(f"EvaluationTool.scope: {PER_MODEL!r} or {OVER_MODELS!r}; got "
                             f"{self.scope!r}")
        if self.reads and self.scope != PER_MODEL:
            raise ValueError(f"EvaluationTool.reads: only a per model tool reads another's "
                             f"step of the same model; {self.name!r} is {self.scope!r}")
        if self.merge and (self.scope != PER_MODEL or self.variants is not one_step):
            raise ValueError(f"EvaluationTool.merge: only a per model tool of one step a model "
                             f"(no variants) merges its steps; {self.name!r} is {self.scope!r}"
                             f"{'' if self.variants is one_step else ' with variants'}")

    def load(self) -> tuple[type, Callable[[Any], Any]]:
        """(its config dataclass, its run function), from its module."""
        # imported here, not at registration: a tool's module imports torch and its own
        # dependencies, which a study that does not run it, and every other tool's job, skip
        module = importlib.import_module(self.module)
        try:
            return getattr(module, self.config), getattr(module, self.run)
        except AttributeError as exc:
            raise ValueError(f"evaluation tool {self.name}: {exc}") from None

    def defaults(self, exclude: Any = ()) -> dict[str, Any]:
        """The fields of the tool's config a study leaves at their defaults (all but `driven`
        and `exclude`), as plain data: part of every step's hash, so a default changed in code
        reruns the steps it changes."""
        config, _ = self.load()
        out = {}
        for f in fields(config):
            if f.name in self.driven or f.name in exclude:
                continue
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
        return {k: asdict(v) if is_dataclass(v) else v for k, v in out.items()}

    def cleared(self) -> tuple[str, ...]:
        """The files a run writes into its folder (`outputs`), removed before a rerun."""
        return tuple(getattr(importlib.import_module(self.module), self.outputs)) \
            if self.outputs else ()

    def check_section_keys(self, raw: Any, where: str) -> Any:
        """A study file's section for this tool as written (`raw`: the study's, or a scale's
        keys), its keys checked against `section`, or against the config's fields less
        `driven`; returned as it is. `where` prefixes errors ('suite.')."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise StudyError(f"{where.rstrip('.')}: a mapping of its keys; got {raw!r}")
        if self.section is None:
            check_config_keys(raw, self.load()[0], self.driven, where)
        else:
            check_keys(raw, self.section, where)
        return raw

    def read_section(self, raw: dict | None, where: str) -> Any:
        """The section the driver reads from a study's keys (`check_section_keys`): a typed
        section's dataclass, its values checked against their types, or the keys as they
        are; None stays None (the tool is not run)."""
        if raw is None or self.section is None:
            return raw
        return self.merged(self.section(), raw, where)

    def merged(self, section: Any, keys: dict, where: str) -> Any:
        """`section` with the mapping `keys` replacing its values (a scale's keys over the
        study's)."""
        if self.section is None:
            return {**section, **keys}
        values = {**OmegaConf.to_container(OmegaConf.structured(section)), **keys}
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(self.section),
                                                       values))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or ""
            raise StudyError(f"{where}{key}: {str(exc).splitlines()[0]}") from None

    def job_config(self, options: dict, place: JobPlace) -> dict:
        """The config the job of one step runs (`job`, or its default)."""
        if self.job is not None:
            return self.job(options, place)
        one = self.scope == PER_MODEL and not place.merges
        checkpoint = place.checkpoints[0] if one else place.checkpoints
        return {**options, "checkpoint": checkpoint, "out": place.out}


# every registered tool by name, in registration order (the order the driver runs them)
TOOLS: dict[str, EvaluationTool] = {}


def register(tool: EvaluationTool) -> EvaluationTool:
    """Add `tool` to those the driver runs, after every tool registered before it. Its name is
    its section, job kind and folder, so a name registered already is a ValueError."""
    if tool.name in TOOLS:
        raise ValueError(f"evaluation tool {tool.name!r}: registered already (module "
                         f"{TOOLS[tool.name].module}); a tool's name is its study section, "
                         "job kind and output folder, so each is registered once")
    if tool.reads and (tool.reads not in TOOLS or TOOLS[tool.reads].scope != PER_MODEL):
        raise ValueError(f"evaluation tool {tool.name!r}: reads={tool.reads!r} must name a per "
                         f"model tool registered before it (registered: {sorted(TOOLS)})")
    TOOLS[tool.name] = tool
    return tool


def tools() -> list[EvaluationTool]:
    """Every registered tool, in the order the driver runs them."""
    return list(TOOLS.values())


# ---- the built-in tools ----------------------------------------------------------------------

register(EvaluationTool(
    name="divergence", module="evals.divergence", config="DivergenceConfig", run="run_config",
    scope=OVER_MODELS, applies=lambda config: config.has_decoder, models="with a decoder",
    options=lambda spec, reading: divergence_options(spec, reading.reference, reading.paths),
    hashed_as="config", driven=("checkpoints", "out_dir"),
    # a study's own wandb keys (e.g. a project) win over the driver's
    job=lambda options, place: {**options, "out_dir": place.out, "wandb": {
        "enabled": place.wandb, "group": place.group, "project": place.project,
        **(options.get("wandb") or {})}},
    stops_between_batches=True, shown=("replays", "lengths")))

register(EvaluationTool(
    name="suite", module="evals.suites.runner", config="SuiteConfig", run="run_suite",
    section=SuiteSpec, check=check_suite_values, variants=suite_overrides,
    options=lambda spec, reading: suite_options(spec, reading.reference, reading.own,
                                                **reading.variant),
    computed=lambda options, reading: suite_computed(options, reading.own),
    # the driver decides reruns itself (by hash), so it may replace what is there
    job=lambda options, place: {**options, "checkpoint": place.checkpoints[0],
                                "out": place.out, "overwrite": True, **place.wandb_fields()},
    driven=SUITE_DRIVEN, stops_between_batches=True, shown=("replays",)))

register(EvaluationTool(
    name="erf", module="evals.erf", config="ErfConfig", run="run_config",
    applies=lambda config: config.traits.decoder_windows, models="with decoder windows",
    check=check_erf_params, options=lambda spec, reading: erf_options(spec, reading.own),
    job=lambda options, place: {**options, "checkpoint": place.checkpoints, "out": place.out},
    driven=ERF_DRIVEN, outputs="OUTPUTS", shown=("length",)))

# each model read once, in its own folder (a model added later is read alone), and merged into
# the study's reading of every model (one wandb run: the merge's)
register(EvaluationTool(
    name="real_text", module="evals.real_text", config="RealTextConfig", run="run",
    section=RealTextSpec, options=lambda spec, reading: real_text_options(spec),
    job=lambda options, place: {**options, "checkpoint": place.checkpoints, "out": place.out,
                                **place.wandb_fields(), "wandb": place.wandb and place.merges},
    driven=("checkpoint", "out", "wandb", "wandb_project", "wandb_group"),
    done="baselines.csv", outputs="OUTPUTS", stops_between_batches=True, shown=("replays",),
    merge="merge_readings"))

register(EvaluationTool(
    name="paths", module="evals.paths", config="PathsConfig", run="run",
    applies=lambda config: config.variant == "ced" and config.traits.decoder_windows,
    models="of variant ced with decoder windows", reads="suite",
    job=lambda options, place: {**options, "suite": list(place.inputs),
                                "checkpoint": place.checkpoints, "out": place.out},
    driven=("suite", "checkpoint", "out"), outputs="OUTPUTS", shown=("replays",)))
