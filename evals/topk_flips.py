"""How often the top-k selection changes under a KV storage format: `python -m evals.topk_flips`.

    python -m evals.topk_flips --checkpoint RUN/seed0/final [RUN/seed1/final ...] --out DIR \
        [--kv indexer:fp4_block32 [global:fp4_block16 ...]] [--tasks kv_recall copy] \
        [--examples 16] [--length 256]

The lightning indexer picks each query's top-k global entries from scores against stored
indexer keys; storing those keys (or the entries, or the window K/V upstream) in a low
precision format can change which entries are picked. For every checkpoint, storage override
(`ced.quant.parse_kv_override`) and layer with an indexer, on task prompts of `--length` tokens
(the same prompts `evals.erf` uses), the parallel forward runs with and without the override and
compares the selected sets query by query:

- `changed`: the share of queries whose selected set differs at all;
- `jaccard`: the mean |A & B| / |A | B| of the two sets;
- `swapped`: the mean number of entries selected by one and not the other, per query.

Only *contested* queries count: those that see more entries than k (the others select every
visible entry, whatever the format). Results pooled over checkpoints (seeds) with a bootstrap
95% CI over (checkpoint, prompt). Writes `topk_flips.csv` and `summary.json` into --out.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import pandas as pd
import torch

from ced import CEDModel
from ced.checkpoint import CheckpointError, load_model
from ced.semantics import visible_entries
from ced.quant import parse_kv_override

from .cli import build_parser, config_from_args, option
from .erf import build_prompts, job_of


def selections(model: CEDModel, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer with an indexer: (index, valid) [B, T, k] of the parallel forward on ids."""
    picked: dict[int, tuple[torch.Tensor, ...]] = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if getattr(attn, "indexer", None) is None:
            continue

        def keep(module, args, output, layer=i):
            ctx = args[5]                      # Attention.forward(x, positions, ..., ctx)
            chosen = ctx.selections[module.spec.global_source]
            if chosen.index is not None:
                picked[layer] = (chosen.index.clone(), chosen.valid.clone())
        hooks.append(attn.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return picked


def _as_mask(index: torch.Tensor, valid: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Selected entries as a BoolTensor [B, T, n_entries]."""
    mask = torch.zeros(*index.shape[:2], n_entries + 1, dtype=torch.bool)
    target = torch.where(valid, index, torch.full_like(index, n_entries))
    return mask.scatter_(-1, target, True)[..., :n_entries]


def compare(plain: CEDModel, changed: CEDModel, ids: torch.Tensor) -> pd.DataFrame:
    """One row per (layer, prompt): changed share, Jaccard and swapped entries over the
    prompt's contested queries."""
    a, b = selections(plain, ids), selections(changed, ids)
    positions = torch.arange(ids.shape[1])
    rows = []
    for layer in sorted(a):
        spec = plain.plan.layers[layer]
        source = plain.plan.sources[spec.global_source]
        visible = visible_entries(positions, source.compress_ratio)          # [T]
        q = visible > plain.cfg.topk                                        # contested queries
        if not bool(q.any()):
            continue
        n = int(visible.max())
        ma, mb = _as_mask(*a[layer], n)[:, q], _as_mask(*b[layer], n)[:, q]
        inter, union = (ma & mb).sum(-1).float(), (ma | mb).sum(-1).float()
        changed = (ma != mb).any(-1).float().mean(-1)
        jaccard = (inter / union.clamp_min(1)).mean(-1)
        swapped = (ma ^ mb).sum(-1).float().mean(-1) / 2
        for p in range(ids.shape[0]):
            rows.append({"layer": layer, "part": spec.part, "prompt": p, "queries": int(q.sum()),
                         "changed": float(changed[p]), "jaccard": float(jaccard[p]),
                         "swapped": float(swapped[p])})
    return pd.DataFrame(rows)


def run(checkpoints: list[Path], out: Path, specs: list[str], tasks: list[str], examples: int,
        length: int, bootstrap: int = 1000, seed: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    ids, _ = build_prompts(tasks, examples, length, {})
    frames = []
    for checkpoint in checkpoints:
        plain = load_model(checkpoint).float()
        if plain.cfg.topk is None:
            raise ValueError(f"--checkpoint {checkpoint}: no top-k (trained with topk=None), so "
                             "no selection can flip")
        for spec in specs:
            table = compare(plain, load_model(checkpoint, kv=spec).float(), ids)
            frames.append(table.assign(checkpoint=str(checkpoint), job=job_of(checkpoint),
                                       kv=spec))
    table = pd.concat(frames, ignore_index=True)
    table.to_csv(out / "topk_flips.csv", index=False, float_format="%.6g")
    rng = np.random.default_rng(seed)
    summary = []
    for (job, spec, layer), part in table.groupby(["job", "kv", "layer"], sort=False):
        row = {"job": job, "kv": spec, "layer": int(layer), "part": part["part"].iloc[0],
               "units": len(part)}
        for metric in ("changed", "jaccard", "swapped"):
            values = part[metric].to_numpy()
            boots = rng.choice(values, size=(bootstrap, len(values))).mean(1)
            row[metric] = float(values.mean())
            row[f"{metric}_ci"] = [float(np.quantile(boots, 0.025)),
                                   float(np.quantile(boots, 0.975))]
        summary.append(row)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for row in summary:
        print(f"[topk_flips] {row['job']} {row['kv']} layer {row['layer']} ({row['part']}): "
              f"{100 * row['changed']:.1f}% of contested queries change their selection "
              f"(CI {100 * row['changed_ci'][0]:.1f}-{100 * row['changed_ci'][1]:.1f}%), "
              f"Jaccard {row['jaccard']:.3f}, {row['swapped']:.2f} entries swapped", flush=True)
    return {"summary": summary}


@dataclass
class TopkFlipsConfig:
    """The options of `python -m evals.topk_flips` (its command line is built from these
    fields by `evals.cli`)."""

    checkpoint: List[str] = option(help="trained ced models (a run's final/)")
    out: str = option(help="output directory")
    kv: List[str] = option(factory=lambda: ["indexer:fp4_block32"], help=(
        "storage overrides to compare against the checkpoint as trained"))
    tasks: List[str] = option(factory=lambda: ["kv_recall", "copy"],
                              help="synthetic tasks the prompts come from")
    examples: int = option(16, help="prompts per task")
    length: int = option(256, help="prompt length T (tokens)")
    bootstrap: int = option(1000, help="bootstrap resamples")


def main(argv: list[str] | None = None) -> int:
    c = config_from_args(TopkFlipsConfig, build_parser(
        TopkFlipsConfig, prog="python -m evals.topk_flips",
        description=__doc__.split("\n\n")[0]).parse_args(argv))
    try:
        for spec in c.kv:
            parse_kv_override(spec)
        run([Path(x) for x in c.checkpoint], Path(c.out), c.kv, c.tasks, c.examples, c.length,
            c.bootstrap)
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
