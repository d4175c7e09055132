"""analysis.laws on fabricated per-model tables: the law that generated N* wins the held-out
comparison, the held-out prediction is the fit on the other cells (checked by hand), and the
model-level CI narrows with more models."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis import laws

# cells of the encoder and W study: (job, W, L_d); R_exact = L_d (W - 1) + 1
CELLS = [("W8_L4", 8, 4), ("W8_L8", 8, 8), ("W8_L20", 8, 20), ("W16_L8", 16, 8),
         ("W32_L8", 32, 8)]


def fabricated(rule, models_per_cell: int = 4, noise: float = 1.0, seed: int = 0):
    """A models.csv whose N* follows `rule(W, R_exact)` plus Gaussian noise (sd `noise`)."""
    rng = np.random.default_rng(seed)
    rows = []
    for job, w, depth in CELLS:
        r_exact = depth * (w - 1) + 1
        for s in range(models_per_cell):
            n_star = rule(w, r_exact) + rng.normal(0, noise)
            rows.append({"job": job, "seed": s, "W": w, "R_exact": r_exact, "N_star": n_star,
                         "largest_competent_d": r_exact + rng.normal(0, 3)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rule,winner", [(lambda w, r: 3 * w, "windows"),
                                         (lambda w, r: w + 12, "tokens"),
                                         (lambda w, r: 0.6 * r, "receptive_field")])
def test_the_generating_law_wins_with_cells_held_out(rule, winner, seed):
    table, errors = laws.compare(fabricated(rule, seed=seed), resamples=200, seed=seed)
    best = table.set_index("law")["held_out_rmse"]
    assert best.idxmin() == winner, table
    assert table.set_index("law").loc[winner, "best"]
    # the winner's score is near the noise (sd 1 token a model, 4 models: about 0.5 a cell)
    assert best[winner] < 2.0
    # every other law of the three misses by more than the noise
    for other in ("windows", "tokens", "receptive_field"):
        if other != winner:
            assert best[other] > 3 * best[winner], table
    assert set(errors["job"]) == {c[0] for c in CELLS}


def test_a_held_out_prediction_is_the_fit_on_the_other_cells():
    models = fabricated(lambda w, r: 2 * w + 5, models_per_cell=2, noise=2.0, seed=7)
    errors = laws.held_out(models, list(laws.LAWS))
    for job in ("W8_L4", "W32_L8"):
        rest, cell = models[models.job != job], models[models.job == job]
        a = (rest.W * rest.N_star).sum() / (rest.W ** 2).sum()       # windows
        c = (rest.N_star - rest.W).mean()                          # tokens
        b = (rest.R_exact * rest.N_star).sum() / (rest.R_exact ** 2).sum()
        expected = {"windows": a * cell.W.mean(), "tokens": cell.W.mean() + c,
                    "receptive_field": b * cell.R_exact.mean()}
        for law, value in expected.items():
            row = errors[(errors.law == law) & (errors.job == job)].iloc[0]
            assert row.predicted == pytest.approx(value, rel=1e-12)
            assert row.error == pytest.approx(value - cell.N_star.mean(), rel=1e-12)


def test_the_model_level_ci_narrows_with_more_models():
    def width(n):
        table, _ = laws.compare(fabricated(lambda w, r: w + 12, models_per_cell=n, noise=4.0),
                                resamples=300)
        row = table.set_index("law").loc["tokens"]
        assert row.rmse_ci_low <= row.held_out_rmse <= row.rmse_ci_high + 1e-9
        return row.rmse_ci_high - row.rmse_ci_low
    assert width(16) < width(2)


def test_models_without_n_star_are_left_out_and_one_cell_is_refused():
    models = fabricated(lambda w, r: 3 * w)
    models.loc[0, "N_star"] = np.nan
    kept, fitted = laws.usable(models)
    assert len(kept) == len(models) - 1 and [law.name for law in fitted][-1] == "reach"
    with pytest.raises(ValueError, match="leaving one cell out needs at least two"):
        laws.usable(models[models.job == "W8_L4"])
    with pytest.raises(ValueError, match=r"no column\(s\) \['R_exact'\]"):
        laws.usable(models.drop(columns="R_exact"))
    assert "reach" not in [law.name for law in
                           laws.usable(models.drop(columns="largest_competent_d"))[1]]


@pytest.mark.parametrize("seed", range(3))
def test_a_model_competent_only_inside_the_replay_is_left_out(seed, tmp_path):
    """A model whose competent bins all lie within W has an N* censored at or below W by its
    competence: it enters no law, so a cell of such models changes nothing, and it is counted."""
    models = fabricated(lambda w, r: 0.5 * r, seed=seed)
    inside = pd.DataFrame([{"job": "W8_L20_short", "seed": s, "W": 8, "R_exact": 141,
                            "N_star": 4.0, "largest_competent_d": d}
                           for s, d in enumerate((4, 8, 4))])
    with_inside = pd.concat([models, inside], ignore_index=True)
    assert laws.usable(with_inside)[0].equals(laws.usable(models)[0])
    a, _ = laws.compare(models, resamples=50, seed=seed)
    b, _ = laws.compare(with_inside, resamples=50, seed=seed)
    pd.testing.assert_frame_equal(a, b)
    # one model competent one bin past W does enter
    past = inside.assign(largest_competent_d=[4, 9, 4])
    assert len(laws.usable(pd.concat([models, past], ignore_index=True))[0]) == len(models) + 1
    source = tmp_path / "models.csv"
    with_inside.to_csv(source, index=False)
    assert laws.main(["--models", str(source), "--out", str(tmp_path), "--resamples", "20"]) == 0
    assert "3 without an N* beyond the replay" in (tmp_path / "laws.md").read_text()


def test_the_command_writes_its_tables(tmp_path):
    source = tmp_path / "models.csv"
    fabricated(lambda w, r: 0.5 * r).to_csv(source, index=False)
    assert laws.main(["--models", str(source), "--out", str(tmp_path / "out"),
                      "--resamples", "50"]) == 0
    table = pd.read_csv(tmp_path / "out" / "laws.csv")
    assert table.loc[table.best, "law"].item() == "receptive_field"
    assert (tmp_path / "out" / "laws.png").stat().st_size > 0
    assert "receptive_field" in (tmp_path / "out" / "laws.md").read_text()
    assert laws.main(["--models", str(tmp_path / "none.csv"), "--out", str(tmp_path)]) == 2
    # --jobs fits only the cells named: W8_L20 and W32_L8 out leaves three cells and 12 models
    assert laws.main(["--models", str(source), "--out", str(tmp_path / "some"), "--resamples",
                      "50", "--jobs", "W8_L4", "W8_L8", "W16_L8"]) == 0
    some = pd.read_csv(tmp_path / "some" / "laws.csv")
    assert (some["cells"] == 3).all() and (some["models"] == 12).all()
    assert set(pd.read_csv(tmp_path / "some" / "held_out.csv")["job"]) == {"W8_L4", "W8_L8",
                                                                            "W16_L8"}
    assert laws.main(["--models", str(source), "--out", str(tmp_path / "bad"), "--jobs",
                      "W8_L4", "W64_L8"]) == 2


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rule,law,expected", [
    (lambda w, r: 3 * w, "windows", 3 * 128),
    (lambda w, r: w + 12, "tokens", 128 + 12),
    (lambda w, r: 0.6 * r, "receptive_field", 0.6 * 2541)])
def test_each_law_is_extrapolated_to_v41_with_a_model_level_interval(rule, law, expected, seed):
    """The generating law's N* at V4.1's geometry (conf/model/deepseek_v41_flash.yaml: W = 128,
    R_exact = 2541) is its constant there: within 5% (noise sd 1 token a model; the fitted
    constant moves by about 1/sqrt(20) of that), inside its own CI; reach has no value at a
    target; and the CI narrows with sixteen times the models (to about a quarter; a bootstrap
    over four models a cell is itself noisy: 0.63 at worst over 12 seeds, so the bound is 0.75)."""
    table = laws.compare(fabricated(rule, seed=seed), resamples=300, seed=seed)[0]
    row = table.set_index("law").loc[law]
    assert (row["target_W"], row["target_R_exact"]) == (128, 2541)
    assert abs(row["target_N_star"] - expected) < 0.05 * expected, row
    assert row["target_ci_low"] <= row["target_N_star"] <= row["target_ci_high"]
    assert np.isnan(table.set_index("law").loc["reach", "target_N_star"])
    wide = row["target_ci_high"] - row["target_ci_low"]
    more = laws.compare(fabricated(rule, models_per_cell=64, seed=seed), resamples=300,
                        seed=seed)[0].set_index("law").loc[law]
    assert more["target_ci_high"] - more["target_ci_low"] < 0.75 * wide


def test_a_target_is_a_geometry_or_a_model_file_and_bad_text_is_one_line():
    assert laws.Target.parse("W=16,R_exact=121") == laws.Target("W=16,R_exact=121", 16, 121)
    assert laws.Target.parse("deepseek_v41_flash") == laws.Target("deepseek_v41_flash", 128,
                                                                   2541)
    for text in ("W=16", "W=16,R_exact=0", "W=16,R_exact", "W=16,R_exact=8,L=2", "no_such"):
        with pytest.raises(ValueError, match="--target"):
            laws.Target.parse(text)


def test_pooled_jobs_are_fitted_as_one_cell(tmp_path):
    """--pool CELL=A,B: a cell's models split over two jobs (seeds 0-2 and seed 3, as an fp32
    model joins a bf16 cell) fit as the cell whole; a seed in both jobs is refused."""
    whole = fabricated(lambda w, r: 0.5 * r)
    split = whole.copy()
    split.loc[(split["job"] == "W8_L8") & (split["seed"] == 3), "job"] = "W8_L8_fp32"
    for table, name in ((whole, "whole"), (split, "split")):
        table.to_csv(tmp_path / f"{name}.csv", index=False)
    assert laws.main(["--models", str(tmp_path / "whole.csv"), "--out", str(tmp_path / "a"),
                      "--resamples", "50"]) == 0
    assert laws.main(["--models", str(tmp_path / "split.csv"), "--out", str(tmp_path / "b"),
                      "--resamples", "50", "--pool", "W8_L8=W8_L8,W8_L8_fp32"]) == 0
    a = pd.read_csv(tmp_path / "a" / "held_out.csv").sort_values(["law", "job"])
    b = pd.read_csv(tmp_path / "b" / "held_out.csv").sort_values(["law", "job"])
    assert list(a["job"]) == list(b["job"]) and list(a["models"]) == list(b["models"])
    assert np.allclose(a["predicted"], b["predicted"]) and np.allclose(a["error"], b["error"])
    split.loc[len(split)] = {**split.iloc[0].to_dict(), "job": "W8_L8_fp32", "seed": 0}
    split.to_csv(tmp_path / "twin.csv", index=False)
    assert laws.main(["--models", str(tmp_path / "twin.csv"), "--out", str(tmp_path / "c"),
                      "--pool", "W8_L8=W8_L8,W8_L8_fp32"]) == 2
