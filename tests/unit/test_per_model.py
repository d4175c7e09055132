"""analysis.per_model: the trained model as the unit (per-model drops with Holm over competent
families, the failure rate with its Clopper-Pearson interval, N*), on fabricated suite results
whose counts are chosen by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.per_model import failure_rates, model_drops, n_star
from evals.suites.stats import binomial_two_sided, clopper_pearson, holm

MARKS = {"L4": {"W": 8, "R_exact": 29}}


def fake(models: dict) -> pd.DataFrame:
    """models: seed -> family -> {"full": (right, n), mode: (full_only, mode_only, kl)}.
    Examples 0..n-1; `full` gets the first `right` right; a mode flips `full_only` of full's
    right answers to wrong and `mode_only` of its wrong ones to right."""
    rows = []
    for seed, families in models.items():
        for family, spec in families.items():
            right, n = spec["full"]
            full = [i < right for i in range(n)]
            for i in range(n):
                rows.append({"job": "L4", "train_seed": seed, "family": family, "x": "9",
                             "id": f"{family}/{i}", "mode": "full", "correct": full[i],
                             "kl_answer": 0.0, "run": f"L4/seed{seed}"})
            for mode, counts in spec.items():
                if mode == "full":
                    continue
                lost, gained, kl = counts
                assert lost <= right and gained <= n - right
                for i in range(n):
                    ok = full[i]
                    if i < lost:
                        ok = False
                    elif right <= i < right + gained:
                        ok = True
                    rows.append({"job": "L4", "train_seed": seed, "family": family, "x": "9",
                                 "id": f"{family}/{i}", "mode": mode, "correct": ok,
                                 "kl_answer": kl, "run": f"L4/seed{seed}"})
    return pd.DataFrame(rows)


# Seed 0: competent on count (0.95) and recall (1.0); at N = W = 8 it loses 30 of 400 count
# answers (p tiny) and nothing on recall: it fails. At N = 16 count loses 1 (0.25 point) and
# the KL is small: N* = 16. Parity is not competent (0.6): its large drop does not count.
# Seed 1: loses 3 count answers at N = 8 (0.75 point: under the 1-point bar, and p = 0.25):
# it does not fail; at N = 8 its drop is above 0.5 point, at 16 its KL is above 0.01, at 24
# both hold: N* = 24.
MODELS = {
    0: {"count": {"full": (380, 400), "replay=8": (30, 0, 0.5), "replay=16": (1, 0, 0.002),
                  "replay=24": (0, 0, 0.0), "replay=exact": (0, 0, 0.0)},
        "recall": {"full": (400, 400), "replay=8": (0, 0, 0.0), "replay=16": (0, 0, 0.0),
                   "replay=24": (0, 0, 0.0), "replay=exact": (0, 0, 0.0)},
        "parity": {"full": (240, 400), "replay=8": (100, 0, 2.0), "replay=16": (50, 0, 1.0),
                   "replay=24": (40, 0, 1.0), "replay=exact": (0, 0, 0.0)}},
    1: {"count": {"full": (390, 400), "replay=8": (3, 0, 0.02), "replay=16": (0, 0, 0.05),
                  "replay=24": (1, 1, 0.001), "replay=exact": (0, 0, 0.0)},
        "recall": {"full": (399, 400), "replay=8": (0, 0, 0.0), "replay=16": (0, 0, 0.0),
                   "replay=24": (0, 0, 0.0), "replay=exact": (0, 0, 0.0)}},
}


def test_model_drops_pair_within_a_model_and_holm_over_its_competent_families():
    drops = model_drops(fake(MODELS), MARKS)
    row = drops[(drops["seed"] == 0) & (drops["family"] == "count")
                & (drops["mode"] == "replay=8")].iloc[0]
    assert (row["N"], row["n"], row["full_only"], row["mode_only"]) == (8, 400, 30, 0)
    assert row["difference"] == pytest.approx(-30 / 400)
    assert row["acc_full"] == pytest.approx(0.95) and row["competent"]
    p_count, p_recall = binomial_two_sided(30, 30), 1.0
    assert row["p_holm"] == pytest.approx(holm([p_count, p_recall])[0])
    parity = drops[(drops["seed"] == 0) & (drops["family"] == "parity")]
    assert not parity["competent"].any() and not parity["fails"].any()
    # N of replay=exact is the model's R_exact
    assert set(drops[drops["mode"] == "replay=exact"]["N"]) == {29}


def test_failure_rate_counts_models_and_uses_the_exact_interval():
    rates = failure_rates(model_drops(fake(MODELS), MARKS))
    at_w = rates[rates["mode"] == "replay=8"].iloc[0]
    assert (at_w["models"], at_w["failed"], at_w["failed_seeds"]) == (2, 1, "0")
    assert (at_w["rate_low"], at_w["rate_high"]) == pytest.approx(clopper_pearson(1, 2))
    assert rates[rates["mode"] == "replay=16"].iloc[0]["failed"] == 0


def test_a_significant_drop_under_one_point_is_not_a_failure():
    # 3 of 400 lost, 0 gained: 0.75 point; p = 0.25 anyway. 8 of 1000 lost: p < 0.01 but 0.8
    models = {0: {"count": {"full": (990, 1000), "replay=8": (8, 0, 0.0)}}}
    drops = model_drops(fake(models), MARKS)
    assert drops.iloc[0]["p_holm"] < 0.01 and not drops.iloc[0]["fails"]
    models = {0: {"count": {"full": (990, 1000), "replay=8": (12, 0, 0.0)}}}
    assert model_drops(fake(models), MARKS).iloc[0]["fails"]


def test_n_star_is_the_smallest_grid_n_where_drop_and_kl_both_hold():
    star = n_star(model_drops(fake(MODELS), MARKS), MARKS).set_index("seed")
    assert star.loc[0, "N_star"] == 16 and star.loc[1, "N_star"] == 24
    assert star.loc[0, "failed_at_W"] and not star.loc[1, "failed_at_W"]
    assert star.loc[0, "drop_at_W"] == pytest.approx(-30 / 400)
    assert star.loc[1, "drop_at_W"] == pytest.approx(-3 / 400)
    assert star.loc[0, "N_star_over_W"] == 2.0
    assert star.loc[1, "N_star_over_R_exact"] == pytest.approx(24 / 29)
    assert star.loc[0, "grid"] == "8 16 24 29"


def test_n_star_falls_back_to_r_exact_and_is_undefined_without_competence():
    models = {0: {"count": {"full": (400, 400), "replay=8": (40, 0, 1.0),
                            "replay=16": (20, 0, 0.5), "replay=exact": (0, 0, 0.0)}},
              1: {"count": {"full": (100, 400), "replay=8": (40, 0, 1.0),
                            "replay=exact": (0, 0, 0.0)}}}
    star = n_star(model_drops(fake(models), MARKS), MARKS).set_index("seed")
    assert star.loc[0, "N_star"] == 29
    assert math.isnan(star.loc[1, "N_star"])          # not competent anywhere: nothing to lose


def test_a_model_competent_nowhere_is_left_out_of_the_failure_rate():
    models = {0: {"count": {"full": (400, 400), "replay=8": (40, 0, 1.0)}},
              1: {"count": {"full": (100, 400), "replay=8": (40, 0, 1.0)}}}
    row = failure_rates(model_drops(fake(models), MARKS)).iloc[0]
    assert (row["models"], row["not_competent"], row["failed"]) == (1, 1, 1)
    assert (row["rate_low"], row["rate_high"]) == pytest.approx(clopper_pearson(1, 1))


def test_a_drop_is_also_read_where_the_evidence_lies_inside_the_replay():
    """x <= N: the replay holds every token the answer needs; a drop there is window state
    carried in from beyond the replay start. Beyond it the global read must carry the fact."""
    def results(lost_near: int, lost_far: int) -> pd.DataFrame:
        rows = []
        for x, lost in (("5", lost_near), ("12", lost_far)):
            for i in range(200):
                for mode, ok in (("full", True), ("replay=8", i >= lost)):
                    rows.append({"job": "L4", "train_seed": 0, "family": "running_count",
                                 "x": x, "id": f"rc/{x}/{i}", "mode": mode, "correct": ok,
                                 "kl_answer": 0.0})
        return pd.DataFrame(rows)
    far = model_drops(results(0, 40), MARKS).iloc[0]
    assert far["fails"] and not far["fails_inside"]
    assert (far["n_inside"], far["difference_inside"]) == (200, 0.0)
    assert far["difference"] == pytest.approx(-40 / 400)
    near = model_drops(results(30, 0), MARKS).iloc[0]
    assert near["fails_inside"] and near["difference_inside"] == pytest.approx(-30 / 200)
    rates = failure_rates(model_drops(results(0, 40), MARKS)).iloc[0]
    assert (rates["failed"], rates["failed_inside"]) == (1, 0)
    star = n_star(model_drops(results(0, 40), MARKS), MARKS).iloc[0]
    assert star["failed_at_W"] and not star["failed_inside_at_W"]
