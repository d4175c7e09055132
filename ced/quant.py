"""Fake quantisation of stored KV: what the model sees after a value was written to the cache
in a deployment storage format and read back (docs/semantics.md section 3.6).

A value is quantised, then dequantised back to the compute dtype, at the point where it is
stored (window K/V, global KV entries, indexer keys; `ced.model`), so that training, the
parallel forward and the incremental engine all read the same stored values. The formats are
the names of `ced.storage` that `ModelConfig.window_kv_dtype`, `global_kv_dtype` and
`indexer_key_dtype` hold; CEDModel implements:

  fp64 / float64, fp32 / float32, bf16 / bfloat16, fp16 / float16: round to that dtype and
      back (round-to-nearest-even, torch's cast); a no-op, with no tensor op at all, where the
      format holds the compute dtype exactly (fp32 in a float32 model, fp64 anywhere).
  fp8 / fp8_e4m3: OCP E4M3 (bias 7, max 448, subnormals down to 2^-9, no infinities) with one
      scale per stored vector, scale = amax / 448 kept in the compute dtype. (The cost model
      prices "fp8" without scale bytes; a per-row scale would add a few bytes per row.)
  fp4 / fp4_e2m1: E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one scale per vector,
      scale = amax / 6 in the compute dtype.
  <fp8 or fp4 name>_block<N>: one scale per N consecutive channels of a vector (the last
      block may be partial), the scale amax / max rounded UP to an E4M3 number, so that no
      value overflows the grid (an amax over 6 * 448 = 2688 (fp4) saturates the scale at 448
      and the values at the grid's maximum). This is how the cost model prices "fp4_block16"
      (main KV) and "fp4_block32" (indexer keys): 1 byte of scale per block.

Values round to the nearest grid point, ties to even, and saturate at +-max. An all-zero
vector or block stays zero (its scale is replaced by 1, so no 0/0).
fp8_e5m2 (any block) and a block on a plain float type ("bf16_block16") are priced by the
cost model but not implemented here: `storage_quantiser` raises a ValueError naming the
ModelConfig key.

Gradients (`ModelConfig.kv_quant_aware`): with False (default) autograd differentiates the
quantiser as written: the float casts pass the gradient through unchanged, but the rounding
of fp8/fp4 has zero gradient, so the stored K/V receive gradient only through their scale
(the amax element of each row or block). With True a straight-through estimator is used:
the forward value is the quantised one, bit for bit, and the gradient is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .storage import parse_storage


@dataclass(frozen=True)
class FloatGrid:
    """The non-negative numbers of a small float format: normal numbers from 2^min_exponent
    with `mantissa_bits` fraction bits, subnormals below them with the same spacing as the
    lowest binade, and `max_value` the largest finite number (saturation point)."""

    name: str
    mantissa_bits: int
    min_exponent: int
    max_value: float


E4M3 = FloatGrid("fp8_e4m3", mantissa_bits=3, min_exponent=-6, max_value=448.0)
E2M1 = FloatGrid("fp4_e2m1", mantissa_bits=1, min_exponent=0, max_value=6.0)
GRIDS = {"fp8": E4M3, "fp8_e4m3": E4M3, "fp4": E2M1, "fp4_e2m1": E2M1}
CASTS = {"fp64": torch.float64, "float64": torch.float64, "fp32": torch.float32,
         "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
         "fp16": torch.float16, "float16": torch.float16}
SUPPORTED = (f"{sorted(CASTS)} (no block), or {sorted(GRIDS)} optionally followed by "
             "_block<N>")


def round_to_grid(x: Tensor, grid: FloatGrid, up: bool = False) -> Tensor:
    """x (any shape, a float dtype) rounded to the nearest number of `grid`, ties to even
    (or, with up=True, to the smallest grid number >= |x|, sign kept), saturating at
    +-grid.max_value. Same shape and dtype.

    Within the binade [2^e, 2^(e+1)) the grid spacing is 2^(e - mantissa_bits) (below the
    smallest normal, the subnormal spacing of the lowest binade); |x| / spacing is exact (a
    power of two), so torch.round's half-to-even on it is round-to-nearest-even on the grid:
    an even multiple of the spacing has an even last mantissa bit, also at a binade's top."""
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude.detach())       # |x| in [2^(exponent-1), 2^exponent)
    exponent = (exponent - 1).clamp(min=grid.min_exponent)
    spacing = torch.ldexp(torch.ones_like(magnitude), exponent - grid.mantissa_bits)
    steps = torch.ceil(magnitude / spacing) if up else torch.round(magnitude / spacing)
    return torch.copysign((steps * spacing).clamp(max=grid.max_value), x)


def quantise_scaled(x: Tensor, grid: FloatGrid, block: int | None) -> Tensor:
    """Fake-quantise x [..., n] to `grid` with one scale per row (block None; scale
    amax / max in x's dtype) or per `block` consecutive channels (scale amax / max rounded up
    to E4M3, the last block zero-padded). Returns the dequantised values [..., n], x's dtype.
    A zero row or block stays zero."""
    n = x.shape[-1]
    size = n if block is None else block
    pad = (-n) % size if n else 0
    blocks = F.pad(x, (0, pad)).unflatten(-1, (-1, max(size, 1)))
    scale = blocks.abs().amax(-1, keepdim=True) / grid.max_value
    if block is not None:
        scale = round_to_grid(scale, E4M3, up=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = round_to_grid(blocks / scale, grid) * scale
    return stored.flatten(-2)[..., :n]


def round_trip_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` and back (torch's round-to-nearest-even cast), same shape and
    dtype as x; x itself, with no op, when `dtype` holds every value of x's dtype."""
    if dtype == x.dtype or torch.finfo(dtype).bits > torch.finfo(x.dtype).bits:
        return x
    return x.to(dtype).to(x.dtype)


def straight_through(x: Tensor, stored: Tensor) -> Tensor:
    """`stored` in the forward pass, bit for bit, with the identity gradient to x: stored
    (detached) plus x - x.detach(), which is exactly zero. Both tensors [...], same shape."""
    return stored.detach() + (x - x.detach())


@dataclass(frozen=True)
class StorageQuantiser:
    """The fake quantiser of one storage format: call it on a tensor [..., n] of stored
    vectors (the last dim is one vector's channels) to get what reading them back gives."""

    name: str
    grid: FloatGrid | None
    block: int | None
    cast: torch.dtype | None
    straight_through: bool

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., n] -> the stored values [..., n], x's dtype (with the identity gradient
        when straight_through and x requires grad)."""
        if self.grid is None:
            stored = round_trip_cast(x, self.cast)
        else:
            stored = quantise_scaled(x, self.grid, self.block)
        if self.straight_through and stored is not x and x.requires_grad:
            return straight_through(x, stored)
        return stored


def storage_quantiser(name: str | None, key: str,
                      straight_through: bool = False) -> StorageQuantiser | None:
    """The quantiser of format `name` (a `ced.storage` name) for ModelConfig field `key`, or
    None for None (the model's own dtype: nothing to do, not even a call). An unknown name,
    or one the cost model knows but CEDModel does not implement, is a ValueError naming
    ModelConfig.<key>."""
    if name is None:
        return None
    try:
        fmt = parse_storage(name)
    except ValueError as err:
        raise ValueError(f"ModelConfig.{key}: {err}") from None
    base = name if fmt.block is None else name[:name.rindex("_block")]
    if base in GRIDS:
        return StorageQuantiser(name, GRIDS[base], fmt.block, None, straight_through)
    if base in CASTS and fmt.block is None:
        return StorageQuantiser(name, None, None, CASTS[base], straight_through)
    raise ValueError(f"ModelConfig.{key}: CEDModel does not implement storage format "
                     f"{name!r} (the cost model prices it, the model cannot store it); "
                     f"supported: {SUPPORTED}")


# The three storage points by their short names in an evaluation-time override.
STORAGE_POINTS = {"window": "window_kv_dtype", "global": "global_kv_dtype",
                  "indexer": "indexer_key_dtype"}


def parse_kv_override(spec: str) -> dict[str, str]:
    """An evaluation-time storage override, e.g. "window:fp8,global:fp4_block16,indexer:fp4_block32",
    -> {"window_kv_dtype": "fp8", ...}: the ModelConfig fields to replace on a trained model
    (fake quantisation has no parameters, so any checkpoint can be read back with any format
    CEDModel implements). A ValueError names the bad part and what is allowed."""
    out: dict[str, str] = {}
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        point, sep, name = part.partition(":")
        if not sep or point not in STORAGE_POINTS or not name:
            raise ValueError(f"kv override {part!r}: expected POINT:FORMAT with POINT one of "
                             f"{sorted(STORAGE_POINTS)} (e.g. global:fp4_block16)")
        storage_quantiser(name, STORAGE_POINTS[point])          # a format the model can store
        out[STORAGE_POINTS[point]] = name
    if not out:
        raise ValueError(f"kv override {spec!r}: empty; e.g. window:fp8,global:fp4_block16")
    return out


@dataclass(frozen=True)
class KVStorage:
    """The quantisers of the three storage points (None: stored as computed): window K/V
    (`window`), global KV entries (`entries`), indexer keys (`index_keys`)."""

    window: Callable[[Tensor], Tensor] | None
    entries: Callable[[Tensor], Tensor] | None
    index_keys: Callable[[Tensor], Tensor] | None

    @classmethod
    def from_config(cls, cfg) -> "KVStorage":
        """From a ModelConfig's window_kv_dtype, global_kv_dtype, indexer_key_dtype and
        kv_quant_aware; ValueError naming the key of a format CEDModel cannot store."""
        ste = cfg.kv_quant_aware
        return cls(storage_quantiser(cfg.window_kv_dtype, "window_kv_dtype", ste),
                   storage_quantiser(cfg.global_kv_dtype, "global_kv_dtype", ste),
                   storage_quantiser(cfg.indexer_key_dtype, "indexer_key_dtype", ste))


def store(quantiser: Callable[[Tensor], Tensor] | None, x: Tensor) -> Tensor:
    """x [..., n] as read back from storage: quantiser(x), or x itself when None."""
    return x if quantiser is None else quantiser(x)


__all__ = ["FloatGrid", "E4M3", "E2M1", "round_to_grid", "quantise_scaled", "round_trip_cast",
           "straight_through", "StorageQuantiser", "storage_quantiser", "KVStorage", "store",
           "STORAGE_POINTS", "parse_kv_override"]
