"""The study driver's paths step (a study file's `paths:` section): evals.paths per trained ced
model with decoder windows, on the documents its own suite step read; its hash covers that
step's, so a suite that changes reruns it; a study with `paths` and no `suite` is refused; and
analysis.paths reads the study's paths folder (a step per model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.study import StudyError, load_study

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}


def study_file(path: Path, examples: int, paths: bool = True) -> Path:
    """Two jobs of two steps: ced (read by paths) and dense (no paths: skipped)."""
    path.write_text(
        "name: pathsmini\n"
        "train: [model=tiny, debug=fast, train.steps=2]\n"
        "jobs:\n  - {name: a, overrides: []}\n  - {name: d, overrides: [model.variant=dense]}\n"
        f"suite: {{replay: [W], examples: {examples}, families: [running_count]}}\n"
        + ("paths: {replays: [W, 2W], families: [running_count]}\n" if paths else ""))
    return path


def driver(study: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", f"study={study}",
                           f"out={out}", "wandb=false", "threads=1", *extra], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)


def steps_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())["steps"]


def test_paths_without_a_suite_section_is_refused_naming_both(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\njobs: [{name: a}]\npaths: {replays: [W]}\n")
    with pytest.raises(StudyError, match=r"paths: reads each model's suite step.*no suite"):
        load_study(str(path))
    path.write_text("name: bad\njobs: [{name: a}]\nsuite: {examples: 2}\n"
                    "paths: {suite: [x]}\n")
    with pytest.raises(StudyError, match=r"paths\.suite: unknown key"):
        load_study(str(path))


def test_the_paths_step_reads_its_suite_step_and_reruns_with_it(tmp_path):
    out = tmp_path / "out"
    study = study_file(tmp_path / "pathsmini.yaml", examples=2)
    first = driver(study, out, "only=all")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = steps_of(out)
    assert steps["suite/a/seed0"]["state"] == "ok" and steps["paths/a/seed0"]["state"] == "ok"
    assert "paths/d/seed0" not in steps                    # dense: no paths to cut
    rows = pd.read_csv(out / "paths" / "a" / "seed0" / "rows.csv")
    read = json.loads((out / "paths" / "a" / "seed0" / "summary.json").read_text())
    assert read["suites"] == [str(out / "suite" / "a" / "seed0")]
    assert set(rows["reading"]) == {"full", "replay", "global_cut", "both"}
    suite_docs = sum(1 for f in (out / "suite" / "a" / "seed0" / "data").glob("*.jsonl")
                     for _ in f.open())
    assert rows["id"].nunique() == suite_docs             # the suite's documents, all of them
    assert rows["N"].nunique() == 2                         # W and 2W, resolved per model

    again = driver(study, out, "only=eval")
    assert again.returncode == 0, again.stderr[-3000:]
    assert steps_of(out)["paths/a/seed0"]["state"] == "skipped"
    study_file(study, examples=3)                           # the suite changes: both rerun
    plan = driver(study, out, "only=plan")
    assert "plan suite/a/seed0: RERUN" in plan.stdout, plan.stdout[-3000:]
    assert "plan paths/a/seed0: RERUN" in plan.stdout, plan.stdout[-3000:]
    rerun = driver(study, out, "only=eval")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert steps_of(out)["paths/a/seed0"]["state"] == "ok"
    reread = pd.read_csv(out / "paths" / "a" / "seed0" / "rows.csv")
    assert reread["id"].nunique() > rows["id"].nunique()

    from analysis.paths import read_rows
    assert len(read_rows(out / "paths")) == len(reread)    # the study's folder, read whole
