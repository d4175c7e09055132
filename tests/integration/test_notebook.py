"""notebooks/study_analysis.ipynb is in sync with its jupytext .py. That it runs on a study's outputs
is tested in test_demo.py, on the `tiny` study that file's tests already make (one study run
instead of two: the CI budget is 10 minutes on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "study_analysis.ipynb"


def test_notebook_pair_in_sync():
    paired = jupytext.read(ROOT / "notebooks" / "study_analysis.py")
    stored = nbformat.read(NOTEBOOK, as_version=4)
    code = lambda nb: [c.source for c in nb.cells if c.cell_type == "code"]  # noqa: E731
    assert code(paired) == code(stored), "run: jupytext --sync notebooks/study_analysis.py"
