"""Analytic cost model of a CED-family config: parameters, active parameters, FLOPs, KV bytes.

From a `ModelConfig` alone (no torch module is built), for every variant and at any scale:
  * parameters per component and per layer, total and active per token (`layer_costs`);
  * active parameters per token in prefill (early-exited tokens vs replayed tokens) and in
    decode (`active_params`);
  * FLOPs of prefill (full, early exit with replay N, exact replay) and of one decode step as
    functions of the prompt length T (`prefill_flops`, `decode_flops`);
  * KV-cache bytes: global entries per token by source and compression ratio, window KV per
    layer, each in its storage format (`kv_bytes_per_token`, `engine_cache_bytes`);
  * R_exact (precise) and the paper's rounded L_d * W (re-exported from ced.config).

Parts the paper has and ced/model.py does not (MoE experts, mHC, Engram, a shared K=V latent,
low-rank projections) are priced from `ModelConfig.unmodelled`; with `unmodelled=None` the
count is exactly what `CEDModel` builds (tests compare it with `model.parameters()`).

FLOPs count matrix multiplications only, 2 per multiply-add (what
`torch.utils.flop_counter.FlopCounterMode` counts); norms, softmax, RoPE, gathers and sorts are
not FLOPs here. Two countings of the attention-side terms:
  counting="executed": what ced/model.py runs. Queries go in blocks of `attention_block`; a
    block's window logits span the block plus the W-1 earlier positions (a masked rectangle);
    a dense global read, and a top-k read that `global_read_is_masked` runs as a masked
    matmul, span the entries visible to the block's last query (a gathered top-k read: its k
    slots per query; a union read, `global_read=union`, an upper bound: the block's queries
    times k, or the visible entries where `attend` may fall back to the masked read, since
    the union's width depends on the picks); the lightning indexer of a Full/Reindex layer
    scores, per block, the entries visible to the block's last query; the SwiGLU runs at its
    padded width (`executed_ff_dim`). The attention terms are the reference kernel's matmuls
    (`ced.attention.attention_kernel("reference")`); the fused CPU kernel does the same products
    per block, except that a plain causal read is one call whose upper blocks it skips.
    Tests hold this equal to FlopCounterMode on the real model, per inference mode.
  counting="causal": what an ideal kernel needs: each query scores only its own visible
    window keys (min(W, ...)), its own min(topk, visible) entries and indexes only visible
    entries. The paper-scale numbers use this.
Both are produced by the same walk over the layer plan (`_Walk`); only the per-block counts
differ. Semantics: docs/semantics.md (sections 1, 3, 4.1, 7).

The report of one config (`report`, `render`) is `ced.cost.report`; its CLI is
`python -m ced.cost model=deepseek_v41_flash [seq_len=131072] [--json | json=true]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ..config import (UNION_READ_MAX_SHARE, LayerSpec, ModelConfig, build_plan,
                      default_hidden_tail, executed_ff_dim, exact_replay_length,
                      global_read_is_masked, keep_from, paper_replay_length, resolve_replay)
from ..storage import StorageFormat, parse_storage

COUNTINGS = ("executed", "causal")
DEFAULT_DTYPE = "fp32"

# ---------------------------------------------------------------------------------------------
# Widths
# ---------------------------------------------------------------------------------------------


def _union_bound(queries: int, visible: int, slots: int) -> int:
    """The most entries a union top-k read (`global_read=union`) scores per query of a block:
    its union holds at most queries x slots of the visible entries; where that many could
    exceed UNION_READ_MAX_SHARE of them, `attend` may fall back to the masked read of all.
    The union's true size depends on the picks, so the executed count is this bound."""
    most = queries * slots
    return most if most <= UNION_READ_MAX_SHARE * visible else visible


@dataclass(frozen=True)
class Widths:
    """The widths the cost formulas need, resolved from the config (latent form or not)."""

    d: int
    heads: int
    head_dim: int          # query/key/value width per head in attention
    window_values: int     # values cached per window position per layer (K and V)
    entry_values: int      # values per global entry (K and V)
    indexer_in: int        # input width of the indexer query projection
    latent: bool
    entry_heads: int = 0   # K/V heads of a global entry (global_kv_heads); 0 in latent form

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Widths":
        u = cfg.unmodelled
        if u is not None and u.kv_latent_dim is not None:
            lat = u.kv_latent_dim
            return cls(cfg.d_model, cfg.n_heads, lat, lat, lat,
                       u.q_lora_rank or cfg.d_model, True)
        q_in = u.q_lora_rank if u is not None and u.q_lora_rank else cfg.d_model
        g = cfg.n_global_kv_heads
        return cls(cfg.d_model, cfg.n_heads, cfg.head_dim, 2 * cfg.d_model,
                   2 * g * cfg.head_dim, q_in, False, g)


# ---------------------------------------------------------------------------------------------
# Parameters per component and per layer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One component: parameters held, parameters active per token, matmul FLOPs per token."""

    total: int
    active: int
    flops: int

    def __add__(self, other: "Part") -> "Part":
        return Part(self.total + other.total, self.active + other.active,
                    self.flops + other.flops)


def _dense_part(n_in: int, n_out: int) -> Part:
    """A weight matrix n_in -> n_out applied once per token."""
    return Part(n_in * n_out, n_in * n_out, 2 * n_in * n_out)


def _vector_part(n: int) -> Part:
    """Parameters without matmul FLOPs (norm weights, sinks, biases, scalars)."""
    return Part(n, n, 0)


ZERO = Part(0, 0, 0)


@dataclass(frozen=True)
class SourceCost:
    """A global KV source: its projection parameters, FLOPs per token fed and per entry made."""

    index: int
    part: str
    compress_ratio: int
    owner_layer: int            # the layer whose row carries it (encoder leader / first decoder)
    params: int
    flops_per_token: int
    flops_per_entry: int


@dataclass(frozen=True)
class LayerCost:
    index: int
    part: str
    window: int | None
    full_causal: bool
    global_mode: str | None
    global_source: int | None
    components: dict[str, Part]

    @property
    def total(self) -> int:
        return sum(p.total for p in self.components.values())

    @property
    def active(self) -> int:
        return sum(p.active for p in self.components.values())

    @property
    def token_flops(self) -> int:
        """Matmul FLOPs per token of this layer, excluding the source it feeds (counted per
        token fed, see SourceCost) and the attention-score terms (counted by `_Walk`)."""
        return sum(p.flops for name, p in self.components.items() if name != "global_source")


def _source_costs(cfg: ModelConfig) -> list[SourceCost]:
    w = Widths.of(cfg)
    plan = build_plan(cfg)
    out = []
    for s in plan.sources:
        m = s.compress_ratio
        # K/V projection of every token: d -> 2 G Dh (ours, G = global_kv_heads) or
        # d -> latent (shared K=V).
        kv = w.d * w.entry_values
        # Softmax-gated pooling: gate per K/V head (ours) or per latent channel, and a bias per
        # block slot. Our choice for the latent form: per-channel gating.
        gate_width = w.entry_values if w.latent else w.entry_heads
        gate = w.d * gate_width + m * gate_width if m > 1 else 0
        index_key = w.entry_values * cfg.indexer_dim if cfg.topk is not None else 0
        norm = cfg.d_model if s.part == "decoder" else 0        # RMSNorm(H_{L_e})
        owner = s.from_layer if s.from_layer is not None else cfg.n_encoder_layers
        flops_token = 2 * kv + (2 * w.d * gate_width if m > 1 else 0)
        out.append(SourceCost(s.index, s.part, m, owner, kv + gate + index_key + norm,
                              flops_token, 2 * index_key))
    return out


def _attention_part(cfg: ModelConfig, has_window: bool) -> Part:
    w, u = Widths.of(cfg), cfg.unmodelled
    q_out = w.heads * w.head_dim
    part = ZERO
    if u is not None and u.q_lora_rank:
        part = part + _dense_part(w.d, u.q_lora_rank) + _vector_part(u.q_lora_rank)
        part = part + _dense_part(u.q_lora_rank, q_out)
    else:
        part = part + _dense_part(w.d, q_out)
    if has_window:
        part = part + (_dense_part(w.d, w.window_values) if w.latent
                       else _dense_part(w.d, w.d) + _dense_part(w.d, w.d))
    if u is not None and u.o_lora_rank:
        part = part + _dense_part(q_out, u.o_lora_rank) + _dense_part(u.o_lora_rank, w.d)
    else:
        part = part + _dense_part(q_out, w.d)
    if cfg.attention_sink:
        part = part + _vector_part(cfg.n_heads)
    return part


def _ffn_part(cfg: ModelConfig) -> Part:
    u, d = cfg.unmodelled, cfg.d_model
    if u is None or not u.has_moe:
        return Part(3 * d * cfg.ff_dim, 3 * d * cfg.ff_dim, 6 * d * cfg.ff_dim)
    expert = 3 * d * u.moe_ff_dim
    router = d * u.moe_routed_experts
    total = router + (u.moe_routed_experts + u.moe_shared_experts) * expert
    active = router + (u.moe_active_experts + u.moe_shared_experts) * expert
    return Part(total, active, 2 * active)


def _hc_part(cfg: ModelConfig) -> Part:
    """mHC for the two sublayers of one layer: mapping (n d) -> (n^2 + 2n), its bias, 3 gates;
    FLOPs: the mapping, the pre-mix (n -> 1), the post-mix (1 -> n), the residual mix (n x n)."""
    u = cfg.unmodelled
    if u is None or u.hc_streams is None:
        return ZERO
    n, d = u.hc_streams, cfg.d_model
    maps = n * n + 2 * n
    per = Part(n * d * maps + maps + 3, n * d * maps + maps + 3,
               2 * n * d * maps + 2 * n * d + 2 * n * d + 2 * n * n * d)
    return per + per


def _engram_part(cfg: ModelConfig) -> Part:
    u, d = cfg.unmodelled, cfg.d_model
    branches = u.hc_streams or 1
    row = u.engram_dim // u.engram_lookups
    table = u.engram_table_rows * row
    proj = u.engram_dim * d * (1 + branches)          # value + one key per residual stream
    conv = d * u.engram_conv_kernel
    return Part(table + proj + conv, u.engram_dim + proj + conv,
                2 * proj + 2 * conv + 2 * d * branches)


def layer_costs(cfg: ModelConfig) -> list[LayerCost]:
    """Per-layer components: norms, attention (q, window K/V, o, sink), indexer query (Full /
    Reindex layers with topk), global_source (the source this layer feeds: an encoder group
    leader, or the decoder source on the first decoder layer), ffn (SwiGLU or MoE), hc (mHC),
    engram."""
    plan = build_plan(cfg)
    w, u = Widths.of(cfg), cfg.unmodelled
    sources = {s.owner_layer: s for s in _source_costs(cfg)} if plan.sources else {}
    out = []
    for spec in plan.layers:
        has_window = spec.window is not None or spec.full_causal
        comps: dict[str, Part] = {"norms": _vector_part(2 * cfg.d_model),
                                  "attention": _attention_part(cfg, has_window)}
        if cfg.topk is not None and spec.global_mode in ("full", "reindex"):
            comps["indexer"] = (_dense_part(w.indexer_in, cfg.indexer_heads * cfg.indexer_dim)
                                + _dense_part(w.d, cfg.indexer_heads))
        src = sources.get(spec.index)
        if src is not None:
            comps["global_source"] = Part(src.params, src.params, 0)
        comps["ffn"] = _ffn_part(cfg)
        if u is not None and u.hc_streams is not None:
            comps["hc"] = _hc_part(cfg)
        if u is not None and spec.index in u.engram_layers:
            comps["engram"] = _engram_part(cfg)
        out.append(LayerCost(spec.index, spec.part, spec.window, spec.full_causal,
                             spec.global_mode, spec.global_source, comps))
    return out


def _embedding_params(cfg: ModelConfig) -> int:
    """The token embedding plus the input token-mixing weights (ModelConfig.shift_tokens)."""
    return (cfg.vocab_size + cfg.shift_tokens) * cfg.d_model


def model_params(cfg: ModelConfig) -> dict[str, int]:
    """Whole-model parameter counts: embedding, lm_head (0 when tied), final norm, layers."""
    layers = layer_costs(cfg)
    emb = _embedding_params(cfg)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    counts = {"embedding": emb, "lm_head": head, "final_norm": cfg.d_model,
              "layers_total": sum(lc.total for lc in layers),
              "layers_active": sum(lc.active for lc in layers)}
    counts["total"] = emb + head + cfg.d_model + counts["layers_total"]
    return counts


def active_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters a token touches (embedding counted whole, as the paper counts it):

    early_exited_token: prefill token that stops after the encoder: embedding, encoder layers,
      and the decoder's KV source (every prompt token feeds the decoder's global KV);
    replayed_token: a prefill token that also runs the decoder layers (no LM head: only the
      last prompt position computes logits);
    decode_token: every layer, the embedding and the LM head (the head counted even when tied,
      as the paper's 2 x 0.66B does).
    Variants without a decoder have no early exit: all three are the full depth.
    """
    layers = layer_costs(cfg)
    emb = _embedding_params(cfg)
    head = cfg.vocab_size * cfg.d_model
    norms = cfg.d_model                                     # final norm
    enc = sum(lc.active for lc in layers if lc.part == "encoder")
    dec_layers = [lc for lc in layers if lc.part == "decoder"]
    dec_src = sum(lc.components["global_source"].active for lc in dec_layers
                  if "global_source" in lc.components)
    dec = sum(lc.active for lc in dec_layers) - dec_src
    early = emb + enc + dec_src
    replayed = early + dec + norms
    return {"early_exited_token": early if cfg.has_decoder else replayed,
            "replayed_token": replayed,
            "decode_token": replayed + head,
            "embedding": emb, "lm_head": head,
            "encoder_layers": enc, "decoder_layers": dec, "decoder_source": dec_src}


# ---------------------------------------------------------------------------------------------
# FLOPs: one walk over the plan, mirroring CEDModel.run_layers / InferenceEngine._advance
# ---------------------------------------------------------------------------------------------


def _sum_floor_div(n: int, m: int) -> int:
    """sum_{j=1}^{n} floor(j / m)."""
    if n <= 0:
        return 0
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _sum_visible(a: int, b: int, m: int) -> int:
    """Entries visible to queries a..b-1 summed: sum floor((i + 1) / m)."""
    return _sum_floor_div(b, m) - _sum_floor_div(a, m)


def _sum_visible_capped(a: int, b: int, m: int, k: int) -> int:
    """sum_{i=a}^{b-1} min(k, floor((i + 1) / m))."""
    cut = k * m - 1                 # first query position with >= k visible entries
    if b <= cut:
        return _sum_visible(a, b, m)
    if a >= cut:
        return k * (b - a)
    return _sum_visible(a, cut, m) + k * (b - cut)


def _sum_min(c0: int, c1: int, cap: int | None) -> int:
    """sum_{c=c0}^{c1} min(cap, c) for 1 <= c0 (cap None: no cap)."""
    def g(n: int) -> int:
        if n <= 0:
            return 0
        if cap is None or n <= cap:
            return n * (n + 1) // 2
        return cap * (cap + 1) // 2 + (n - cap) * cap
    return g(c1) - g(c0 - 1)


@dataclass
class FlopTally:
    """FLOPs by kind. `linear`: per-token projections of layers (q, K/V, o, indexer q/w, FFN,
    mHC, Engram); `sources`: global KV projections, pooling gates and indexer keys;
    `window_attention`, `global_attention`: QK and PV over window keys and global entries;
    `indexer`: lightning-indexer scoring; `head`: the LM head."""

    linear: int = 0
    sources: int = 0
    window_attention: int = 0
    global_attention: int = 0
    indexer: int = 0
    head: int = 0
    by_part: dict[str, int] = field(default_factory=lambda: {"encoder": 0, "decoder": 0})

    @property
    def total(self) -> int:
        return (self.linear + self.sources + self.window_attention + self.global_attention
                + self.indexer + self.head)

    def as_dict(self) -> dict[str, int]:
        return {"linear": self.linear, "sources": self.sources,
                "window_attention": self.window_attention,
                "global_attention": self.global_attention, "indexer": self.indexer,
                "head": self.head, "encoder_layers": self.by_part["encoder"],
                "decoder_layers": self.by_part["decoder"], "total": self.total}


class _Walk:
    """Replays the structure of the engine's calls on a cache made of counts: per window layer
    the contiguous range of positions it holds, per source the number of tokens it consumed."""

    def __init__(self, cfg: ModelConfig, counting: str, batch: int = 1):
        if counting not in COUNTINGS:
            raise ValueError(f"counting: must be one of {COUNTINGS}; got {counting!r}")
        self.cfg, self.counting, self.batch = cfg, counting, batch
        self.plan = build_plan(cfg)
        self.layers = layer_costs(cfg)
        self.sources = _source_costs(cfg) if self.plan.sources else []
        self.fed_by = {s.owner_layer: s.index for s in self.sources if s.part == "encoder"}
        self.windows: dict[int, tuple[int, int]] = {}     # layer -> (lo, hi) held
        self.consumed = [0] * len(self.plan.sources)
        self.tally = FlopTally()
        w = Widths.of(cfg)
        self.attn_per_key = 4 * w.heads * w.head_dim     # QK + PV, per query per key
        self.index_per_entry = 2 * cfg.indexer_heads * cfg.indexer_dim + 2 * cfg.indexer_heads

    # -- pieces ------------------------------------------------------------------------------
    def _feed(self, src: int, start: int, end: int, part: str) -> None:
        s = self.sources[src]
        first = max(start, self.consumed[src])
        if end <= first:
            return
        n_new = end // s.compress_ratio - self.consumed[src] // s.compress_ratio
        flops = self.batch * ((end - first) * s.flops_per_token + n_new * s.flops_per_entry)
        self.tally.sources += flops
        self.tally.by_part[part] += flops
        self.consumed[src] = end

    def _blocks(self, start: int, end: int):
        if self.counting == "causal":
            yield start, end
            return
        step = self.cfg.attention_block
        for a in range(start, end, step):
            yield a, min(a + step, end)

    def _layer(self, lc: LayerCost, spec: LayerSpec, start: int, end: int) -> None:
        cfg, b, t = self.cfg, self.batch, self.tally
        n = end - start
        flops = b * n * lc.token_flops
        if self.counting == "executed" and "ffn" in lc.components and not (
                cfg.unmodelled is not None and cfg.unmodelled.has_moe):
            # the zero units of the padded SwiGLU width (ced.config.executed_ff_dim)
            flops += b * n * 6 * cfg.d_model * (executed_ff_dim(cfg) - cfg.ff_dim)
        t.linear += flops
        src_index = self.fed_by.get(spec.index)
        before = t.total
        if src_index is not None:
            self._feed(src_index, start, end, lc.part)
        has_window = spec.window is not None or spec.full_causal
        lo = start
        if has_window:
            held = self.windows.get(spec.index)
            if held is not None and held[1] == start and held[0] < held[1]:
                lo = held[0]
        source = self.sources[spec.global_source] if spec.global_source is not None else None
        entries = (self.consumed[spec.global_source] // source.compress_ratio
                   if source is not None else 0)
        indexes = (cfg.topk is not None and spec.global_mode in ("full", "reindex"))
        for a, z in self._blocks(start, end):
            q = z - a
            if has_window:
                if self.counting == "executed":
                    low = 0 if spec.full_causal else max(a - spec.window + 1, 0)
                    keys = q * (z - max(lo, low))
                else:
                    cap = None if spec.full_causal else spec.window
                    keys = _sum_min(a - lo + 1, z - lo, cap)
                t.window_attention += b * keys * self.attn_per_key
            if source is not None:
                m = source.compress_ratio
                if self.counting == "executed":
                    if cfg.topk is None:
                        read = q * (z // m)
                    elif cfg.global_read == "union":
                        read = q * _union_bound(q, z // m, min(cfg.topk, entries))
                    else:   # the same per-block choice as ced.attention.attend
                        slots = min(cfg.topk, entries)
                        masked = global_read_is_masked(cfg.global_read, q, z // m, slots,
                                                       cfg.n_heads // cfg.n_global_kv_heads)
                        read = q * (z // m if masked else slots)
                    scored = q * min(entries, z // m)   # the entries visible to the block
                else:
                    read = (_sum_visible_capped(a, z, m, cfg.topk) if cfg.topk is not None
                            else _sum_visible(a, z, m))
                    scored = _sum_visible(a, z, m)
                t.global_attention += b * read * self.attn_per_key
                if indexes:
                    t.indexer += b * scored * self.index_per_entry
        t.by_part[lc.part] += flops + (t.total - before)
        if has_window:
            self.windows[spec.index] = (max(lo, keep_from(end, spec.window)), end)

    def run(self, part: str, start: int, end: int) -> None:
        if end <= start:
            return
        for spec in self.plan.part(part):
            self._layer(self.layers[spec.index], spec, start, end)

    def feed_decoder(self, start: int, end: int) -> None:
        dec = self.plan.decoder_source
        if dec is not None:
            self._feed(dec.index, start, end, "decoder")

    def head(self, positions: int) -> None:
        self.tally.head += self.batch * positions * 2 * self.cfg.d_model * self.cfg.vocab_size

    # -- the engine's and the model's calls ----------------------------------------------------
    def advance(self, encoder_from: int, decoder_from: int, end: int) -> None:
        """InferenceEngine._advance: encoder [encoder_from, end), decoder source, decoder
        [decoder_from, end), logits at the last position."""
        self.run("encoder", encoder_from, end)
        if self.cfg.has_decoder:
            self.feed_decoder(encoder_from, end)
            self.run("decoder", decoder_from, end)
        self.head(1)

    def clear_decoder_windows(self) -> None:
        for spec in self.plan.part("decoder"):
            self.windows.pop(spec.index, None)


def _check_length(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}; got {value!r}")


def prefill_flops(cfg: ModelConfig, seq_len: int, replay: None | int | str = None,
                  counting: str = "causal", batch: int = 1) -> FlopTally:
    """FLOPs of `InferenceEngine.prefill` of a `seq_len`-token prompt: replay None (every
    token through every layer), an int N (early exit, the decoder runs the last N) or 'exact'
    (N = R_exact). Logits at the last position only."""
    _check_length("seq_len", seq_len)
    walk = _Walk(cfg, counting, batch)
    n = resolve_replay(cfg, replay, seq_len)
    walk.advance(0, seq_len - n, seq_len)
    return walk.tally


def engine_flops(cfg: ModelConfig, seq_len: int, replay: None | int | str = None,
                 decode_steps: int = 0, counting: str = "executed",
                 batch: int = 1) -> list[FlopTally]:
    """FLOPs of a prefill followed by `decode_steps` decode steps, one tally per call (the
    decode steps see the cache the prefill left, e.g. decoder windows holding only replayed
    positions)."""
    _check_length("seq_len", seq_len)
    walk = _Walk(cfg, counting, batch)
    n = resolve_replay(cfg, replay, seq_len)
    walk.advance(0, seq_len - n, seq_len)
    tallies = [walk.tally]
    for step in range(decode_steps):
        walk.tally = FlopTally()
        walk.advance(seq_len + step, seq_len + step, seq_len + step + 1)
        tallies.append(walk.tally)
    return tallies


def decode_flops(cfg: ModelConfig, context: int, counting: str = "causal",
                 batch: int = 1) -> FlopTally:
    """FLOPs of one decode step after a full prefill of `context` tokens (the new token sits
    at position `context`; every window is full)."""
    _check_length("context", context)
    return engine_flops(cfg, context, None, 1, counting, batch)[1]


def forward_flops(cfg: ModelConfig, seq_len: int, counting: str = "executed",
                  batch: int = 1) -> FlopTally:
    """FLOPs of the parallel forward `CEDModel.forward(ids)` (logits at every position)."""
    _check_length("seq_len", seq_len)
    walk = _Walk(cfg, counting, batch)
    walk.run("encoder", 0, seq_len)
    if cfg.has_decoder:
        walk.feed_decoder(0, seq_len)
        walk.run("decoder", 0, seq_len)
    walk.head(seq_len)
    return walk.tally


def prefill_flops_ratio(cfg: ModelConfig, seq_len: int, replay: None | int | str = "W",
                        counting: str = "causal") -> float:
    """FLOPs of early-exit prefill with `replay` (any form of `ced.config.replay_length`;
    default 'W', N = window) over the full prefill."""
    full = prefill_flops(cfg, seq_len, None, counting).total
    return prefill_flops(cfg, seq_len, replay, counting).total / full


# ---------------------------------------------------------------------------------------------
# KV-cache bytes
# ---------------------------------------------------------------------------------------------


def _formats(cfg: ModelConfig, dtype: str | None) -> tuple[StorageFormat, StorageFormat,
                                                           StorageFormat]:
    """Window, global and indexer-key formats: the config's, or `dtype` (default fp32) where
    the config says None. (The engine stores everything in the model's dtype whatever the
    config says: that is `engine_cache_bytes`.)"""
    base = dtype or DEFAULT_DTYPE
    return (parse_storage(cfg.window_kv_dtype or base), parse_storage(cfg.global_kv_dtype or base),
            parse_storage(cfg.indexer_key_dtype or base))


def kv_bytes_per_token(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """Global KV bytes per token of sequence, by source, in the configured storage formats
    (`dtype`, default fp32, for the fields left None), and window KV per layer.

    Entry bytes = main entry (K and V: 2 d values, or one shared latent) + indexer key (with
    topk); a source of ratio m adds 1/m entry per token. Returned as exact fractions turned
    to float where needed (`global_kv_bytes_per_token` is exact for V4.1: 890)."""
    window_fmt, global_fmt, index_fmt = _formats(cfg, dtype)
    w = Widths.of(cfg)
    plan = build_plan(cfg)
    entry_main = global_fmt.vector_bytes(w.entry_values)
    entry_index = index_fmt.vector_bytes(cfg.indexer_dim) if cfg.topk is not None else 0
    entry = entry_main + entry_index
    sources = []
    per_token = Fraction(0)
    entries = Fraction(0)
    for s in plan.sources:
        share = Fraction(1, s.compress_ratio)
        entries += share
        per_token += share * entry
        sources.append({"source": s.index, "part": s.part, "from_layer": s.from_layer,
                        "compress_ratio": s.compress_ratio, "entries_per_token": float(share),
                        "bytes_per_token": float(share * entry)})
    position_bytes = window_fmt.vector_bytes(w.window_values)
    windows = []
    for spec in plan.layers:
        if spec.window is not None:
            # A full window: what the layer holds once it has computed W - 1 positions or more.
            held = spec.window - keep_from(spec.window, spec.window)
            windows.append({"layer": spec.index, "part": spec.part, "positions": held,
                            "bytes": held * position_bytes})
        elif spec.full_causal:
            windows.append({"layer": spec.index, "part": spec.part, "positions": "all",
                            "bytes_per_token": position_bytes})
    total_bytes = per_token
    return {
        "formats": {"window_kv": window_fmt.name, "global_kv": global_fmt.name,
                    "indexer_key": index_fmt.name if cfg.topk is not None else None},
        "entry_bytes": {"main": entry_main, "indexer_key": entry_index, "total": entry},
        "global_entries_per_token": float(entries),
        "global_kv_bytes_per_token": (int(total_bytes) if total_bytes.denominator == 1
                                      else float(total_bytes)),
        "sources": sources,
        "window_position_bytes": position_bytes,
        "window_kv_per_layer": windows,
        "window_kv_bytes_all_layers": sum(x.get("bytes", 0) for x in windows),
    }


def engine_cache_bytes(cfg: ModelConfig, seq_len: int, replay: None | int | str = None,
                       decode_steps: int = 0, batch: int = 1, dtype: str = "fp32",
                       hidden_tail: int | None = None) -> dict[str, int]:
    """Bytes `Cache.nbytes()` reports after `InferenceEngine.prefill(ids[B, seq_len], replay)`
    and `decode_steps` decode steps, with every tensor in the model's `dtype`:

    window_kv: each window layer holds min(W - 1, positions it computed) positions of K and V
      (2 d values); a full-causal (dense) layer holds every position; after an early-exit
      prefill the decoder layers computed only the replayed positions (then the decoded ones);
    global_kv: floor(L / m) entries per source, K and V (2 G Dh values each entry, G =
      n_global_kv_heads: 2 d with multi-head entries);
    indexer_keys: indexer_dim values per entry (with topk);
    pending_blocks: the L mod m tokens of the incomplete block, 2 G Dh projected values each
      plus G gate logits (ratio > 1);
    encoder_hidden: H_{L_e} of the last min(hidden_tail, L) positions (d values each).
    L = seq_len + decode_steps. hidden_tail defaults as InferenceEngine's does."""
    _check_length("seq_len", seq_len)
    _check_length("decode_steps", decode_steps, 0)
    fmt = parse_storage(dtype)
    plan = build_plan(cfg)
    length = seq_len + decode_steps
    n_dec = resolve_replay(cfg, replay, seq_len) + decode_steps if cfg.has_decoder else 0
    d, size = cfg.d_model, (lambda values: batch * fmt.vector_bytes(values))
    window = 0
    for spec in plan.layers:
        if spec.full_causal or spec.window is not None:
            computed = n_dec if spec.part == "decoder" else length
            held = computed - max(0, keep_from(computed, spec.window))
            window += held * size(2 * d)
    global_kv = index = pending = 0
    g = cfg.n_global_kv_heads
    entry = 2 * g * cfg.head_dim
    for s in plan.sources:
        m = s.compress_ratio
        entries, rest = divmod(length, m)
        global_kv += entries * size(entry)
        if cfg.topk is not None:
            index += entries * size(cfg.indexer_dim)
        pending += rest * (size(entry) + (size(g) if m > 1 else 0))
    if hidden_tail is None:
        hidden_tail = default_hidden_tail(cfg)
    tail = min(hidden_tail, length) if cfg.has_decoder else 0
    counts = {"window_kv": window, "global_kv": global_kv, "indexer_keys": index,
              "pending_blocks": pending, "encoder_hidden": tail * size(d)}
    counts["total"] = sum(counts.values())
    return counts
