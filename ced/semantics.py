"""The semantics of the CED family in code: replay starts, window lower bounds, which global
entries a query may see, and the top-k selection, plus the rotary embedding. Nothing else
computes these (docs/semantics.md); ced/attention.py and ced/model.py call them.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# The semantics: masks, replay starts, visibility and selection. Nothing else computes these.
# ---------------------------------------------------------------------------------------------


def as_replay_starts(value: None | int | Tensor, batch: int, name: str,
                     device: torch.device | None = None) -> Tensor | None:
    """Normalise a replay-start argument to LongTensor[B, K] (K starts per row) or None.

    Accepts None, an int (same start for every row), LongTensor[B] or LongTensor[B, K].
    A query at position i is truncated at the latest start s <= i (docs/semantics.md 4.4).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected None, an int >= 0 or a LongTensor; got a bool")
    if isinstance(value, int):
        starts = torch.full((batch, 1), value, dtype=torch.long, device=device)
    elif isinstance(value, Tensor):
        if value.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: tensor must be integer-valued; got dtype {value.dtype}")
        starts = value.to(device=device, dtype=torch.long)
        if starts.dim() == 1:
            starts = starts[:, None]
        if starts.dim() != 2 or starts.shape[0] != batch:
            raise ValueError(f"{name}: tensor must have shape [B] or [B, K] with B={batch}; "
                             f"got {tuple(value.shape)}")
    else:
        raise ValueError(f"{name}: expected None, an int >= 0 or a LongTensor; got "
                         f"{type(value).__name__}")
    if starts.numel() and int(starts.min()) < 0:
        raise ValueError(f"{name}: replay starts must be >= 0; got {int(starts.min())}")
    return starts


def window_lower_bound(query_positions: Tensor, window: int | None,
                       replay_starts: Tensor | None) -> Tensor:
    """Earliest window-key position each query may see: max(i - W + 1, s(i), 0).

    query_positions: LongTensor[Tq]; window: W, or None for the whole causal prefix;
    replay_starts: LongTensor[B, K] or None, s(i) = latest start <= i (0 if none).
    Returns LongTensor[B, Tq] (or [1, Tq] without starts). A query sees keys p with
    lower <= p <= i.
    """
    lower = query_positions if window is None else query_positions - (window - 1)
    lower = lower.clamp(min=0) if window is not None else torch.zeros_like(query_positions)
    lower = lower[None, :]
    if replay_starts is not None:
        lower = torch.maximum(lower, latest_start(query_positions, replay_starts))
    return lower


def latest_start(query_positions: Tensor, starts: Tensor) -> Tensor:
    """s(i): the latest start <= i per row and query (0 where none applies).
    query_positions LongTensor[Tq], starts LongTensor[B, K] -> LongTensor[B, Tq]."""
    applies = starts[:, None, :] <= query_positions[None, :, None]              # [B, Tq, K]
    return torch.where(applies, starts[:, None, :], 0).amax(dim=-1)


def merge_starts(*starts: Tensor | None) -> Tensor | None:
    """Several start tensors [B, K_i] (None: none) as one [B, sum K_i]: a query is truncated at
    the latest start of any of them (replay starts and document starts alike)."""
    given = [s for s in starts if s is not None]
    if not given:
        return None
    return given[0] if len(given) == 1 else torch.cat(given, dim=1)


def first_visible_entry(query_positions: Tensor, compress_ratio: int,
                        document_starts: Tensor | None) -> Tensor | None:
    """Document mask of the global read: the first entry each query may read, ceil(d(i) / m)
    with d(i) the latest document start <= i (an entry visible to query i must also begin at
    or after d(i); an entry that straddles d(i) is complete for no query of either document).
    LongTensor[B, Tq], or None without document starts (every entry from 0)."""
    if document_starts is None:
        return None
    d = latest_start(query_positions, document_starts)
    return torch.div(d + compress_ratio - 1, compress_ratio, rounding_mode="floor")


def visible_entries(query_positions: Tensor, compress_ratio: int) -> Tensor:
    """Number of global entries visible to each query: only complete blocks,
    entry j visible to query i iff (j + 1) * m <= i + 1. LongTensor[Tq]."""
    return torch.div(query_positions + 1, compress_ratio, rounding_mode="floor")


# Significant bits an indexer score keeps before the top-k, per dtype: about half the
# mantissa, far coarser than the few ulps by which two kernels (a parallel forward against one
# decode step, a batch of queries against one) compute the same score, far finer than any
# difference a trained indexer means.
SCORE_BITS = {torch.float64: 26, torch.float32: 11, torch.float16: 5, torch.bfloat16: 4}


def round_scores(scores: Tensor, visible: Tensor) -> Tensor:
    """Indexer scores rounded, per query, to SCORE_BITS significant bits relative to the
    largest visible |score|: the same (query, entry) gets the same rounded score whichever
    kernel computed it (barring a value within kernel error of a grid boundary), so equal
    scores stay equal and the tie rule decides them identically on every path.

    scores [B, Tq, E]; visible bool [Tq, E] or [B, Tq, E]. The grid is a power of two (from frexp) and the
    division by it exact, so rounding adds no error of its own; the rounding is half-to-even."""
    if scores.shape[-1] == 0:
        return scores.detach()
    levels, grid = _score_levels(scores, visible)
    return levels * grid


def _score_levels(scores: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
    """`round_scores` as (levels, grid): integer-valued levels round(score / grid), at most
    2 ** SCORE_BITS in magnitude on visible entries, and the per-query grid [B, Tq, 1]."""
    bits = SCORE_BITS.get(scores.dtype, 11)
    magnitude = torch.where(visible, scores.detach().abs(), 0.0).amax(-1, keepdim=True)
    _, exponent = torch.frexp(magnitude)           # magnitude < 2 ** exponent
    grid = torch.ldexp(torch.ones_like(magnitude), exponent - bits)
    return torch.round(scores.detach() / grid), grid


def entry_visibility(n_entries: int, n_visible: Tensor, first: Tensor | None) -> Tensor:
    """Which of `n_entries` entries each query may read: j < n_visible[i] and, under a document
    mask, j >= first[b, i]. BoolTensor[Tq, E], or [B, Tq, E] when `first` [B, Tq] is given."""
    entry = torch.arange(n_entries, device=n_visible.device)
    visible = entry[None, :] < n_visible[:, None]                             # [Tq, E]
    if first is not None:
        visible = visible[None] & (entry[None, None, :] >= first[:, :, None])
    return visible


def select_entries(scores: Tensor, n_visible: Tensor, k: int,
                   first: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k visible entries per query; among equal scores the lower entry index wins.

    Scores are compared after `round_scores` (batch-invariant selection: a near-tie that two
    kernels would break differently in the last bit is an exact tie, decided by the index).
    scores: [B, Tq, E]; n_visible: LongTensor[Tq]; first: LongTensor[B, Tq] or None, the
    document mask's first readable entry (`first_visible_entry`). Returns (index, valid), both
    [B, Tq, min(k, E)]; slots with valid=False are padding (fewer than k visible) and must be
    masked by the reader.
    """
    n_entries = scores.shape[-1]
    k = min(k, n_entries)
    visible = entry_visibility(n_entries, n_visible, first)
    # One distinct int64 key per entry, so that a (partial, unstable) top-k gives the order a
    # stable sort of the rounded scores would: the higher level first, among equal levels the
    # lower index; every invisible entry after every visible one, again lower index first.
    # |level| <= 2 ** SCORE_BITS (26 in float64) and E < 2 ** 30 keep the keys inside int64.
    if n_entries:
        levels, _ = _score_levels(scores, visible)
        rank = n_entries - 1 - torch.arange(n_entries, device=scores.device)
        levels = torch.where(visible, levels, 0.0).to(torch.int64)
        key = torch.where(visible, levels * n_entries + rank,
                          torch.iinfo(torch.int64).min + rank)
        index = torch.topk(key, k, dim=-1).indices
    else:
        index = torch.zeros(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    count = n_visible[None, :] if first is None else (n_visible[None, :] - first).clamp(min=0)
    valid = torch.arange(k, device=scores.device)[None, None, :] < count[..., None]  # [B|1, Tq, k]
    return index, valid.expand(scores.shape[0], -1, -1)


def rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding of x [..., T, Dh] at integer positions [T] (angles in float64): each
    pair (x[j], x[j + Dh/2]) is rotated by positions * theta^(-2j/Dh)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return _Rotate.apply(x, angle.cos().to(x.dtype), angle.sin().to(x.dtype))


class _Rotate(torch.autograd.Function):
    """x [..., T, Dh] rotated pairwise by cos, sin [T, Dh/2]. Written as four in-place
    products into one output (no slices, negation or concatenation for autograd to undo);
    the backward is the inverse rotation (sin -> -sin) of the gradient, since a rotation's
    transpose is its inverse."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first)
    torch.mul(x2, cos, out=second)
    first.addcmul_(x2, sin, value=1 if inverse else -1)    # x1 cos -/+ x2 sin
    second.addcmul_(x1, sin, value=-1 if inverse else 1)   # x2 cos +/- x1 sin
    return out
