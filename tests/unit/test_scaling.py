"""analysis.scaling on a fabricated scaling study whose KL at N = W follows a known power law in
the inexact layers L_d - 1 and W (and is round-off for L_d = 1, where N = W >= R_exact): the fit
leaves the exact job out, recovers the exponents, the extrapolation and its band bracket the
truth, the accuracy drops are pooled per job, and the command line writes its outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from ced import ModelConfig
from analysis.scaling import extrapolate, fit_power_law, geometry, main, points

GRID = [(1, 16), (2, 16), (3, 16), (2, 8), (2, 32)]          # (L_d, W) per job


def true_kl(layers: int, window: int) -> float:
    """(L_d - 1)^1.5 W^-0.5; L_d = 1 replays exactly at N = W: round-off, which a log fit over
    positive values would take for a real point 15 decades down."""
    return 0.01 * (layers - 1) ** 1.5 * window ** -0.5 if layers > 1 else 3e-17


def fake_study(root, noise: float = 0.05, lost: int = 0):
    rng = np.random.default_rng(0)
    div_rows = []
    for layers, window in GRID:
        job = f"L{layers}_W{window}"
        for seed in range(3):
            run = root / "runs" / job / f"seed{seed}"
            (run / "final").mkdir(parents=True)
            (run / "final" / "config.json").write_text(json.dumps(ModelConfig(
                variant="ced", n_encoder_layers=2, n_decoder_layers=layers, window=window,
                encoder_kv_groups=0).to_dict()))
            kl = true_kl(layers, window) * 10 ** rng.normal(0, noise)
            for prompt in range(4):
                div_rows += [{"checkpoint": str(run / "final"), "mode": f"replay={window}",
                              "metric": "kl", "step": 0, "value": kl, "prompt": prompt},
                             {"checkpoint": str(run / "final"), "mode": "replay=1",
                              "metric": "kl", "step": 0, "value": 5.0, "prompt": prompt}]
            suite = root / "suite" / job / f"seed{seed}"
            suite.mkdir(parents=True)
            rows = []
            for i in range(50):
                for mode in ("full", f"replay={window}"):
                    wrong = mode != "full" and i < lost
                    rows.append({"id": f"recall/d=5/{i}", "family": "recall", "x": 5,
                                 "mode": mode, "correct": int(not wrong),
                                 "target": "7", "prediction": "7",
                                 "kl_answer": 0.0 if mode == "full" else kl / 10})
            pd.DataFrame(rows).to_csv(suite / "results.csv", index=False)
    (root / "divergence").mkdir()
    pd.DataFrame(div_rows).to_parquet(root / "divergence" / "divergence.parquet")


def test_fit_recovers_the_power_law_and_brackets_the_extrapolation(tmp_path):
    # 0.02 decades of seed noise: with two depth points (L_d - 1 = 1, 2: 0.3 decades apart)
    # the slope's standard error is about 0.05, inside the 0.15 tolerance below
    fake_study(tmp_path, noise=0.02)
    table = points(tmp_path, geometry(tmp_path))
    assert len(table) == 15 and table["kl_first"].notna().all()
    assert set(table[table["exact"]]["job"]) == {"L1_W16"}
    assert (table["R_exact"] == table["L_d"] * (table["W"] - 1) + 1).all()
    coef = fit_power_law(table, "kl_first")
    assert coef[1] == pytest.approx(1.5, abs=0.15) and coef[2] == pytest.approx(-0.5, abs=0.15)
    fit = extrapolate(table, "kl_first", 20, 128, bootstrap=300)
    truth = true_kl(20, 128)
    assert fit["band"][0] < truth < fit["band"][1]
    assert abs(math.log10(fit["prediction"] / truth)) < 0.3
    assert fit["leave_one_job_out_decades"] < 0.2
    assert fit["fitted_range"] == {"L_d": [2, 3], "W": [8, 32]}
    assert fit["exact_jobs"] == ["L1_W16"]


def test_cli_reports_no_drop_when_none_and_a_drop_when_there_is_one(tmp_path):
    fake_study(tmp_path / "none")
    assert main(["--study", str(tmp_path / "none"), "--out", str(tmp_path / "a"),
                 "--bootstrap", "100"]) == 0
    result = json.loads((tmp_path / "a" / "fit.json").read_text())
    assert result["fits"]["kl_first"]["fitted"] and result["fits"]["kl_answer"]["fitted"]
    assert any("no job drops significantly" in line for line in result["statement"])
    for name in ("scaling.csv", "scaling.png", "scaling.md"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    fake_study(tmp_path / "lossy", lost=10)
    assert main(["--study", str(tmp_path / "lossy"), "--out", str(tmp_path / "b"),
                 "--bootstrap", "100"]) == 0
    drops = json.loads((tmp_path / "b" / "fit.json").read_text())["drops"]
    assert all(d["drop"] == pytest.approx(-10 / 50) and d["ci_high"] < 0 for d in drops)
    assert main(["--study", str(tmp_path / "nothing"), "--out", str(tmp_path / "c")]) == 2
