"""Whether this CPU computes bfloat16 matmuls natively, measured rather than looked up.

The studies' recipes train in bf16 autocast (`train.mixed_precision=bf16`), which on a CPU with
native bf16 dot products (x86 avx512_bf16 or AMX, Arm's bf16 extensions) is faster than fp32.
On a CPU without them oneDNN emulates bf16 and a matmul runs an order of magnitude or more
slower than in fp32: a study planned in hours then takes days, and nothing says why. A timing
probe answers for any CPU without a table of instruction sets; it costs a few milliseconds
where bf16 is native and about a tenth of a second where it is emulated.
"""

from __future__ import annotations

import time

import torch

# bf16 slower than fp32 by more than this is emulation: a native bf16 matmul is at worst about
# as fast as fp32's, an emulated one an order of magnitude slower (benchmarks/README.md, "bf16
# on CPU")
EMULATED_SLOWDOWN = 3.0


def _best_seconds(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    a @ b                       # the first call allocates and picks the kernel
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def bf16_matmul_slowdown(size: int = 256, reps: int = 3) -> float:
    """Time of a [size, size] @ [size, size] bf16 matmul on the CPU over the fp32 one, at the
    current torch thread count (the best of `reps` each): about 1 or below where bf16 is native,
    10 or more where it is emulated."""
    generator = torch.Generator().manual_seed(0)  # no draw from the global RNG a run relies on
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    fp32 = _best_seconds(a, b, reps)
    bf16 = _best_seconds(a.to(torch.bfloat16), b.to(torch.bfloat16), reps)
    return bf16 / max(fp32, 1e-9)


def bf16_cpu_warning(slowdown: float) -> str | None:
    """The warning a CPU run in bf16 autocast prints when `slowdown` (`bf16_matmul_slowdown`)
    says this CPU emulates bf16; None when it does not."""
    if slowdown <= EMULATED_SLOWDOWN:
        return None
    return (f"train.mixed_precision=bf16 on a CPU without native bf16: a bf16 matmul runs "
            f"{slowdown:.0f}x slower than fp32 here, so this run will be many times slower than "
            f"on a CPU with avx512_bf16 / AMX. train.mixed_precision=no trains in fp32 (a "
            f"different recipe: its models are not the bf16 ones, bit for bit or otherwise)")
