"""Whether a banded window read beats the fused kernel's masked rectangle at a study's shape.

    python benchmarks/window_read.py [--batch 16] [--length 256] [--heads 4] [--head-dim 16]
                                     [--window 8] [--block 64] [--rounds 10]

`ced.attention.attend` reads each query block's window keys as one rectangle (the block's
queries against every key some query of the block sees: block + W - 1 keys) through torch's
fused CPU flash kernel, the hidden keys masked. At W = 8 and block 64 that scores 9x the keys a
query sees (ced.cost's "executed" against "ideal" window attention), which benchmarks/README.md
named as a lever. This times, for one layer's window read alone (no global read, no sink), a
forward and backward of:

  rectangle   `attend` itself (window keys only): what every study runs
  band        each query against its own W keys only, through a strided view of the keys
              (elementwise products and sums, autograd)
  band_mm     the same W keys per query read by batched matmuls of one query row each

interleaved round by round (`peer.interleaved_rounds`), one thread, fp32. The three forms give
the same output (checked on every run in float64 before timing, tolerance 1e-10).
Defaults: the depth study's attention geometry (d_model 64 in 4 heads, T 256, W 8, block 64).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from peer import interleaved_rounds  # noqa: E402

from ced.attention import WindowKV, attend  # noqa: E402
from ced.semantics import window_lower_bound  # noqa: E402


def rectangle_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   block: int) -> torch.Tensor:
    """`attend`'s window read: q, k, v [B, H, T, Dh] at positions 0..T-1 -> [B, H, T, Dh]."""
    positions = torch.arange(q.shape[2])
    lower = window_lower_bound(positions, window, None)
    out, _ = attend(q, positions, lower, WindowKV(k, v, positions), None, None, None, block)
    return out


def _banded(x: torch.Tensor, window: int) -> torch.Tensor:
    """x [B, H, T, Dh] -> [B, H, T, W, Dh]: the W keys ending at each position (zeros before
    position 0), a strided view of the padded keys."""
    return F.pad(x, (0, 0, window - 1, 0)).unfold(2, window, 1).transpose(-1, -2)


def _before_start(length: int, window: int) -> torch.Tensor:
    """[T, W]: True where slot j of query i would be a position before 0."""
    return torch.arange(window)[None, :] + torch.arange(length)[:, None] < window - 1


def band_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
              block: int = 0) -> torch.Tensor:
    """Each query against its own W keys, elementwise: the same softmax as `rectangle_read`
    (q scaled by 1/sqrt(Dh) as `attend` scales it). -> [B, H, T, Dh]."""
    q = q / q.shape[-1] ** 0.5
    scores = (q[..., None, :] * _banded(k, window)).sum(-1)
    probs = scores.masked_fill(_before_start(q.shape[2], window), -torch.inf).softmax(-1)
    return (probs[..., None] * _banded(v, window)).sum(-2)


def band_mm_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                 block: int = 0) -> torch.Tensor:
    """`band_read` by batched matmuls of one query row against its W keys."""
    q = q / q.shape[-1] ** 0.5
    scores = torch.matmul(q[..., None, :], _banded(k, window).transpose(-1, -2))[..., 0, :]
    probs = scores.masked_fill(_before_start(q.shape[2], window), -torch.inf).softmax(-1)
    return torch.matmul(probs[..., None, :], _banded(v, window))[..., 0, :]


READS = {"rectangle": rectangle_read, "band": band_read, "band_mm": band_mm_read}


def check_agree(window: int, block: int, seed: int = 0) -> float:
    """The largest |difference| of every form's output from the rectangle's, float64, on a
    small random case (B 2, H 2, T 3 blocks and a part, Dh 8)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, 3 * block + block // 2, 8)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    want = rectangle_read(q, k, v, window, block)
    return max(float((read(q, k, v, window, block) - want).abs().max())
               for read in READS.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("batch", 16), ("length", 256), ("heads", 4), ("head-dim", 16),
                          ("window", 8), ("block", 64), ("rounds", 10), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    error = check_agree(args.window, args.block)
    if error > 1e-10:
        raise SystemExit(f"the window reads disagree by {error:.2e} (float64): not timed")
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.length, args.head_dim)
    tensors = [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]
    grad = torch.randn(shape, generator=gen)

    def step(read):
        def run():
            for t in tensors:
                t.grad = None
            read(*tensors, args.window, args.block).backward(grad)
        return run

    times = interleaved_rounds({name: step(read) for name, read in READS.items()},
                               args.warmup, args.rounds, "window read",
                               lambda t: "  ".join(f"{n} {t[n][-1] * 1e3:.1f}ms"
                                                   for n in READS if t[n]))
    print(f"B {args.batch} x T {args.length}, {args.heads} heads of {args.head_dim}, "
          f"W {args.window}, block {args.block}; forward + backward of one layer's window "
          f"read; forms agree to {error:.1e} (float64)")
    base = times["rectangle"]
    for name in READS:
        ratio = statistics.median(b / t for b, t in zip(base, times[name]))
        print(f"  {name:10s} {statistics.median(times[name]) * 1e3:7.2f} ms   "
              f"rectangle / {name} {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
