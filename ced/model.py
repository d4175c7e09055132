"""The modules of the CED model family (dense, swa, yoco, ced): the layers and `CEDModel`.

One code path serves training, parallel evaluation and incremental inference:
`CEDModel.run_layers` processes a run of new positions through a run of layers, reading and
(optionally) extending per-layer window caches and per-source global KV states. The parallel
forward calls it once over all positions with empty states; the inference engine calls it with
its cache. Attention itself is `attend`; which window keys a query may see is
`window_lower_bound`; which global entries, `visible_entries` and `select_entries`.
Those live in ced/semantics.py, `attend` and its kernels in ced/attention.py; this file holds
the modules. Semantics: docs/semantics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import (ForwardContext, Selection, SourceKV, WindowKV, _gather_entries,
                        attend, shared)
from .config import LayerSpec, ModelConfig, build_plan, executed_ff_dim, keep_from
from .quant import KVStorage, store
from .semantics import (as_replay_starts, entry_visibility, first_visible_entry, latest_start,
                        merge_starts, rotary, select_entries, visible_entries,
                        window_lower_bound)


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


# Entries the indexer scores at a time (IndexerQuery.scores): the [B, C, heads, chunk]
# intermediate of a 128-query block then stays in cache (timings: benchmarks/README.md).
SCORE_CHUNK = 1024


class IndexerQuery(nn.Module):
    """The lightning indexer's query side for a Full or Reindex layer:
    score(i, j) = sum_h w_h(x_i) * relu(q_h(x_i) . k_j)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim = cfg.indexer_heads, cfg.indexer_dim
        self.q = nn.Linear(cfg.d_model, self.heads * self.dim, bias=False)
        self.w = nn.Linear(cfg.d_model, self.heads, bias=False)

    def _query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, C, D] -> the query vectors q [B, C, heads, Di] and head weights w [B, C, heads]."""
        b, c, _ = x.shape
        return (self.q(x).view(b, c, self.heads, self.dim),
                self.w(x) * (self.heads ** -0.5))

    def _weighted(self, w: Tensor, dots: Tensor) -> Tensor:
        """sum_h w_h * relu(dot_h / sqrt(Di)): w [B, C, heads], dots q . k [B, C, heads, N]
        -> [B, C, N]."""
        return torch.einsum("bch,bchn->bcn", w, torch.relu(dots * (self.dim ** -0.5)))

    def scores(self, x: Tensor, keys: Tensor) -> Tensor:
        """x [B, C, D] (detached by the caller), keys [B, E, Di] -> scores [B, C, E].

        The entries are scored SCORE_CHUNK at a time: the all-pairs intermediate
        [B, C, heads, chunk] then stays in cache, where written whole it made the scoring
        memory-bound at long T. Each score is the same operations on the same numbers (its dot
        over Di, then the sum over heads); a narrow last chunk may be served by another matmul
        kernel and differ in the last bits, as a block of another width always could, which
        `round_scores` makes an exact tie (tests/unit/test_semantics.py)."""
        q, w = self._query(x)
        out = x.new_empty(*x.shape[:2], keys.shape[1])
        for e0 in range(0, max(keys.shape[1], 1), SCORE_CHUNK):   # no entries: one empty chunk
            chunk = keys[:, e0:e0 + SCORE_CHUNK]
            out[:, :, e0:e0 + SCORE_CHUNK] = self._weighted(
                w, torch.einsum("bchd,bed->bche", q, chunk))
        return out

    def picked_scores(self, x: Tensor, keys: Tensor, index: Tensor) -> Tensor:
        """`scores` at the chosen entries only: x [B, C, D], keys [B, E, Di], index [B, C, k]
        -> [B, C, k], scores(x, keys).gather(-1, index) computed from the k gathered keys of
        each query. The indexer's KL reads only these, so its gradient needs nothing of the
        other entries: scoring all of them with autograd kept a [B, C, heads, E] tensor per
        block for a backward that is zero outside the picks (quadratic memory in T)."""
        picked = _gather_entries(keys[:, None], index)[:, 0]              # [B, C, k, Di]
        q, w = self._query(x)
        return self._weighted(w, torch.einsum("bchd,bckd->bchk", q, picked))


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
            with torch.no_grad():     # the selection's scores; their gradient: picked_scores
                scores = self.indexer.scores(x[:, c0:c1], source.index_keys[:, :n_read])
            index, valid = select_entries(scores, n_visible[c0:c1], self.cfg.topk,
                                          None if first is None else first[:, c0:c1])
            if index.shape[-1] < slots:   # fewer entries than slots: pad with invalid slots
                index = F.pad(index, (0, slots - index.shape[-1]))
                valid = F.pad(valid, (0, slots - valid.shape[-1]))
            picks.append(index)
            valids.append(valid)
            if ctx.want_aux:
                picked_scores.append(self.indexer.picked_scores(x[:, c0:c1],
                                                                source.index_keys, index))
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
        first = (shared(ctx.masks, first_visible_entry, positions, source.compress_ratio,
                        ctx.document_starts) if source is not None else None)
        if source is not None and cfg.topk is not None:
            if self.indexer is not None:
                selection = self._select(x, positions, source, first, ctx)
                ctx.selections[spec.global_source] = selection
            else:
                selection = ctx.selections[spec.global_source]
                if ctx.dense_global_read:
                    selection = None
        # no source: a decoder read without its global read (decoder_global_read=False)
        train_indexer = ctx.want_aux and self.indexer is not None and source is not None
        out, global_probs = attend(q, positions, lower, keys, source, selection, self.sink,
                                   cfg.attention_block, want_global_probs=train_indexer,
                                   global_read=cfg.global_read, first_entry=first,
                                   masks=ctx.masks)
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
        ([B, K] or None) on top of whatever positions the window caches lack. The layers'
        masks are built once for the call and shared (`ced.attention.shared`)."""
        for spec in self.plan.part(part):
            block = self.blocks[spec.index]
            x = block.attn_norm(h)
            fed = self.source_fed_by.get(spec.index)
            if fed is not None:
                self.sources[fed].append(state.sources[fed], x, positions)
            lower = None
            if block.attn.has_window:
                lower = shared(ctx.masks, window_lower_bound, positions, spec.window,
                               replay_starts)
            source = (state.sources[spec.global_source] if spec.global_source is not None
                      and (part == "encoder" or self.cfg.decoder_global_read) else None)
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

    def _check_forward_inputs(self, input_ids: Tensor, **decoder_arguments) -> None:
        """One-line ValueErrors naming a bad argument of `forward` (its shape, dtype, token
        range; a decoder argument given to a model without a decoder)."""
        cfg = self.cfg
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, T]; got {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
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
        for name, given in decoder_arguments.items():
            if given is not None and not cfg.has_decoder:
                raise ValueError(f"{name}: variant {cfg.variant!r} has no decoder; only 'yoco' "
                                 "and 'ced' accept it")

    def forward(self, input_ids: Tensor, decoder_replay_start: None | int | Tensor = None,
                encoder_replay_start: None | int | Tensor = None, *, return_aux: bool = False,
                dense_global_read: bool = False, document_starts: None | Tensor = None,
                decoder_global_start: None | int | Tensor = None):
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
        decoder_global_start: None, int, LongTensor[B] or [B, K]: the path cut that complements
        a bounded replay (docs/semantics.md 4.6): a decoder query at i reads only the decoder
        global entries that begin at or after the latest start s <= i (entries before s
        removed, as a document start removes them), while its window chain stays whole. A
        measurement, not an inference mode: the engine has no such argument.
        """
        cfg = self.cfg
        self._check_forward_inputs(input_ids, decoder_replay_start=decoder_replay_start,
                                   decoder_global_start=decoder_global_start)
        b, t = input_ids.shape
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
            if decoder_global_start is not None:
                cut = merge_starts(docs, as_replay_starts(decoder_global_start, b,
                                                          "decoder_global_start",
                                                          input_ids.device))
                # The decoder's global reads see the cut as a document start; its windows
                # do not (dec_starts). Fresh masks: the encoder's were built without it.
                ctx = replace(ctx, document_starts=cut, masks={}, selections={})
            h = self.run_layers("decoder", h, positions, state, ctx, dec_starts)
        logits = self.logits(h)
        if not return_aux:
            return logits
        kl = torch.stack(ctx.indexer_kl).mean() if ctx.indexer_kl else logits.new_zeros(())
        return logits, {"indexer_kl": kl}
