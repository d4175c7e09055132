"""Training speed of the four variants against a plain GPT of the same size (`make bench-peer`).

Both sides have about 13M parameters: d_model 256, 16 layers (ced family: 8 encoder + 8
decoder), 4 heads, vocab 259. The GPT (benchmarks/gpt.py) has a GELU MLP of width 4d; the ced
family a SwiGLU MLP of width 683, so the MLP parameters match. ced: top-k 64, window 64,
encoder compression 2 in 3 groups from layer 2, decoder compression 1, Reindex every 4;
ced_mq: the same with multi-query global entries (global_kv_heads 1: one K and one V row per
entry for all 4 heads, as V4.1 shares its entries).

One figure = one AdamW training step (forward, backward, update) in one process. The models
take turns step by step (interleaved, so a change in machine load hits all of them alike);
after the warm-up rounds the median of `--steps` rounds is reported as tokens/s, and the ratio
to the GPT as the median over rounds of the paired ratio (GPT step time / model step time in
the same round; the JSON also keeps the ratio of the two medians). Beside it, the analytic
matmul FLOPs of each model's forward (ced.cost; the GPT's own count), so the table says how
much of a ratio is work the model does and how much is the rate it does it at. Targets (issue
35, against the work each variant does): dense, yoco, ced and ced_mq run their executed
forward FLOPs at >= 0.9 of the GPT's FLOP rate at both shapes (`rate_vs_gpt`: tokens/s ratio
over executed-FLOP ratio; their ideal FLOP ratio to the GPT is about 1); swa >= 1.3x the
GPT's tokens/s at T = 2048, where its windows skip most of the GPT's attention.

    python benchmarks/peer.py                       # both shapes, fp32, torch's threads
    python benchmarks/peer.py --shapes 8x512 --steps 3 --variants ced
    python benchmarks/peer.py --compile pointwise   # torch.compile of MLPs and norms (warm-up)

Writes benchmarks/results/peer.json and peer.md (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import core  # noqa: E402  (benchmarks/core.py: the benchmarked configs)
from ced import CEDModel, ModelConfig  # noqa: E402
from ced.cost import forward_flops  # noqa: E402
from ced.model import MLP, RMSNorm  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = ("dense", "swa", "yoco", "ced", "ced_mq")
COMMON = dict(vocab_size=259, d_model=256, n_heads=4, n_encoder_layers=8, n_decoder_layers=8,
              window=64, d_ff=683, max_seq_len=2048)
CED_FIELDS = core.CED_FIELDS   # one definition of the benchmarked ced's sparse read (core.py)
RATE_TARGETS = {"ced": 0.9, "ced_mq": 0.9, "dense": 0.9, "yoco": 0.9}
SWA_TARGET_LONG = (2048, 1.3)


def model_config(variant: str, **overrides) -> ModelConfig:
    """The benchmark's config of `variant` (one of VARIANTS; ced_mq is ced with one K/V head
    per global entry), with `overrides` (--set) on top."""
    fields = {"ced": CED_FIELDS, "ced_mq": {**CED_FIELDS, "global_kv_heads": 1}}.get(variant, {})
    return ModelConfig(variant="ced" if variant == "ced_mq" else variant,
                       **{**COMMON, **fields, **overrides})


def build(name: str, overrides: dict, compile_mode: str = "none") -> torch.nn.Module:
    """The seeded model; compile_mode `pointwise` compiles the ced family's MLPs and norms
    (the elementwise work between matmuls, `torch.compile` per module), `all` also the GPT's
    blocks, so that both sides get their elementwise ops fused."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=259, d_model=256, n_heads=4, n_layers=16,
                              max_seq_len=2048))
        if compile_mode == "all":
            for block in model.blocks:
                block.compile()
        return model
    model = CEDModel(model_config(name, **overrides))
    if compile_mode != "none":
        for module in model.modules():
            if isinstance(module, (MLP, RMSNorm)):
                module.compile()
    return model


def make_step(model: torch.nn.Module, ids: torch.Tensor, dtype: str):
    """One AdamW step on next-token cross-entropy (+ the indexer KL for a model with one), on
    the device of `ids`; dtype fp32 or bf16 (autocast). benchmarks/gpu_check.py times it too."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    indexed = isinstance(model, CEDModel) and model.cfg.topk is not None

    def step() -> None:
        with autocast:
            if indexed:
                logits, aux = model(ids, return_aux=True)
                extra = aux["indexer_kl"]
            else:
                logits, extra = model(ids), 0.0
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        (loss + extra).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_shape(batch: int, length: int, names: list[str], steps: int, warmup: int,
                dtype: str, overrides: dict, compile_mode: str = "none") -> dict:
    ids = torch.randint(0, 259, (batch, length), generator=torch.Generator().manual_seed(length))
    models = {name: build(name, overrides, compile_mode) for name in names}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    step_fns = {name: make_step(m.train(), ids, dtype) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + steps):
        for name in names:
            start = time.perf_counter()
            step_fns[name]()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
        shown = "  ".join(f"{n} {times[n][-1]:.2f}s" for n in names if times[n])
        print(f"  {batch}x{length} round {round_ + 1}/{warmup + steps}"
              f"{' (warm-up)' if round_ < warmup else ''}  {shown}", flush=True)
    tokens = batch * length
    out = {}
    for name in names:
        median = statistics.median(times[name])
        out[name] = {"params": params[name], "times_s": times[name], "median_s": median,
                     "tokens_per_s": tokens / median}
    for name, model in models.items():
        # Matmul FLOPs of the forward (the backward is about twice that for every model alike,
        # so the ratios hold for the step): `ideal` needs only the keys and entries a query
        # sees (ced.cost counting "causal"), `executed` is what the model's kernels multiply
        # (ced.cost "executed": window rectangles per query block, a top-k read run as a masked
        # matmul over every visible entry; the GPT's fused causal kernel: its causal pairs).
        if name == "gpt":
            ideal = executed = model.forward_flops(length)
        else:
            ideal = forward_flops(model.cfg, length, counting="causal").total
            executed = forward_flops(model.cfg, length, counting="executed").total
        out[name].update(flops_ideal=batch * ideal, flops_executed=batch * executed)
    for name in names:
        # Each round's step time of the GPT over the model's, paired by round, then the
        # median: on a shared 2-core machine whole rounds run 20-30% slow or fast together,
        # which a ratio of separate medians lets through and a paired ratio cancels.
        paired = [g / t for g, t in zip(times["gpt"], times[name])]
        out[name]["ratio_to_gpt"] = statistics.median(paired)
        out[name]["ratio_of_medians"] = out[name]["tokens_per_s"] / out["gpt"]["tokens_per_s"]
        # GPT / model FLOPs: the ratio the model would reach at the GPT's FLOP rate; measured
        # over executed is how fast the model runs its own matmuls against the GPT's
        out[name]["flop_ratio_ideal"] = out["gpt"]["flops_ideal"] / out[name]["flops_ideal"]
        out[name]["flop_ratio_executed"] = (out["gpt"]["flops_executed"]
                                            / out[name]["flops_executed"])
        out[name]["rate_vs_gpt"] = out[name]["ratio_to_gpt"] / out[name]["flop_ratio_executed"]
    return out


def check_targets(results: dict) -> list[str]:
    failures = []
    for shape, row in results.items():
        length = int(shape.split("x")[1])
        for name, target in RATE_TARGETS.items():
            if name in row and row[name]["rate_vs_gpt"] < target:
                failures.append(f"{name} at {shape}: FLOP rate {row[name]['rate_vs_gpt']:.2f} "
                                f"of the GPT's < {target}")
        if "swa" in row and length == SWA_TARGET_LONG[0] and \
                row["swa"]["ratio_to_gpt"] < SWA_TARGET_LONG[1]:
            failures.append(f"swa at {shape}: {row['swa']['ratio_to_gpt']:.2f}x < "
                            f"{SWA_TARGET_LONG[1]}x")
    return failures


def markdown(results: dict, meta: dict) -> str:
    names = [n for n in ("gpt", *VARIANTS) if n in next(iter(results.values()))]
    lines = [f"Training step (fwd + bwd + AdamW), {meta['dtype']}, {meta['threads']} threads, "
             f"median of {meta['steps']} interleaved steps; torch {meta['torch']}; torch.compile: "
             f"{meta['compile']}.", "",
             "| B x T | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for shape, row in results.items():
        cells = []
        for n in names:
            r = row[n]
            cells.append(f"{r['ratio_to_gpt']:.2f}x ({r['tokens_per_s']:.0f} tok/s)")
        lines.append(f"| {shape.replace('x', ' x ')} | " + " | ".join(cells) + " |")
    lines += ["", "Where the ratio comes from: forward matmul FLOPs, GPT / model (ced.cost; "
              "`ideal`: only the keys and entries each query sees; `executed`: what the kernels "
              "multiply, e.g. a top-k read as a masked matmul over every visible entry), and "
              "the model's FLOP rate against the GPT's (measured ratio / executed ratio).", "",
              "| B x T | " + " | ".join(f"{n} ideal / executed / rate" for n in names[1:]) + " |",
              "|---|" + "---|" * (len(names) - 1)]
    for shape, row in results.items():
        lines.append(f"| {shape.replace('x', ' x ')} | " + " | ".join(
            f"{row[n]['flop_ratio_ideal']:.2f}x / {row[n]['flop_ratio_executed']:.2f}x / "
            f"{row[n]['rate_vs_gpt']:.2f}" for n in names[1:]) + " |")
    lines.append("")
    lines.append("Parameters: " + ", ".join(
        f"{n} {next(iter(results.values()))[n]['params'] / 1e6:.2f}M" for n in names))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x512,2x2048", help="comma-separated BxT")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="ModelConfig override for the ced-family models, e.g. "
                             "--set global_read=auto (JSON values)")
    parser.add_argument("--compile", choices=("none", "pointwise", "all"), default="none",
                        help="torch.compile: pointwise = the ced family's MLPs and norms; all = "
                             "those and the GPT's blocks (compiled during the warm-up)")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if args.compile != "none" and args.warmup < 1:
        parser.error(f"--compile {args.compile} needs --warmup >= 1: the first step compiles, "
                     "and a timed round would count the compilation")
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    names = ["gpt"] + [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names[1:] if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    results = {}
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.lower().split("x"))
        print(f"[bench-peer] {batch} x {length}", flush=True)
        results[f"{batch}x{length}"] = bench_shape(batch, length, names, args.steps,
                                                   args.warmup, args.dtype, overrides,
                                                   args.compile)
    meta = {"dtype": args.dtype, "threads": torch.get_num_threads(), "steps": args.steps,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "overrides": overrides, "compile": args.compile}
    table = markdown(results, meta)
    print(table)
    failures = check_targets(results)
    print("targets: " + ("all met" if not failures else "MISSED: " + "; ".join(failures)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer.json").write_text(json.dumps({"meta": meta, "results": results,
                                                    "missed": failures}, indent=2))
    (args.out / "peer.md").write_text(table)
    print(f"wrote {args.out / 'peer.json'} and {args.out / 'peer.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
