"""Job against job (analysis.arms, arms.csv of `python -m analysis.findings`) on a fabricated two-arm
study: which jobs are paired by default (one training setting apart) and on request, the
differences by hand, the example- and model-level CIs, paired and unpaired documents."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.arms import compare_values, job_pairs
from analysis.findings import main
from evals.suites.stats import crossed_difference, welch_p

ROOT = Path(__file__).resolve().parents[2]
SHARED = ["data=synthetic", "model=tiny"]
N_DOCS = 40
# job -> (its overrides, per seed the documents lost at replay=8, KL at the answer, doc prefix)
JOBS = {"k2": (["model.topk=2"], {0: 12, 1: 14, 2: 16}, 0.3, "rc"),
        "k4": (["model.topk=4"], {0: 4, 1: 5, 2: 6}, 0.1, "rc"),
        # two settings from k4, and other documents: compared only on request, unpaired
        "k4_sim": (["model.topk=4", "train.replay.probability=0.5", "train.replay.length=8"],
                   {0: 2, 1: 2}, 0.05, "other")}


def write_job(study: Path, job: str) -> None:
    """The driver's records of one job: per seed its study_step.json and suite results (full
    right everywhere; replay=8 wrong on the first `lost` documents)."""
    overrides, lost, kl, prefix = JOBS[job]
    for seed, k in lost.items():
        run = study / "runs" / job / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "study_step.json").write_text(json.dumps(
            {"hash": "x", "job": job, "overrides": sorted([*SHARED, *overrides,
                                                             f"train.seed={seed}"])}))
        rows = []
        for i in range(N_DOCS):
            doc = {"id": f"{prefix}/{i}", "family": "running_count", "x": "9",
                   "target": "3"}
            rows.append({**doc, "mode": "full", "correct": True, "kl_answer": 0.0,
                         "prediction": "3"})
            rows.append({**doc, "mode": "replay=8", "correct": i >= k, "kl_answer": kl,
                         "prediction": "3" if i >= k else "4"})
        suite = study / "suite" / job / f"seed{seed}"
        suite.mkdir(parents=True)
        pd.DataFrame(rows).to_csv(suite / "results.csv", index=False)
        (suite / "summary.json").write_text(json.dumps(
            {"run": {"settings": {"window": 8, "r_exact": 15}}}))


@pytest.fixture
def study(tmp_path) -> Path:
    root = tmp_path / "ablation"
    for job in JOBS:
        write_job(root, job)
    (root / "summary.json").write_text(json.dumps({"study": "ablation", "steps": {
        f"train/{job}/seed0": {"state": "ok", "run_dir": str(root / "runs" / job / "seed0")}
        for job in ("k4_sim", "k2", "k4")}}))
    return root


def test_findings_cli_writes_the_job_against_job_table(study, tmp_path):
    out = tmp_path / "findings"
    done = subprocess.run([sys.executable, "-m", "analysis.findings", "--study", str(study),
                           "--out", str(out), "--compare", "k4:k4_sim"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"[findings] arms: {out / 'arms.csv'}" in done.stdout
    arms = pd.read_csv(out / "arms.csv")
    pairs = arms.drop_duplicates(["from", "to"])
    assert list(zip(pairs["from"], pairs["to"], pairs["differs"])) == [
        ("k2", "k4", "model.topk: 2 -> 4"),
        ("k4", "k4_sim", "train.replay.length: - -> 8; train.replay.probability: - -> 0.5")]
    rows = arms.set_index(["from", "to", "mode", "metric"])
    # k2 loses 14 of 40 on average at N = 8, k4 5: k4 is 0.225 better, paired on documents
    acc = rows.loc[("k2", "k4", "replay=8", "accuracy")]
    assert (acc["value_from"], acc["value_to"]) == pytest.approx((0.65, 0.875))
    assert acc["difference"] == pytest.approx(0.225)
    assert (acc["models_from"], acc["models_to"], acc["documents"]) == (3, 3, N_DOCS)
    assert acc["pairing"] == "paired" and acc["N"] == 8
    assert acc["ci_low"] < 0.225 < acc["ci_high"] and acc["ci_low"] > 0
    assert acc["seed_ci_low"] <= acc["ci_low"] and acc["seed_ci_high"] >= acc["ci_high"]
    assert acc["welch_p"] == pytest.approx(welch_p([0.70, 0.65, 0.60], [0.90, 0.875, 0.85]),
                                           rel=1e-4)
    drop = rows.loc[("k2", "k4", "replay=8", "drop")]
    assert drop["difference"] == pytest.approx(0.225)       # full is 1 everywhere
    kl = rows.loc[("k2", "k4", "replay=8", "kl_answer")]
    assert kl["difference"] == pytest.approx(-0.2) and kl["ci_low"] == pytest.approx(-0.2)
    full = rows.loc[("k2", "k4", "full", "accuracy")]
    assert full["difference"] == 0 and math.isnan(full["N"])
    assert ("k2", "k4", "full", "drop") not in rows.index     # no drop of full against itself
    # other documents: unpaired, the models nested
    sim = rows.loc[("k4", "k4_sim", "replay=8", "accuracy")]
    assert sim["pairing"] == "unpaired" and math.isnan(sim["documents"])
    assert sim["difference"] == pytest.approx(0.95 - 0.875)
    assert sim["seed_ci_method"] == "nested" and sim["models_to"] == 2
    assert (out / "arms.png").stat().st_size > 1000
    assert "## Job against job" in (out / "findings.md").read_text()


def test_a_pair_naming_an_unknown_job_is_one_line(study, tmp_path, capsys):
    assert main(["--study", str(study), "--out", str(tmp_path / "out"),
                 "--compare", "k2:k8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --compare k2:k8: no job k8 with suite results; jobs: k2, k4, k4_sim"]


def test_jobs_are_paired_by_one_setting_and_by_their_configs_without_stamps(study):
    assert [p[:2] for p in job_pairs(study, ["k2", "k4", "k4_sim"])] == [("k2", "k4")]
    # an archive keeps config.yaml only; seed and thread keys are not settings
    for job in JOBS:
        for run in (study / "runs" / job).iterdir():
            (run / "study_step.json").unlink()
            seed = int(run.name[4:])
            config = {"model": {}, "train": {"seed": seed, "threads": 1 + seed, "replay": {}}}
            for item in JOBS[job][0]:
                key, value = item.split("=")
                *nodes, leaf = key.split(".")
                node = config
                for name in nodes:
                    node = node[name]
                node[leaf] = float(value)
            (run / "config.yaml").write_text(json.dumps(config))     # JSON is YAML
    assert [p[:2] for p in job_pairs(study, ["k2", "k4", "k4_sim"])] == [("k2", "k4")]


def test_crossed_difference_draws_documents_once_for_both_jobs():
    # every model of `after` is `before` + 0.5 on each document: the shared document effect
    # cancels, and only the models' spread (none here) is left
    rng = np.random.default_rng(0)
    docs = rng.normal(size=40)
    before = np.stack([docs, docs + 0.1])
    after = before + 0.5
    draws = crossed_difference(before, after, 500, 0)
    assert draws.std() < 0.1 and np.mean(draws) == pytest.approx(0.5, abs=0.05)
    with pytest.raises(ValueError, match="same items"):
        crossed_difference(before, after[:, :10])
    # one model a job on the same documents: the model CI is the document CI
    index = pd.MultiIndex.from_product([[0], range(40)])
    row = compare_values(pd.Series(docs, index=index), pd.Series(docs + 1, index=index), 200)
    assert row["difference"] == pytest.approx(1.0) and row["pairing"] == "paired"
    assert row["ci_low"] == pytest.approx(1.0) and row["seed_ci_high"] == pytest.approx(1.0)
