"""Statistics for accuracy tables, at two levels of replication.

Example level (the examples of one trained model, or of several pooled as if independent):
Wilson intervals and the exact binomial test (scipy's), the exact McNemar test on paired
outcomes, Holm's step-down adjustment (pure Python; tests/unit/test_stats.py checks it).

Model level (the trained model, i.e. the training seed, as the unit): a hierarchical bootstrap
(seeds, then examples within each drawn seed), a crossed one (models and the documents they all
read, drawn independently; for two jobs' models, `crossed_difference`), a t interval over
per-seed means, Welch's test of two groups of models, and the exact Clopper-Pearson interval of
a rate such as "models that fail at N = W" (scipy).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (good at 0/n and n/n, unlike the
    normal approximation), `scipy.stats.binomtest`'s. n = 0 gives (0, 1)."""
    if n == 0:
        return 0.0, 1.0     # scipy refuses n = 0; no data bounds nothing
    # imported here: scipy.stats takes seconds to import, and the suite runner imports this
    from scipy.stats import binomtest
    ci = binomtest(correct, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips (Binomial(n, 1/2)),
    `scipy.stats.binomtest`'s (for p = 1/2: 2 * P(X <= min(k, n - k)), capped at 1)."""
    if n == 0:
        return 1.0          # scipy refuses n = 0; no flips are no evidence
    from scipy.stats import binomtest     # lazily, as in wilson_interval
    return float(binomtest(k, n, 0.5).pvalue)


def mcnemar_exact(reference: list[bool], other: list[bool]) -> dict:
    """Paired comparison of two scorings of the same examples.

    b = reference right and other wrong, c = reference wrong and other right (the discordant
    pairs); under H0 (equal accuracy) b ~ Binomial(b + c, 1/2). Returns b, c and the exact
    two-sided p-value. Concordant pairs carry no information about the difference.
    """
    if len(reference) != len(other):
        raise ValueError("mcnemar_exact: the two scorings must cover the same examples")
    b = sum(1 for r, o in zip(reference, other) if r and not o)
    c = sum(1 for r, o in zip(reference, other) if o and not r)
    return {"b": b, "c": c, "p_value": binomial_two_sided(b, b + c)}


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error control), in the input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion k / n, e.g. the share of
    trained models that fail; `scipy.stats.binomtest(k, n).proportion_ci(method="exact")`.
    n = 0 gives (0, 1)."""
    if not 0 <= k <= n:
        raise ValueError(f"clopper_pearson: need 0 <= k <= n; got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    # lazy, as in wilson_interval: scipy.stats costs ~0.6 s to import
    from scipy.stats import binomtest
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def hierarchical_bootstrap(groups: Sequence[Sequence[float]], resamples: int = 2000,
                           seed: int = 0) -> np.ndarray:
    """Bootstrap distribution of the mean over groups of the mean within a group, resampling
    both levels: each replicate draws len(groups) groups with replacement (the trained models,
    i.e. seeds), then, independently for every drawn slot, that group's values with
    replacement (its examples). Every group weighs the same, whatever its size: the model is
    the unit. Returns the `resamples` replicate statistics, shape [resamples].

    Drawing a group's values with replacement is a multinomial draw over its distinct values,
    so a paired difference in {-1, 0, +1} costs three categories, not n draws. Empty groups
    are dropped; no group at all gives an empty array."""
    rng = np.random.default_rng(seed)
    compact = []
    for values in groups:
        values = np.asarray(values, dtype=float)
        if values.size:
            distinct, counts = np.unique(values, return_counts=True)
            compact.append((distinct, counts / values.size, values.size))
    if not compact or resamples < 1:
        return np.empty(0)
    n_groups = len(compact)
    picks = rng.integers(0, n_groups, size=(resamples, n_groups))
    stats = np.zeros(resamples)
    for g, (distinct, probs, size) in enumerate(compact):
        slots = picks == g
        draws = int(slots.sum())
        if not draws:
            continue
        means = rng.multinomial(size, probs, size=draws) @ distinct / size
        replicate = np.nonzero(slots)[0]          # the replicate of each slot, in slot order
        np.add.at(stats, replicate, means)
    return stats / n_groups


def crossed_bootstrap(matrix: np.ndarray, resamples: int = 2000, seed: int = 0,
                      counts: np.ndarray | None = None) -> np.ndarray:
    """Bootstrap distribution of the mean over models of each model's mean over items, for a
    complete [models, items] matrix (every model read the same items, e.g. the same suite
    documents or the same files), resampling models and items independently of each other:
    each replicate draws the models with replacement and, once for all of them, the items with
    replacement. An item's effect shared by every model is then drawn as one (not averaged
    away as independent noise per model, as `hierarchical_bootstrap` does), and the
    model-to-model spread as the other. Every model weighs the same: the model is the unit.

    counts: optional [models, items] weights; `matrix` then holds per-item sums and a model's
    mean is the ratio sum / count over the drawn items (e.g. token values summed per file,
    the file the item). Returns the `resamples` replicate statistics, shape [resamples]; an
    empty matrix gives an empty array.

    The draws are multinomial multiplicities, so no [models, items] copy is made per
    replicate."""
    matrix = np.asarray(matrix, dtype=float)
    if matrix.ndim != 2:
        raise ValueError(f"matrix: expected [models, items], got shape {matrix.shape}")
    counts = np.ones_like(matrix) if counts is None else np.asarray(counts, dtype=float)
    if counts.shape != matrix.shape:
        raise ValueError(f"counts: expected shape {matrix.shape}, got {counts.shape}")
    if matrix.size == 0 or resamples < 1:
        return np.empty(0)
    if np.isnan(matrix).any():
        raise ValueError("matrix: every model must have a value for every item (no NaN)")
    n_models, n_items = matrix.shape
    rng = np.random.default_rng(seed)
    w_models = _draws(rng, n_models, resamples)
    return _mean_over_models(w_models, _draws(rng, n_items, resamples), matrix, counts)


def _draws(rng: np.random.Generator, n: int, resamples: int) -> np.ndarray:
    """Multiplicities of `resamples` draws of n things out of n with replacement, [resamples, n]."""
    return rng.multinomial(n, np.full(n, 1 / n), size=resamples)


def _index_draws(rng: np.random.Generator, n: int, resamples: int) -> np.ndarray:
    """The same multiplicities as `_draws`, counted from uniform indices: one bincount instead
    of a binomial per item and replicate, which is what a bootstrap over hundreds of
    documents, thousands of times per table, can afford."""
    picks = rng.integers(0, n, size=(resamples, n)) + n * np.arange(resamples)[:, None]
    return np.bincount(picks.ravel(), minlength=resamples * n).reshape(resamples, n)


def bootstrap_means(values: Sequence[float], resamples: int = 2000,
                    seed: int = 0) -> np.ndarray:
    """Bootstrap distribution of the mean of `values` drawn with replacement (the examples as
    independent), shape [resamples]; empty values give an empty array."""
    values = np.asarray(values, dtype=float)
    if values.size == 0 or resamples < 1:
        return np.empty(0)
    rng = np.random.default_rng(seed)
    return values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)


def _mean_over_models(w_models: np.ndarray, w_items: np.ndarray, matrix: np.ndarray,
                      counts: np.ndarray) -> np.ndarray:
    """Per replicate, the mean over the drawn models of each model's mean over the drawn
    items (a ratio of sums where `counts` are not all one)."""
    ratio = (w_items @ matrix.T) / np.maximum(w_items @ counts.T, 1e-300)   # [resamples, M]
    return (w_models * ratio).sum(1) / matrix.shape[0]


def crossed_difference(before: np.ndarray, after: np.ndarray, resamples: int = 2000,
                       seed: int = 0) -> np.ndarray:
    """Bootstrap distribution of a difference between two groups of models that read the same
    items (two jobs' models on the same documents): mean over `after`'s models minus mean over
    `before`'s, each model's value its mean over the items. `before` and `after` are
    [models, items] matrices whose columns are the same items. Each replicate draws the items
    once, for both (an item's effect shared by the two jobs is drawn as one, so it cancels as
    it does in the estimate), and each group's models on their own (the models are two
    independent samples). Returns the `resamples` replicate differences; an empty side gives
    an empty array."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if before.ndim != 2 or after.ndim != 2 or before.shape[1] != after.shape[1]:
        raise ValueError(f"before, after: expected [models, items] with the same items; got "
                         f"shapes {before.shape} and {after.shape}")
    if before.size == 0 or after.size == 0 or resamples < 1:
        return np.empty(0)
    if np.isnan(before).any() or np.isnan(after).any():
        raise ValueError("before, after: every model must have a value for every item (no NaN)")
    rng = np.random.default_rng(seed)
    w_items = _index_draws(rng, before.shape[1], resamples)
    mean_after = _mean_over_models(_draws(rng, len(after), resamples), w_items, after,
                                   np.ones_like(after))
    return mean_after - _mean_over_models(_draws(rng, len(before), resamples), w_items, before,
                                          np.ones_like(before))


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The central `confidence` interval of bootstrap replicates (NaN, NaN when empty)."""
    if replicates.size == 0:
        return math.nan, math.nan
    tail = (1 - confidence) / 2
    return float(np.quantile(replicates, tail)), float(np.quantile(replicates, 1 - tail))


def seed_t_test(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Student t interval of the mean of per-seed values (one value per trained model) and the
    two-sided p-value of mean = 0 (`scipy.stats.ttest_1samp`). Fewer than two seeds, or seeds
    that all agree, give NaN where the t statistic is undefined (an interval of zero width
    around a shared value is returned as that value)."""
    values = np.asarray(values, dtype=float)
    if values.size < 2:
        return math.nan, math.nan, math.nan
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    if sd == 0.0:
        return mean, mean, (1.0 if mean == 0.0 else 0.0)
    # lazy, as in wilson_interval: scipy.stats costs ~0.6 s to import
    from scipy import stats
    half = float(stats.t.ppf(0.5 + confidence / 2, values.size - 1)) * sd / math.sqrt(values.size)
    p = float(stats.ttest_1samp(values, 0.0).pvalue)
    return mean - half, mean + half, p


def welch_p(before, after) -> float:
    """Two-sided p of Welch's t test (unequal variances) that two groups of per-model values
    share their mean, e.g. two jobs' models; NaN with fewer than two values a side or no
    spread in either (up to round-off)."""
    x, y = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if len(x) < 2 or len(y) < 2:
        return math.nan

    def flat(v: np.ndarray) -> bool:
        # means of identical values can differ in the last bits: that is no spread either
        return bool(np.ptp(v) <= 1e-12 * max(1.0, float(np.abs(v).max())))
    if flat(x) and flat(y):
        return math.nan
    # lazy, as in wilson_interval: scipy.stats costs ~0.6 s to import
    from scipy.stats import ttest_ind
    with warnings.catch_warnings():
        # a side whose values agree up to round-off makes scipy warn of precision loss in its
        # variance; that variance is zero either way, and the test stands on the other side's
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(ttest_ind(y, x, equal_var=False).pvalue)
