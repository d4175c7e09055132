"""Storage formats of cached tensors, for the cost model (`ced.cost`).

A format name is a base type, optionally followed by `_block{N}`: one 1-byte scale (E4M3 or
UE8M0) per N consecutive values, as in DeepSeek-V4.1's FP4 KV (docs/semantics.md section 7: a
512-dim latent in FP4 with one E4M3 scale per 16 channels is 256 + 32 = 288 bytes).

Base types: fp64 / float64, fp32 / float32, bf16 / bfloat16, fp16 / float16, fp8 / fp8_e4m3 /
fp8_e5m2, fp4 / fp4_e2m1. Examples: "fp32", "bf16", "fp8", "fp4_block16", "fp8_e4m3_block128".

A stored vector of n values takes ceil(n * bits / 8) bytes plus ceil(n / N) scale bytes (a
vector is padded to whole bytes and whole blocks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

BASE_BITS = {
    "fp64": 64, "float64": 64,
    "fp32": 32, "float32": 32,
    "bf16": 16, "bfloat16": 16,
    "fp16": 16, "float16": 16,
    "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8,
    "fp4": 4, "fp4_e2m1": 4,
}
SCALE_BYTES = 1
_BLOCK = re.compile(r"^(?P<base>.+?)_block(?P<block>[1-9][0-9]*)$")


@dataclass(frozen=True)
class StorageFormat:
    name: str
    bits: int                  # bits per stored value
    block: int | None          # values per 1-byte scale, or None (no scales)

    def vector_bytes(self, n_values: int) -> int:
        """Bytes of one stored vector of n_values values (scales included)."""
        if n_values < 0:
            raise ValueError(f"StorageFormat.vector_bytes: n_values must be >= 0; got {n_values}")
        data = math.ceil(n_values * self.bits / 8)
        scales = 0 if self.block is None else math.ceil(n_values / self.block) * SCALE_BYTES
        return data + scales


def parse_storage(name: str) -> StorageFormat:
    """Parse a format name (see the module docstring); ValueError on anything else."""
    if not isinstance(name, str):
        raise ValueError(f"storage format: expected a string such as 'fp32' or 'fp4_block16'; "
                         f"got {name!r}")
    base, block = name, None
    match = _BLOCK.match(name)
    if match:
        base, block = match["base"], int(match["block"])
    if base not in BASE_BITS:
        raise ValueError(f"storage format {name!r}: unknown base type {base!r}; known: "
                         f"{sorted(BASE_BITS)}, optionally followed by _block<N>")
    return StorageFormat(name, BASE_BITS[base], block)


def torch_dtype_format(dtype) -> StorageFormat:
    """The format a torch dtype stores (the engine keeps every cached tensor in the model's
    dtype): torch.float64 -> fp64, and so on."""
    name = str(dtype).removeprefix("torch.")
    return parse_storage(name)


__all__ = ["StorageFormat", "parse_storage", "torch_dtype_format", "BASE_BITS"]
