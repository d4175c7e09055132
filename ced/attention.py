"""The attention function of the CED family, `attend`: one softmax over a query's window keys,
its selected global entries and a sink, in query blocks; the per-layer state it reads
(`WindowKV`, `SourceKV`, `Selection`, `ForwardContext`); and the two kernels of the joint
read (`joint_read`: the reference and the fused CPU flash node `_FlashRead`). Which keys a
query sees comes from ced/semantics.py; the modules that call `attend` are in ced/model.py.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .block_masks import (empty_slots, invisible_entries, unpicked_entries, union_of_picks,
                          window_block)
from .config import UNION_READ_MAX_SHARE, ModelConfig, global_read_is_masked
from .exact_ops import hidden_bits, masked_fill_hidden, matmul_operand
from .semantics import first_visible_entry, visible_entries, window_lower_bound

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
    # The masks this call's layers share (`shared`): built by the first layer that needs one,
    # read by the others.
    masks: dict = field(default_factory=dict)


# Whether `shared` shares masks across the layers of a call. False builds each mask where it is
# used, layer by layer and block by block: the computation tests/unit/test_shared_masks.py
# compares the shared one against, bit for bit. Nothing else sets it.
SHARE_MASKS = True


def shared(memo: dict | None, build: Callable, *args):
    """build(*args), once per memo (`ForwardContext.masks`: one forward or engine call) for the
    same tensors and equal other arguments. Why: the layers of a part see the same window
    bounds and document mask, and the Reuse layers of a reselection group the same picks, so
    their per-block masks are equal tensors; rebuilding them in every layer and block cost
    about 60-100 ms of a 2 s training step at the depth study's L_d = 20 (benchmarks/README.md).
    Tensors are keyed by identity, which is sound because the memo keeps them alive (no id is
    reused while it lives) and nothing modifies them in place; an argument that is not a tensor
    (an int, a dtype, None) is keyed by value. Returns what build returns."""
    if memo is None or not SHARE_MASKS:
        return build(*args)
    key = (build, *(id(a) if isinstance(a, Tensor) else a for a in args))
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = (args, build(*args))
    return hit[1]


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


def _flat_rows(entries: Tensor, index: Tensor) -> Tensor:
    """index [B, C, k] into entries [B, G, E, Dh] as rows of entries.reshape(B * G * E, Dh):
    LongTensor[B * G * C * k], head-major ([B, G, C, k] order)."""
    b, h, e, _ = entries.shape
    offset = (torch.arange(b * h, device=index.device) * e).view(b, h, 1, 1)
    return (index[:, None] + offset).reshape(-1)


def _gather_entries(entries: Tensor, index: Tensor) -> Tensor:
    """entries [B, G, E, Dh], index [B, C, k] -> [B, G, C, k, Dh], head-major so that the reads
    in `attend` are plain batched matmuls (an einsum over a [B, C, k, H, Dh] layout copies in
    its backward and ran at half the speed)."""
    b, h, e, dh = entries.shape
    picked = _GatherRows.apply(entries.reshape(b * h * e, dh), _flat_rows(entries, index))
    return picked.view(b, h, *index.shape[1:], dh)


def _add_rows(grad_entries: Tensor, index: Tensor, grad_rows: Tensor) -> None:
    """The backward of `_gather_entries` into a buffer: grad_entries [B, G, E, Dh] (contiguous)
    += the rows' gradient [B, G, C, k, Dh] at index [B, C, k]."""
    dh = grad_entries.shape[-1]
    grad_entries.view(-1, dh).index_add_(0, _flat_rows(grad_entries, index),
                                         grad_rows.reshape(-1, dh))


def _union_rows(entries: Tensor, rows: Tensor, heads: int) -> Tensor:
    """The union entries of one block: entries [B, G, E, Dh] at `rows` of `union_of_picks`
    -> [B, heads, U, Dh] (query head i on K/V head i // (heads / G))."""
    b, g, _, dh = entries.shape
    width = rows.numel() // max(b * g, 1)
    picked = entries.reshape(-1, dh).index_select(0, rows).view(b, g, width, dh)
    return _per_query_head(picked, heads)


# ---------------------------------------------------------------------------------------------
# Kernels of the joint softmax read. `attend` decides which keys each query sees; a kernel only
# computes softmax([q.k for every key set] ++ [sink]) and the matching value reads. Two kernels
# compute the same quantity: the reference (plain matmuls, softmax over concatenated logits; any
# device and dtype) and, on CPU, torch's fused flash-attention kernel called once per key set
# with the partial reads merged through their log-sum-exps (a gathered top-k set, whose keys
# differ per query, is one more partial read there, by sparse products). The choice is speed
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
    """One set of keys a block of queries reads: k, v [B, H, S, Dh], or with gathered=True a
    top-k read: the entries k, v [B, G, E, Dh] (G K/V heads) and each query's picks `index`
    [B, C, k] into them; hidden: BoolTensor broadcastable to [B, H, C, S] (or [B, H, C, k]),
    True where a query may not read the key (slot)."""

    k: Tensor
    v: Tensor
    hidden: Tensor
    gathered: bool = False
    # True when `hidden` is exactly "key j > query i" on a square block that starts at key 0:
    # the fused kernel then masks causally itself and skips the blocks above the diagonal.
    causal: bool = False
    index: Tensor | None = None

    @property
    def width(self) -> int:
        return self.index.shape[-1] if self.index is not None else self.k.shape[-2]

    def rows(self) -> tuple[Tensor, Tensor]:
        """A gathered set's per-query K and V rows [B, G, C, k, Dh], copied with autograd (the
        reference read; the fused one reads the entries in place, `_Picks`)."""
        return _gather_entries(self.k, self.index), _gather_entries(self.v, self.index)


def _gathered_scores(q: Tensor, k: Tensor) -> Tensor:
    """q [B, H, C, Dh] against each query's gathered rows k [B, G, C, k, Dh] -> [B, H, C, k]
    (the reference read). Query head i reads K/V head i // (H / G)."""
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


class _Picks:
    """A query block's top-k picks as a sparse pattern, so that the fused read never copies the
    picked rows: row (b, h, c) of the queries flattened [B * H * C, Dh] has k nonzeros, at the
    rows of the entries flattened [B * G * E, Dh] that query head h reads (K/V head
    h // (H / G)). A copy of the rows is k times the entries' size per query and head, and reading
    it one (1 x Dh) @ (Dh x k) product at a time is memory-bound; the sparse products read the
    entries in place (timings: benchmarks/README.md, "Long context"). index [B, C, k] (padding
    slots must still hold an entry in range: their logits are masked)."""

    def __init__(self, index: Tensor, entries: Tensor, heads: int):
        b, g, e, self.head_dim = entries.shape
        c, k = index.shape[1:]
        kv_head = torch.arange(heads, device=index.device) // (heads // g)
        offset = (torch.arange(b, device=index.device)[:, None] * g + kv_head) * e   # [B, H]
        self.columns = (index[:, None] + offset[:, :, None, None]).reshape(-1)
        self.row_starts = torch.arange(0, b * heads * c * k + 1, k, device=index.device)
        self.size = (b * heads * c, b * g * e)
        self.shape = (b, heads, c, k)

    def _matrix(self, values: Tensor) -> Tensor:
        with warnings.catch_warnings():       # torch warns once that sparse CSR is in beta
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(self.row_starts, self.columns, values.reshape(-1),
                                           self.size, check_invariants=False)

    def dots(self, x: Tensor, entries: Tensor) -> Tensor:
        """x [B, H, C, Dh] dotted with each query head's picked entries -> [B, H, C, k]."""
        pattern = self._matrix(x.new_zeros(self.columns.shape))
        out = torch.sparse.sampled_addmm(pattern, x.reshape(-1, self.head_dim),
                                         entries.reshape(-1, self.head_dim).t(), beta=0.0)
        return out.values().view(self.shape)

    def sums(self, weights: Tensor, entries: Tensor) -> Tensor:
        """sum_j weights[..., j] * picked entry j: weights [B, H, C, k] -> [B, H, C, Dh]."""
        out = torch.sparse.mm(self._matrix(weights), entries.reshape(-1, self.head_dim))
        return out.view(*self.shape[:3], self.head_dim)


def _per_query_head(entries: Tensor, heads: int) -> Tensor:
    """Global K or V [B, G, E, Dh] as [B, heads, E, Dh], query head i on K/V head
    i // (heads / G): the tensor itself when G = heads, a stride-0 view when G = 1."""
    b, g, e, dh = entries.shape
    if g == heads:
        return entries
    return entries[:, :, None].expand(b, g, heads // g, e, dh).reshape(b, heads, e, dh)


def _read_reference(q: Tensor, key_sets: list[KeySet], sink: Tensor | None,
                    masks: dict | None = None) -> tuple[Tensor, list[Tensor]]:
    """The joint softmax read with plain matmuls (ced/exact_ops.py). q [B, H, C, Dh] (scaled);
    masks: `attend`'s. Returns the output [B, H, C, Dh] and the probabilities over each key set."""
    b, h, c, _ = q.shape
    sink_dtype, operand = q.dtype, matmul_operand(q)
    q = operand(q)
    logits = []
    rows = [ks.rows() if ks.gathered else None for ks in key_sets]
    for ks, kv in zip(key_sets, rows):
        scores = _gathered_scores(q, kv[0]) if ks.gathered else torch.matmul(q, operand(ks.k).mT)
        logits.append(masked_fill_hidden(scores, shared(masks, hidden_bits, ks.hidden,
                                                        scores.dtype)))
    if sink is not None:
        logits.append(sink.view(1, h, 1, 1).to(sink_dtype).expand(b, h, c, 1))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out, at, per_set = None, 0, []
    for ks, kv in zip(key_sets, rows):
        p = probs[..., at:at + ks.width]
        at += ks.width
        read = (_gathered_values(p, kv[1]) if ks.gathered
                else torch.matmul(operand(p), operand(ks.v)))
        out = read if out is None else out + read
        per_set.append(p)
    return out, per_set


@dataclass(frozen=True)
class _FlashSet:
    """One key set of one query block as the fused read takes it: keys and values are rows
    start:stop of parents[parent] and parents[parent + 1]; mask: the additive float mask
    (-inf where hidden) or None when the kernel masks causally itself; empty: BoolTensor of
    the query rows that see none of the set's keys (the kernel reports lse 0 there), or None.
    gathered: a top-k read: the parents are the entries [B, G, E, Dh] (shared by every block)
    and `index` [B, C, k] the block's picks, read in place by sparse products (`_Picks`)
    instead of the fused kernel."""

    parent: int
    start: int
    stop: int
    mask: Tensor | None
    empty: Tensor | None
    causal: bool
    gathered: bool = False
    index: Tensor | None = None


def _additive(hidden: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """hidden (bool) -> the fused kernel's additive mask in dtype (-inf where hidden, else 0)
    and the query rows that see none of the keys, hidden.all(-1)."""
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, -torch.inf), hidden.all(-1)


def _flash_set(ks: KeySet, parent: int, start: int, q: Tensor,
               masks: dict | None = None) -> _FlashSet:
    """`ks` as the fused read takes it: its keys are rows start:start + width of parents[parent]
    (and its values of parents[parent + 1]); its hidden mask made additive in q's dtype (once
    per `masks` memo for a hidden mask the layers share, see `shared`)."""
    mask = empty = None
    if not ks.causal:
        mask, empty = shared(masks, _additive, ks.hidden, q.dtype)
    return _FlashSet(parent, start, start + ks.width, mask, empty, ks.causal, ks.gathered,
                     ks.index)


def _flash_kv(parents: tuple, fs: _FlashSet) -> tuple[Tensor, Tensor]:
    if fs.gathered:
        return parents[fs.parent], parents[fs.parent + 1]
    return (parents[fs.parent][:, :, fs.start:fs.stop],
            parents[fs.parent + 1][:, :, fs.start:fs.stop])


def _gathered_read(qc: Tensor, k: Tensor, v: Tensor, fs: _FlashSet
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """A gathered key set's normalised read and log-sum-exp, as the fused kernel returns them
    for a plain set, and its own probabilities (kept for the backward): qc [B, H, C, Dh],
    entries k, v [B, G, E, Dh] picked by fs.index -> [B, H, C, Dh], [B, H, C] (-inf and a zero
    read on rows that see none of the set's keys), [B, H, C, k]."""
    picks = _Picks(fs.index, k, qc.shape[1])
    scores = picks.dots(qc, k) + fs.mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if fs.empty is not None:
        probs = probs.masked_fill(fs.empty[..., None], 0.0)
    return picks.sums(probs, v), lse, probs


def _grouped_outer(a: Tensor, x: Tensor, g: int) -> Tensor:
    """sum over the query heads of each K/V head group of a[h, c, j] x[h, c, d]:
    a [B, H, C, k], x [B, H, C, Dh] -> [B, G, C, k, Dh] (the gradient of gathered rows)."""
    b, h, c, n = a.shape
    if g == h:
        # one query head a group: a plain outer product, which a matmul with an inner
        # dimension of 1 computes 2-3x slower on CPU (the same single products, bit for bit)
        return a.unsqueeze(-1) * x.unsqueeze(-2)
    grouped_a = a.view(b, g, h // g, c, n).permute(0, 1, 3, 4, 2)         # [B, G, C, k, H/G]
    grouped_x = x.view(b, g, h // g, c, x.shape[-1]).transpose(2, 3)       # [B, G, C, H/G, Dh]
    return torch.matmul(grouped_a, grouped_x)


def _gathered_backward(g: Tensor, qc: Tensor, k: Tensor, v: Tensor, oc: Tensor, tc: Tensor,
                       own: tuple[Tensor, Tensor], index: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """The joint softmax's gradient through a gathered set, given the joint output oc and
    log-sum-exp tc of the block (as `_FLASH_BACKWARD` takes them for a plain set) and the set's
    own (probabilities, lse) from the forward: the joint probabilities are
    p = p_own * exp(lse_own - L), and ds = p * (g.v - rowsum(g * out)). Entries k, v
    [B, G, E, Dh] picked by index [B, C, k]. Returns dq [B, H, C, Dh] and the picked rows'
    dk, dv [B, G, C, k, Dh] (`_add_rows` adds them into the entries' gradient)."""
    own_probs, own_lse = own
    scale = torch.exp(own_lse - tc).nan_to_num(0.0)     # 0 on rows that see none of the set
    probs = own_probs * scale[..., None].to(qc.dtype)
    row = (g * oc).sum(-1, keepdim=True)
    picks = _Picks(index, k, qc.shape[1])
    ds = probs * (picks.dots(g, v) - row)
    heads = k.shape[1]
    return picks.sums(ds, k), _grouped_outer(ds, qc, heads), _grouped_outer(probs, g, heads)


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
    A gathered top-k set (`_FlashSet.gathered`: its parents are the entries, its index the
    block's picks) takes the same two steps by sparse products (`_gathered_read`,
    `_gathered_backward`).

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
                    own[c0, fs.parent] = (probs, lse)
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
        grad_parents = [torch.zeros_like(p) if p is not None and wants[3 + i] else None
                        for i, p in enumerate(parents)]
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
                                                        ctx.own[c0, fs.parent], fs.index)
                    for i, d in ((fs.parent, dk), (fs.parent + 1, dv)):
                        if grad_parents[i] is not None:
                            _add_rows(grad_parents[i], fs.index, d)
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
    sparse products for gathered ones, in float32/float64 (in bf16 the reference's softmax over
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
    if ks.width == 0:       # no entry complete yet: a gathered set of no slots has no picks
        return q.new_zeros(*q.shape[:3], 0)
    with torch.no_grad():
        scores = (_Picks(ks.index, ks.k, q.shape[1]).dots(q, ks.k) if ks.gathered
                  else torch.matmul(q, ks.k.transpose(-1, -2)))
        scores = scores.masked_fill(ks.hidden, -torch.inf)
        return torch.exp(scores - total[..., None].to(q.dtype))


def _read_flash(q: Tensor, key_sets: list[KeySet], sink: Tensor | None, probs_of: int | None
                ) -> tuple[Tensor, list[Tensor | None]]:
    """The joint softmax read through `_FlashRead` as one block; the probabilities of key set
    `probs_of` only (recomputed, detached), the others None. A call with nothing to read
    (every set empty) is a plan block without sets: output 0."""
    used = [ks for ks in key_sets if ks.width > 0]
    # each set's K and V are its own two slots, in order: set i at slot 2 i
    sets = tuple(_flash_set(ks, 2 * i, 0, q) for i, ks in enumerate(used))
    out, total = _FlashRead.apply(q, sink, [(0, q.shape[2], sets)],
                                  *[t for ks in used for t in (ks.k, ks.v)])
    per_set: list[Tensor | None] = [None] * len(key_sets)
    if probs_of is not None:
        per_set[probs_of] = _set_probs(q, key_sets[probs_of], total)
    return out, per_set


def joint_read(q: Tensor, key_sets: list[KeySet], sink: Tensor | None,
               probs_of: int | None = None, masks: dict | None = None
               ) -> tuple[Tensor, list[Tensor | None]]:
    """softmax over the logits q.k of every key set plus the sink logit (per head, it only
    enters the denominator), and the matching read of the values. q [B, H, C, Dh], already
    scaled; masks: `attend`'s. Returns the output [B, H, C, Dh] and the probabilities over each
    key set ([B, H, C, S], detached where the fused kernel ran; only `probs_of`'s is sure)."""
    if _flash_applies(q, key_sets):
        return _read_flash(q, key_sets, sink, probs_of)
    return _read_reference(q, key_sets, sink, masks)


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


# The K/V tensors `attend` hands `_FlashRead` after (q, sink, plan), as slots: a key set's keys
# are at its slot and its values at slot + 1. The window's K/V, then the global entries' K/V
# per query head, then the global entries' K/V per K/V head, which a gathered block's set
# indexes (its picked rows are read in place, never copied).
_WINDOW_SLOT, _ENTRY_SLOT, _GATHERED_SLOT, _UNION_SLOT = 0, 2, 4, 6   # a union set: 6 + 2 i


def attend(q: Tensor, query_positions: Tensor, lower: Tensor | None, window: WindowKV | None,
           source: SourceKV | None, selection: Selection | None, sink: Tensor | None,
           block: int, want_global_probs: bool = False,
           global_read: str = "auto", first_entry: Tensor | None = None,
           masks: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """Attention of queries over their window keys and global entries, in query blocks.

    q: [B, H, Tq, Dh] (rotated) at query_positions [Tq]; lower: [B|1, Tq] from
    `window_lower_bound`; window: keys at ascending positions, or None (no window keys);
    source: the global KV read, or None; selection: top-k entries, or None/index None to read
    every visible entry; sink: [H] logits that only enter the denominator; global_read:
    how a top-k read runs per block (`ced.config.global_read_is_masked`: a gather of the k
    entries, or one matmul over the visible entries with the unselected ones masked; the same
    softmax over the same entries either way); first_entry: [B, Tq] or None, the document
    mask of a dense read (`first_visible_entry`; a top-k selection already respects it);
    masks: the call's `ForwardContext.masks`, or None: the per-block masks are then built here
    (with it, once a call for the layers that share them, see `shared`).
    Returns the output [B, H, Tq, Dh] and, if asked, the attention mass on global entries
    summed over heads, [B, Tq, k] (selected read) or [B, Tq, E] (dense read), detached.

    Why this stays one function, over 60 lines: it is the one readable place for the visibility
    rules (which window keys a query sees, which global entries are visible and selected, how
    the read forms mask them; each form's per-block mask is a function of ced/block_masks.py
    of tensors the layers of a call share, so that it is built once a call). Each block's
    rules become KeySets; the one softmax over all of them and the sink is taken by the fused
    CPU kernel for every block at once (`_FlashRead`) or by `joint_read` per block (the
    reference: bf16 gathers, other devices): the same quantity. Training, parallel evaluation
    and the engine all run through it.
    """
    b, h, n_queries, dh = q.shape
    q = q * (1.0 / math.sqrt(dh))      # scaled once here rather than every block's logits
    sparse = selection is not None and selection.index is not None
    n_visible = visible_entries(query_positions, source.compress_ratio) if source else None
    causal = _plain_causal(q, query_positions, lower, window, source, sparse, first_entry)
    if causal:
        block = n_queries
    # Global K/V per query head for the plain and masked reads, made when a block first needs
    # them (a gathered read takes the K/V heads' entries and maps the query heads itself).
    entry_k = entry_v = None
    # per block: (c0, c1, key sets, where each set's keys start in window.k / entry_k as
    # (slot, start) for the fused read (a gathered set: source.k at _GATHERED_SLOT, its
    # index), the selection, masked)
    blocks, any_gathered, unions = [], False, []
    for c0 in range(0, n_queries, block):
        c1 = min(c0 + block, n_queries)
        key_sets: list[KeySet] = []
        spans: list[tuple[int, int] | None] = []
        if window is not None:
            first, last, hidden = shared(masks, window_block, lower, window.positions,
                                         query_positions, c0, c1)
            key_sets.append(KeySet(window.k[:, :, first:last], window.v[:, :, first:last],
                                   hidden, causal=causal))
            spans.append((_WINDOW_SLOT, first))
        masked, idx, union = False, None, None
        if source is not None:
            n_read = int(n_visible[c1 - 1])
            if sparse:
                idx = selection.index[:, c0:c1]
                masked = global_read_is_masked(global_read, c1 - c0, n_read, idx.shape[-1],
                                               h // source.k.shape[1])
            if sparse and global_read == "union":
                union, rows, hidden = shared(masks, union_of_picks, selection.index,
                                             selection.valid, c0, c1, n_read,
                                             source.k.shape[1], source.n_entries)
                if union.shape[1] > UNION_READ_MAX_SHARE * n_read:
                    union, masked = None, True      # nearly every entry: the masked read
            if union is not None:
                unions.append((union, _union_rows(source.k, rows, h),
                               _union_rows(source.v, rows, h)))
                key_sets.append(KeySet(unions[-1][1], unions[-1][2], hidden))
                spans.append((_UNION_SLOT + 2 * (len(unions) - 1), 0))
            elif sparse and not masked:
                hidden = shared(masks, empty_slots, selection.valid, c0, c1)
                key_sets.append(KeySet(source.k, source.v, hidden, gathered=True, index=idx))
                spans.append((_GATHERED_SLOT, 0))
                any_gathered = True
            else:
                if masked:
                    hidden = shared(masks, unpicked_entries, selection.index, selection.valid,
                                    c0, c1, n_read)
                else:
                    hidden = shared(masks, invisible_entries, query_positions,
                                    source.compress_ratio, first_entry, c0, c1, n_read)
                if entry_k is None:
                    entry_k, entry_v = _per_query_head(source.k, h), _per_query_head(source.v, h)
                key_sets.append(KeySet(entry_k[:, :, :n_read], entry_v[:, :, :n_read], hidden,
                                       causal=causal))
                spans.append((_ENTRY_SLOT, 0))
        blocks.append((c0, c1, key_sets, spans, idx, masked, union))

    wants_mass = want_global_probs and source is not None
    global_probs = []
    if all(_flash_applies(q, key_sets) for _, _, key_sets, *_ in blocks):
        # every block through the fused kernel, in one autograd node (see _FlashRead)
        plan = [(c0, c1, tuple(_flash_set(ks, *span, q, masks)
                               for ks, span in zip(key_sets, spans) if ks.width > 0))
                for c0, c1, key_sets, spans, *_ in blocks]
        parents = (window.k if window is not None else None,
                   window.v if window is not None else None,
                   entry_k, entry_v, *((source.k, source.v) if any_gathered else (None, None)),
                   *(t for _, k, v in unions for t in (k, v)))
        result, total = _FlashRead.apply(q, sink, plan, *parents)
        if wants_mass:
            probs = [_set_probs(q[:, :, c0:c1], key_sets[-1], total[:, :, c0:c1])
                     for c0, c1, key_sets, *_ in blocks]
    else:
        outputs, probs = [], []
        for c0, c1, key_sets, *_ in blocks:
            qc = q[:, :, c0:c1]
            out, block_probs = joint_read(qc, key_sets, sink,
                                          len(key_sets) - 1 if wants_mass else None, masks)
            outputs.append(out if out is not None else qc.new_zeros(b, h, c1 - c0, dh))
            probs.append(block_probs[-1] if wants_mass else None)
        result = torch.cat(outputs, dim=2)
    if wants_mass:
        for (c0, c1, key_sets, _, idx, masked, union), p in zip(blocks, probs):
            mass = p.detach().sum(dim=1)
            width = key_sets[-1].width
            if union is not None:     # union columns -> entries -> the selection's slots
                spread = mass.new_zeros(*mass.shape[:2], source.n_entries)
                spread.scatter_(-1, union[:, None, :].expand(-1, mass.shape[1], -1), mass)
                mass = torch.gather(spread, -1, idx)
            elif sparse and masked:   # back to the selection's slots [B, C, k]
                mass = torch.gather(F.pad(mass, (0, source.n_entries - width)), -1, idx)
            elif not sparse:
                mass = F.pad(mass, (0, source.n_entries - width))
            global_probs.append(mass)
    return result, (torch.cat(global_probs, dim=1) if global_probs else None)
