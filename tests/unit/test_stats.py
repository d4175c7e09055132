"""evals.suites.stats: the example-level statistics against scipy, and the model-level ones
(hierarchical bootstrap, seed t test, Clopper-Pearson) against cases computed by hand."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from scipy import stats as sps

from evals.suites.stats import (binomial_two_sided, clopper_pearson, crossed_bootstrap,
                                hierarchical_bootstrap,
                                holm, mcnemar_exact, percentile_interval, seed_t_test,
                                wilson_interval)


def closed_form_wilson(correct: int, n: int, z: float = 1.959963984540054):
    """The Wilson interval by its formula (what evals.suites.stats computed before it used
    scipy's)."""
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def counted_two_sided(k: int, n: int) -> float:
    """2 * P(X <= min(k, n - k)) for X ~ Binomial(n, 1/2), capped at 1, by exact counting."""
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2 ** n)


GRID = [(k, n) for n in [*range(1, 41), 97, 200, 1000, 7200] for k in
        sorted({*range(min(n, 40) + 1), n // 3, n // 2, n - 3, n - 1, n} & set(range(n + 1)))]


def test_the_binomial_pieces_equal_their_closed_forms():
    """scipy.stats.binomtest gives the numbers the closed forms gave, to 1e-12."""
    for k, n in GRID:
        assert wilson_interval(k, n) == pytest.approx(closed_form_wilson(k, n), abs=1e-12), (k, n)
        assert binomial_two_sided(k, n) == pytest.approx(counted_two_sided(k, n),
                                                         abs=1e-12), (k, n)
    assert wilson_interval(0, 0) == (0.0, 1.0) and binomial_two_sided(0, 0) == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_exact_mcnemar_equals_scipy_binomial_test(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    reference = [rng.random() < 0.8 for _ in range(n)]
    other = [r if rng.random() < 0.9 else not r for r in reference]
    result = mcnemar_exact(reference, other)
    b, c = result["b"], result["c"]
    expected = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    assert result["p_value"] == pytest.approx(expected, rel=1e-9, abs=1e-300)
    assert binomial_two_sided(b, b + c) == result["p_value"]


def test_holm_known_case():
    # sorted p 0.01, 0.02, 0.03, 0.5 -> 4 * 0.01, max(3 * 0.02, .), max(2 * 0.03, .), 0.5
    assert holm([0.03, 0.01, 0.5, 0.02]) == pytest.approx([0.06, 0.04, 0.5, 0.06])


@pytest.mark.parametrize("seed", range(6))
def test_holm_rejects_what_the_step_down_procedure_rejects(seed):
    """Holm's definition: walk the p-values in ascending order, reject while p_(r) <=
    alpha / (m - r); the adjusted p-values reject at alpha exactly that set."""
    rng = np.random.default_rng(seed)
    p = list(rng.uniform(0, 0.2, size=int(rng.integers(1, 12))) ** 2)
    m, order = len(p), np.argsort(p)
    for alpha in (0.01, 0.05):
        step_down = set()
        for rank, i in enumerate(order):
            if p[i] > alpha / (m - rank):
                break
            step_down.add(int(i))
        assert {i for i, q in enumerate(holm(p)) if q <= alpha} == step_down


@pytest.mark.parametrize("k,n,low,high", [
    # tabulated exact intervals (4 decimals); 0/n has the closed form 1 - 0.025^(1/n)
    (0, 3, 0.0, 0.7076),
    (1, 6, 0.0042, 0.6412),
    (0, 8, 0.0, 0.3694),
    (8, 8, 0.6306, 1.0),
    (5, 10, 0.1871, 0.8129),
])
def test_clopper_pearson_known_values(k, n, low, high):
    got = clopper_pearson(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)
    # the ends are Beta quantiles
    a = sps.beta.ppf(0.025, k, n - k + 1) if k else 0.0
    b = sps.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    assert got == pytest.approx((a, b), abs=1e-9)
    if k == 0:
        assert got[1] == pytest.approx(1 - 0.025 ** (1 / n), abs=1e-12)


def test_clopper_pearson_rejects_bad_counts_and_covers_empty():
    assert clopper_pearson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        clopper_pearson(4, 3)


def test_hierarchical_bootstrap_two_constant_seeds_by_hand():
    """Seed A loses every example (-1), seed B none (0). Within-seed resampling changes
    nothing, so a replicate is the mean of two seeds drawn with replacement: AA -1, AB and BA
    -0.5, BB 0, with probabilities 1/4, 1/2, 1/4."""
    reps = hierarchical_bootstrap([[-1.0] * 50, [0.0] * 80], resamples=40000, seed=3)
    values, counts = np.unique(reps, return_counts=True)
    assert list(values) == [-1.0, -0.5, 0.0]
    assert counts / counts.sum() == pytest.approx([0.25, 0.5, 0.25], abs=0.01)
    assert percentile_interval(reps) == (-1.0, 0.0)


def test_hierarchical_bootstrap_one_seed_is_the_ordinary_bootstrap():
    """With one group, a replicate is the mean of n draws with replacement: for 0/1 values with
    share p, k/n with k ~ Binomial(n, p), so mean p and variance p(1 - p)/n."""
    n, p = 40, 0.25
    reps = hierarchical_bootstrap([[1.0] * 10 + [0.0] * 30], resamples=60000, seed=1)
    assert reps.mean() == pytest.approx(p, abs=0.002)
    assert reps.var() == pytest.approx(p * (1 - p) / n, rel=0.03)
    assert set(np.round(reps * n, 9)) <= set(range(n + 1))


def test_hierarchical_bootstrap_enumerated_exactly_on_a_tiny_case():
    """Two seeds with two examples each: the replicate distribution has a closed form
    (enumerate the seed draws, then each slot's example draws); the bootstrap matches it."""
    groups = [[0.0, 1.0], [1.0, 1.0]]
    exact: dict[float, float] = {}
    for a, b in itertools.product(range(2), repeat=2):          # seed slots, prob 1/4 each
        for ea in itertools.product(groups[a], repeat=2):        # slot 1's examples
            for eb in itertools.product(groups[b], repeat=2):    # slot 2's examples
                value = (np.mean(ea) + np.mean(eb)) / 2
                exact[value] = exact.get(value, 0.0) + 0.25 / 16
    reps = hierarchical_bootstrap(groups, resamples=80000, seed=7)
    for value, prob in exact.items():
        assert np.mean(np.isclose(reps, value)) == pytest.approx(prob, abs=0.006)


def test_hierarchical_bootstrap_weighs_models_not_examples():
    """A seed with 10x the examples does not pull the mean: the model is the unit."""
    reps = hierarchical_bootstrap([[1.0] * 1000, [0.0] * 100], resamples=20000, seed=0)
    assert reps.mean() == pytest.approx(0.5, abs=0.01)
    assert hierarchical_bootstrap([], resamples=10).size == 0
    assert math.isnan(percentile_interval(np.empty(0))[0])


def test_crossed_bootstrap_enumerated_exactly_on_a_tiny_case():
    """2 models x 2 items: a replicate draws 2 model slots and, once for all, 2 item slots
    (4 x 4 equally likely draws); the replicate distribution matches the enumeration."""
    matrix = np.array([[0.0, 1.0], [1.0, 1.0]])
    exact: dict[float, float] = {}
    for models in itertools.product(range(2), repeat=2):
        for items in itertools.product(range(2), repeat=2):
            value = float(np.mean([matrix[m, d] for m in models for d in items]))
            exact[value] = exact.get(value, 0.0) + 1 / 16
    reps = crossed_bootstrap(matrix, resamples=80000, seed=5)
    for value, prob in exact.items():
        assert np.mean(np.isclose(reps, value)) == pytest.approx(prob, abs=0.006)


@pytest.mark.parametrize("seed", range(3))
def test_crossed_bootstrap_variance_is_models_plus_items(seed):
    """For an additive matrix a_m + b_d the replicate variance is var(a)/M + var(b)/D
    (population variances: the bootstrap's own); checked at 3% on random matrices."""
    rng = np.random.default_rng(seed)
    n_models, n_items = int(rng.integers(3, 9)), int(rng.integers(50, 300))
    a, b = rng.normal(0, 0.3, n_models), rng.normal(0, 1.0, n_items)
    reps = crossed_bootstrap(a[:, None] + b[None, :], resamples=60000, seed=seed)
    assert reps.mean() == pytest.approx(a.mean() + b.mean(), abs=0.01)
    assert reps.var() == pytest.approx(a.var() / n_models + b.var() / n_items, rel=0.03)


def test_a_shared_item_effect_is_one_draw_crossed_and_averaged_away_nested():
    """Every model with the same item values (the effect is the document's, not the model's):
    crossed keeps the items' variance var(b)/D; the nested bootstrap, drawing each model's
    items anew, divides it by the model count M as well: sqrt(M) narrower."""
    rng = np.random.default_rng(11)
    n_models, b = 8, rng.choice([-1.0, 0.0, 1.0], size=400, p=[0.3, 0.6, 0.1])
    matrix = np.tile(b, (n_models, 1))
    crossed = crossed_bootstrap(matrix, resamples=40000, seed=1)
    nested = hierarchical_bootstrap(list(matrix), resamples=40000, seed=1)
    assert crossed.var() == pytest.approx(b.var() / b.size, rel=0.04)
    assert nested.var() == pytest.approx(b.var() / b.size / n_models, rel=0.04)


def test_crossed_bootstrap_with_counts_is_a_ratio_mean_per_model():
    """counts make each model's mean sum / count over the drawn items: one model, two files
    with sums 1 and 4 over 1 and 2 tokens gives 1 (file 0 twice), 5/3 (one of each) or 2 (file
    1 twice) with probabilities 1/4, 1/2, 1/4; equal counts give the plain crossed means."""
    reps = crossed_bootstrap(np.array([[1.0, 4.0]]), resamples=40000, seed=2,
                             counts=np.array([[1.0, 2.0]]))
    for value, prob in ((1.0, 0.25), (5 / 3, 0.5), (2.0, 0.25)):
        assert np.mean(np.isclose(reps, value)) == pytest.approx(prob, abs=0.01)
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 7))
    assert np.allclose(crossed_bootstrap(values * 5, 200, seed=4, counts=np.full((3, 7), 5.0)),
                       crossed_bootstrap(values, 200, seed=4))
    with pytest.raises(ValueError, match="counts: expected shape"):
        crossed_bootstrap(values, 10, counts=np.ones((3, 6)))


def test_crossed_bootstrap_edge_cases():
    assert crossed_bootstrap(np.array([[0.25, 0.25], [0.25, 0.25]]), resamples=50).tolist() == \
        [0.25] * 50
    assert crossed_bootstrap(np.empty((0, 3)), resamples=10).size == 0
    with pytest.raises(ValueError, match="no NaN"):
        crossed_bootstrap(np.array([[0.0, np.nan]]), resamples=10)
    with pytest.raises(ValueError, match=r"\[models, items\]"):
        crossed_bootstrap(np.zeros(4), resamples=10)


def test_seed_level_interval_is_wider_than_the_example_level_one():
    """Three seeds that disagree (-0.11, -0.28, -0.14 over 1400 examples each): pooling the
    examples as independent gives a CI of about +-0.01; the seeds' spread gives far more."""
    rng = np.random.default_rng(0)
    groups = [np.where(rng.random(1400) < d, -1.0, 0.0) for d in (0.11, 0.28, 0.14)]
    pooled = np.concatenate(groups)
    half_example = 1.96 * pooled.std() / math.sqrt(pooled.size)
    low, high = percentile_interval(hierarchical_bootstrap(groups, resamples=4000))
    assert high - low > 5 * 2 * half_example
    t_low, t_high, p = seed_t_test([g.mean() for g in groups])
    assert t_low < -0.3 and t_high > 0.0 and 0.05 < p < 0.2   # not significant at seed level


def test_seed_t_test_matches_scipy():
    values = [-0.11, -0.28, -0.14]
    low, high, p = seed_t_test(values)
    ci = sps.ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert (low, high) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert p == pytest.approx(sps.ttest_1samp(values, 0.0).pvalue)
    assert all(math.isnan(v) for v in seed_t_test([0.3]))
    assert seed_t_test([0.0, 0.0, 0.0]) == (0.0, 0.0, 1.0)
