"""Training throughput and model FLOPs utilisation (`make bench-train`).

For the default small `ced` config (conf/model/ced.yaml) at T = 512, batch 8, in fp32 and bf16
(CPU autocast): training tokens/s (forward + backward + AdamW step, median of timed steps after
warm-up) and MFU = (matmul FLOPs of one step, counted by torch's FlopCounterMode) / step time /
(this machine's matmul peak, measured here with large square matmuls in the same dtype).
Target: at least 25% of the measured peak in fp32.

Writes benchmarks/results/train.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ced import CEDModel, ModelConfig
from ced.train_config import model_conf

ROOT = Path(__file__).resolve().parents[1]


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """Best observed FLOP/s of a size x size matmul in `dtype`."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size ** 3 / (time.perf_counter() - start))
    return best


def train_step(model, optimizer, ids, dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits, aux = model(ids, return_aux=True)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    (loss + aux["indexer_kl"]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure(cfg: ModelConfig, seq_len: int, batch: int, dtype: torch.dtype, steps: int) -> dict:
    torch.manual_seed(0)
    model = CEDModel(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    train_step(model, optimizer, ids, dtype)
    with FlopCounterMode(display=False) as counter:
        train_step(model, optimizer, ids, dtype)
    flops = counter.get_total_flops()
    times = []
    for i in range(steps):
        start = time.perf_counter()
        train_step(model, optimizer, ids, dtype)
        times.append(time.perf_counter() - start)
        print(f"  {str(dtype):15s} step {i + 1}/{steps}: {times[-1]:.2f}s", flush=True)
    step_time = statistics.median(times)
    return {"step_s": step_time, "tokens_per_s": batch * seq_len / step_time,
            "flops_per_step": flops, "achieved_flops": flops / step_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default="ced", help="a conf/model/*.yaml name")
    args = parser.parse_args()
    raw = model_conf(args.model)
    cfg = ModelConfig.from_dict(raw)
    results = {"model": args.model, "seq_len": args.seq_len, "batch": args.batch,
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(f"measuring {name} matmul peak ...", flush=True)
        peak = matmul_peak(dtype)
        row = measure(cfg, args.seq_len, args.batch, dtype, args.steps)
        row["matmul_peak_flops"] = peak
        row["mfu"] = row["achieved_flops"] / peak
        results[name] = row
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(results, indent=2))
    print(f"\nTraining throughput, {args.model} (conf/model/{args.model}.yaml), T={args.seq_len}, "
          f"batch {args.batch}, {results['threads']} threads")
    print(f"{'dtype':6s} {'tokens/s':>10s} {'GFLOP/step':>11s} {'achieved GFLOP/s':>17s} "
          f"{'peak GFLOP/s':>13s} {'MFU':>6s}")
    for name in ("fp32", "bf16"):
        r = results[name]
        print(f"{name:6s} {r['tokens_per_s']:10.0f} {r['flops_per_step'] / 1e9:11.1f} "
              f"{r['achieved_flops'] / 1e9:17.1f} {r['matmul_peak_flops'] / 1e9:13.1f} "
              f"{r['mfu']:6.1%}")
    verdict = "PASS" if results["fp32"]["mfu"] >= 0.25 else "MISS"
    print(f"target: fp32 MFU >= 25% of the measured peak: {verdict}")


if __name__ == "__main__":
    main()
