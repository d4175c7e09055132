"""Every console script in pyproject.toml points at a callable, and every `python -m` entry
point the README documents has one."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_resolves_to_a_callable():
    for name, target in scripts().items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_every_entry_point_has_a_console_script():
    modules = {target.partition(":")[0].removesuffix(".__main__") for target in scripts().values()}
    assert {"ced.cli.train", "ced.cli.cost", "evals.divergence", "evals.suites", "evals.lmeval",
            "experiments.run", "analysis.report", "analysis.findings", "evals.erf",
            "evals.topk_flips", "analysis.scaling"} <= modules
