"""Learning probe: how fast do a plain GPT and the ced variants learn a synthetic task, on
identical batches? (`make bench-learning`)

The findings need models that retrieve. When a variant stays at chance, this probe says whether
the variant is at fault or the budget is: every model sees the same training rows (built by
`ced.data.build_source`), the same loss (answer tokens only, `ced.train.token_weights`), the same
AdamW schedule (linear warm-up, cosine decay to 0.1 lr) and is scored with the same metric
(validation exact match per family, `ced.data.answer_accuracy`, teacher-forced).

Models: `gpt` (benchmarks/gpt.py, learned absolute positions), `gpt-rotary` (the same GPT with
rotary embeddings instead, as every ced variant has), and the ced variants dense | swa | yoco | ced
with `--layers` split evenly between encoder and decoder.

    python benchmarks/learning.py                                   # kv_recall, no filler
    python benchmarks/learning.py --models gpt,gpt-rotary,yoco --steps 1500 \\
        --tasks '{"kv_recall": {"filler": 32}}' --d-model 128

Writes learning.json, learning.md and learning.png (exact match against step, one panel per
family) to benchmarks/results/ (or --out DIR). Models train one after another, in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from ced import CEDModel, ModelConfig  # noqa: E402
from ced.data import answer_accuracy, build_source  # noqa: E402
from ced.train import token_weights  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

CED_VARIANTS = ("dense", "swa", "yoco", "ced")
GPT_MODELS = {"gpt": "learned", "gpt-rotary": "rotary"}


def build_model(name: str, args: argparse.Namespace) -> torch.nn.Module:
    """A fresh model `name` (gpt | gpt-rotary | dense | swa | yoco | ced) of the probe's size."""
    torch.manual_seed(args.seed)
    if name in GPT_MODELS:
        return GPT(GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                             max_seq_len=args.seq_len, positions=GPT_MODELS[name]))
    if name not in CED_VARIANTS:
        raise ValueError(f"--models: unknown model {name!r}; allowed: "
                         f"{', '.join([*GPT_MODELS, *CED_VARIANTS])}")
    encoder = max(1, args.layers // 2)
    return CEDModel(ModelConfig(
        variant=name, d_model=args.d_model, n_heads=args.heads, n_encoder_layers=encoder,
        n_decoder_layers=args.layers - encoder, window=args.window,
        topk=(args.topk or None) if name == "ced" else None, global_from_layer=1,
        encoder_kv_groups=1, shift_tokens=args.shift_tokens, max_seq_len=args.seq_len))


def exact_match(model: torch.nn.Module, batch: dict, families: list[str]) -> dict[str, float]:
    """Teacher-forced validation exact match per family of `batch` (rows [B, T])."""
    model.eval()
    with torch.no_grad():
        predictions = model(batch["input_ids"]).argmax(-1)
    model.train()
    return {family: round(scores["exact_match"], 4)
            for family, scores in answer_accuracy(predictions, batch, families).items()}


def train_one(name: str, args: argparse.Namespace, train_rows, valid: dict,
              families: list[str]) -> dict:
    """Train model `name` for args.steps steps; its curve [(step, {family: exact match})]."""
    model = build_model(name, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    curve, start = [], time.perf_counter()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / args.warmup)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * cosine
        batch = train_rows(step)
        weights = token_weights(batch, "answers", 1.0)
        logits = model(batch["input_ids"])
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten().clamp(min=0),
                                 reduction="none")
        loss = (losses * weights.flatten()).sum() / weights.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            scores = exact_match(model, valid, families)
            curve.append((step + 1, scores))
            print(f"{name:>10} step {step + 1:5d} loss {loss.item():.3f} exact {scores} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    return {"curve": curve, "seconds": round(time.perf_counter() - start, 1),
            "params": sum(p.numel() for p in model.parameters())}


def write_outputs(out: Path, args: argparse.Namespace, results: dict, families: list[str]) -> None:
    """learning.json (everything), learning.md (final exact match) and learning.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                  indent=1) + "\n")
    lines = [f"Learning probe: {args.steps} steps, batch {args.batch} x {args.seq_len}, "
             f"d_model {args.d_model}, {args.layers} layers, lr {args.lr}, seed {args.seed}, "
             f"tasks {args.tasks}", "",
             "| model | params | " + " | ".join(families) + " | time (s) |",
             "|---" * (len(families) + 3) + "|"]
    for name, row in results.items():
        final = row["curve"][-1][1] if row["curve"] else {}
        cells = " | ".join(f"{final.get(f, float('nan')):.3f}" for f in families)
        lines.append(f"| {name} | {row['params']:,} | {cells} | {row['seconds']} |")
    (out / "learning.md").write_text("\n".join(lines) + "\n")
    # lazy: matplotlib costs ~0.3 s to import, and only the closing figure needs it
    import matplotlib
    matplotlib.use("Agg")
    # imported after the backend is chosen (matplotlib.use above)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(families), figsize=(4.5 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for name, row in results.items():
            ax.plot([s for s, _ in row["curve"]], [sc.get(family, math.nan) for _, sc in row["curve"]],
                    marker=".", label=name)
        ax.set(title=family, xlabel="step", ylabel="validation exact match", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,gpt-rotary,dense,yoco",
                   help="comma-separated: gpt, gpt-rotary, dense, swa, yoco, ced")
    p.add_argument("--tasks", default='{"kv_recall": {"filler": 0}}',
                   help="JSON: data.tasks of the synthetic source (name -> params)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--topk", type=int, default=16,
                   help="ced: top-k of the sparse read (0: read every visible entry)")
    p.add_argument("--shift-tokens", type=int, default=0,
                   help="ced variants: ModelConfig.shift_tokens (input token mixing, 0: off)")
    p.add_argument("--curriculum-rows", type=int, default=0,
                   help="data.curriculum_rows: training rows over which filler ramps up from 0")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--valid-rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "results"))
    args = p.parse_args(argv)
    for key in ("steps", "batch", "seq_len", "d_model", "layers", "heads", "eval_every",
                "valid_rows", "warmup"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    try:
        tasks = json.loads(args.tasks)
    except json.JSONDecodeError as err:
        p.error(f"--tasks must be JSON (name -> params), got {args.tasks!r}: {err}")
    if not isinstance(tasks, dict) or not tasks:
        p.error(f"--tasks must be a non-empty JSON object, got {args.tasks!r}")
    args.task_config = {name: {"weight": 1.0, **(params or {})} for name, params in tasks.items()}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # `only`: the tasks named, not every registered one
    data = {"kind": "synthetic", "tasks": args.task_config, "only": list(args.task_config),
            "seed": 0, "curriculum_rows": args.curriculum_rows}
    train, valid_source = build_source(data, "train"), build_source(data, "validation")
    families = train.families
    valid = valid_source.rows(0, args.valid_rows, args.seq_len)

    def train_rows(step: int) -> dict:
        return train.rows(step * args.batch, args.batch, args.seq_len)

    results = {name: train_one(name, args, train_rows, valid, families)
               for name in args.models.split(",")}
    write_outputs(Path(args.out), args, results, families)
    print((Path(args.out) / "learning.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
