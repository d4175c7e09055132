"""The schema of a study file (`conf/experiment/<name>.yaml`) and its loader.

A study is checked like a training config: every key against the dataclasses below (a
misspelt key such as `overides`, `exampels` or `divergance` is a one-line `StudyError` naming
the key and the allowed keys), then the values against their types through OmegaConf's
structured configs. Its evaluation sections are those of the registered evaluation tools
(`experiments.tools`: `divergence:`, `suite:`, `erf:`, `real_text:` and any tool registered
before the study is loaded), each checked by its tool: a typed section (`suite:` against
`experiments.sections.SuiteSpec`) key by key and value by value, any other section's keys
against the tool's config fields less those the driver sets (`erf:` against
`evals.erf.ErfConfig` less `ERF_DRIVEN`). The loader keeps them in `StudyConfig.evaluations`,
and a scale's keys for a section in its `ScaleSpec.evaluations`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced.presets import PRESET_DIR, STUDY_DIR, StudyError, preset_overrides, study_path

from .sections import SET_BY_LOADER, check_keys
from .tools import TOOLS

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
class ScaleSpec:
    """Extra settings of one scale: `train` overrides appended to the study's, an evaluation
    section's keys replacing the study's (`<tool>: {...}`, kept in `evaluations`), and `seeds`
    (if set) replacing the study's."""

    train: List[str] = field(default_factory=list)
    seeds: Optional[List[int]] = None   # replaces the study's seeds at this scale
    # tool name -> the keys of its section at this scale, as written (set by the loader)
    evaluations: Dict[str, Any] = field(default_factory=dict, metadata=SET_BY_LOADER)


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
    scales: Dict[str, ScaleSpec] = field(default_factory=dict)
    scale: str = field(default="demo", metadata=SET_BY_LOADER)   # the scale applied
    # tool name -> its section (a typed section's dataclass, or the keys as written), for
    # every registered evaluation tool the study names (set by the loader)
    evaluations: Dict[str, Any] = field(default_factory=dict, metadata=SET_BY_LOADER)

    def seeds_of(self, job: JobSpec) -> List[int]:
        """The seeds `job` is trained with: its own, else the study's."""
        return list(job.seeds) if job.seeds is not None else list(self.seeds)

    def as_written(self) -> dict:
        """The study as resolved, its evaluation sections where a file writes them: at the
        top, and in each scale (for `only=plan`'s print)."""
        study = OmegaConf.to_container(OmegaConf.structured(self))
        study.pop("evaluations")
        for scale in study["scales"].values():
            scale.update(scale.pop("evaluations"))
        return {**study, **OmegaConf.to_container(OmegaConf.create(self.evaluations))}


def file_keys(schema: type = StudyConfig) -> list[str]:
    """The keys a study file (or one of its scales: `ScaleSpec`) may have: the schema's own
    and a section per registered evaluation tool."""
    own = [f.name for f in fields(schema) if not f.metadata.get("set_by_loader")]
    clash = sorted(set(own) & set(TOOLS))
    if clash:
        raise StudyError(f"evaluation tool(s) {clash}: named as a key of the study itself; a "
                         "tool's name is its own section")
    return sorted([*own, *TOOLS])


def _split_sections(node: dict, schema: type, where: str) -> dict[str, Any]:
    """Check the keys of `node` (the study file, or one of its scales) against `schema`'s and
    the registered tools' names, then take its evaluation sections out of it: tool name ->
    its section's keys as written, checked by the tool."""
    allowed = file_keys(schema)
    for key in node:
        if key not in allowed:
            raise StudyError(f"{where}{key}: unknown key; allowed keys of "
                             f"{where.rstrip('.') or 'a study'}: {allowed}")
    return {name: tool.check_section_keys(node.pop(name), f"{where}{name}.")
            for name, tool in TOOLS.items() if name in node}


def load_study(name: str, scale: str = "demo", seeds: list[int] | None = None) -> StudyConfig:
    """conf/experiment/<name>.yaml, checked, with its `scales.<scale>` section applied (train
    overrides appended, evaluation keys and seeds replaced); `seeds` (the driver's option)
    replaces both."""
    path = study_path(name)
    where = f"study {path.stem}: "
    study = _read_study(path, where)
    _apply_scale(study, scale, seeds, where)
    _check_jobs_and_seeds(study, seeds, where)
    for name, section in study.evaluations.items():
        if section is not None and TOOLS[name].check is not None:
            TOOLS[name].check(section, f"{where}{name}.")
        reads = TOOLS[name].reads
        if section is not None and reads and study.evaluations.get(reads) is None:
            raise StudyError(f"{where}{name}: reads each model's {reads} step, and the study "
                             f"has no {reads} section (add one, or remove {name})")
    return study


def _read_study(path: Path, where: str) -> StudyConfig:
    """The file's keys checked against the schema (its evaluation sections' and every scale's
    keys too), then its values through OmegaConf's structured config."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise StudyError(f"study {path.name}: must be a mapping with keys {file_keys()}")
    try:
        sections = _split_sections(raw, StudyConfig, "")
        scale_sections = {scale_name: _split_sections(extra, ScaleSpec, f"scales.{scale_name}.")
                          for scale_name, extra in (raw.get("scales") or {}).items()
                          if isinstance(extra, dict)}
        check_keys(raw, StudyConfig, "")
        sections = {name: TOOLS[name].read_section(section, f"{name}.")
                    for name, section in sections.items()}
    except StudyError as exc:
        raise StudyError(where + str(exc)) from None
    raw.setdefault("name", path.stem)
    try:
        study = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StudyConfig), raw))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "study"
        raise StudyError(f"{where}{key}: {str(exc).splitlines()[0]}") from None
    study.evaluations = sections
    for scale_name, extra in scale_sections.items():
        study.scales[scale_name].evaluations = extra
    return study


def _apply_scale(study: StudyConfig, scale: str, seeds: list[int] | None, where: str) -> None:
    """`scales.<scale>` onto the study in place: presets and train overrides, evaluation
    keys, seeds; then the driver's `seeds`."""
    scales = {k: (v or ScaleSpec()) for k, v in study.scales.items()}
    if scale not in scales and scale not in ("demo", "full"):
        raise StudyError(f"scale={scale}: the study {study.name} defines "
                         f"{sorted(set(scales) | {'demo', 'full'})}")
    extra = scales.get(scale) or ScaleSpec()
    study.train = preset_overrides(study.presets, where) + list(study.train) + list(extra.train)
    for name, section in study.evaluations.items():
        keys = extra.evaluations.get(name)
        if section is not None and keys:
            study.evaluations[name] = TOOLS[name].merged(section, keys, f"{where}{name}.")
    study.scale = scale
    if extra.seeds is not None:
        study.seeds = list(extra.seeds)
    if seeds is not None:
        study.seeds = list(seeds)
    for job in study.jobs:
        if extra.seeds is not None or seeds is not None:
            job.seeds = None          # a scale's or the driver's seeds replace the job's own


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
