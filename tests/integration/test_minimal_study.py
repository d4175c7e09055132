"""The minimal study file that docs/studies.md opens with, copied from the page as it stands:
the driver composes and runs it (two tiny jobs one setting apart, the suite, the report), and
`analysis.findings` compares the two jobs with each other (arms.csv); the report shows the same
table under "Arms compared"."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

from analysis.findings import main as findings_main
from ced.run_id import IDENTITY, RunId, read_run_id

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "studies.md"


def minimal_study() -> str:
    """The first YAML block of the guide's "A minimal study to copy" section."""
    text = GUIDE.read_text()
    section = text[text.index("## A minimal study to copy"):]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_the_guides_minimal_study_runs_and_compares_its_arms(tmp_path):
    spec = tmp_path / "my_topk.yaml"
    spec.write_text(minimal_study())
    out = tmp_path / "study"
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "experiments.run", f"study={spec}",
                           f"out={out}", "threads=1", "wandb=false"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all steps ok" in done.stdout
    # every model folder says which model it holds as fields (ced.run_id), for the readers
    for job in ("k2", "k4"):
        for folder in (out / "runs" / job / "seed0", out / "suite" / job / "seed0"):
            assert read_run_id(folder) == RunId(job, 0)
            assert (folder / IDENTITY).exists()
    findings = tmp_path / "findings"
    assert findings_main(["--study", str(out), "--out", str(findings)]) == 0
    arms = pd.read_csv(findings / "arms.csv")
    assert set(zip(arms["from"], arms["to"], arms["differs"])) == {
        ("k2", "k4", "model.topk: 2 -> 4")}
    assert {"full", "replay=1", "replay=8", "replay=exact"} <= set(arms["mode"])
    assert {"accuracy", "drop", "kl_answer"} == set(arms["metric"])
    assert (arms["models_from"] == 1).all() and (arms["models_to"] == 1).all()
    assert (arms["pairing"] == "paired").all()
    assert arms[["ci_low", "ci_high", "seed_ci_low", "seed_ci_high"]].notna().all().all()
    report = (out / "report" / "report.md").read_text()
    assert "## Arms compared" in report and "(arms.png)" in report
    assert "model.topk: 2 -> 4" in report
