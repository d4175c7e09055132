"""Shared building blocks of the task generators (ced/data/tasks.py): parameter checks that
raise `TaskParamError` naming `data.tasks.<task>.<param>`, neutral filler text, and the layout
of facts, distractors and filler at controlled distances."""

from __future__ import annotations

import random
from typing import Any, Optional

from .registry import TaskParamError

UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"


def check_int(family: str, name: str, value: Any, low: int, optional: bool = False) -> Optional[int]:
    """`value` if it is an integer >= low (or None when optional), else a TaskParamError."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        allowed = f"{'null or ' if optional else ''}an integer >= {low}"
        raise TaskParamError(family, name, f"must be {allowed}, got {value!r}")
    return value


def check_alphabet(family: str, name: str, value: Any) -> str:
    """`value` if it is a non-empty string of distinct ASCII letters/digits."""
    if not (isinstance(value, str) and value and len(set(value)) == len(value)
            and all(c.isascii() and c.isalnum() for c in value)):
        raise TaskParamError(family, name, f"must be a non-empty string of distinct ASCII "
                             f"letters/digits, got {value!r}")
    return value


def check_layout(family: str, distance: Any, length: Any, filler: Any) -> None:
    """Check the shared layout params (distance, length: optional >= 1; filler >= 0)."""
    check_int(family, "distance", distance, 1, optional=True)
    check_int(family, "length", length, 1, optional=True)
    check_int(family, "filler", filler, 0)


def check_min_distance(family: str, distance: Optional[int], minimum: int) -> None:
    """A TaskParamError unless `distance` is None or at least `minimum`."""
    if distance is not None and distance < minimum:
        raise TaskParamError(family, "distance", f"must be >= {minimum} for these params (the "
                             f"fact and everything that must follow it), got {distance}")


# ---- filler and layout --------------------------------------------------------------------
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def filler_text(rng: random.Random, n: int) -> str:
    """Exactly n characters of neutral text: lowercase pseudo-words, each followed by a space."""
    words, size = [], 0
    while size < n:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS)
                       for _ in range(rng.randint(1, 3)))
        words.append(word + " ")
        size += len(word) + 1
    return "".join(words)[: n - 1] + " " if n > 0 else ""


def composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` split into `parts` non-negative integers at random cut points."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _others_per_region(rng: random.Random, n: int, m: int, fixed: list[int], free: list[int],
                       cap: dict[int, int], free_cap: int) -> list[int]:
    """How many of n others go into each of the m + 1 regions: a uniform random merge, then
    moved only as far as the fixed regions' capacities `cap` and the free ones' total
    `free_cap` require."""
    bars = sorted(rng.sample(range(n + m), m))
    counts = [b - a - 1 for a, b in zip([-1] + bars, bars + [n + m])]
    spill = 0
    for j in fixed:
        spill += max(0, counts[j] - cap[j])
        counts[j] = min(counts[j], cap[j])
    while sum(counts[j] for j in free) > free_cap:
        j = max(free, key=lambda j: counts[j])
        counts[j] -= 1
        spill += 1
    for _ in range(spill):
        room = [j for j in fixed if counts[j] < cap[j]]
        if sum(counts[j] for j in free) < free_cap:
            room += free
        counts[rng.choice(room)] += 1
    return counts


def layout(rng: random.Random, family: str, facts: list[str], others: list[str], query: str,
           gaps: list[Optional[int]], length: Optional[int],
           filler_max: int) -> tuple[str, list[int]]:
    """Lay out `facts` (in order), `others` (equal widths, kept in order) and filler, then `query`.

    Region 0 lies before facts[0]; region j >= 1 between facts[j-1] and facts[j] (or the query).
    gaps[j-1] fixes region j's size in tokens (its others plus filler); None leaves it free.
    Free regions share what `length` leaves, or a random [0, filler_max] filler when length is
    None. Others are spread over regions as a uniform random merge, then moved only as far as
    the region sizes require. Returns (context, offset of each fact in context).
    """
    m, n = len(facts), len(others)
    width = len(others[0]) if others else 1
    assert all(len(o) == width for o in others)
    sizes: list[Optional[int]] = [None] + list(gaps)
    fixed = [j for j in range(m + 1) if sizes[j] is not None]
    free = [j for j in range(m + 1) if sizes[j] is None]
    cap = {j: sizes[j] // width for j in fixed}
    core = 1 + sum(map(len, facts)) + len(query) + sum(sizes[j] for j in fixed)  # BOS included
    if length is None:
        free_cap = n
    else:
        need = core + max(0, n - sum(cap.values())) * width
        if length < need:
            raise TaskParamError(family, "length", f"must be >= {need} for these params, got {length}")
        free_cap = (length - core) // width

    counts = _others_per_region(rng, n, m, fixed, free, cap, free_cap)
    free_items = sum(counts[j] for j in free)
    free_fill = rng.randint(0, filler_max) if length is None else length - core - free_items * width
    free_parts = iter(composition(rng, free_fill, free_items + len(free)))
    out: list[str] = []
    offsets: list[int] = []
    items = iter(others)
    for j in range(m + 1):
        if sizes[j] is None:
            parts = [next(free_parts) for _ in range(counts[j] + 1)]
        else:
            parts = composition(rng, sizes[j] - counts[j] * width, counts[j] + 1)
        for k, size in enumerate(parts):
            out.append(filler_text(rng, size))
            if k < counts[j]:
                out.append(next(items))
        if j < m:
            offsets.append(sum(map(len, out)))
            out.append(facts[j])
    out.append(query)
    return "".join(out), offsets


def distinct_strings(rng: random.Random, alphabet: str, size: int, count: int) -> list[str]:
    """`count` distinct random strings of `size` characters from `alphabet`."""
    base = len(alphabet)
    out = []
    for code in rng.sample(range(base ** size), count):
        chars = []
        for _ in range(size):
            code, digit = divmod(code, base)
            chars.append(alphabet[digit])
        out.append("".join(chars))
    return out
