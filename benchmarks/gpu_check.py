"""GPU check (`make gpu-check`): exactness on the device, and speed against a plain GPT.

Three sections. Every cell is guarded: an error or an out-of-memory is recorded in the cell and
the check goes on; a cell that would start after --budget-s is recorded as skipped. The JSON
is rewritten after every cell, so a run cut short still leaves what it measured.

1. Exactness: for every variant, a small float64 model with random weights; incremental prefill
   + decode equals the parallel forward (docs/semantics.md invariants 1-4: full prefill for
   all, early exit with N = R_exact and bounded N = 3 against the truncated-window forward for
   the split variants), max |difference| against the tolerance 1e-9.
2. Short context, the peer benchmark's models (benchmarks/peer.py: d_model 256, 16 layers,
   W 64, ced top-k 64, about 13M parameters each, and the plain GPT): one AdamW training step
   at 8 x 512 and 2 x 2048, fp32 and bf16 autocast; tokens/s, the ratio to the GPT, the
   executed forward-FLOP ratio (ced.cost) and the FLOP rate against the GPT's (the
   short-context target reads the rate: >= 0.9).
3. Long context, B = 1, T = 8192, 16384, 32768 (--long): the bf16 training step, the GPT's
   forward against each variant's full prefill and, for the split variants, the early-exit
   prefill with N = W; peak memory beside every time.

Times are CUDA-event medians (perf_counter on the CPU) of --iters runs after --warmup. Writes
gpu_check.json and gpu_check.md into --out (default benchmarks/results). Without a CUDA device
it says so and exits 0; `--device cpu --tiny` runs every section at toy sizes, which the test
suite does so that the script is known to run between GPU loans.

    python benchmarks/gpu_check.py                      # on a CUDA machine, about 5 minutes
    python benchmarks/gpu_check.py --device cpu --tiny  # every code path, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from ced import CEDModel, InferenceEngine, ModelConfig, exact_replay_length  # noqa: E402
from ced.cost import forward_flops  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from peer import COMMON, make_step, model_config  # noqa: E402

TOL = 1e-9
VARIANTS = ("dense", "swa", "yoco", "ced")
MODELS = ("gpt",) + VARIANTS
SHORT_SHAPES = ((8, 512), (2, 2048))
LONG_LENGTHS = (8192, 16384, 32768)
# --tiny: the same code at toy sizes (d_model 32, W 8, top-k 8; every layer count kept)
TINY = dict(d_model=32, d_ff=86, window=8, topk=8)
TINY_SHORT_SHAPES = ((2, 64),)
TINY_LONG_LENGTHS = (128,)


def exactness(device: torch.device) -> dict:
    """Engine against parallel forward per variant, float64: {variant: {max_abs_diff, ok}}."""
    return {variant: exactness_of(variant, device) for variant in VARIANTS}


def exactness_of(variant: str, device: torch.device) -> dict:
    """{max_abs_diff: {replay: worst |engine - forward|}, ok} of one variant's small model."""
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
    return {"max_abs_diff": worst, "ok": all(v <= TOL for v in worst.values())}


def build(name: str, max_seq_len: int, tiny: bool, device: torch.device) -> torch.nn.Module:
    """The peer benchmark's model `name` (gpt or a variant), seeded, on `device`."""
    torch.manual_seed(0)
    sizes = TINY if tiny else {}
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=COMMON["vocab_size"],
                             d_model=sizes.get("d_model", COMMON["d_model"]),
                             n_heads=COMMON["n_heads"],
                             n_layers=COMMON["n_encoder_layers"] + COMMON["n_decoder_layers"],
                             max_seq_len=max_seq_len)).to(device)
    fields = dict(sizes, max_seq_len=max_seq_len)
    if name != "ced":
        fields.pop("topk", None)
    return CEDModel(model_config(name, **fields)).to(device)


def executed_flops(model: torch.nn.Module, length: int) -> int:
    """Forward matmul FLOPs the model's kernels multiply on one sequence (ced.cost)."""
    if isinstance(model, GPT):
        return model.forward_flops(length)
    return forward_flops(model.cfg, length, counting="executed").total


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> dict:
    """Median seconds of `iters` calls after `warmup`, and the peak memory (GiB, CUDA only)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    out = {"median_s": statistics.median(times), "times_s": times}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


class Check:
    """The results tree, the time budget, and the guard every cell runs under."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.began = time.perf_counter()
        self.result: dict = {"meta": {
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu"),
            "torch": torch.__version__, "tiny": args.tiny, "warmup": args.warmup,
            "iters": args.iters, "budget_s": args.budget_s,
            "tf32": torch.backends.cuda.matmul.allow_tf32}}

    def save(self) -> None:
        self.result["meta"]["elapsed_s"] = round(time.perf_counter() - self.began, 1)
        self.args.out.mkdir(parents=True, exist_ok=True)
        (self.args.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2))

    def cell(self, path: tuple[str, ...], fn: Callable[[], dict]) -> dict | None:
        """Run fn into result[path...]: its dict, or {'error': ...}, or {'skipped': ...}."""
        node = self.result
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if time.perf_counter() - self.began > self.args.budget_s:
            node[path[-1]] = {"skipped": f"past --budget-s {self.args.budget_s}"}
            return None
        label = " / ".join(path)
        try:
            value = fn()
            print(f"[gpu-check] {label}: {brief(value)}", flush=True)
        except Exception as error:  # noqa: BLE001 - every failure is a result here
            value = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            print(f"[gpu-check] {label}: {value['error']}", flush=True)
            if not isinstance(error, torch.cuda.OutOfMemoryError):
                traceback.print_exc()
        finally:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        node[path[-1]] = value
        self.save()
        return value


def brief(value: dict) -> str:
    if "median_s" in value:
        extra = f", peak {value['peak_gib']:.1f} GiB" if "peak_gib" in value else ""
        return f"{value['median_s'] * 1e3:.1f} ms{extra}"
    return json.dumps(value)[:200]


def training_cells(check: Check, section: str, batch: int, length: int, dtypes: tuple[str, ...],
                   warmup: int, iters: int) -> None:
    """Training-step cells of every model at batch x length, then their ratios to the GPT."""
    shape = f"{batch}x{length}"
    ids = torch.randint(0, COMMON["vocab_size"], (batch, length),
                        generator=torch.Generator().manual_seed(length)).to(check.device)
    for name in MODELS:
        for dtype in dtypes:
            def run(name=name, dtype=dtype) -> dict:
                model = build(name, max(length, COMMON["max_seq_len"]), check.args.tiny,
                              check.device).train()
                row = timed(make_step(model, ids, dtype), check.device, warmup, iters)
                row.update(params=sum(p.numel() for p in model.parameters()),
                           tokens_per_s=ids.numel() / row["median_s"],
                           flops_executed=batch * executed_flops(model, length))
                return row
            check.cell((section, shape, f"train_{dtype}", name), run)
        for dtype in dtypes:
            add_ratios(check.result[section][shape][f"train_{dtype}"])
    check.save()


def add_ratios(rows: dict) -> None:
    """Ratio to the GPT (its step time over the model's), the executed FLOP ratio, and the
    model's FLOP rate against the GPT's (ratio / FLOP ratio), where both cells were measured."""
    gpt = rows.get("gpt", {})
    for row in rows.values():
        if "median_s" in row and "median_s" in gpt:
            row["ratio_to_gpt"] = gpt["median_s"] / row["median_s"]
            row["flop_ratio_executed"] = gpt["flops_executed"] / row["flops_executed"]
            row["rate_vs_gpt"] = row["ratio_to_gpt"] / row["flop_ratio_executed"]


def prefill_cells(check: Check, length: int, warmup: int, iters: int) -> None:
    """The GPT's forward against each variant's full prefill and early-exit prefill (N = W)."""
    shape = f"1x{length}"
    prompt = torch.randint(0, COMMON["vocab_size"], (1, length),
                           generator=torch.Generator().manual_seed(length + 1)).to(check.device)
    for name in MODELS:
        replays = ["full"] + (["W"] if name in ("yoco", "ced") else [])
        for replay in replays:
            def run(name=name, replay=replay) -> dict:
                model = build(name, length, check.args.tiny, check.device).eval()
                if name == "gpt":
                    fn = lambda: model(prompt)  # noqa: E731
                else:
                    engine = InferenceEngine(model)
                    kwargs = {} if replay == "full" else {"replay": model.cfg.window}
                    fn = lambda: engine.prefill(prompt, **kwargs)  # noqa: E731
                with torch.no_grad(), torch.autocast(check.device.type, dtype=torch.bfloat16):
                    row = timed(fn, check.device, warmup, iters)
                row["tokens_per_s"] = length / row["median_s"]
                return row
            check.cell(("long", shape, "prefill_bf16", f"{name}:{replay}"), run)
    rows = check.result["long"][shape]["prefill_bf16"]
    gpt = rows.get("gpt:full", {})
    for row in rows.values():
        if "median_s" in row and "median_s" in gpt:
            row["ratio_to_gpt_forward"] = gpt["median_s"] / row["median_s"]
    check.save()


def markdown(result: dict) -> str:
    """The tables of gpu_check.md: ratio to the GPT (tokens/s) per cell."""
    meta = result["meta"]
    lines = [f"GPU check on {meta['device']}, torch {meta['torch']}, median of {meta['iters']} "
             f"after {meta['warmup']} warm-up, {meta['elapsed_s']} s in all.", ""]
    exact = result.get("exactness", {})
    if exact:
        lines.append("Exactness (engine = forward, float64, tol 1e-9): " + ", ".join(
            f"{v} {'ok' if r.get('ok') else 'FAILED ' + json.dumps(r)}" for v, r in exact.items()))
        lines.append("")
    for section in ("short", "long"):
        for shape, kinds in result.get(section, {}).items():
            for kind, rows in kinds.items():
                lines += [f"{section} {shape} {kind}:", "",
                          "| model | ms | tokens/s | ratio to GPT | FLOP ratio | rate vs GPT "
                          "| peak GiB |", "|---|---|---|---|---|---|---|"]
                for name, row in rows.items():
                    if "median_s" not in row:
                        lines.append(f"| {name} | {row.get('error') or row.get('skipped')} "
                                     "| | | | | |")
                        continue
                    ratio = row.get("ratio_to_gpt", row.get("ratio_to_gpt_forward"))
                    cells = [f"{row['median_s'] * 1e3:.1f}", f"{row['tokens_per_s']:.0f}",
                             f"{ratio:.2f}x" if ratio else "",
                             f"{row['flop_ratio_executed']:.2f}x"
                             if "flop_ratio_executed" in row else "",
                             f"{row['rate_vs_gpt']:.2f}" if "rate_vs_gpt" in row else "",
                             f"{row['peak_gib']:.1f}" if "peak_gib" in row else ""]
                    lines.append(f"| {name} | " + " | ".join(cells) + " |")
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="toy sizes (d_model 32, T 64 and 128): every code path in seconds")
    parser.add_argument("--long", default=",".join(map(str, LONG_LENGTHS)),
                        help="comma-separated T of the long-context section (B = 1)")
    parser.add_argument("--sections", default="exactness,short,long")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="no cell starts after this many seconds (the rest: skipped)")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"exactness", "short", "long"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; allowed: exactness, short, long")
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device: {args.device!r}; allowed: cuda, cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing was checked (the CPU test suite covers "
              "the semantics; --device cpu --tiny runs this script's code paths)")
        return 0
    device = torch.device(args.device)
    check = Check(args, device)
    if "exactness" in sections:
        for variant in VARIANTS:
            check.cell(("exactness", variant), lambda v=variant: exactness_of(v, device))
    if "short" in sections:
        for batch, length in (TINY_SHORT_SHAPES if args.tiny else SHORT_SHAPES):
            training_cells(check, "short", batch, length, ("fp32", "bf16"), args.warmup,
                           args.iters)
    if "long" in sections:
        lengths = TINY_LONG_LENGTHS if args.tiny else tuple(
            int(t) for t in args.long.split(",") if t.strip())
        for length in lengths:
            warmup, iters = min(args.warmup, 1), min(args.iters, 3)
            training_cells(check, "long", 1, length, ("bf16",), warmup, iters)
            prefill_cells(check, length, warmup, iters)
    check.save()
    table = markdown(check.result)
    (args.out / "gpu_check.md").write_text(table)
    print(table)
    failed = [v for v, r in check.result.get("exactness", {}).items() if not r.get("ok")]
    print("exactness: " + ("all variants exact" if not failed else f"FAILED for {failed}"))
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
