"""Model configuration, its validation, and the layer schedule derived from it.

Everything structural about a variant (which layers have a window, which read which global KV,
in which mode, with which compression) is computed here, by `build_plan`, and nowhere else.
See docs/semantics.md sections 1 and 3.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Literal

from .storage import parse_storage


@dataclass(frozen=True)
class VariantTraits:
    """What a variant is, structurally (docs/semantics.md section 1). `build_plan` builds the
    layer plan from these, and every other place that needs to know "does this variant have
    X" asks `VARIANT_TRAITS` (or `ModelConfig.traits`) instead of naming variants.

    has_decoder:       split into encoder and decoder parts: early exit, decoder replay and
                       prefix-cache encoder replay exist.
    has_windows:       layers attend through a sliding window of W (False: dense, whose window
                       is the whole causal prefix).
    decoder_windows:   decoder layers have their own windows, so a decoder replay is exact only
                       from R_exact = L_d * (W - 1) + 1 (without them R_exact = 1).
    encoder_global_kv: encoder layers from `global_from_layer` read grouped global KVs.
    topk_study:        the study driver evaluates this variant's checkpoints with top-k
                       overrides (experiments.run, suite `topk`): the variant whose sparse reads
                       of compressed KV the top-k study is about.
    """

    has_decoder: bool
    has_windows: bool
    decoder_windows: bool
    encoder_global_kv: bool
    topk_study: bool

    @property
    def exact_early_exit(self) -> bool:
        """Any decoder replay N >= 1 is exact: a decoder without windows (yoco)."""
        return self.has_decoder and not self.decoder_windows


VARIANT_TRAITS: dict[str, VariantTraits] = {
    "dense": VariantTraits(has_decoder=False, has_windows=False, decoder_windows=False,
                           encoder_global_kv=False, topk_study=False),
    "swa": VariantTraits(has_decoder=False, has_windows=True, decoder_windows=False,
                         encoder_global_kv=False, topk_study=False),
    "yoco": VariantTraits(has_decoder=True, has_windows=True, decoder_windows=False,
                          encoder_global_kv=False, topk_study=False),
    "ced": VariantTraits(has_decoder=True, has_windows=True, decoder_windows=True,
                         encoder_global_kv=True, topk_study=True),
}
VARIANTS = tuple(VARIANT_TRAITS)
GLOBAL_READS = ("auto", "gather", "masked", "union")
# With global_read="auto", a block of queries reads its top-k entries through the masked dense
# matmul while the visible entries number at most this many times the top-k slots, divided by
# the query heads per K/V head (global_kv_heads): where the two reads cost the same on CPU (the
# gather copies each entry once per K/V head). The measurements: benchmarks/README.md, "The
# auto rule of the top-k read".
MASKED_READ_MAX_RATIO = 32
# With global_read="union", a block whose union of picks holds more than this share of the
# entries visible to it reads them masked instead: the union's copy of its K/V rows then costs
# more than the entries it skips (a block of 64 queries at T = 512, fp32, one thread: the two
# break even near 0.7; benchmarks/README.md, "The union read, built").
UNION_READ_MAX_SHARE = 0.75
# CPU GEMMs ran up to 1.3x slower at a SwiGLU width such as 683 than at 688 (benchmarks/README):
# the MLP runs its hidden width padded to a multiple of this (`executed_ff_dim`).
FF_PAD = 16
GlobalMode = Literal["full", "reindex", "reuse"]


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model. Keys equal those of `conf/model/*.yaml`.

    Variants (one code path, docs/semantics.md section 1):
      dense: `n_encoder_layers + n_decoder_layers` layers of full causal attention (`window` unused).
      swa:   the same depth, sliding-window attention only.
      yoco:  SWA encoder; decoder layers read only ONE global KV projected from the normalised
             encoder output (no decoder windows, ratio 1).
      ced:   encoder layers >= `global_from_layer` add global reads over `encoder_kv_groups`
             shared KVs; every decoder layer has its own window plus a read of ONE decoder global
             KV projected from the normalised encoder output.
    Fields that a variant does not use (e.g. `encoder_kv_groups` for `yoco`) are ignored.
    """

    variant: str = "ced"
    vocab_size: int = 259
    d_model: int = 128
    n_heads: int = 4
    n_encoder_layers: int = 8
    n_decoder_layers: int = 8
    window: int = 32
    topk: int | None = None
    global_from_layer: int = 2
    encoder_kv_groups: int = 3
    encoder_compress_ratio: int = 2
    decoder_compress_ratio: int = 1
    decoder_reindex_every: int | None = None
    indexer_heads: int = 4
    indexer_dim: int = 32
    attention_sink: bool = True
    d_ff: int | None = None
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    dropout: float = 0.0
    tie_embeddings: bool = False
    # Short causal token mixing at the input: position i's embedding plus a learned per-channel
    # multiple of the embeddings of tokens i-1 .. i-shift_tokens (0: off). A function of the
    # token ids alone, so it needs no cache and is the same under every replay policy; it turns
    # associative recall into a one-step lookup (see CEDModel.embed_tokens).
    shift_tokens: int = 0
    # Standard deviation of those per-channel weights at init. Zero starts the model as the
    # plain embedding, which is a saddle: the attention that would use the previous token's
    # embedding gets no gradient while the weights are zero, and the weights none while no
    # attention uses them; small models then take thousands of steps to learn recall, or never
    # (FINDINGS.md 0.4). A random init (1.0) breaks it.
    shift_init: float = 1.0
    # Queries are processed in blocks of this many positions; a speed/memory knob only.
    attention_block: int = 128
    # How a top-k read is executed (same result either way, see `global_read_is_masked`):
    # "gather" copies each query's k entries; "masked" scores every visible entry with one
    # matmul and masks the unselected ones; "auto" picks the cheaper per query block; "union"
    # scores, per query block and batch row, only the entries some query of the block picked
    # (one matmul over their union, the others masked; its size depends on the picks).
    global_read: str = "auto"
    # A path ablation, for evaluation (`ced.checkpoint.evaluation_overrides`, decoder_global=off):
    # False removes every decoder layer's read of the decoder global KV, leaving its window
    # alone. Evidence from before a bounded replay's start reaches the decoder by that global
    # read or by the decoder's window chain, which the replay cuts; a model read without the
    # read shows what the chain carries (docs/semantics.md 4.6). ced only; True as trained.
    decoder_global_read: bool = True
    # K/V heads of every global KV (the entries a layer's global read sees). None: n_heads,
    # one K and one V row per head (multi-head). 1: one K and one V row per entry shared by
    # every query head (multi-query; V4.1 shares one entry across heads, there as one latent
    # used as both K and V). Must divide n_heads; query head i reads K/V head
    # i // (n_heads / global_kv_heads). Fewer heads: smaller source projections, entries and
    # cache, and a top-k gather that copies each selected entry once per K/V head.
    global_kv_heads: int | None = None
    # Storage formats of cached KV at deployment (see ced/storage.py: "fp32", "bf16", "fp8",
    # "fp4_block16", ...). None: the model's own dtype, which is what the engine stores. The
    # cost model prices every format; CEDModel fake-quantises window K/V, global KV entries
    # and indexer keys where they are stored (ced/quant.py says which formats it implements).
    window_kv_dtype: str | None = None
    global_kv_dtype: str | None = None
    indexer_key_dtype: str | None = None
    # Training through those formats: True uses a straight-through estimator (identity
    # gradient); False differentiates the quantiser as written (fp8/fp4 rounding has zero
    # gradient). See ced/quant.py.
    kv_quant_aware: bool = False
    # ---- cost model only (ced.cost); CEDModel and the engine ignore this ------------------
    # Parts of the paper-scale model that ced/model.py does not implement (MoE, mHC, Engram,
    # latent attention), described so that the cost model prices them; see UnmodelledParts.
    # None (every small config): the model is exactly what ced/model.py builds.
    unmodelled: "UnmodelledParts | None" = None

    def __post_init__(self) -> None:
        if isinstance(self.unmodelled, dict):
            object.__setattr__(self, "unmodelled", UnmodelledParts.from_dict(self.unmodelled))
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_global_kv_heads(self) -> int:
        """K/V heads of a global KV entry (global_kv_heads, or n_heads when None)."""
        return self.n_heads if self.global_kv_heads is None else self.global_kv_heads

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def n_layers(self) -> int:
        return self.n_encoder_layers + self.n_decoder_layers

    @property
    def describes_unmodelled_parts(self) -> bool:
        """True when the config prices parts CEDModel does not build (cost model only)."""
        return self.unmodelled is not None

    @property
    def traits(self) -> VariantTraits:
        """The variant's structural description (`VARIANT_TRAITS`)."""
        return VARIANT_TRAITS[self.variant]

    @property
    def has_decoder(self) -> bool:
        """True for the split variants (yoco, ced), whose decoder can be early-exited."""
        return self.traits.has_decoder

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """Build from a plain mapping (e.g. a Hydra node); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig: unknown key(s) {unknown}; allowed keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fail(field_name: str, message: str, value: Any) -> None:
    raise ValueError(f"ModelConfig.{field_name}: {message}; got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(c: ModelConfig, name: str, minimum: int, none_means: str | None = None) -> None:
    value = getattr(c, name)
    if value is None and none_means is not None:
        return
    if not _is_int(value) or value < minimum:
        allowed = f"an integer >= {minimum}"
        _fail(name, f"must be None ({none_means}) or {allowed}" if none_means
              else f"must be {allowed}", value)


def _validate(c: ModelConfig) -> None:
    if c.variant not in VARIANTS:
        _fail("variant", f"must be one of {VARIANTS}", c.variant)
    for name in ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "max_seq_len",
                 "indexer_heads", "indexer_dim", "attention_block", "encoder_compress_ratio",
                 "decoder_compress_ratio"):
        _check_int(c, name, 1)
    if c.d_model % c.n_heads:
        _fail("n_heads", f"must divide d_model ({c.d_model})", c.n_heads)
    if c.head_dim % 2:
        _fail("n_heads", f"d_model / n_heads must be even for rotary embeddings "
              f"(d_model={c.d_model})", c.n_heads)
    _check_int(c, "n_decoder_layers", 1 if c.has_decoder else 0)
    if c.traits.has_windows:
        _check_int(c, "window", 1)
    _check_int(c, "topk", 1, none_means="read every visible global entry")
    _check_int(c, "decoder_reindex_every", 1, none_means="no Reindex layers")
    _check_int(c, "d_ff", 1, none_means="4 * d_model")
    if c.global_kv_heads is not None and (not _is_int(c.global_kv_heads)
                                          or c.global_kv_heads < 1
                                          or c.n_heads % c.global_kv_heads):
        _fail("global_kv_heads", f"must be None or an integer >= 1 that divides n_heads "
              f"({c.n_heads})", c.global_kv_heads)
    if c.global_read not in GLOBAL_READS:
        _fail("global_read", f"must be one of {GLOBAL_READS}", c.global_read)
    if not isinstance(c.attention_sink, bool):
        _fail("attention_sink", "must be true or false", c.attention_sink)
    if not isinstance(c.tie_embeddings, bool):
        _fail("tie_embeddings", "must be true or false", c.tie_embeddings)
    if isinstance(c.shift_tokens, bool) or not isinstance(c.shift_tokens, int) \
            or not 0 <= c.shift_tokens <= 8:
        _fail("shift_tokens", "must be an integer in [0, 8] (0: no token mixing)", c.shift_tokens)
    if isinstance(c.shift_init, bool) or not isinstance(c.shift_init, (int, float)) \
            or not 0.0 <= c.shift_init < float("inf"):
        _fail("shift_init", "must be a finite number >= 0 (the init std of the token-mixing "
              "weights; 0: start as the plain embedding)", c.shift_init)
    if not isinstance(c.kv_quant_aware, bool):
        _fail("kv_quant_aware", "must be true or false", c.kv_quant_aware)
    if isinstance(c.dropout, bool) or not isinstance(c.dropout, (int, float)) \
            or not 0.0 <= c.dropout < 1.0:
        _fail("dropout", "must lie in [0, 1)", c.dropout)
    if isinstance(c.rope_theta, bool) or not isinstance(c.rope_theta, (int, float)) \
            or not 0 < c.rope_theta < float("inf"):
        _fail("rope_theta", "must be a finite number > 0", c.rope_theta)

    for name in ("window_kv_dtype", "global_kv_dtype", "indexer_key_dtype"):
        value = getattr(c, name)
        if value is not None:
            try:
                parse_storage(value)
            except ValueError as err:
                _fail(name, f"must be None (the model's dtype) or a storage format ({err})",
                      value)
    if c.unmodelled is not None:
        if not isinstance(c.unmodelled, UnmodelledParts):
            _fail("unmodelled", "must be None or a mapping of UnmodelledParts fields",
                  c.unmodelled)
        _validate_unmodelled(c, c.unmodelled)

    _validate_variant_fields(c)


def _validate_variant_fields(c: ModelConfig) -> None:
    """The fields only some variants use (VARIANT_TRAITS says which)."""
    t = c.traits
    if t.exact_early_exit and c.decoder_compress_ratio != 1:
        _fail("decoder_compress_ratio", f"must be 1 for variant {c.variant!r} (YOCO's "
              "cross-decoder reads an uncompressed KV)", c.decoder_compress_ratio)
    if t.encoder_global_kv:
        if not _is_int(c.global_from_layer) or not (
                0 <= c.global_from_layer <= c.n_encoder_layers):
            _fail("global_from_layer", f"must lie in [0, n_encoder_layers={c.n_encoder_layers}]",
                  c.global_from_layer)
        global_layers = c.n_encoder_layers - c.global_from_layer
        _check_int(c, "encoder_kv_groups", 0)
        if global_layers > 0 and not 1 <= c.encoder_kv_groups <= global_layers:
            _fail("encoder_kv_groups", f"must lie in [1, {global_layers}] so that every group "
                  f"holds at least one of the encoder layers {c.global_from_layer}.."
                  f"{c.n_encoder_layers - 1}", c.encoder_kv_groups)
        if global_layers == 0 and c.encoder_kv_groups != 0:
            _fail("encoder_kv_groups", "must be 0 when global_from_layer == n_encoder_layers "
                  "(no encoder layer reads a global KV)", c.encoder_kv_groups)
        if global_layers > 0 and c.window < c.encoder_compress_ratio:
            _fail("window", f"must be >= encoder_compress_ratio ({c.encoder_compress_ratio}): "
                  "the window covers the incomplete compression block", c.window)
    if c.decoder_global_read is not True and (c.decoder_global_read is not False
                                              or not t.decoder_windows):
        _fail("decoder_global_read", "must be True, or False for variant 'ced' only (the one "
              "whose decoder layers keep a window without their global read)",
              c.decoder_global_read)
    if t.decoder_windows and c.window < c.decoder_compress_ratio:
        _fail("window", f"must be >= decoder_compress_ratio ({c.decoder_compress_ratio}): "
              "the window covers the incomplete compression block", c.window)


# ---- parts of the paper-scale model that ced/model.py does not build ----------------------

@dataclass(frozen=True)
class UnmodelledParts:
    """Architecture the paper has and our model code does not, for the cost model only.

    Every field is optional; a None (or empty) field means "as ced/model.py builds it".

    Latent attention (V4.1: one shared latent per window position and per global entry, used as
    K and V by every head, i.e. multi-query):
      kv_latent_dim: latent width; queries and outputs then have head dim kv_latent_dim.
      q_lora_rank:   low-rank query d -> r -> n_heads * head_dim (an RMSNorm of width r between);
                     the indexer's query then reads the rank-r query latent.
      o_lora_rank:   low-rank output n_heads * head_dim -> r -> d.
    MoE feed-forward (replaces the SwiGLU MLP in every layer): moe_routed_experts routed
      SwiGLU experts of width moe_ff_dim, moe_active_experts of them per token, plus
      moe_shared_experts always-active ones and a router d -> moe_routed_experts.
    mHC (manifold-constrained hyper-connections): hc_streams residual streams; each of the two
      sublayers of a layer has a dynamic mapping (hc_streams * d) -> (n^2 + 2n), its static
      bias (n^2 + 2n) and 3 gating scalars.
    Engram (hashed n-gram memory) in engram_layers: engram_table_rows rows of width
      engram_dim / engram_lookups, engram_lookups rows gathered per token and concatenated to
      engram_dim values, a value projection engram_dim -> d, a key projection engram_dim -> d
      per residual stream (hc_streams, or 1), and a depthwise causal convolution of width
      engram_conv_kernel over d channels.
    """

    kv_latent_dim: int | None = None
    q_lora_rank: int | None = None
    o_lora_rank: int | None = None
    moe_routed_experts: int | None = None
    moe_active_experts: int | None = None
    moe_shared_experts: int = 0
    moe_ff_dim: int | None = None
    hc_streams: int | None = None
    engram_layers: tuple[int, ...] = ()
    engram_table_rows: int | None = None
    engram_dim: int | None = None
    engram_lookups: int | None = None
    engram_conv_kernel: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.engram_layers, list):
            object.__setattr__(self, "engram_layers", tuple(self.engram_layers))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "UnmodelledParts":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"ModelConfig.unmodelled: unknown key(s) {unknown}; allowed keys: "
                             f"{sorted(known)}")
        return cls(**values)

    @property
    def has_moe(self) -> bool:
        return self.moe_routed_experts is not None

    @property
    def has_engram(self) -> bool:
        return bool(self.engram_layers)


def _fail_unmodelled(name: str, message: str, value: Any) -> None:
    raise ValueError(f"ModelConfig.unmodelled.{name}: {message}; got {value!r}")


def _validate_unmodelled(c: ModelConfig, u: UnmodelledParts) -> None:
    for name in ("kv_latent_dim", "q_lora_rank", "o_lora_rank", "moe_routed_experts",
                 "moe_active_experts", "moe_ff_dim", "hc_streams", "engram_table_rows",
                 "engram_dim", "engram_lookups"):
        value = getattr(u, name)
        if value is not None and (not _is_int(value) or value < 1):
            _fail_unmodelled(name, "must be None or an integer >= 1", value)
    for name, minimum in (("moe_shared_experts", 0), ("engram_conv_kernel", 1)):
        value = getattr(u, name)
        if not _is_int(value) or value < minimum:
            _fail_unmodelled(name, f"must be an integer >= {minimum}", value)
    moe = {n: getattr(u, n) for n in ("moe_routed_experts", "moe_active_experts", "moe_ff_dim")}
    if any(v is not None for v in moe.values()):
        for name, value in moe.items():
            if value is None:
                _fail_unmodelled(name, "must be set when any of moe_routed_experts, "
                                 "moe_active_experts, moe_ff_dim is", value)
        if u.moe_active_experts > u.moe_routed_experts:
            _fail_unmodelled("moe_active_experts", f"must be <= moe_routed_experts "
                             f"({u.moe_routed_experts})", u.moe_active_experts)
    elif u.moe_shared_experts:
        _fail_unmodelled("moe_shared_experts", "must be 0 without routed experts "
                         "(moe_routed_experts is None)", u.moe_shared_experts)
    layers = u.engram_layers
    if not isinstance(layers, tuple) or not all(_is_int(i) for i in layers):
        _fail_unmodelled("engram_layers", "must be a list of layer indices", layers)
    if len(set(layers)) != len(layers) or any(not 0 <= i < c.n_layers for i in layers):
        _fail_unmodelled("engram_layers", f"must hold distinct layer indices in "
                         f"[0, {c.n_layers})", layers)
    engram = {n: getattr(u, n) for n in ("engram_table_rows", "engram_dim", "engram_lookups")}
    if layers:
        for name, value in engram.items():
            if value is None:
                _fail_unmodelled(name, "must be set when engram_layers is not empty", value)
        if u.engram_dim % u.engram_lookups:
            _fail_unmodelled("engram_lookups", f"must divide engram_dim ({u.engram_dim})",
                             u.engram_lookups)
    elif any(v is not None for v in engram.values()):
        name = next(n for n, v in engram.items() if v is not None)
        _fail_unmodelled(name, "needs engram_layers (empty: no Engram)", engram[name])


# ---- the layer schedule ------------------------------------------------------------------

@dataclass(frozen=True)
class SourceSpec:
    """One global KV. `from_layer` is the layer whose normalised attention input feeds it
    (an encoder group leader), or None for the decoder source fed by RMSNorm(H_{L_e})."""

    index: int
    compress_ratio: int
    from_layer: int | None
    part: Literal["encoder", "decoder"]


@dataclass(frozen=True)
class LayerSpec:
    index: int
    part: Literal["encoder", "decoder"]
    window: int | None            # None: no window keys (yoco decoder) -- see `full_causal`
    full_causal: bool             # dense variant: the window is the whole causal prefix
    global_source: int | None     # which SourceSpec it reads
    global_mode: GlobalMode | None


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    sources: tuple[SourceSpec, ...]

    def part(self, name: str) -> tuple[LayerSpec, ...]:
        return tuple(spec for spec in self.layers if spec.part == name)

    @property
    def decoder_source(self) -> SourceSpec | None:
        return next((s for s in self.sources if s.part == "decoder"), None)


def group_sizes(n_items: int, n_groups: int) -> list[int]:
    """Contiguous group sizes differing by at most one, earlier groups larger."""
    base, extra = divmod(n_items, n_groups)
    return [base + (1 if g < extra else 0) for g in range(n_groups)]


def build_plan(c: ModelConfig) -> LayerPlan:
    """The per-layer schedule of windows, global sources and Full/Reindex/Reuse modes."""
    layers: list[LayerSpec] = []
    sources: list[SourceSpec] = []
    t = c.traits
    if not t.has_decoder:
        for i in range(c.n_layers):
            layers.append(LayerSpec(i, "encoder", c.window if t.has_windows else None,
                                    not t.has_windows, None, None))
        return LayerPlan(tuple(layers), ())

    # Encoder: SWA everywhere; for ced, global groups from `global_from_layer` on.
    leader_of: dict[int, int] = {}
    if t.encoder_global_kv and c.n_encoder_layers > c.global_from_layer:
        start = c.global_from_layer
        for size in group_sizes(c.n_encoder_layers - c.global_from_layer, c.encoder_kv_groups):
            src = len(sources)
            sources.append(SourceSpec(src, c.encoder_compress_ratio, start, "encoder"))
            for i in range(start, start + size):
                leader_of[i] = src
            start += size
    for i in range(c.n_encoder_layers):
        src = leader_of.get(i)
        mode = None if src is None else ("full" if sources[src].from_layer == i else "reuse")
        layers.append(LayerSpec(i, "encoder", c.window, False, src, mode))

    # Decoder: one shared source from the normalised encoder output.
    dec_src = len(sources)
    sources.append(SourceSpec(dec_src, c.decoder_compress_ratio, None, "decoder"))
    for j in range(c.n_decoder_layers):
        if j == 0:
            mode: GlobalMode = "full"
        elif c.decoder_reindex_every and j % c.decoder_reindex_every == 0:
            mode = "reindex"
        else:
            mode = "reuse"
        window = c.window if t.decoder_windows else None
        layers.append(LayerSpec(c.n_encoder_layers + j, "decoder", window, False, dec_src, mode))
    return LayerPlan(tuple(layers), tuple(sources))


def executed_ff_dim(c: ModelConfig) -> int:
    """The SwiGLU hidden width CEDModel's MLP runs at: ff_dim padded up to a multiple of
    FF_PAD with zero units that are not parameters (ced.model.MLP; a speed choice only, the
    function is that of width ff_dim). The cost model's counting="executed" counts it."""
    return c.ff_dim + (-c.ff_dim % FF_PAD)


def global_read_is_masked(mode: str, n_queries: int, n_read: int, slots: int,
                          heads_per_kv_head: int = 1) -> bool:
    """Whether a block of `n_queries` queries reads its `slots` top-k entries (out of the first
    `n_read` entries, those visible to its last query) through the masked dense matmul rather
    than a gather; `mode` is ModelConfig.global_read; heads_per_kv_head: n_heads /
    n_global_kv_heads (the gather copies each entry once per K/V head, so it pays off sooner
    with fewer of them). Both compute the same softmax over the same entries; the choice is
    speed only, and the cost model (counting="executed") follows the same rule."""
    if mode != "auto":
        return mode == "masked"
    return (n_queries > 1
            and n_read * heads_per_kv_head <= MASKED_READ_MAX_RATIO * max(slots, 1))


def _split_variants() -> str:
    """"'yoco' and 'ced'": the variants with a decoder, for error messages."""
    return " and ".join(repr(v) for v, t in VARIANT_TRAITS.items() if t.has_decoder)


def exact_replay_length(c: ModelConfig) -> int:
    """Smallest decoder replay N for which early-exit prefill is exact (docs/semantics.md 4.1).

    ced: n_decoder_layers * (window - 1) + 1; yoco: 1 (no decoder windows, any N >= 1 is exact).
    """
    if not c.has_decoder:
        raise ValueError(f"exact_replay_length: variant {c.variant!r} has no decoder to replay; "
                         f"only {_split_variants()} do")
    if c.traits.decoder_windows:
        return c.n_decoder_layers * (c.window - 1) + 1
    return 1


def paper_replay_length(c: ModelConfig) -> int:
    """The paper's rounded figure n_decoder_layers * window (2560 at V4.1 scale)."""
    if not c.has_decoder:
        raise ValueError(f"paper_replay_length: variant {c.variant!r} has no decoder")
    return c.n_decoder_layers * c.window


def exact_encoder_replay_length(c: ModelConfig) -> int:
    """Smallest encoder replay N_e that makes a prefix-cache hit exact (docs/semantics.md 4.2)."""
    if not c.has_decoder:
        raise ValueError(f"exact_encoder_replay_length: variant {c.variant!r} has no prefix-"
                         f"cache replay; only {_split_variants()} do")
    return c.n_encoder_layers * (c.window - 1) + 1


def exact_policy_encoder_replay_length(c: ModelConfig, n_replay: int, n_new: int) -> int:
    """Smallest encoder replay N_e that makes the `encoder_replay` multi-turn policy exact
    (docs/semantics.md 4.3): its decoder reads H_{L_e} of the N - m replayed prefix positions
    from the encoder replay itself, so N_e >= L_e (W - 1) + max(N - m, 1), which is
    `exact_encoder_replay_length` when the replay lies within the new turn (N <= m)."""
    return exact_encoder_replay_length(c) - 1 + max(n_replay - n_new, 1)


# ---- replay lengths: every written form, resolved in one place -----------------------------

ReplayPart = Literal["decoder", "encoder"]
# "W", "W/4", "2W", "3W/2": a multiple of the window; spaces are ignored.
_WINDOW_FORM = re.compile(r"([1-9]\d*)?W(?:/([1-9]\d*))?")
_FORMS = "'exact' or an int >= 1 (or 'R_exact', 'W', 'W/4', 'W/2', '2W')"
# What each part accepts, for error messages: a decoder replay may be None (no early exit);
# an encoder replay is asked for only where one must run.
REPLAY_FORMS = {"decoder": f"None, {_FORMS}", "encoder": _FORMS}


REPLAY_FORM_HELP = "N (an int >= 1), W, W/k, kW, kW/d, R_exact or exact"


def parse_replay_form(value: Any, name: str = "replay") -> int | str:
    """A replay length as a user writes it (a CLI argument, a config value), checked but not
    resolved: an int >= 1 (also as a string of digits), 'exact' / 'R_exact', or a multiple of
    the window ('W', 'W/4', '2W', '3W/2'), which `replay_length` resolves once a model config
    is known. Anything else is a one-line ValueError naming `name` and the forms."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        text = value.replace(" ", "")
        if text.isdigit() and int(text) >= 1:
            return int(text)
        if text in ("exact", "R_exact") or is_window_form(text):
            return text
    raise ValueError(f"{name}: expected {REPLAY_FORM_HELP}; got {value!r}")


def is_window_form(text: str) -> bool:
    """True if `text` is a multiple of the window that `replay_length` resolves ('W', 'W/4',
    '2W', '3W/2'; spaces ignored): a study can check it before any model config exists."""
    return _WINDOW_FORM.fullmatch(text.replace(" ", "")) is not None


def window_form_length(text: str, window: int) -> int | None:
    """floor(k * W / d), at least 1, of a window form ('W', 'W/d', 'kW', 'kW/d'; spaces
    ignored) on a window of `window` positions; None when `text` is not a window form."""
    form = _WINDOW_FORM.fullmatch(text.replace(" ", ""))
    if form is None:
        return None
    times, divisor = int(form.group(1) or 1), int(form.group(2) or 1)
    return max(1, times * window // divisor)


def replay_length(c: ModelConfig, replay: None | int | str, part: ReplayPart = "decoder",
                  name: str = "replay") -> int | None:
    """The replay length N (decoder) or N_e (encoder) that `replay` stands for, not clipped.

    None -> None (no replay: every position runs); an int N >= 1 -> N; 'exact' or 'R_exact'
    -> the smallest exact length of `part` (`exact_replay_length` /
    `exact_encoder_replay_length`; an error without a decoder); 'W', 'W/d', 'kW', 'kW/d' ->
    floor(k * W / d), at least 1 (needs no decoder: a study resolves them from any config).
    Anything else is a one-line ValueError naming `name`.
    """
    if part not in ("decoder", "encoder"):
        raise ValueError(f"replay_length: part must be 'decoder' or 'encoder'; got {part!r}")
    if replay is None:
        return None
    if isinstance(replay, str):
        text = replay.replace(" ", "")
        if text in ("exact", "R_exact"):
            if not c.has_decoder:
                raise ValueError(f"{name}: variant {c.variant!r} has no decoder, so {replay!r} "
                                 f"is undefined; only {_split_variants()} have one")
            return exact_replay_length(c) if part == "decoder" else exact_encoder_replay_length(c)
        length = window_form_length(text, c.window)
        if length is not None:
            return length
    if isinstance(replay, bool) or not isinstance(replay, int):
        raise ValueError(f"{name}: expected {REPLAY_FORMS[part]}; got {replay!r}")
    if replay < 1:
        what = "the last prompt token always runs the decoder" if part == "decoder" else \
            "an encoder replay reruns at least one prefix token"
        raise ValueError(f"{name}: must be >= 1 ({what}); got {replay}")
    return replay


@dataclass(frozen=True)
class StatedReplay:
    """A replay length as written and the N it stands for on one model (`state_replay`), so
    that a tool can say both: `str()` is 'W/3 -> 2', '3W -> 15 (R_exact; 3W is 24)', or '8'
    when the form is the number itself."""

    form: str                  # as written, spaces removed: 'W/3', '3W', '8', 'exact'
    length: int                # the form's own length (`replay_length`)
    n: int                     # the length a tool uses: `length`, at most `exact`
    exact: int | None          # R_exact (decoder) or the exact N_e (encoder); None: no decoder
    part: str = "decoder"

    @property
    def clamped(self) -> bool:
        return self.n < self.length

    def __str__(self) -> str:
        if self.clamped:
            exact = _EXACT_NAME[self.part]
            return f"{self.form} -> {self.n} ({exact}; {self.form} is {self.length})"
        return self.form if self.form == str(self.n) else f"{self.form} -> {self.n}"

    def warning(self, name: str = "replay") -> str | None:
        """The line a tool prints when the form was capped at the exact length; else None."""
        if not self.clamped:
            return None
        return (f"warning: {name}: {self.form} is {self.length} positions on this model, above "
                f"{_EXACT_NAME[self.part]} = {self.exact} (from which replay is exact); "
                f"using N = {self.exact}")


_EXACT_NAME = {"decoder": "R_exact", "encoder": "the exact N_e"}


def state_replay(c: ModelConfig, replay: int | str, part: ReplayPart = "decoder",
                 name: str = "replay") -> StatedReplay:
    """What a tool evaluates for a replay form written by a user: `replay_length`, capped at
    the exact length of `part` (R_exact, or the exact N_e of docs/semantics.md 4.2) when the
    model has a decoder. A longer replay computes exactly what the exact one does, so the
    cap changes no result, only the N a table reports; the returned `StatedReplay` says so
    (`warning`). Lengths that are not replays (distances, a continuation) use
    `replay_length` itself."""
    length = replay_length(c, parse_replay_form(replay, name), part, name)
    exact = None
    if c.has_decoder:
        exact = exact_replay_length(c) if part == "decoder" else exact_encoder_replay_length(c)
    return StatedReplay(str(replay).replace(" ", ""), length,
                        length if exact is None else min(length, exact), exact, part)


def describe_replays(stated: Iterable[StatedReplay]) -> str:
    """'W/3 -> 2, 3W -> 15 (R_exact; 3W is 24), 8': how each form resolved, for a progress
    line or a record."""
    return ", ".join(str(s) for s in stated)


def resolve_replay(c: ModelConfig, replay: None | int | str, available: int,
                   name: str = "replay", part: ReplayPart = "decoder") -> int:
    """Positions a replay runs out of `available` (an int >= 0), as the engine and the cost
    model count them: None -> all `available`; any form of `replay_length` -> that length,
    clipped to `available`. A replay on a variant without a decoder is a ValueError naming
    `name` (docs/semantics.md 4.1, 4.2)."""
    if replay is None:
        return available
    if not c.has_decoder:
        raise ValueError(f"{name}: variant {c.variant!r} has no decoder to replay; use "
                         "replay=None (every token through every layer)")
    return min(replay_length(c, replay, part, name), available)


def keep_from(end, window: int | None):
    """First position a layer's window cache keeps once it has computed every position before
    `end` (an int, or a LongTensor): the next query, at `end`, sees `end - W + 1 .. end`, so a
    window layer keeps the last W - 1 positions, from `end - (W - 1)`. Below 0 (fewer than
    W - 1 positions computed) nothing is dropped. A full-causal layer (window None) keeps
    everything: 0."""
    if window is None:
        return 0
    return end - (window - 1)


def default_hidden_tail(c: ModelConfig, replays: Iterable[int] = ()) -> int:
    """Trailing positions of H_{L_e} a cache keeps for the `cached_hidden` policy
    (docs/semantics.md 4.3): enough for R_exact and for each decoder replay in `replays`,
    capped at max_seq_len; 0 without a decoder. `InferenceEngine`'s default (no `replays`)
    and the cost model's."""
    if not c.has_decoder:
        return 0
    return min(max([exact_replay_length(c), *replays]), c.max_seq_len)


__all__ = ["ModelConfig", "UnmodelledParts", "LayerPlan", "LayerSpec", "SourceSpec", "build_plan",
           "group_sizes", "VariantTraits", "VARIANT_TRAITS", "VARIANTS",
           "exact_replay_length", "paper_replay_length", "exact_encoder_replay_length",
           "replay_length", "resolve_replay", "state_replay", "StatedReplay",
           "describe_replays", "is_window_form", "keep_from", "default_hidden_tail",
           "global_read_is_masked", "GLOBAL_READS", "UNION_READ_MAX_SHARE", "executed_ff_dim", "FF_PAD"]
