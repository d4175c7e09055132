"""The uncensored suite: its generator realises the requested span starts, and analysis.reach
computes competence, N*(d), the margin and a model's N* per bin on fabricated outcomes."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pytest

from ced import ModelConfig, exact_replay_length
from analysis import reach, tables
from evals.suites.families import SuiteSettings, build_documents, uncensored_span_starts


def _cfg(window: int, decoder_layers: int) -> ModelConfig:
    return ModelConfig(variant="ced", d_model=32, n_heads=2, n_encoder_layers=2,
                       n_decoder_layers=decoder_layers, window=window, topk=4,
                       global_from_layer=1, encoder_kv_groups=1, max_seq_len=512)


@pytest.mark.parametrize("window,decoder_layers", [(8, 2), (16, 2), (8, 8), (4, 20), (32, 8)])
def test_grid_reaches_past_r_exact(window, decoder_layers):
    r_exact = exact_replay_length(_cfg(window, decoder_layers))
    grid = uncensored_span_starts(window, r_exact)
    assert grid == sorted(set(grid)) and min(grid) >= 3
    assert grid[-1] == 3 * r_exact // 2 > r_exact and r_exact in grid
    assert {d for d in (window // 2, window, window + 1, 3 * window // 2, 2 * window)
            if 3 <= d < r_exact} <= set(grid)
    below = [d for d in grid if d > 2 * window and d < r_exact]
    assert all(d % window == 0 for d in below)          # multiples of W up to R_exact
    # every replay length below R_exact has evidence beyond it, and W/2 and up inside it
    for n in range(grid[0], r_exact):
        assert any(d > n for d in grid) and any(d <= n for d in grid)


@pytest.mark.parametrize("window,decoder_layers", [(8, 2), (16, 2), (8, 8)])
@pytest.mark.parametrize("family", ["running_count", "running_bracket"])
def test_generator_realises_each_requested_bin(window, decoder_layers, family):
    cfg = _cfg(window, decoder_layers)
    settings = SuiteSettings.from_config(cfg, [window], span_grid="uncensored")
    grid = uncensored_span_starts(window, exact_replay_length(cfg))
    docs = build_documents(settings, examples=5, families=[family])
    assert sorted({d["x"] for d in docs}) == grid
    lengths = {d["length"] for d in docs}
    assert len(lengths) == 1 and lengths.pop() > max(grid)        # one prompt length for all
    for doc in docs:
        context = doc["context"]
        # `|` sits exactly d tokens before the answer (the prompt's end is distance 1: `?`)
        assert len(context) - context.rindex("|") == doc["x"] == doc["distance"]
        window_text = context[context.rindex("|") + 1:-1]
        if family == "running_count":
            assert doc["target"] == str(window_text.count("a"))
        else:
            assert doc["target"] == str(window_text.count("(") - window_text.count(")"))


@pytest.mark.parametrize("filler", [0, 7, 32])
@pytest.mark.parametrize("family", ["running_count", "running_bracket"])
def test_state_filler_lays_prompts_out_as_training_does(filler, family):
    """With state_filler every example draws its own prefix of 0..F symbols before `|` (the
    training layout), the span start is still the bin's, and the prompt is never longer than
    the span plus F; without it every prompt has one length (the test above)."""
    cfg = _cfg(8, 8)
    settings = SuiteSettings.from_config(cfg, [8], span_grid="uncensored", state_filler=filler)
    docs = build_documents(settings, examples=12, families=[family])
    assert sorted({d["x"] for d in docs}) == uncensored_span_starts(8, exact_replay_length(cfg))
    prefixes = set()
    for doc in docs:
        context = doc["context"]
        assert len(context) - context.rindex("|") == doc["x"] == doc["distance"]
        prefix = context.rindex("|")
        assert 0 <= prefix <= filler and doc["length"] == len(context) + 1   # + BOS
        prefixes.add(prefix)
    if filler >= 7:
        assert len(prefixes) > 3          # drawn per example, not one length for all
    with pytest.raises(ValueError, match="state_filler"):
        SuiteSettings.from_config(cfg, [8], span_grid="uncensored", state_filler=-1)
    with pytest.raises(ValueError, match="state_filler and state_length"):
        SuiteSettings.from_config(cfg, [8], span_grid="uncensored", state_filler=filler,
                                  state_length=120)


def test_extra_distances_join_the_grid_and_bad_names_are_refused():
    cfg = _cfg(8, 2)
    settings = SuiteSettings.from_config(cfg, [8], span_grid="uncensored", extra_distances=(10,))
    assert 10 in settings.span_starts
    with pytest.raises(ValueError, match="span_grid"):
        SuiteSettings.from_config(cfg, [8], span_grid="everything")
    with pytest.raises(ValueError, match="span_grid"):
        SuiteSettings.from_config(ModelConfig(variant="dense", d_model=32, n_heads=2,
                                              n_encoder_layers=2, n_decoder_layers=2),
                                  [8], span_grid="uncensored")


def test_n_star_of_bin_needs_every_larger_n():
    assert reach.n_star_of_bin(pd.Series({4: -0.5, 8: 0.0, 12: -0.1, 15: 0.0})) == 15
    assert reach.n_star_of_bin(pd.Series({4: -0.5, 8: -0.004, 12: 0.0, 15: 0.0})) == 8
    assert reach.n_star_of_bin(pd.Series({4: 0.0, 8: 0.0})) == 4
    assert math.isnan(reach.n_star_of_bin(pd.Series({4: 0.0, 8: -0.2})))


def _fabricate(rng: random.Random, models: dict, grid_n: list[int], examples: int = 40):
    """Suite rows (results.csv shape) from a rule per model: `models[(job, seed)] = (acc_full
    by d, lose(d, n) -> probability that a right answer turns wrong at replay n)`."""
    rows = []
    for (job, seed), (full_by_d, lose) in models.items():
        for d, acc in full_by_d.items():
            for i in range(examples):
                doc = f"running_count/distance={d}/{i}"
                right = i < round(acc * examples)
                rows.append({"job": job, "train_seed": seed, "family": "running_count",
                             "x": str(d), "id": doc, "mode": "full", "correct": right})
                for n in grid_n:
                    mode = "replay=exact" if n == grid_n[-1] else f"replay={n}"
                    wrong = right and rng.random() < lose(d, n)
                    rows.append({"job": job, "train_seed": seed, "family": "running_count",
                                 "x": str(d), "id": doc, "mode": mode,
                                 "correct": right and not wrong})
            rows.append({"job": job, "train_seed": seed, "family": "recall", "x": "5",
                         "id": "recall/0", "mode": "full", "correct": seed % 2 == 0})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(5))
def test_bins_models_and_cells_on_a_fabricated_study(seed):
    rng = random.Random(seed)
    grid_n, marks = [4, 8, 12, 15], {"window": {"W": 8, "R_exact": 15},
                                      "global": {"W": 8, "R_exact": 15}}
    bins_d = [4, 8, 9, 12, 15, 22]
    # "window": the replay loses every answer whose span starts beyond it (d > n);
    # "global": nothing is lost anywhere; seed 1 of "window" is not competent beyond d = 12
    models = {("window", s): ({d: (0.5 if (s == 1 and d > 12) else 1.0) for d in bins_d},
                              lambda d, n: 1.0 if d > n and n < 15 else 0.0) for s in (0, 1)}
    models.update({("global", s): ({d: 1.0 for d in bins_d}, lambda d, n: 0.0)
                   for s in (0, 1)})
    results = _fabricate(rng, models, grid_n)
    paired = reach.paired_outcomes(results, marks)
    bins = reach.bin_table(paired, results, marks)
    window = bins[bins["job"] == "window"].set_index(["seed", "d"])
    # N*(d): the smallest grid N >= d (15 = R_exact for every d above 12), margin N*(d) - d
    for d in bins_d:
        expect = next(n for n in grid_n if n >= d) if d <= 15 else 15
        assert window.loc[(0, d), "N_star_d"] == expect
        assert window.loc[(0, d), "margin"] == expect - d
    assert not window.loc[(1, 15), "competent"] and window.loc[(1, 12), "competent"]
    assert (bins[bins["job"] == "global"]["N_star_d"] == 4).all()
    models_t = reach.model_table(paired, bins, results, marks).set_index(["job", "seed"])
    assert models_t.loc[("window", 0), "N_star"] == 15
    assert models_t.loc[("window", 1), "N_star"] == 12          # censored at its reach
    assert models_t.loc[("window", 1), "largest_competent_d"] == 12
    assert models_t.loc[("window", 0), "horizon"] == 22
    assert models_t.loc[("window", 0), "drop_beyond"] == -1.0
    assert models_t.loc[("window", 0), "drop_inside"] == 0.0
    assert models_t.loc[("window", 1), "n_beyond"] == 80         # only d = 9, 12 competent
    assert bool(models_t.loc[("window", 0), "fails_beyond"])
    assert not models_t.loc[("global", 0), "fails_beyond"]
    assert models_t.loc[("global", 0), "recall_full"] == 1.0
    assert models_t.loc[("global", 1), "recall_full"] == 0.0
    cells = reach.cell_table(paired, models_t.reset_index(), bins, marks).set_index("job")
    assert cells.loc["window", "drop_beyond"] == -1.0
    assert cells.loc["window", "failed_beyond"] == 2 and cells.loc["global", "failed_beyond"] == 0
    assert cells.loc["global", "seed_ci_low_beyond"] == cells.loc["global", "seed_ci_high_beyond"] == 0
    assert cells.loc["window", "ci_low_beyond"] <= -0.95
    # N*(d) - d per span start, over the models competent on each bin
    margins = reach.margin_table(bins).set_index(["job", "d"])
    for d in bins_d:
        expect = (next(n for n in grid_n if n >= d) if d <= 15 else 15) - d
        row = margins.loc[("window", d)]
        assert row["models"] == (1 if d > 12 else 2), (d, row)
        assert row["margin_median"] == row["margin_min"] == row["margin_max"] == expect
        # N*(d) >= d - W at every bin of "window" (its N*(d) >= d up to R_exact, 15 >= 22 - 8)
        assert row["past_d_minus_W"] == row["models"]
        assert margins.loc[("global", d), "margin_median"] == 4 - d
        assert margins.loc[("global", d), "past_d_minus_W"] == (2 if 4 >= d - 8 else 0)


def test_job_steps_difference_and_its_interval():
    models = pd.DataFrame({"job": ["a"] * 4 + ["b"] * 4 + ["c"] * 4,
                           "drop_inside": [0.0] * 12,
                           "drop_beyond": [0.0, -0.01, 0.01, 0.0, -0.5, -0.4, -0.6, -0.5,
                                           -0.5, -0.45, -0.55, -0.5]})
    steps = reach.job_steps(models).set_index(["from", "to"])
    assert list(steps.index) == [("a", "b"), ("b", "c")]
    ab = steps.loc[("a", "b")]
    assert ab["change_beyond"] == pytest.approx(-0.5)
    assert ab["ci_low_beyond"] < -0.5 < ab["ci_high_beyond"] < -0.3
    assert ab["welch_p_beyond"] < 0.01 and ab["models_beyond"] == "4 + 4"
    bc = steps.loc[("b", "c")]
    assert bc["ci_low_beyond"] < 0 < bc["ci_high_beyond"] and bc["welch_p_beyond"] > 0.5
    assert ab["change_inside"] == 0 and math.isnan(ab["welch_p_inside"])
    extra = reach.job_steps(models, [("a", "c")])
    assert extra["change_beyond"].iloc[0] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="no job z"):
        reach.job_steps(models, [("a", "z")])
    assert ab["paired_seeds_beyond"] == 0 and math.isnan(ab["paired_change_beyond"])


@pytest.mark.parametrize("seed", range(5))
def test_a_paired_step_cancels_the_spread_between_seeds(seed):
    """Two jobs on the same seeds whose drops differ by a small shift per seed, on a spread
    between seeds much larger than the shift: the unpaired CI spans zero, the paired one (over
    the shared seeds only) excludes it and centres on the shift; a seed one job lacks is left
    out of the pairs."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(-0.5, 0.0, 6)
    shift = rng.normal(-0.05, 0.005, 6)
    models = pd.DataFrame({"job": ["a"] * 6 + ["b"] * 5, "seed": list(range(6)) + list(range(5)),
                           "drop_inside": [0.0] * 11,
                           "drop_beyond": [*base, *(base[:5] + shift[:5])]})
    row = reach.job_steps(models, [("a", "b")]).iloc[0]
    assert row["paired_seeds_beyond"] == 5
    assert row["paired_change_beyond"] == pytest.approx(shift[:5].mean(), abs=1e-12)
    assert row["paired_ci_low_beyond"] < shift[:5].mean() < row["paired_ci_high_beyond"] < 0
    assert row["paired_p_beyond"] < 0.01
    assert row["ci_low_beyond"] < 0 < row["ci_high_beyond"]       # unpaired: lost in the spread
    assert row["paired_change_inside"] == 0 and row["paired_p_inside"] == 1.0   # no change at all


@pytest.mark.parametrize("seed", range(3))
def test_a_pooled_cell_reads_two_jobs_models_as_one_cells(seed):
    """--pool: a job and its fp32 models of other seeds read as one cell; the pooled row
    equals the cell of one job holding all those models, and a seed in both is refused."""
    rng = random.Random(seed)
    grid_n = [4, 8, 12, 15]
    marks = {job: {"W": 8, "R_exact": 15} for job in ("bf", "fp", "one", "wide")}
    marks["wide"] = {"W": 16, "R_exact": 31}
    bins_d = [4, 9, 12]
    lose = {s: rng.uniform(0.2, 0.9) for s in range(4)}
    rule = {s: ({d: 1.0 for d in bins_d}, lambda d, n, p=lose[s]: p if d > n else 0.0)
            for s in range(4)}
    models = {("bf", s): rule[s] for s in (0, 1, 2)}
    models[("fp", 3)] = rule[3]
    results = _fabricate(random.Random(seed), models, grid_n)
    one = _fabricate(random.Random(seed), {("one", s): rule[s] for s in range(4)}, grid_n)
    paired = reach.paired_outcomes(results, marks)
    bins = reach.bin_table(paired, results, marks)
    table = reach.model_table(paired, bins, results, marks)
    cell = reach.pooled_cells(paired, table, bins, marks, {"both": ["bf", "fp"]}).iloc[0]
    assert cell["job"] == "both" and cell["pooled"] == "bf+fp" and cell["models"] == 4
    paired_1 = reach.paired_outcomes(one, marks)
    bins_1 = reach.bin_table(paired_1, one, marks)
    whole = reach.cell_table(paired_1, reach.model_table(paired_1, bins_1, one, marks), bins_1,
                             marks).iloc[0]
    # the same models (same rules, same draws per model): the same cell, up to the bootstrap
    for column in ("drop_beyond", "ci_low_beyond", "ci_high_beyond", "failed_beyond",
                   "judged_beyond", "n_beyond", "N_star_median"):
        assert cell[column] == pytest.approx(whole[column], abs=1e-12), column
    twins = _fabricate(random.Random(seed), {**models, ("fp", 0): rule[0]}, grid_n)
    paired_t = reach.paired_outcomes(twins, marks)
    bins_t = reach.bin_table(paired_t, twins, marks)
    with pytest.raises(ValueError, match=r"seed\(s\) \[0\] in more than one"):
        reach.pooled_cells(paired_t, reach.model_table(paired_t, bins_t, twins, marks), bins_t,
                           marks, {"both": ["bf", "fp"]})
    with pytest.raises(ValueError, match="different"):
        reach.pooled_cells(paired, table, bins, {**marks, "fp": marks["wide"]},
                           {"both": ["bf", "fp"]})
    with pytest.raises(ValueError, match="CELL=JOB_A,JOB_B"):
        tables.parse_pools(["both=bf"])
    with pytest.raises(ValueError, match="more than one cell"):
        tables.parse_pools(["a=x,y", "b=y,z"])
