"""notebooks/analysis.ipynb runs on a study's outputs (the `tiny` study, made here by the
driver) without errors and draws its plots; the .ipynb is in sync with its jupytext .py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"


def test_notebook_pair_in_sync():
    paired = jupytext.read(ROOT / "notebooks" / "analysis.py")
    stored = nbformat.read(NOTEBOOK, as_version=4)
    code = lambda nb: [c.source for c in nb.cells if c.cell_type == "code"]  # noqa: E731
    assert code(paired) == code(stored), "run: jupytext --sync notebooks/analysis.py"


def test_notebook_executes_on_study_outputs(tmp_path, monkeypatch):
    study = tmp_path / "study"
    done = subprocess.run([sys.executable, "-m", "experiments.run", "study=tiny", f"out={study}",
                           "threads=1", "wandb=false"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert (study / "report" / "report.html").exists(), done.stdout[-3000:] + done.stderr[-2000:]
    figures = tmp_path / "figures"
    monkeypatch.setenv("CED_STUDY_DIR", str(study))
    monkeypatch.setenv("CED_NOTEBOOK_OUT", str(figures))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()           # raises CellExecutionError on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 4
    names = {p.stem for p in figures.glob("*.png")}
    assert {"training_curves", "divergence_vs_N", "cost_quality_frontier"} <= names
    assert any(n.startswith("accuracy_") for n in names)
