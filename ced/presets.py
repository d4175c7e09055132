"""The training CLI's `experiment=<study>` and the presets a study file names.

`python -m ced.train experiment=demo model=yoco` trains like the demo study's yoco job: it
takes the study file's shared `train` overrides (conf/experiment/<name>.yaml, with its
`presets:` from conf/experiment/presets/ in front and its demo scale's `train` behind). This
module reads only those lists. The study driver (experiments/study.py) reads and checks the
whole file with these same functions; ced/ imports nothing from experiments/.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
STUDY_DIR = CONF_DIR / "experiment"
PRESET_DIR = STUDY_DIR / "presets"


class StudyError(ValueError):
    """A bad study file or driver option; the message is one line naming the key."""


def known_studies() -> list[str]:
    """The names of the studies in conf/experiment/ (every <name>.yaml), sorted: what the
    driver's --help and its errors list, read from the folder so a new study is never left
    out."""
    return sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


def study_path(name: str) -> Path:
    """A study name (conf/experiment/<name>.yaml) or a path to a .yaml file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else STUDY_DIR / f"{name}.yaml"
    if not path.exists():
        raise StudyError(f"study={name}: no {path}; known studies: {known_studies()}")
    return path


def preset_overrides(names: list[str], where: str = "") -> list[str]:
    """The `train` overrides of the presets `names` (conf/experiment/presets/<name>.yaml), in
    order. They go before a study's own `train` overrides, so a key the study also sets takes
    the study's value (Hydra: the last value of a key wins)."""
    out: list[str] = []
    known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    for i, name in enumerate(names):
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            raise StudyError(f"{where}presets[{i}]: no preset {name!r}; known presets: {known}")
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        train = raw.get("train") if isinstance(raw, dict) else None
        if set(raw or {}) - {"train"} or not isinstance(train, list):
            raise StudyError(f"{where}presets[{i}]: {path} must be a mapping with one key, "
                             f"`train`, a list of ced.train overrides")
        out += [str(item) for item in train]
    return out


def study_train_overrides(name: str, scale: str = "demo") -> list[str]:
    """A study's shared training overrides at `scale`: its presets', its own `train`, then
    `scales.<scale>.train`; what every job of the study trains with before its own."""
    path = study_path(name)
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    where = f"study {path.stem}: "
    if not isinstance(raw, dict):
        raise StudyError(f"{where}must be a mapping")
    lists = {"presets": raw.get("presets") or [], "train": raw.get("train") or [],
             f"scales.{scale}.train": ((raw.get("scales") or {}).get(scale) or {}).get("train")
             or []}
    for key, value in lists.items():
        if not isinstance(value, list):
            raise StudyError(f"{where}{key}: must be a list; got {value!r}")
    return (preset_overrides([str(n) for n in lists["presets"]], where)
            + [str(o) for o in lists["train"]] + [str(o) for o in lists[f"scales.{scale}.train"]])
