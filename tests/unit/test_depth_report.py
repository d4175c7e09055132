"""analysis.depth on a fabricated depth study: per job the failure rate at N = W (exact CI), N*
per model, the drop at N = W with both CIs, and the erf mechanism join, all by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analysis.depth import extrapolation_table, main, mechanism_table
from evals.suites.stats import clopper_pearson

W = 8
R_EXACT = {"L2_no_sim": 15, "L2_sim": 15, "L20_no_sim": 141}


def write_model(study: Path, job: str, seed: int, losses: dict, n: int = 200) -> None:
    """One trained model: `full` right on every running_count example; mode -> lost answers."""
    rows = []
    for i in range(n):
        rows.append({"id": f"rc/{i}", "family": "running_count", "x": "9", "mode": "full",
                     "correct": True, "kl_answer": 0.0, "target": "3", "prediction": "3"})
        for mode, (lost, kl) in losses.items():
            rows.append({"id": f"rc/{i}", "family": "running_count", "x": "9", "mode": mode,
                         "correct": i >= lost, "kl_answer": kl, "target": "3",
                         "prediction": "3" if i >= lost else "4"})
    suite = study / "suite" / job / f"seed{seed}"
    suite.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(suite / "results.csv", index=False)
    (suite / "summary.json").write_text(json.dumps(
        {"run": {"settings": {"window": W, "r_exact": R_EXACT[job]}}}))
    run = study / "runs" / job / f"seed{seed}"
    run.mkdir(parents=True)
    layers = 2 if job.startswith("L2_") else 20
    probability = 0.5 if job.endswith("_sim") and not job.endswith("no_sim") else 0.0
    (run / "config.yaml").write_text(
        f"model:\n  n_decoder_layers: {layers}\n  window: {W}\n  shift_tokens: 0\n"
        f"train:\n  replay:\n    probability: {probability}\n    length: 8\n")


@pytest.fixture
def study(tmp_path) -> Path:
    root = tmp_path / "depth"
    # L_d = 2: both models lossless at N = W; N* = W
    for seed in (0, 1):
        write_model(root, "L2_no_sim", seed, {"replay=8": (0, 0.001), "replay=12": (0, 0.0),
                                               "replay=exact": (0, 0.0)})
    # ... and with replay simulation, seed 0 loses 10 of 200 at N = W, seed 1 nothing
    for seed, lost in ((0, 10), (1, 0)):
        write_model(root, "L2_sim", seed, {"replay=8": (lost, 0.001), "replay=12": (0, 0.0),
                                           "replay=exact": (0, 0.0)})
    # L_d = 20: seed 0 loses 20 of 200 at N = W (fails), recovers at 16; seed 1 loses 1 at
    # W (no failure) but its KL stays above 0.01 until 24
    write_model(root, "L20_no_sim", 0, {"replay=8": (20, 0.5), "replay=16": (0, 0.005),
                                        "replay=24": (0, 0.0), "replay=exact": (0, 0.0)})
    write_model(root, "L20_no_sim", 1, {"replay=8": (1, 0.2), "replay=16": (0, 0.05),
                                        "replay=24": (0, 0.002), "replay=exact": (0, 0.0)})
    return root


def test_depth_report_counts_models_and_finds_n_star(study, tmp_path):
    out = tmp_path / "out"
    assert main(["--study", str(study), "--out", str(out)]) == 0
    depth = pd.read_csv(out / "depth.csv").set_index("job")
    deep = depth.loc["L20_no_sim"]
    assert (deep["L_d"], deep["judged"], deep["failed_at_W"]) == (20, 2, 1)
    assert (deep["fail_rate_low"], deep["fail_rate_high"]) == pytest.approx(clopper_pearson(1, 2),
                                                                            abs=1e-5)
    assert deep["W_over_R_exact"] == pytest.approx(8 / 141)
    assert (deep["N_star_min"], deep["N_star_max"]) == (16, 24)
    assert depth.loc["L2_no_sim", "failed_at_W"] == 0
    assert depth.loc["L2_no_sim", "N_star_median"] == 8
    star = pd.read_csv(out / "n_star.csv")
    assert list(star.columns[:9]) == ["job", "arm", "seed", "L_d", "W", "R_exact", "N_star",
                                      "drop_at_W", "failed_at_W"]
    assert set(star["arm"]) == {"no_sim", "sim"}
    # the arm test: the job-against-job rows of analysis.findings at N = W, sim - no_sim
    arms = pd.read_csv(out / "arms_at_W.csv")
    assert len(arms) == 1
    test = arms.iloc[0]
    assert (test["L_d"], test["no_sim"], test["sim"], test["mode"]) == (2, "L2_no_sim", "L2_sim",
                                                                        "replay=8")
    assert (test["drop_no_sim"], test["drop_sim"]) == pytest.approx((0.0, -10 / 400))
    assert test["difference"] == pytest.approx(-10 / 400) and test["pairing"] == "paired"
    assert (test["models_from"], test["models_to"]) == (2, 2)
    assert test["seed_ci_low"] <= -0.05 + 1e-9 and test["seed_ci_high"] >= -1e-9
    assert "Replay simulation against none at each depth" in (out / "depth.md").read_text()
    at_w = pd.read_csv(out / "drop_at_W.csv").set_index("job")
    row = at_w.loc["L20_no_sim"]
    assert row["difference"] == pytest.approx(-21 / 400) and row["seeds"] == 2
    assert row["seed_ci_low"] <= -0.1 + 1e-9 and row["seed_ci_high"] >= -0.005 - 1e-9
    assert row["ci_high"] < 0                       # the example-level CI excludes 0
    for name in ("failure_vs_depth.png", "n_star_vs_depth.png", "depth.md"):
        assert (out / name).exists(), name
    # two depths of the no_sim arm: the line runs through the geometric means (2, 1), (20, 6^0.5)
    extra = pd.read_csv(out / "extrapolation.csv").set_index("L_d")
    assert extra.loc[20, "N_star_over_W"] == pytest.approx(6 ** 0.5)
    assert extra.loc[20, "fail_at_W"] == "1/4"


def test_mechanism_joins_erf_shares_with_n_star():
    n_star = pd.DataFrame({"job": ["a"] * 4, "seed": [0, 1, 2, 3], "L_d": [20] * 4,
                           "arm": ["no_sim"] * 4, "N_star": [8, 16, 24, 32],
                           "N_star_over_W": [1, 2, 3, 4]})
    shares = pd.DataFrame({"job": ["a"] * 4, "seed": [0, 1, 2, 3],
                           "share_beyond_W": [0.01, 0.02, 0.05, 0.09],
                           "share_beyond_2W": [0.001, 0.004, 0.003, 0.02]})
    table, stats = mechanism_table(shares, n_star)
    assert len(table) == 4
    assert stats["share_beyond_W/all"]["rho"] == pytest.approx(1.0)
    assert stats["share_beyond_2W/all"]["rho"] == pytest.approx(0.8)
    assert stats["share_beyond_W/L_d=20"]["models"] == 4


def test_extrapolation_recovers_a_power_law_and_skips_single_depth_arms():
    rows = []
    for arm, slope in (("no_sim", 0.5), ("sim", 0.0)):
        for depth in (2, 4, 8):
            for seed in range(3):
                ratio = 1.5 * (depth / 2) ** slope
                rows.append({"arm": arm, "seed": seed, "L_d": depth, "W": 8, "N_star": 8 * ratio,
                             "N_star_over_W": ratio, "failed_at_W": seed == 0,
                             "failed_inside_at_W": False})
    rows.append({"arm": "shift2", "seed": 0, "L_d": 2, "W": 8, "N_star": 12,
                 "N_star_over_W": 1.5, "failed_at_W": True, "failed_inside_at_W": False})
    table = extrapolation_table(pd.DataFrame(rows), targets=(20,), resamples=50)
    assert set(table["arm"]) == {"no_sim", "sim"}           # one depth: no line
    no_sim = table.set_index("arm").loc["no_sim"]
    assert no_sim["slope"] == pytest.approx(0.5)
    assert no_sim["N_star_over_W"] == pytest.approx(1.5 * 10 ** 0.5)
    # every model of a depth agrees: resampling cannot move the line
    assert no_sim["N_star_over_W_low"] == pytest.approx(no_sim["N_star_over_W_high"])
    assert no_sim["R_exact"] == 20 * 7 + 1
    assert no_sim["fail_at_W"] == "3/9" and no_sim["fail_inside_at_W"] == "0/9"
    assert (no_sim["fail_low"], no_sim["fail_high"]) == pytest.approx(clopper_pearson(3, 9))
    assert table.set_index("arm").loc["sim", "N_star_over_W"] == pytest.approx(1.5)
