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
much of a ratio is work the model does and how much is the rate it does it at. Targets
(against the work each variant does): dense, yoco, ced and ced_mq run their executed
forward FLOPs at >= 0.9 of the GPT's FLOP rate at both shapes (`rate_vs_gpt`: tokens/s ratio
over executed-FLOP ratio; their ideal FLOP ratio to the GPT is about 1); swa >= 1.3x the
GPT's tokens/s at T = 2048, where its windows skip most of the GPT's attention.

The long-context table (where a sparse read and early exit should pay): B = 1,
T = 8192, 16384 and 32768, with fewer layers so that a step stays near a minute on a CPU
(`--long-shapes BxT:L`, L layers per half; the GPT has 2L). Per model, interleaved as above:
one training step, and a prefill through `ced.inference` (early exit with replay = W for the
variants with a decoder, every token through every layer for dense and swa) against the GPT's
forward; the peak memory of each (in a fresh process per model and phase: the rise of the
resident set's high-water mark over the resident set before it, or CUDA's peak allocation);
and ced's executed forward FLOPs by kind (indexer, global and window attention, projections),
which say what a missed target is made of. Targets at T = 8192: training step swa >= 2.5x,
ced and ced_mq >= 2.0x, yoco >= 1.4x, dense >= 0.9x the GPT's tokens/s; ced's early-exit
prefill >= 3x the GPT's forward. At 32768: ced >= 4x on the training step.

    python benchmarks/peer.py                       # both tables, fp32, torch's threads
    python benchmarks/peer.py --tables short        # 8x512 and 2x2048 only (minutes)
    python benchmarks/peer.py --tables long --long-shapes 1x8192:2 --variants ced,yoco
    python benchmarks/peer.py --shapes 8x512 --steps 3 --variants ced
    python benchmarks/peer.py --compile pointwise   # torch.compile of MLPs and norms (warm-up)

Writes benchmarks/results/peer.json and peer.md (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import core  # noqa: E402  (benchmarks/core.py: the benchmarked configs)
from ced import CEDModel, InferenceEngine, ModelConfig  # noqa: E402
from ced.cost import forward_flops, prefill_flops  # noqa: E402
from ced.model import MLP, RMSNorm  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = ("dense", "swa", "yoco", "ced", "ced_mq")
COMMON = dict(vocab_size=259, d_model=256, n_heads=4, n_encoder_layers=8, n_decoder_layers=8,
              window=64, d_ff=683, max_seq_len=2048)
CED_FIELDS = core.CED_FIELDS   # one definition of the benchmarked ced's sparse read (core.py)
RATE_TARGETS = {"ced": 0.9, "ced_mq": 0.9, "dense": 0.9, "yoco": 0.9}
SWA_TARGET_LONG = (2048, 1.3)
# B x T : layers per half (the GPT has twice as many): a step near a minute on 2 CPU cores
LONG_SHAPES = "1x8192:2,1x16384:2,1x32768:1"
# T -> {variant: minimum ratio to the GPT's tokens/s}
LONG_STEP_TARGETS = {8192: {"swa": 2.5, "ced": 2.0, "ced_mq": 2.0, "yoco": 1.4, "dense": 0.9},
                     32768: {"ced": 4.0}}
LONG_PREFILL_TARGETS = {8192: {"ced": 3.0}}


def model_config(variant: str, **overrides) -> ModelConfig:
    """The benchmark's config of `variant` (one of VARIANTS; ced_mq is ced with one K/V head
    per global entry), with `overrides` (--set) on top."""
    fields = {"ced": CED_FIELDS, "ced_mq": {**CED_FIELDS, "global_kv_heads": 1}}.get(variant, {})
    return ModelConfig(variant="ced" if variant == "ced_mq" else variant,
                       **{**COMMON, **fields, **overrides})


def build(name: str, overrides: dict, compile_mode: str = "none", layers: int | None = None,
          max_len: int | None = None) -> torch.nn.Module:
    """The seeded model; compile_mode `pointwise` compiles the ced family's MLPs and norms
    (the elementwise work between matmuls, `torch.compile` per module), `all` also the GPT's
    blocks, so that both sides get their elementwise ops fused.

    `layers` (the long-context table) replaces COMMON's 8 layers a half (the GPT gets 2 x
    layers, with rotary positions: a learned table would be 8M parameters at 32k), and the
    encoder's global reads shrink with it: from layer min(2, ceil(layers / 2)), in at most
    min(3, the layers left) groups (with one layer a half only the decoder reads a global
    KV); `max_len` raises max_seq_len above COMMON's 2048."""
    torch.manual_seed(0)
    max_len = max(max_len or 0, COMMON["max_seq_len"])
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=259, d_model=256, n_heads=4,
                              n_layers=2 * (layers or COMMON["n_encoder_layers"]),
                              max_seq_len=max_len,
                              positions="learned" if layers is None else "rotary"))
        if compile_mode == "all":
            for block in model.blocks:
                block.compile()
        return model
    shape = {"max_seq_len": max_len}
    if layers is not None:
        shape.update(n_encoder_layers=layers, n_decoder_layers=layers)
        if name in ("ced", "ced_mq"):
            first = min(2, (layers + 1) // 2)
            shape.update(global_from_layer=first, encoder_kv_groups=min(3, layers - first))
    model = CEDModel(model_config(name, **{**shape, **overrides}))
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


def interleaved_rounds(fns: dict, warmup: int, steps: int, label: str,
                       shown: Callable[[dict], str]) -> dict:
    """Run every function of `fns` once per round, in order, for `warmup + steps` rounds;
    key -> the wall times (s) of its last `steps` rounds. Interleaving puts every function
    under the same machine load round by round, so that ratios paired by round cancel it.
    After each round prints `label`, the round and `shown(times so far)`."""
    times: dict = {key: [] for key in fns}
    for round_ in range(warmup + steps):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_ >= warmup:
                times[key].append(time.perf_counter() - start)
        print(f"  {label} round {round_ + 1}/{warmup + steps}"
              f"{' (warm-up)' if round_ < warmup else ''}  {shown(times)}", flush=True)
    return times


def bench_shape(batch: int, length: int, names: list[str], steps: int, warmup: int,
                dtype: str, overrides: dict, compile_mode: str = "none") -> dict:
    ids = torch.randint(0, 259, (batch, length), generator=torch.Generator().manual_seed(length))
    models = {name: build(name, overrides, compile_mode) for name in names}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    step_fns = {name: make_step(m.train(), ids, dtype) for name, m in models.items()}
    times = interleaved_rounds(
        step_fns, warmup, steps, f"{batch}x{length}",
        lambda t: "  ".join(f"{n} {t[n][-1]:.2f}s" for n in names if t[n]))
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


def make_prefill(model: torch.nn.Module, ids: torch.Tensor, dtype: str):
    """The inference pass the long table times: the GPT's forward; for the ced family a
    `ced.inference` prefill, with early exit at replay = W for a model with a decoder (yoco,
    ced) and every token through every layer otherwise (dense, swa). No gradients, bf16
    autocast as the step's; the model is put back in training mode after it."""
    engine = None if isinstance(model, GPT) else InferenceEngine(model)
    replay = model.cfg.window if engine is not None and model.cfg.has_decoder else None
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def prefill() -> None:
        model.eval()
        with torch.no_grad(), autocast:
            model(ids) if engine is None else engine.prefill(ids, replay=replay)
        model.train()

    return prefill


def flop_breakdown(name: str, model: torch.nn.Module, length: int, batch: int) -> dict:
    """Forward and prefill matmul FLOPs of one model (ced.cost; the GPT's own count): the
    executed and ideal totals, and for the ced family the executed forward by kind."""
    if name == "gpt":
        total = batch * model.forward_flops(length)
        return {"forward_executed": total, "forward_ideal": total, "prefill_executed": total}
    cfg = model.cfg
    replay = cfg.window if cfg.has_decoder else None
    executed = forward_flops(cfg, length, counting="executed")
    return {"forward_executed": batch * executed.total,
            "forward_ideal": batch * forward_flops(cfg, length, counting="causal").total,
            "prefill_executed": batch * prefill_flops(cfg, length, replay, "executed").total,
            "forward_by_kind": {k: batch * v for k, v in executed.as_dict().items()}}


def bench_long_shape(batch: int, length: int, layers: int, names: list[str], steps: int,
                     warmup: int, dtype: str, overrides: dict, memory: bool = True) -> dict:
    """One long-context row: per model the training step's and the prefill's tokens/s, each
    paired by round against the GPT's step and forward, their peak memory (`peak_memory`, in
    fresh processes) and FLOPs (`flop_breakdown`)."""
    ids = torch.randint(0, 259, (batch, length), generator=torch.Generator().manual_seed(length))
    models = {name: build(name, overrides, layers=layers, max_len=length) for name in names}
    fns = {(name, phase): (make_step(m.train(), ids, dtype) if phase == "step"
                           else make_prefill(m, ids, dtype))
           for name, m in models.items() for phase in ("step", "prefill")}
    times = interleaved_rounds(
        fns, warmup, steps, f"{batch}x{length} ({layers} layers a half)",
        lambda t: "step/prefill: " + "  ".join(
            f"{n} {t[n, 'step'][-1]:.1f}/{t[n, 'prefill'][-1]:.1f}s"
            for n in names if t[n, "step"]))
    out = {}
    for name in names:
        row = {"params": sum(p.numel() for p in models[name].parameters()),
               **flop_breakdown(name, models[name], length, batch)}
        for phase in ("step", "prefill"):
            median = statistics.median(times[name, phase])
            # the GPT's own step against each model's step; the GPT's forward against a prefill
            paired = [g / t for g, t in zip(times["gpt", phase], times[name, phase])]
            row[phase] = {"times_s": times[name, phase], "median_s": median,
                          "tokens_per_s": batch * length / median,
                          "ratio_to_gpt": statistics.median(paired)}
            if memory:
                row[phase]["peak_mb"] = peak_memory(name, batch, length, layers, phase, dtype,
                                                    overrides)
        out[name] = row
    return out


def peak_memory(name: str, batch: int, length: int, layers: int, phase: str, dtype: str,
                overrides: dict) -> float:
    """MB the phase ("step" or "prefill") adds at its peak to what the process held before it,
    measured in a fresh process (`--memory-child`), so that no other model's freed memory
    hides it."""
    spec = json.dumps({"name": name, "batch": batch, "length": length, "layers": layers,
                       "phase": phase, "dtype": dtype, "overrides": overrides})
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-child",
                           spec], capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"peak memory of {name} {phase} at {batch}x{length} failed "
                           f"(rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])["peak_mb"]


def memory_child(spec: str) -> None:
    """In a fresh process: build one model, run its phase once, print {"peak_mb": ...}: the
    CUDA peak allocation on a GPU, else the rise of VmHWM (reset first) over VmRSS before."""
    job = json.loads(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(job["name"], job["overrides"], layers=job["layers"],
                  max_len=job["length"]).to(device)
    ids = torch.randint(0, 259, (job["batch"], job["length"]),
                        generator=torch.Generator().manual_seed(job["length"])).to(device)
    fn = (make_step(model.train(), ids, job["dtype"]) if job["phase"] == "step"
          else make_prefill(model, ids, job["dtype"]))
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    else:
        peak = core.peak_rss_rise(fn)["increase_mb"]
    print(json.dumps({"peak_mb": peak}), flush=True)


def check_long_targets(long: dict) -> list[str]:
    """The long-context targets (LONG_STEP_TARGETS, LONG_PREFILL_TARGETS) that a row missed."""
    failures = []
    for shape, row in long.items():
        length = int(shape.split("x")[1])
        for phase, targets in (("step", LONG_STEP_TARGETS), ("prefill", LONG_PREFILL_TARGETS)):
            for name, target in targets.get(length, {}).items():
                if name in row and row[name][phase]["ratio_to_gpt"] < target:
                    failures.append(f"{name} {phase} at {shape}: "
                                    f"{row[name][phase]['ratio_to_gpt']:.2f}x < {target}x")
    return failures


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


def markdown_long(long: dict, meta: dict) -> str:
    """The long-context tables: step and prefill against the GPT, their peak memory, and the
    ced family's executed forward FLOPs by kind."""
    names = [n for n in ("gpt", *VARIANTS) if n in next(iter(long.values()))]
    lines = [f"Long context: one training step and one prefill (early exit at replay = W where "
             f"the model has a decoder; the GPT: its forward), {meta['dtype']}, "
             f"{meta['threads']} threads, median of {meta['steps']} interleaved rounds; ratio "
             "to the GPT paired by round.", "",
             "| B x T (layers a half) | phase | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for shape, row in long.items():
        label = f"{shape.replace('x', ' x ')} ({meta['long_layers'][shape]})"
        for phase in ("step", "prefill"):
            lines.append(f"| {label} | {phase} | " + " | ".join(
                f"{row[n][phase]['ratio_to_gpt']:.2f}x ({row[n][phase]['tokens_per_s']:.0f} "
                "tok/s)" for n in names) + " |")
    if "peak_mb" in next(iter(long.values()))["gpt"]["step"]:
        lines += ["", "Peak memory a phase adds (MB; a fresh process per model and phase):", "",
                  "| B x T | phase | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for shape, row in long.items():
            for phase in ("step", "prefill"):
                lines.append(f"| {shape.replace('x', ' x ')} | {phase} | " + " | ".join(
                    f"{row[n][phase]['peak_mb']:.0f}" for n in names) + " |")
    return "\n".join(lines + ["", *flop_table(long)]) + "\n"


def flop_table(long: dict) -> list[str]:
    """Markdown lines: per shape and model the GPT's forward FLOPs over the model's (executed
    and ideal: the ratio a model would reach at the GPT's FLOP rate), and each kind's share of
    the model's executed forward."""
    names = [n for n in VARIANTS if n in next(iter(long.values()))]
    kinds = ("indexer", "global_attention", "window_attention", "linear", "sources", "head")
    lines = ["Forward FLOPs (ced.cost), GPT / model (executed, ideal), and each kind's share of "
             "the model's executed forward:", "",
             "| B x T | model | GPT / model, executed | ideal | " + " | ".join(kinds) + " |",
             "|---|---|---|---|" + "---|" * len(kinds)]
    for shape, row in long.items():
        gpt = row["gpt"]["forward_executed"]
        for n in names:
            by_kind, total = row[n]["forward_by_kind"], row[n]["forward_executed"]
            lines.append(f"| {shape.replace('x', ' x ')} | {n} | {gpt / total:.2f}x | "
                         f"{gpt / row[n]['forward_ideal']:.2f}x | " + " | ".join(
                             f"{by_kind[k] / total:.1%}" for k in kinds) + " |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", default="short,long", help="short (8x512, 2x2048), long "
                        "(T = 8k-32k), or both")
    parser.add_argument("--shapes", default="8x512,2x2048", help="short table: BxT, comma-"
                        "separated")
    parser.add_argument("--long-shapes", default=LONG_SHAPES, help="long table: BxT:L, L "
                        "layers a half (the GPT: 2L)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="long table: the peak memory of each model and phase")
    parser.add_argument("--flops-only", action="store_true", help="long table: print the "
                        "FLOP breakdown of --long-shapes (what each ratio could reach at the "
                        "GPT's FLOP rate) and time nothing")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
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
                             "those and the GPT's blocks (compiled during the warm-up); short "
                             "table only")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if args.compile != "none" and args.warmup < 1:
        parser.error(f"--compile {args.compile} needs --warmup >= 1: the first step compiles, "
                     "and a timed round would count the compilation")
    args.tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    if not args.tables or set(args.tables) - {"short", "long"}:
        parser.error(f"--tables: short, long or short,long; got {','.join(args.tables)!r}")
    args.names = ["gpt"] + [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in args.names[1:] if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    try:
        args.long_shapes = [parse_long_shape(item) for item in args.long_shapes.split(",")]
    except ValueError as exc:
        parser.error(f"--long-shapes: {exc}")
    shapes = [f"{b}x{t}" for b, t, _ in args.long_shapes]
    if len(set(shapes)) < len(shapes):
        parser.error(f"--long-shapes: one row per B x T; got {shapes}")
    args.overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            args.overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            args.overrides[key] = value
    return args


def parse_long_shape(item: str) -> tuple[int, int, int]:
    """"BxT:L" -> (B, T, L); a ValueError saying the form otherwise."""
    try:
        shape, _, layers = item.strip().lower().partition(":")
        batch, length = (int(x) for x in shape.split("x"))
        result = (batch, length, int(layers))
    except ValueError:
        raise ValueError(f"{item!r} is not BxT:L (e.g. 1x8192:2)") from None
    if min(result) < 1:
        raise ValueError(f"{item!r}: B, T and L must be >= 1")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child)
        return 0
    if args.flops_only:
        print("\n".join(flop_table({
            f"{b}x{t}": {n: flop_breakdown(n, build(n, args.overrides, layers=layers, max_len=t),
                                         t, b) for n in args.names}
            for b, t, layers in args.long_shapes})))
        return 0
    results, long, layers = {}, {}, {}
    for shape in args.shapes.split(",") if "short" in args.tables else []:
        batch, length = (int(x) for x in shape.lower().split("x"))
        print(f"[bench-peer] {batch} x {length}", flush=True)
        results[f"{batch}x{length}"] = bench_shape(batch, length, args.names, args.steps,
                                                   args.warmup, args.dtype, args.overrides,
                                                   args.compile)
    for batch, length, n_layers in args.long_shapes if "long" in args.tables else []:
        print(f"[bench-peer] long context {batch} x {length}, {n_layers} layers a half",
              flush=True)
        layers[f"{batch}x{length}"] = n_layers
        long[f"{batch}x{length}"] = bench_long_shape(batch, length, n_layers, args.names,
                                                     args.steps, args.warmup, args.dtype,
                                                     args.overrides, args.memory)
    meta = {"dtype": args.dtype, "threads": torch.get_num_threads(), "steps": args.steps,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "overrides": args.overrides, "compile": args.compile, "long_layers": layers}
    tables = ([markdown(results, meta)] if results else []) + \
        ([markdown_long(long, meta)] if long else [])
    print("\n".join(tables))
    failures, long_failures = check_targets(results), check_long_targets(long)
    for label, missed, ran in (("targets", failures, results), ("long-context targets",
                                                                 long_failures, long)):
        if ran:
            print(f"{label}: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer.json").write_text(json.dumps(
        {"meta": meta, "results": results, "missed": failures, "long": long,
         "long_missed": long_failures}, indent=2))
    (args.out / "peer.md").write_text("\n".join(tables))
    print(f"wrote {args.out / 'peer.json'} and {args.out / 'peer.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
