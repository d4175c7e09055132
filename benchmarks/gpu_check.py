"""GPU readiness (`make gpu-check`): the model, engine and a training step on CUDA.

1. Exactness on the device: for every variant, a small float64 model with random weights on
   CUDA; incremental prefill + decode equals the parallel forward (docs/semantics.md
   invariants 1-4: full prefill for all, early exit with N = R_exact and bounded N = 3
   against the truncated-window forward for the split variants), max |difference| against
   the tolerance 1e-9.
2. Timings (CUDA events, median of 5 after 2 warm-up runs) at the peer benchmark's size
   (d_model 256, 8 + 8 layers, W 64, ced top-k 64, B 8 x T 512): one AdamW training step per
   variant in fp32 and bf16 autocast, and the prefill (full and, for the split variants,
   early exit with N = W) at T = 2048.

Writes benchmarks/results/gpu_check.json (or --out). Without a CUDA device it says so and exits
with status 0 having checked nothing: the CPU test suite covers the semantics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from ced import CEDModel, InferenceEngine, ModelConfig, exact_replay_length  # noqa: E402
from peer import CED_FIELDS, COMMON  # noqa: E402

TOL = 1e-9
VARIANTS = ("dense", "swa", "yoco", "ced")


def exactness(device: torch.device) -> dict:
    out = {}
    for variant in VARIANTS:
        cfg = ModelConfig(variant=variant, vocab_size=61, d_model=32, n_heads=2,
                          n_encoder_layers=3, n_decoder_layers=2, window=4,
                          topk=3 if variant == "ced" else None, global_from_layer=1,
                          encoder_kv_groups=2, max_seq_len=128)
        torch.manual_seed(0)
        model = CEDModel(cfg).double().to(device).eval()
        engine = InferenceEngine(model)
        ids = torch.randint(0, 61, (2, 40), device=device)
        prompt, steps = 30, 10
        replays = [None] + (["exact", 3] if cfg.has_decoder else [])
        worst = {}
        with torch.no_grad():
            for replay in replays:
                if replay is None:
                    start = None
                else:
                    n = min(exact_replay_length(cfg), prompt) if replay == "exact" else replay
                    start = prompt - n
                reference = model(ids, decoder_replay_start=start)
                prefilled = engine.prefill(ids[:, :prompt], replay=replay)
                logits, cache = prefilled.logits, prefilled.cache
                diffs = [(logits - reference[:, prompt - 1]).abs().max().item()]
                for t in range(prompt, prompt + steps - 1):
                    step = engine.decode(ids[:, t], cache)
                    diffs.append((step - reference[:, t]).abs().max().item())
                worst[str(replay)] = max(diffs)
        out[variant] = {"max_abs_diff": worst, "ok": all(v <= TOL for v in worst.values())}
    return out


def cuda_time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timings(device: torch.device) -> dict:
    out = {}
    for variant in VARIANTS:
        cfg = ModelConfig(variant=variant, **COMMON, **(CED_FIELDS if variant == "ced" else {}))
        torch.manual_seed(0)
        model = CEDModel(cfg).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (8, 512), device=device)
        row = {}
        for dtype in ("fp32", "bf16"):
            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                    logits, aux = model(ids, return_aux=True)
                loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
                (loss + aux["indexer_kl"]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seconds = cuda_time(step)
            row[f"train_step_{dtype}_s"] = seconds
            row[f"train_tokens_per_s_{dtype}"] = ids.numel() / seconds
        engine = InferenceEngine(model.eval())
        prompt = torch.randint(0, cfg.vocab_size, (1, 2048), device=device)
        with torch.no_grad():
            row["prefill_full_s"] = cuda_time(lambda: engine.prefill(prompt))
            if cfg.has_decoder:
                row["prefill_replay_W_s"] = cuda_time(
                    lambda: engine.prefill(prompt, replay=cfg.window))
        out[variant] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing was checked (the CPU test suite covers "
              "the semantics)")
        return 0
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "exactness": exactness(device), "timings": timings(device)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    failed = [v for v, r in result["exactness"].items() if not r["ok"]]
    print("exactness: " + ("all variants exact" if not failed else f"FAILED for {failed}"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
