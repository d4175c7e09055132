"""Small exact statistics for accuracy tables: Wilson intervals, the exact McNemar test on
paired outcomes, and Holm's step-down adjustment. Pure Python (no scipy)."""

from __future__ import annotations

import math


def wilson_interval(correct: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (good at 0/n and n/n, unlike the
    normal approximation). n = 0 gives (0, 1)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips (Binomial(n, 1/2)):
    2 * P(X <= min(k, n - k)), capped at 1."""
    if n == 0:
        return 1.0
    low = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2 ** n
    return min(1.0, 2 * tail)


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
