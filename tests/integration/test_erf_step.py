"""The study driver's erf step (a study file's `erf:` section): evals.erf per trained model with
decoder windows, its W forms resolved per model and its prompt lengthened to cover the decoder's
reach; skipped when fresh, rerun when an option changes, shown by only=plan, and read by
analysis.archive into erf_shares.csv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ced.config import ModelConfig
from experiments.sections import erf_options
from experiments.study import StudyError, load_study

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}


def study_file(path: Path, examples: int) -> Path:
    """Two jobs of two steps: ced (decoder windows: measured) and dense (none: skipped)."""
    path.write_text(
        "name: erfmini\n"
        "train: [model=tiny, debug=fast, train.steps=2]\n"
        "jobs:\n  - {name: a, overrides: []}\n  - {name: d, overrides: [model.variant=dense]}\n"
        "erf:\n"
        f"  tasks: [running_state]\n  examples: {examples}\n  length: 2W\n"
        "  params: {running_state: {window_len: 3W/2}}\n  dtype: float32\n  bootstrap: 20\n")
    return path


def driver(study: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", f"study={study}",
                           f"out={out}", "wandb=false", "threads=1", *extra], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)


def test_erf_options_resolve_forms_per_model_and_cover_the_reach():
    """W forms and R_exact in length and params become the model's lengths; a length that would
    cut the decoder's reach grows to R_exact + W; other values pass as written."""
    spec = {"tasks": ["running_state"], "examples": 4, "length": "2W",
            "params": {"running_state": {"window_len": "3W/2", "filler": 5}}}
    narrow = ModelConfig(variant="ced", n_decoder_layers=2, window=16, max_seq_len=512)
    options = erf_options(spec, narrow)     # R_exact 31: 2W = 32 < R_exact + W = 47
    assert options["length"] == 31 + 16
    assert json.loads(options["params"]) == {"running_state": {"window_len": 24, "filler": 5}}
    assert options["tasks"] == ["running_state"] and options["examples"] == 4
    wide = erf_options({**spec, "length": 200}, narrow)
    assert wide["length"] == 200                   # long enough already: kept
    exact = erf_options({**spec, "params": {"running_state": {"window_len": "R_exact"}}},
                        narrow)
    assert json.loads(exact["params"]) == {"running_state": {"window_len": 31}}


def test_a_misspelt_erf_key_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\njobs: [{name: a}]\nerf: {exampels: 3}\n")
    with pytest.raises(StudyError, match=r"erf\.exampels: unknown key"):
        load_study(str(path))
    path.write_text("name: bad\njobs: [{name: a}]\nerf: {checkpoint: [x]}\n")
    with pytest.raises(StudyError, match=r"erf\.checkpoint: unknown key"):
        load_study(str(path))


def test_the_erf_step_runs_skips_and_reruns_and_the_archive_reads_it(tmp_path):
    out = tmp_path / "out"
    study = study_file(tmp_path / "erfmini.yaml", examples=2)
    first = driver(study, out, "only=all")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps["erf/a/seed0"]["state"] == "ok"
    assert "erf/d/seed0" not in steps                      # dense: no decoder windows
    measured = out / "erf" / "a" / "seed0"
    for name in ("erf.csv", "summary.json", "erf.md", "erf.png"):
        assert (measured / name).exists(), name
    settings = json.loads((measured / "summary.json").read_text())["settings"]
    assert settings["length"] == 2 * 7 + 1 + 8              # 2W = 16 < R_exact + W = 23
    assert settings["params"] == {"running_state": {"window_len": 12}}

    again = driver(study, out, "only=eval")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"]["erf/a/seed0"]["state"] \
        == "skipped"
    study_file(study, examples=3)
    plan = driver(study, out, "only=plan")
    assert "plan erf/a/seed0: RERUN" in plan.stdout, plan.stdout[-3000:]
    rerun = driver(study, out, "only=eval")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"]["erf/a/seed0"]["state"] == "ok"
    assert json.loads((measured / "summary.json").read_text())["settings"]["examples"] == 3

    from analysis.archive import archive
    into = tmp_path / "archive"
    archive(out, into)
    shares = pd.read_csv(into / "erf_shares.csv")
    assert list(zip(shares["job"], shares["seed"])) == [("a", 0)]
    assert 0.0 <= shares["share_beyond_W"].iloc[0] <= 1.0
