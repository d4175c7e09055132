"""The CED model family (dense, swa, yoco, ced) in one file.

One code path serves training, parallel evaluation and incremental inference:
`CEDModel.run_layers` processes a run of new positions through a run of layers, reading and
(optionally) extending per-layer window caches and per-source global KV states. The parallel
forward calls it once over all positions with empty states; the inference engine calls it with
its cache. Attention itself is `attend`; which window keys a query may see is
`window_lower_bound`; which global entries, `visible_entries` and `select_entries`.
Semantics: docs/semantics.md.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import (LayerSpec, ModelConfig, build_plan, executed_ff_dim, global_read_is_masked,
                     keep_from)
from .quant import KVStorage, store

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


# ---------------------------------------------------------------------------------------------
# State: per-layer window KV and per-source global KV. Empty in a parallel forward; the engine's
# cache in incremental inference.
# ---------------------------------------------------------------------------------------------


@dataclass
class WindowKV:
    """Window keys/values one layer keeps for later queries: k, v [B, H, S, Dh] at ascending
    positions [S]. Positions absent here (evicted, or never computed: bounded replay) are simply
    not visible, which is how a replay start acts inside the engine."""

    k: Tensor
    v: Tensor
    positions: Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, like: Tensor) -> "WindowKV":
        kv = like.new_zeros(batch, heads, 0, head_dim)
        return cls(kv, kv.clone(), torch.zeros(0, dtype=torch.long, device=like.device))


@dataclass
class SourceKV:
    """One global KV: complete entries k, v [B, G, E, Dh] (RoPE at j*m; G K/V heads,
    ModelConfig.n_global_kv_heads), indexer keys [B, E, Di], and the projected tokens of the
    incomplete block, pending_tokens [B, p, 2 G Dh] and pending_gates [B, p, G], not yet
    visible to anyone."""

    k: Tensor
    v: Tensor
    index_keys: Tensor | None
    pending_tokens: Tensor
    pending_gates: Tensor
    compress_ratio: int

    @classmethod
    def empty(cls, cfg: ModelConfig, compress_ratio: int, batch: int, like: Tensor) -> "SourceKV":
        g, dh = cfg.n_global_kv_heads, cfg.head_dim
        index_keys = like.new_zeros(batch, 0, cfg.indexer_dim) if cfg.topk is not None else None
        return cls(like.new_zeros(batch, g, 0, dh), like.new_zeros(batch, g, 0, dh), index_keys,
                   like.new_zeros(batch, 0, 2 * g * dh), like.new_zeros(batch, 0, g),
                   compress_ratio)

    @property
    def n_entries(self) -> int:
        return self.k.shape[2]

    @property
    def next_position(self) -> int:
        """First token position this source has not consumed yet."""
        return self.n_entries * self.compress_ratio + self.pending_tokens.shape[1]


@dataclass
class Selection:
    """Top-k entries chosen for the current queries: index/valid [B, Tq, k]; scores [B, Tq, k]
    are the indexer's (with grad) for the KL loss. With a dense read, index is None and scores
    cover every entry [B, Tq, E]."""

    index: Tensor | None
    valid: Tensor | None
    scores: Tensor | None


@dataclass
class ForwardContext:
    """Per-call settings and scratch shared by the layers of one forward/engine call."""

    keep_windows: bool = False
    dense_global_read: bool = False
    want_aux: bool = False
    selections: dict[int, Selection] = field(default_factory=dict)
    indexer_kl: list[Tensor] = field(default_factory=list)
    # When a dict, each layer's output hidden state [B, T, D] is recorded under its index
    # (evaluation: per-layer divergence of a bounded replay).
    hidden: dict[int, Tensor] | None = None
    # Document mask (training on packed rows): LongTensor[B, K] of positions where documents
    # start; None: one document per row. See CEDModel.forward.
    document_starts: Tensor | None = None


# ---------------------------------------------------------------------------------------------
# The attention function: one softmax over window keys, selected global entries and a sink.
# ---------------------------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """rows[index] with embedding's forward kernel and an index_add backward: on CPU the
    fastest pairing measured (about 10% of a ced training step over index_select)."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.n_rows = rows.shape[0]
        return F.embedding(index, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        grad_rows = grad.new_zeros(ctx.n_rows, grad.shape[-1])
        grad_rows.index_add_(0, index, grad.reshape(-1, grad.shape[-1]))
        return grad_rows, None


def _gather_entries(entries: Tensor, index: Tensor) -> Tensor:
    """entries [B, G, E, Dh], index [B, C, k] -> [B, G, C, k, Dh], head-major so that the reads
    in `attend` are plain batched matmuls (an einsum over a [B, C, k, H, Dh] layout copies in
    its backward and ran at half the speed)."""
    b, h, e, dh = entries.shape
    offset = (torch.arange(b * h, device=index.device) * e).view(b, h, 1, 1)
    picked = _GatherRows.apply(entries.reshape(b * h * e, dh),
                               (index[:, None] + offset).reshape(-1))
    return picked.view(b, h, *index.shape[1:], dh)


def _chosen_mask(index: Tensor, valid: Tensor, n_read: int) -> Tensor:
    """Selected entries as a mask: index/valid [B, C, k] -> BoolTensor[B, C, n_read]. Padding
    slots (valid False) go to a spare column that is cut off, so they never mark an entry."""
    spare = torch.full_like(index, n_read)
    target = torch.where(valid, index, spare).clamp_max(n_read)
    mask = torch.zeros(*index.shape[:2], n_read + 1, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, target, True)[..., :n_read]


# ---------------------------------------------------------------------------------------------
# Kernels of the joint softmax read. `attend` decides which keys each query sees; a kernel only
# computes softmax([q.k for every key set] ++ [sink]) and the matching value reads. Two kernels
# compute the same quantity: the reference (plain matmuls, softmax over concatenated logits; any
# device and dtype) and, on CPU, torch's fused flash-attention kernel called once per key set
# with the partial reads merged through their log-sum-exps (a gathered top-k set, whose keys
# differ per query, is one more partial read there, by grouped matmuls). The choice is speed
# only (about 2x on the attention of a training step).
# ---------------------------------------------------------------------------------------------

ATTENTION_KERNELS = ("auto", "reference")
_attention_kernel = "auto"
try:
    _FLASH_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
except (AttributeError, RuntimeError):          # a torch build without the CPU kernel
    _FLASH_FORWARD = _FLASH_BACKWARD = None
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def set_attention_kernel(name: str) -> str:
    """Choose the kernel of every later `attend` call; returns the previous choice.
    "auto": the fused CPU flash kernel where it applies (CPU tensors of fp32/fp64/bf16; a
    gathered top-k set only in fp32/fp64 and for more than one query, see `_flash_applies`),
    else the reference; "reference": always the reference. Both give the
    same result up to floating-point rounding (tests/unit/test_attention_kernels.py)."""
    global _attention_kernel
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel: must be one of {ATTENTION_KERNELS}; got {name!r}")
    previous, _attention_kernel = _attention_kernel, name
    return previous


def current_attention_kernel() -> str:
    """The kernel `attend` uses now ("auto" or "reference"), for run records."""
    return _attention_kernel


@contextmanager
def attention_kernel(name: str):
    """`with attention_kernel("reference"): ...` runs the block with that kernel."""
    previous = set_attention_kernel(name)
    try:
        yield
    finally:
        set_attention_kernel(previous)


@dataclass
class KeySet:
    """One set of keys a block of queries reads: k, v [B, H, S, Dh], or with gathered=True the
    per-query rows of a top-k gather [B, G, C, k, Dh] (G K/V heads); hidden: BoolTensor
    broadcastable to [B, H, C, S] (or [B, H, C, k]), True where a query may not read the key."""

    k: Tensor
    v: Tensor
    hidden: Tensor
    gathered: bool = False
    # True when `hidden` is exactly "key j > query i" on a square block that starts at key 0:
    # the fused kernel then masks causally itself and skips the blocks above the diagonal.
    causal: bool = False

    @property
    def width(self) -> int:
        return self.k.shape[-2]


def _gathered_scores(q: Tensor, k: Tensor) -> Tensor:
    """q [B, H, C, Dh] against each query's gathered rows k [B, G, C, k, Dh] -> [B, H, C, k].
    Query head i reads K/V head i // (H / G): per query and K/V head one (H/G x Dh) @ (Dh x k)
    product, so a multi-query entry (G = 1) is copied once and read by every head."""
    b, h, c, dh = q.shape
    g = k.shape[1]
    grouped = q.view(b, g, h // g, c, dh).transpose(2, 3)            # [B, G, C, H/G, Dh]
    scores = torch.matmul(grouped, k.transpose(-1, -2))               # [B, G, C, H/G, k]
    return scores.transpose(2, 3).reshape(b, h, c, k.shape[-2])


def _gathered_values(p: Tensor, v: Tensor) -> Tensor:
    """Probabilities p [B, H, C, k] over gathered rows v [B, G, C, k, Dh] -> [B, H, C, Dh]."""
    b, h, c, n = p.shape
    g = v.shape[1]
    grouped = p.view(b, g, h // g, c, n).transpose(2, 3)              # [B, G, C, H/G, k]
    return torch.matmul(grouped, v).transpose(2, 3).reshape(b, h, c, v.shape[-1])


def _per_query_head(entries: Tensor, heads: int) -> Tensor:
    """Global K or V [B, G, E, Dh] as [B, heads, E, Dh], query head i on K/V head
    i // (heads / G): the tensor itself when G = heads, a stride-0 view when G = 1."""
    b, g, e, dh = entries.shape
    if g == heads:
        return entries
    return entries[:, :, None].expand(b, g, heads // g, e, dh).reshape(b, heads, e, dh)


def _read_reference(q: Tensor, key_sets: list[KeySet], sink: Tensor | None
                    ) -> tuple[Tensor, list[Tensor]]:
    """The joint softmax read with plain matmuls. q [B, H, C, Dh] (already scaled).
    Returns the output [B, H, C, Dh] and the probabilities over each key set, [B, H, C, S]."""
    b, h, c, _ = q.shape
    logits = []
    for ks in key_sets:
        if ks.gathered:
            scores = _gathered_scores(q, ks.k)
        else:
            scores = torch.matmul(q, ks.k.transpose(-1, -2))
        logits.append(scores.masked_fill(ks.hidden, -torch.inf))
    if sink is not None:
        logits.append(sink.view(1, h, 1, 1).to(q.dtype).expand(b, h, c, 1))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out, at, per_set = None, 0, []
    for ks in key_sets:
        p = probs[..., at:at + ks.width]
        at += ks.width
        read = _gathered_values(p, ks.v) if ks.gathered else torch.matmul(p, ks.v)
        out = read if out is None else out + read
        per_set.append(p)
    return out, per_set


@dataclass(frozen=True)
class _FlashSet:
    """One key set of one query block as the fused read takes it: keys and values are rows
    start:stop of parents[parent] and parents[parent + 1]; mask: the additive float mask
    (-inf where hidden) or None when the kernel masks causally itself; empty: BoolTensor of
    the query rows that see none of the set's keys (the kernel reports lse 0 there), or None.
    gathered: the parents are this block's gathered top-k rows [B, G, C, k, Dh] (whole), read
    with the grouped matmuls of the reference instead of the fused kernel."""

    parent: int
    start: int
    stop: int
    mask: Tensor | None
    empty: Tensor | None
    causal: bool
    gathered: bool = False


def _flash_set(ks: KeySet, parent: int, start: int, q: Tensor) -> _FlashSet:
    """`ks` as the fused read takes it: its keys are rows start:start + width of parents[parent]
    (and its values of parents[parent + 1]); its hidden mask made additive in q's dtype."""
    mask = None if ks.causal else torch.zeros(ks.hidden.shape, dtype=q.dtype,
                                              device=q.device).masked_fill_(ks.hidden, -torch.inf)
    return _FlashSet(parent, start, start + ks.width, mask,
                     None if ks.causal else ks.hidden.all(-1), ks.causal, ks.gathered)


def _flash_kv(parents: tuple, fs: _FlashSet) -> tuple[Tensor, Tensor]:
    if fs.gathered:
        return parents[fs.parent], parents[fs.parent + 1]
    return (parents[fs.parent][:, :, fs.start:fs.stop],
            parents[fs.parent + 1][:, :, fs.start:fs.stop])


def _gathered_read(qc: Tensor, k: Tensor, v: Tensor, fs: _FlashSet
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """A gathered key set's normalised read and log-sum-exp, as the fused kernel returns them
    for a plain set, and its own probabilities (kept for the backward): qc [B, H, C, Dh], rows
    k, v [B, G, C, k, Dh] -> [B, H, C, Dh], [B, H, C] (-inf and a zero read on rows that see
    none of the set's keys), [B, H, C, k]."""
    scores = _gathered_scores(qc, k) + fs.mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if fs.empty is not None:
        probs = probs.masked_fill(fs.empty[..., None], 0.0)
    return _gathered_values(probs, v), lse, probs


def _grouped_outer(a: Tensor, x: Tensor, g: int) -> Tensor:
    """sum over the query heads of each K/V head group of a[h, c, j] x[h, c, d]:
    a [B, H, C, k], x [B, H, C, Dh] -> [B, G, C, k, Dh] (the gradient of gathered rows)."""
    b, h, c, n = a.shape
    grouped_a = a.view(b, g, h // g, c, n).permute(0, 1, 3, 4, 2)         # [B, G, C, k, H/G]
    grouped_x = x.view(b, g, h // g, c, x.shape[-1]).transpose(2, 3)       # [B, G, C, H/G, Dh]
    return torch.matmul(grouped_a, grouped_x)


def _gathered_backward(g: Tensor, qc: Tensor, k: Tensor, v: Tensor, oc: Tensor, tc: Tensor,
                       own: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The joint softmax's gradient through a gathered set, given the joint output oc and
    log-sum-exp tc of the block (as `_FLASH_BACKWARD` takes them for a plain set) and the set's
    own (probabilities, lse) from the forward: the joint probabilities are
    p = p_own * exp(lse_own - L), and ds = p * (g.v - rowsum(g * out)). Returns dq
    [B, H, C, Dh] and the rows' dk, dv [B, G, C, k, Dh]."""
    own_probs, own_lse = own
    scale = torch.exp(own_lse - tc).nan_to_num(0.0)     # 0 on rows that see none of the set
    probs = own_probs * scale[..., None].to(qc.dtype)
    row = (g * oc).sum(-1, keepdim=True)
    ds = probs * (_gathered_scores(g, v) - row)
    heads = k.shape[1]
    return _gathered_values(ds, k), _grouped_outer(ds, qc, heads), _grouped_outer(probs, g, heads)


def _sink_lse(sink: Tensor | None, like: Tensor) -> Tensor:
    """The sink's logit as a log-sum-exp term shaped like a set's lse [B, H, C] (-inf: none)."""
    if sink is None:
        return torch.full_like(like, -torch.inf)
    return sink.to(like.dtype).view(1, -1, 1).expand_as(like)


class _FlashRead(torch.autograd.Function):
    """softmax over several key sets and a sink, one fused flash call per set, for every query
    block of an `attend` call in one autograd node.

    Per block, each call returns its set's normalised read o_i and log-sum-exp l_i; the joint
    read is sum_i exp(l_i - L) o_i with L = logsumexp(l_1, .., l_n, sink). The backward calls
    the fused backward per set with the joint output and L in place of the set's own: the kernel
    then recomputes the joint probabilities exp(s - L) and its row term rowsum(grad * out) is
    the joint one, which is exactly the gradient of the joint softmax (no term is missing).
    A gathered top-k set (`_FlashSet.gathered`: its parents are the block's own rows) takes the
    same two steps by grouped matmuls (`_gathered_read`, `_gathered_backward`).

    Why one node for all blocks: with a node per block, autograd would back-propagate each
    block's slice of q and of the shared K/V as a zero tensor the size of the whole parent,
    filled, copied into and summed, per block (quadratic in the number of blocks); here each
    block's gradient is written into (q) or added into (K, V) its slice of one buffer.
    plan: per block (c0, c1, sets), the queries c0:c1 and their `_FlashSet`s (none: the block
    reads nothing, its output is 0). Returns the output [B, H, T, Dh] and L [B, H, T]."""

    @staticmethod
    def forward(ctx, q, sink, plan, *parents):
        outs, totals = [], []
        own = {}      # a gathered set's own probabilities and lse, by its first parent
        for c0, c1, sets in plan:
            qc = q[:, :, c0:c1]
            reads, lses = [], []
            for fs in sets:
                if fs.gathered:
                    o, lse, probs = _gathered_read(qc, *_flash_kv(parents, fs), fs)
                    own[fs.parent] = (probs, lse)
                else:
                    o, lse = _FLASH_FORWARD(qc, *_flash_kv(parents, fs), 0.0, fs.causal,
                                            attn_mask=fs.mask, scale=1.0)
                if fs.empty is not None:
                    lse = lse.masked_fill(fs.empty, -torch.inf)   # the kernel says 0 there
                reads.append(o)
                lses.append(lse)
            if not sets:
                outs.append(qc.new_zeros(qc.shape))
                lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
                totals.append(_sink_lse(sink, qc.new_zeros(qc.shape[:3], dtype=lse_dtype)))
                continue
            if sink is not None:
                lses.append(_sink_lse(sink, lses[0]))
            total = torch.logsumexp(torch.stack(lses), dim=0)
            out = reads[0] * torch.exp(lses[0] - total)[..., None].to(q.dtype)
            for o, lse in zip(reads[1:], lses[1:]):
                out = out + o * torch.exp(lse - total)[..., None].to(q.dtype)
            outs.append(out)
            totals.append(total)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        total = totals[0] if len(totals) == 1 else torch.cat(totals, dim=2)
        ctx.plan, ctx.own = plan, own
        ctx.save_for_backward(q, sink, out, total, *parents)
        ctx.mark_non_differentiable(total)
        return out, total

    @staticmethod
    def backward(ctx, grad, _grad_total):
        q, sink, out, total, *parents = ctx.saved_tensors
        wants = ctx.needs_input_grad
        grad_q = torch.zeros_like(q) if wants[0] else None
        # a gathered set's rows belong to one block: their gradient is assigned, not added
        gathered = {i for _, _, sets in ctx.plan for fs in sets if fs.gathered
                    for i in (fs.parent, fs.parent + 1)}
        grad_parents = [torch.zeros_like(p) if p is not None and wants[3 + i]
                        and i not in gathered else None for i, p in enumerate(parents)]
        grad_sink = torch.zeros_like(sink, dtype=total.dtype) \
            if sink is not None and wants[1] else None
        # last block first, the order in which autograd ran a node per block
        for c0, c1, sets in reversed(ctx.plan):
            if not sets:
                continue
            g = grad[:, :, c0:c1].contiguous()
            qc, oc, tc = q[:, :, c0:c1], out[:, :, c0:c1].contiguous(), total[:, :, c0:c1]
            dq = None
            for fs in sets:
                if fs.gathered:
                    dq_set, dk, dv = _gathered_backward(g, qc, *_flash_kv(parents, fs), oc, tc,
                                                        ctx.own[fs.parent])
                    for i, d in ((fs.parent, dk), (fs.parent + 1, dv)):
                        if wants[3 + i]:
                            grad_parents[i] = d
                else:
                    dq_set, dk, dv = _FLASH_BACKWARD(g, qc, *_flash_kv(parents, fs), oc, tc,
                                                     0.0, fs.causal, attn_mask=fs.mask,
                                                     scale=1.0)
                    for i, d in ((fs.parent, dk), (fs.parent + 1, dv)):
                        if grad_parents[i] is not None:
                            grad_parents[i][:, :, fs.start:fs.stop] += d
                dq = dq_set if dq is None else dq + dq_set
            if grad_q is not None:
                grad_q[:, :, c0:c1] = dq
            if grad_sink is not None:
                # d out / d sink = -out * p_sink per query row
                p_sink = torch.exp(sink.to(tc.dtype).view(1, -1, 1) - tc)
                grad_sink += -((g * oc).sum(-1).to(tc.dtype) * p_sink).sum((0, 2))
        if grad_sink is not None:
            grad_sink = grad_sink.to(sink.dtype)
        return grad_q, grad_sink, None, *grad_parents


def _fused_kernel_takes(q: Tensor) -> bool:
    """Whether the fused kernel is chosen and can run for queries like q (CPU, its dtypes)."""
    return (_attention_kernel == "auto" and _FLASH_FORWARD is not None
            and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES)


def _flash_applies(q: Tensor, key_sets: list[KeySet]) -> bool:
    """Whether `_FlashRead` takes these key sets: the fused kernel for plain sets, and its
    grouped matmuls for gathered ones, in float32/float64 (in bf16 the reference's softmax over
    the concatenated logits stays the one place that rounds them) and for more than one query
    (one decode query: the reference's few small matmuls cost less than the node). In a
    training forward the node saves the per-block slice gradients of q and of the window K/V.
    Timings of both choices: benchmarks/README.md, "Gathered reads inside the fused node:
    decode and training timings"."""
    return _fused_kernel_takes(q) and all(
        ks.k.dtype == q.dtype and ks.v.dtype == q.dtype
        and (not ks.gathered or (q.dtype in (torch.float32, torch.float64) and q.shape[2] > 1))
        for ks in key_sets)


def _set_probs(q: Tensor, ks: KeySet, total: Tensor) -> Tensor:
    """The joint softmax's probabilities over one key set [B, H, C, S] (a gathered set: over
    its slots, [B, H, C, k]), recomputed from the joint log-sum-exp `total` [B, H, C]
    (detached)."""
    with torch.no_grad():
        scores = (_gathered_scores(q, ks.k) if ks.gathered
                  else torch.matmul(q, ks.k.transpose(-1, -2)))
        scores = scores.masked_fill(ks.hidden, -torch.inf)
        return torch.exp(scores - total[..., None].to(q.dtype))


def _read_flash(q: Tensor, key_sets: list[KeySet], sink: Tensor | None, probs_of: int | None
                ) -> tuple[Tensor, list[Tensor | None]]:
    """The joint softmax read through `_FlashRead` as one block; the probabilities of key set
    `probs_of` only (recomputed, detached), the others None. A call with nothing to read
    (every set empty) is a plan block without sets: output 0."""
    used = [ks for ks in key_sets if ks.width > 0]
    sets = tuple(_flash_set(ks, 2 * i, 0, q) for i, ks in enumerate(used))
    out, total = _FlashRead.apply(q, sink, [(0, q.shape[2], sets)],
                                  *[t for ks in used for t in (ks.k, ks.v)])
    per_set: list[Tensor | None] = [None] * len(key_sets)
    if probs_of is not None:
        per_set[probs_of] = _set_probs(q, key_sets[probs_of], total)
    return out, per_set


def joint_read(q: Tensor, key_sets: list[KeySet], sink: Tensor | None,
               probs_of: int | None = None) -> tuple[Tensor, list[Tensor | None]]:
    """softmax over the logits q.k of every key set plus the sink logit (per head, it only
    enters the denominator), and the matching read of the values. q [B, H, C, Dh], already
    scaled. Returns the output [B, H, C, Dh] and the probabilities over each key set
    ([B, H, C, S], detached where the fused kernel ran; only `probs_of`'s is guaranteed)."""
    if _flash_applies(q, key_sets):
        return _read_flash(q, key_sets, sink, probs_of)
    return _read_reference(q, key_sets, sink)


def _plain_causal(q: Tensor, query_positions: Tensor, lower: Tensor | None,
                  window: WindowKV | None, source: SourceKV | None, sparse: bool,
                  first_entry: Tensor | None) -> bool:
    """Whether a whole `attend` call is one plain causal read the fused kernel can mask by
    itself (query i sees keys 0..i of one key set): a full-causal window from position 0 with
    no replay or document start, or a ratio-1 dense global read with no document mask. Such a
    call then runs as one block: per-block masks would make the kernel score every key it
    hides, about twice the work of its causal loop at long T."""
    if not _fused_kernel_takes(q):
        return False
    n, start = len(query_positions), int(query_positions[0]) if len(query_positions) else -1
    if start != 0:
        return False
    if window is not None and source is None:
        return (window.positions.numel() == n and window.k.dtype == q.dtype
                and not bool(lower.any()))
    if window is None and source is not None:
        return (not sparse and first_entry is None and source.compress_ratio == 1
                and source.n_entries == n and source.k.dtype == q.dtype)
    return False


def attend(q: Tensor, query_positions: Tensor, lower: Tensor | None, window: WindowKV | None,
           source: SourceKV | None, selection: Selection | None, sink: Tensor | None,
           block: int, want_global_probs: bool = False,
           global_read: str = "auto", first_entry: Tensor | None = None
           ) -> tuple[Tensor, Tensor | None]:
    """Attention of queries over their window keys and global entries, in query blocks.

    q: [B, H, Tq, Dh] (rotated) at query_positions [Tq]; lower: [B|1, Tq] from
    `window_lower_bound`; window: keys at ascending positions, or None (no window keys);
    source: the global KV read, or None; selection: top-k entries, or None/index None to read
    every visible entry; sink: [H] logits that only enter the denominator; global_read:
    how a top-k read runs per block (`ced.config.global_read_is_masked`: a gather of the k
    entries, or one matmul over the visible entries with the unselected ones masked; the same
    softmax over the same entries either way); first_entry: [B, Tq] or None, the document
    mask of a dense read (`first_visible_entry`; a top-k selection already respects it).
    Returns the output [B, H, Tq, Dh] and, if asked, the attention mass on global entries
    summed over heads, [B, Tq, k] (selected read) or [B, Tq, E] (dense read), detached.

    Why this stays one function, over 60 lines: it is the one readable place for the visibility
    rules (which window keys a query sees, which global entries are visible and selected, how
    the three read forms mask them). Each block's rules become KeySets; the one softmax over
    all of them and the sink is taken by the fused CPU kernel for every block at once
    (`_FlashRead`) or by `joint_read` per block (the reference: bf16 gathers, other devices): the
    same quantity. Training, parallel evaluation and the engine all run through it.
    """
    b, h, n_queries, dh = q.shape
    q = q * (1.0 / math.sqrt(dh))      # scaled once here rather than every block's logits
    sparse = selection is not None and selection.index is not None
    n_visible = visible_entries(query_positions, source.compress_ratio) if source else None
    causal = _plain_causal(q, query_positions, lower, window, source, sparse, first_entry)
    if causal:
        block = n_queries
    # Global K/V per query head for the plain and masked reads, made when a block first needs
    # them (a gathered read copies the K/V heads' rows and groups the query heads itself).
    entry_k = entry_v = None
    # per block: (c0, c1, key sets, where each set's keys start in window.k / entry_k as
    # (parent, start) for the fused read (a gathered set: its own rows, parents 4 + 2i, 5 + 2i,
    # kept in `gathered_rows`), the selection, masked)
    blocks, gathered_rows = [], []
    for c0 in range(0, n_queries, block):
        c1 = min(c0 + block, n_queries)
        qpos = query_positions[c0:c1]
        key_sets: list[KeySet] = []
        spans: list[tuple[int, int] | None] = []
        if window is not None:
            low = lower[:, c0:c1]
            first = int(torch.searchsorted(window.positions, low.min()))
            last = int(torch.searchsorted(window.positions, qpos[-1], right=True))
            kpos = window.positions[first:last]
            hidden = (kpos[None, None, :] < low[:, :, None]) | (kpos[None, None, :] > qpos[None, :, None])
            key_sets.append(KeySet(window.k[:, :, first:last], window.v[:, :, first:last],
                                   hidden[:, None], causal=causal))
            spans.append((0, first))
        masked, idx = False, None
        if source is not None:
            n_read = int(n_visible[c1 - 1])
            if sparse:
                idx, valid = selection.index[:, c0:c1], selection.valid[:, c0:c1]
                masked = global_read_is_masked(global_read, c1 - c0, n_read, idx.shape[-1],
                                               h // source.k.shape[1])
            if sparse and not masked:
                rows = (_gather_entries(source.k, idx), _gather_entries(source.v, idx))
                key_sets.append(KeySet(*rows, ~valid[:, None], gathered=True))
                spans.append((4 + len(gathered_rows), 0))
                gathered_rows.extend(rows)
            else:
                if masked:
                    hidden = ~_chosen_mask(idx, valid, n_read)[:, None]
                else:
                    entry = torch.arange(n_read, device=q.device)
                    hidden = (entry[None, :] >= n_visible[c0:c1, None])[None, None]
                    if first_entry is not None:
                        hidden = hidden | (entry < first_entry[:, c0:c1, None])[:, None]
                if entry_k is None:
                    entry_k, entry_v = _per_query_head(source.k, h), _per_query_head(source.v, h)
                key_sets.append(KeySet(entry_k[:, :, :n_read], entry_v[:, :, :n_read], hidden,
                                       causal=causal))
                spans.append((2, 0))
        blocks.append((c0, c1, key_sets, spans, idx, masked))

    wants_mass = want_global_probs and source is not None
    global_probs = []
    if all(_flash_applies(q, key_sets) for _, _, key_sets, *_ in blocks):
        # every block through the fused kernel, in one autograd node (see _FlashRead)
        plan = [(c0, c1, tuple(_flash_set(ks, *span, q) for ks, span in zip(key_sets, spans)
                               if ks.width > 0)) for c0, c1, key_sets, spans, *_ in blocks]
        parents = (window.k if window is not None else None,
                   window.v if window is not None else None,
                   entry_k, entry_v, *gathered_rows)
        result, total = _FlashRead.apply(q, sink, plan, *parents)
        if wants_mass:
            probs = [_set_probs(q[:, :, c0:c1], key_sets[-1], total[:, :, c0:c1])
                     for c0, c1, key_sets, *_ in blocks]
    else:
        outputs, probs = [], []
        for c0, c1, key_sets, *_ in blocks:
            qc = q[:, :, c0:c1]
            out, block_probs = joint_read(qc, key_sets, sink,
                                          len(key_sets) - 1 if wants_mass else None)
            outputs.append(out if out is not None else qc.new_zeros(b, h, c1 - c0, dh))
            probs.append(block_probs[-1] if wants_mass else None)
        result = torch.cat(outputs, dim=2)
    if wants_mass:
        for (c0, c1, key_sets, _, idx, masked), p in zip(blocks, probs):
            mass = p.detach().sum(dim=1)
            width = key_sets[-1].width
            if sparse and masked:     # back to the selection's slots [B, C, k]
                mass = torch.gather(F.pad(mass, (0, source.n_entries - width)), -1, idx)
            elif not sparse:
                mass = F.pad(mass, (0, source.n_entries - width))
            global_probs.append(mass)
    return result, (torch.cat(global_probs, dim=1) if global_probs else None)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GlobalKVSource(nn.Module):
    """Produces one global KV from a hidden state: per-token K/V projection (G = global_kv_heads
    heads), softmax-gated pooling over blocks of `compress_ratio` tokens (a gate per K/V head),
    RoPE at the block's first position, and indexer keys projected from the pooled entry
    (docs/semantics.md section 3.1). Entries and indexer keys are stored here, so here they
    pass through their storage formats (3.6)."""

    def __init__(self, cfg: ModelConfig, compress_ratio: int):
        super().__init__()
        self.cfg, self.ratio = cfg, compress_ratio
        self.storage = KVStorage.from_config(cfg)
        self.heads = cfg.n_global_kv_heads
        self.entry_width = 2 * self.heads * cfg.head_dim       # K and V rows of one entry
        self.kv = nn.Linear(cfg.d_model, self.entry_width, bias=False)
        if compress_ratio > 1:
            self.gate = nn.Linear(cfg.d_model, self.heads, bias=False)
            self.gate_bias = nn.Parameter(torch.zeros(compress_ratio, self.heads))
        # The indexer is trained by its KL loss alone, so its keys read a detached entry.
        self.index_key = (nn.Linear(self.entry_width, cfg.indexer_dim, bias=False)
                          if cfg.topk is not None else None)

    def append(self, state: SourceKV, x: Tensor, positions: Tensor) -> None:
        """Consume new tokens x [B, T, D] at contiguous positions [T]; complete blocks become
        entries. Tokens the source already holds (a prefix-cache replay) are skipped."""
        if positions.numel() == 0:
            return
        expected, first = state.next_position, int(positions[0])
        if first > expected:
            raise ValueError(
                f"global KV source: tokens from position {expected} are missing (got tokens from "
                f"{first}); a replay must start at or before the incomplete compression block")
        x = x[:, expected - first:]
        if x.shape[1] == 0:
            return
        b, cfg, m = x.shape[0], self.cfg, self.ratio
        tokens = torch.cat((state.pending_tokens, self.kv(x)), dim=1)
        gates = (torch.cat((state.pending_gates, self.gate(x)), dim=1) if m > 1
                 else state.pending_gates)
        n_new = tokens.shape[1] // m
        if n_new:
            block = tokens[:, :n_new * m].view(b, n_new, m, 2, self.heads, cfg.head_dim)
            if m > 1:
                weight = torch.softmax(gates[:, :n_new * m].view(b, n_new, m, self.heads)
                                       + self.gate_bias, dim=2)
                entry = (block * weight[:, :, :, None, :, None]).sum(dim=2)
            else:
                entry = block[:, :, 0]
            entry_pos = (state.n_entries + torch.arange(n_new, device=x.device)) * m
            k = rotary(entry[:, :, 0].transpose(1, 2), entry_pos, cfg.rope_theta)
            v = entry[:, :, 1].transpose(1, 2)
            # Stored vectors are head rows [Dh] of K (after RoPE, as cached) and of V.
            state.k = torch.cat((state.k, store(self.storage.entries, k)), dim=2)
            state.v = torch.cat((state.v, store(self.storage.entries, v)), dim=2)
            if self.index_key is not None:
                keys = self.index_key(entry.reshape(b, n_new, self.entry_width).detach())
                keys = store(self.storage.index_keys, keys)
                state.index_keys = torch.cat((state.index_keys, keys), dim=1)
        state.pending_tokens = tokens[:, n_new * m:]
        if m > 1:
            state.pending_gates = gates[:, n_new * m:]


class IndexerQuery(nn.Module):
    """The lightning indexer's query side for a Full or Reindex layer:
    score(i, j) = sum_h w_h(x_i) * relu(q_h(x_i) . k_j)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim = cfg.indexer_heads, cfg.indexer_dim
        self.q = nn.Linear(cfg.d_model, self.heads * self.dim, bias=False)
        self.w = nn.Linear(cfg.d_model, self.heads, bias=False)

    def scores(self, x: Tensor, keys: Tensor) -> Tensor:
        """x [B, C, D] (detached by the caller), keys [B, E, Di] -> scores [B, C, E]."""
        b, c, _ = x.shape
        q = self.q(x).view(b, c, self.heads, self.dim)
        w = self.w(x) * (self.heads ** -0.5)
        dots = torch.relu(torch.einsum("bchd,bed->bche", q, keys) * (self.dim ** -0.5))
        return torch.einsum("bch,bche->bce", w, dots)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        d = cfg.d_model
        self.has_window = spec.window is not None or spec.full_causal
        # Query, and window key/value when the layer has window keys, in one matmul.
        self.qkv = nn.Linear(d, 3 * d if self.has_window else d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.sink = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sink else None
        self.indexer = (IndexerQuery(cfg) if cfg.topk is not None
                        and spec.global_mode in ("full", "reindex") else None)
        self.storage = KVStorage.from_config(cfg)

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 2)

    def _select(self, x: Tensor, positions: Tensor, source: SourceKV, first: Tensor | None,
                ctx: ForwardContext) -> Selection:
        """Indexer scores for the current queries, block by block, and their top-k (from the
        entries the document mask `first` [B, T] leaves readable, when given)."""
        n_visible = visible_entries(positions, source.compress_ratio)
        x = x.detach()
        if ctx.dense_global_read:   # warm-up: read everything, train the indexer on all of it
            return Selection(None, None, self.indexer.scores(x, source.index_keys))
        picks, valids, picked_scores = [], [], []
        block = self.cfg.attention_block
        slots = min(self.cfg.topk, source.n_entries)
        for c0 in range(0, x.shape[1], block):
            c1 = min(c0 + block, x.shape[1])
            # Only the entries visible to the block's last query can be chosen: scoring the
            # rest (about half of a causal forward's) would be work the selection discards.
            n_read = int(n_visible[c1 - 1])
            scores = self.indexer.scores(x[:, c0:c1], source.index_keys[:, :n_read])
            index, valid = select_entries(scores, n_visible[c0:c1], self.cfg.topk,
                                          None if first is None else first[:, c0:c1])
            if index.shape[-1] < slots:   # fewer entries than slots: pad with invalid slots
                index = F.pad(index, (0, slots - index.shape[-1]))
                valid = F.pad(valid, (0, slots - valid.shape[-1]))
            picks.append(index)
            valids.append(valid)
            if ctx.want_aux:
                picked_scores.append(torch.gather(F.pad(scores, (0, slots - n_read)) if
                                                  n_read < slots else scores, -1, index))
        return Selection(torch.cat(picks, 1), torch.cat(valids, 1),
                         torch.cat(picked_scores, 1) if picked_scores else None)

    def forward(self, x: Tensor, positions: Tensor, lower: Tensor | None,
                window: WindowKV | None, source: SourceKV | None, ctx: ForwardContext) -> Tensor:
        """x [B, T, D] (normalised) at contiguous positions [T] -> [B, T, D]."""
        cfg, spec = self.cfg, self.spec
        projected = self.qkv(x).split(cfg.d_model, dim=-1)
        q = rotary(self._split(projected[0]), positions, cfg.rope_theta)
        keys = None
        if self.has_window:
            # The window cache's one storage point: the new positions' K (after RoPE) and V
            # head rows, before the current queries read them, so that a query reads its own
            # and earlier keys exactly as a later decode step reads them from the cache.
            k = store(self.storage.window,
                      rotary(self._split(projected[1]), positions, cfg.rope_theta))
            v = store(self.storage.window, self._split(projected[2]))
            if window is not None:
                keys = WindowKV(torch.cat((window.k, k), 2), torch.cat((window.v, v), 2),
                                torch.cat((window.positions, positions)))
            else:
                keys = WindowKV(k, v, positions)

        selection = None
        first = (first_visible_entry(positions, source.compress_ratio, ctx.document_starts)
                 if source is not None else None)
        if source is not None and cfg.topk is not None:
            if self.indexer is not None:
                selection = self._select(x, positions, source, first, ctx)
                ctx.selections[spec.global_source] = selection
            else:
                selection = ctx.selections[spec.global_source]
                if ctx.dense_global_read:
                    selection = None
        train_indexer = ctx.want_aux and self.indexer is not None
        out, global_probs = attend(q, positions, lower, keys, source, selection, self.sink,
                                   cfg.attention_block, want_global_probs=train_indexer,
                                   global_read=cfg.global_read, first_entry=first)
        if train_indexer:
            ctx.indexer_kl.append(_indexer_kl(global_probs, selection, positions, source, first))

        if window is not None and ctx.keep_windows:
            kept = 0
            if spec.window is not None:
                kept = int(torch.searchsorted(keys.positions,
                                              keep_from(positions[-1] + 1, spec.window)))
            window.k, window.v = keys.k[:, :, kept:], keys.v[:, :, kept:]
            window.positions = keys.positions[kept:]
        b, t = x.shape[:2]
        return self.o(out.transpose(1, 2).reshape(b, t, cfg.d_model))


def _indexer_kl(global_probs: Tensor, selection: Selection, positions: Tensor,
                source: SourceKV, first: Tensor | None = None) -> Tensor:
    """KL(main attention over the candidates || softmax of indexer scores over them), averaged
    over queries with at least one candidate. The main distribution is detached."""
    if selection.index is not None:
        candidate = selection.valid
    else:
        n_visible = visible_entries(positions, source.compress_ratio)
        candidate = entry_visibility(source.n_entries, n_visible, first).expand_as(
            selection.scores)
    target = global_probs.masked_fill(~candidate, 0.0)
    total = target.sum(-1, keepdim=True)
    has_candidates = candidate.any(-1) & (total[..., 0] > 0)
    target = target / total.clamp_min(torch.finfo(target.dtype).tiny)
    log_q = torch.log_softmax(selection.scores.masked_fill(~candidate, -torch.inf), dim=-1)
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - log_q), 0.0)
    per_query = terms.sum(-1)
    if not bool(has_candidates.any()):
        return per_query.sum() * 0.0
    return per_query[has_candidates].mean()


class MLP(nn.Module):
    """SwiGLU feed-forward.

    The hidden width runs padded to `ced.config.executed_ff_dim` (a multiple of FF_PAD) with
    zero units that are not parameters: CPU GEMMs at a width such as 683 ran up to 1.3x slower
    than at 688 (benchmarks/peer.py's SwiGLU), and a zero unit adds exactly nothing (its gate
    and up rows are 0, silu(0) * 0 = 0, and its down column is 0), so the function and the
    parameters are those of the unpadded MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ff_dim, bias=False)   # one matmul
        self.down = nn.Linear(cfg.ff_dim, cfg.d_model, bias=False)
        self.pad = executed_ff_dim(cfg) - cfg.ff_dim

    def forward(self, x: Tensor) -> Tensor:
        gate_up, down = self.gate_up.weight, self.down.weight
        if self.pad:
            width, d = down.shape[1], down.shape[0]
            gate_up = F.pad(gate_up.view(2, width, d), (0, 0, 0, self.pad)).view(-1, d)
            down = F.pad(down, (0, self.pad))
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, spec)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)


@dataclass
class ModelState:
    """Everything a run of layers reads besides the hidden state: one WindowKV per layer that
    has window keys (None otherwise) and one SourceKV per global source."""

    windows: list[WindowKV | None]
    sources: list[SourceKV]


class CEDModel(nn.Module):
    """All four variants. `forward` is the parallel forward over a whole sequence; the engine
    (`ced.inference`) drives the same `run_layers` incrementally."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.describes_unmodelled_parts:
            raise ValueError("ModelConfig.unmodelled: describes parts this model code does not "
                             "build (MoE, mHC, Engram, a shared K=V latent); such a config is "
                             "for the cost model (python -m ced.cost), not for CEDModel")
        KVStorage.from_config(cfg)   # a storage format the model cannot store fails here, whole
        self.cfg = cfg
        self.plan = build_plan(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Row j-1 weighs the embedding of the token j positions back (see embed_tokens).
        self.shift_weights = (nn.Parameter(torch.empty(cfg.shift_tokens, cfg.d_model))
                              if cfg.shift_tokens else None)
        self.blocks = nn.ModuleList(Block(cfg, spec) for spec in self.plan.layers)
        self.sources = nn.ModuleList(GlobalKVSource(cfg, s.compress_ratio)
                                     for s in self.plan.sources)
        self.source_fed_by = {s.from_layer: s.index for s in self.plan.sources
                              if s.from_layer is not None}
        # The decoder's global KV reads RMSNorm(H_{L_e}), with a norm of its own.
        self.encoder_output_norm = RMSNorm(cfg.d_model) if cfg.has_decoder else None
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.drop = nn.Dropout(cfg.dropout)
        self.apply(self._init_weights)
        for block in self.blocks:   # residual projections scaled down with depth (GPT-2)
            std = 0.02 / math.sqrt(2 * cfg.n_layers)
            nn.init.normal_(block.attn.o.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=std)
        if self.shift_weights is not None:   # per-channel random weights: see cfg.shift_init
            nn.init.normal_(self.shift_weights, std=cfg.shift_init)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def encoder_parameters(self) -> list[nn.Parameter]:
        """The parameters of the encoder's layers and of its global KV sources (yoco, ced;
        empty for variants without a decoder): what `optim.encoder_hold_steps` holds still.
        The embedding, the decoder's KV source and everything above it are not included."""
        if not self.cfg.has_decoder:
            return []
        modules = [self.blocks[spec.index] for spec in self.plan.part("encoder")]
        modules += [self.sources[s.index] for s in self.plan.sources if s.part == "encoder"]
        return [p for m in modules for p in m.parameters()]

    # ---- building blocks shared with the engine ------------------------------------------

    def empty_state(self, batch: int, keep_windows: bool) -> ModelState:
        like = self.embed.weight
        cfg = self.cfg
        windows = [WindowKV.empty(batch, cfg.n_heads, cfg.head_dim, like)
                   if keep_windows and b.attn.has_window else None for b in self.blocks]
        sources = [SourceKV.empty(cfg, s.compress_ratio, batch, like) for s in self.plan.sources]
        return ModelState(windows, sources)

    def embed_tokens(self, tokens: Tensor, start: int = 0,
                     document_starts: Tensor | None = None) -> Tensor:
        """The first layer's input at positions [start, T) of tokens [B, T]: [B, T - start, D].

        With cfg.shift_tokens = s > 0, position i gets embed(tokens[i]) plus
        shift_weights[j-1] * embed(tokens[i-j]) for j = 1..s (nothing for i - j < 0): a short
        causal depthwise convolution over the embeddings. It depends on token ids only, which
        the forward and the engine both hold in full, so it adds no cache and behaves the same
        under every replay start and prefix-cache policy. Its point: a value token that already
        carries its key's embedding can be found by a single content match, which small models
        learn in a few hundred steps instead of never (FINDINGS.md). Under a document mask
        (document_starts [B, K]), tokens before position i's document start add nothing."""
        s = self.cfg.shift_tokens
        if not s:
            return self.embed(tokens[:, start:])
        first = max(0, start - s)
        e = self.embed(tokens[:, first:])
        pad = s - (start - first)                 # positions before 0 contribute zeros
        if pad:
            e = torch.cat((e.new_zeros(e.shape[0], pad, e.shape[2]), e), dim=1)
        h = e[:, s:]                              # e[:, s + m] is position start + m
        positions = torch.arange(start, tokens.shape[1], device=tokens.device)
        document = (None if document_starts is None
                    else latest_start(positions, document_starts)[..., None])   # [B, T, 1]
        for j in range(1, s + 1):
            shifted = self.shift_weights[j - 1] * e[:, s - j:e.shape[1] - j]
            if document is not None:
                shifted = shifted * (positions[None, :, None] - j >= document)
            h = h + shifted
        return h

    def run_layers(self, part: str, h: Tensor, positions: Tensor, state: ModelState,
                   ctx: ForwardContext, replay_starts: Tensor | None = None) -> Tensor:
        """Run new positions [T] (contiguous) with hidden state h [B, T, D] through the
        'encoder' or 'decoder' layers; window queries are truncated at `replay_starts`
        ([B, K] or None) on top of whatever positions the window caches lack."""
        for spec in self.plan.part(part):
            block = self.blocks[spec.index]
            x = block.attn_norm(h)
            fed = self.source_fed_by.get(spec.index)
            if fed is not None:
                self.sources[fed].append(state.sources[fed], x, positions)
            lower = None
            if block.attn.has_window:
                lower = window_lower_bound(positions, spec.window, replay_starts)
            source = state.sources[spec.global_source] if spec.global_source is not None else None
            h = h + self.drop(block.attn(x, positions, lower, state.windows[spec.index],
                                         source, ctx))
            h = h + self.drop(block.mlp(block.mlp_norm(h)))
            if ctx.hidden is not None:
                ctx.hidden[spec.index] = h
        return h

    def feed_decoder_source(self, encoder_out: Tensor, positions: Tensor,
                            state: ModelState) -> None:
        """Project the decoder's one global KV from RMSNorm(H_{L_e}) at `positions`."""
        src = self.plan.decoder_source
        if src is not None:
            self.sources[src.index].append(state.sources[src.index],
                                           self.encoder_output_norm(encoder_out), positions)

    def logits(self, h: Tensor) -> Tensor:
        return self.lm_head(self.final_norm(h))

    # ---- the parallel forward ------------------------------------------------------------

    def forward(self, input_ids: Tensor, decoder_replay_start: None | int | Tensor = None,
                encoder_replay_start: None | int | Tensor = None, *, return_aux: bool = False,
                dense_global_read: bool = False, document_starts: None | Tensor = None):
        """Parallel forward. input_ids [B, T] -> logits [B, T, V].

        decoder_replay_start: None, int, LongTensor[B] or [B, K]: every decoder window query at
        position i is truncated at the latest start s <= i (docs/semantics.md 4.1, 4.4). With
        s = T - N this equals early-exit prefill with replay N followed by decode steps.
        encoder_replay_start: the same for encoder (and dense/swa) windows (docs/semantics.md
        4.4; a plain mask, not the prefix-cache emulation of its 4.2, which reuses untruncated
        global KV).
        return_aux: also return {"indexer_kl": scalar} (0 when there is no indexer).
        dense_global_read: read every visible global entry even when topk is set (indexer
        warm-up); the indexer KL then covers every visible entry.
        document_starts: None, or LongTensor[B] / [B, K] of positions where a document starts
        (training on packed rows, docs/semantics.md 7.1): a query at i sees nothing before the
        latest document start d <= i, in every layer: window keys from d, global entries that
        begin at or after d, input token mixing from d. Each document of a packed row is then
        computed as if it stood alone (up to the compression blocks' alignment to d). The
        engine has no such argument: a prompt is one document.
        """
        cfg = self.cfg
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, T]; got {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if t > cfg.max_seq_len:
            raise ValueError(f"input_ids: length {t} exceeds ModelConfig.max_seq_len="
                             f"{cfg.max_seq_len}")
        if input_ids.dtype == torch.bool or input_ids.is_floating_point():
            raise ValueError(f"input_ids: token ids must have an integer dtype (torch.long); "
                             f"got {input_ids.dtype}")
        if input_ids.numel():       # one min/max per call (one device sync), as the engine does
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()
            if low < 0 or high >= cfg.vocab_size:
                raise ValueError(f"input_ids: token ids must lie in [0, {cfg.vocab_size}) "
                                 f"(ModelConfig.vocab_size); got values from {low} to {high}")
        if decoder_replay_start is not None and not cfg.has_decoder:
            raise ValueError(f"decoder_replay_start: variant {cfg.variant!r} has no decoder; "
                             "only 'yoco' and 'ced' accept it")
        dec_starts = as_replay_starts(decoder_replay_start, b, "decoder_replay_start",
                                      input_ids.device)
        enc_starts = as_replay_starts(encoder_replay_start, b, "encoder_replay_start",
                                      input_ids.device)
        docs = as_replay_starts(document_starts, b, "document_starts", input_ids.device)
        enc_starts, dec_starts = merge_starts(enc_starts, docs), merge_starts(dec_starts, docs)
        ctx = ForwardContext(keep_windows=False, dense_global_read=dense_global_read,
                             want_aux=return_aux, document_starts=docs)
        state = self.empty_state(b, keep_windows=False)
        positions = torch.arange(t, device=input_ids.device)
        h = self.drop(self.embed_tokens(input_ids, 0, docs))
        h = self.run_layers("encoder", h, positions, state, ctx, enc_starts)
        if cfg.has_decoder:
            self.feed_decoder_source(h, positions, state)
            h = self.run_layers("decoder", h, positions, state, ctx, dec_starts)
        logits = self.logits(h)
        if not return_aux:
            return logits
        kl = torch.stack(ctx.indexer_kl).mean() if ctx.indexer_kl else logits.new_zeros(())
        return logits, {"indexer_kl": kl}
