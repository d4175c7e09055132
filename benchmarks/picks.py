"""How much of a top-k read's masked matmul a trained model's picks could skip.

    python benchmarks/picks.py CHECKPOINT [--rows 8] [--seq-len 512] [--json OUT]

A query block of `ced.attention.attend` reads its top-k picks either by gathering them or, where
`ced.config.global_read_is_masked` says so (most blocks at the studies' shapes), by one matmul
over every entry visible to its last query (n_read) with the unpicked ones masked. A read over
the union of the block's picks (the lever benchmarks/README.md names) scores only the entries
some query of the block picked. Its saving depends on how the picks overlap, which untrained
indexers do not show: this reads a trained checkpoint's picks on held-out text (the validation
files of `data=stdlib`, as `evals.real_text` reads them, cut into rows of --seq-len bytes) and
prints, per global source (its compression ratio) and per query block position, the entries
read masked (n_read), the union of the block's picks per batch row, and the ratio of their
sums: the fraction of the masked read's score and value work the union read would keep.

The picks are recorded by wrapping `attend` where the model calls it (`ced.model.attend`), so
the forward itself is the model's own; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ced.model as model_module  # noqa: E402
from ced.checkpoint import load_model  # noqa: E402
from ced.config import global_read_is_masked  # noqa: E402
from ced.semantics import visible_entries  # noqa: E402
from evals.real_text import validation_files  # noqa: E402


def block_unions(records: list, q: torch.Tensor, block: int, source, selection,
                 global_read: str) -> None:
    """Append (compress ratio, block start, n_read, union size, masked) per query block and
    batch row of one `attend` call (q [B, H, Tq, Dh]) with a top-k selection (index/valid
    [B, Tq, k]) to `records`; masked: whether the block reads through the masked matmul
    (`global_read_is_masked`, as `attend` decides) rather than a gather."""
    q_len, heads_per_kv_head = q.shape[2], q.shape[1] // source.k.shape[1]
    n_visible = visible_entries(torch.arange(q_len), source.compress_ratio)
    for c0 in range(0, q_len, block):
        c1 = min(c0 + block, q_len)
        index, valid = selection.index[:, c0:c1], selection.valid[:, c0:c1]
        n_read = int(n_visible[c1 - 1])
        masked = global_read_is_masked(global_read, c1 - c0, n_read, index.shape[-1],
                                       heads_per_kv_head)
        for row in range(index.shape[0]):
            union = torch.unique(index[row][valid[row]]).numel()
            records.append((source.compress_ratio, c0, n_read, union, masked))


def read_picks(checkpoint: Path, rows: int, seq_len: int) -> list:
    """Every (compress ratio, block start, n_read, union) of one forward of `checkpoint` over
    `rows` rows of `seq_len` held-out bytes."""
    model = load_model(checkpoint).eval()
    text = b"".join(data for _, data in validation_files())
    if len(text) < rows * seq_len:
        raise ValueError(f"--rows {rows} x --seq-len {seq_len} exceeds the held-out text "
                         f"({len(text)} bytes)")
    ids = torch.tensor(list(text[: rows * seq_len]), dtype=torch.long).view(rows, seq_len)
    records: list = []
    attend = model_module.attend

    def recording(q, query_positions, lower, window, source, selection, sink, block, *args,
                  **kwargs):
        if source is not None and selection is not None and selection.index is not None:
            block_unions(records, q, block, source, selection,
                         kwargs.get("global_read", "auto"))
        return attend(q, query_positions, lower, window, source, selection, sink, block,
                      *args, **kwargs)

    model_module.attend = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model_module.attend = attend
    return records


def _kept(rows: np.ndarray) -> float:
    """sum(union) / sum(n_read) of `rows` (NaN for none)."""
    return float(rows[:, 3].sum() / rows[:, 2].sum()) if len(rows) else float("nan")


def summary(records: list) -> list[dict]:
    """Per compress ratio (one row each, then one per block start): blocks, the share read
    masked, mean n_read, mean union, and sum(union) / sum(n_read) over the masked blocks (the
    work a union read would keep; NaN where no block is masked)."""
    table = np.array(records, dtype=float)
    out = []
    for ratio in sorted(set(table[:, 0])):
        part = table[table[:, 0] == ratio]
        for start in [None, *sorted(set(part[:, 1]))]:
            rows = part if start is None else part[part[:, 1] == start]
            out.append({"compress_ratio": int(ratio),
                        "block_start": "all" if start is None else int(start),
                        "blocks": len(rows), "masked_share": rows[:, 4].mean(),
                        "n_read_mean": rows[:, 2].mean(), "union_mean": rows[:, 3].mean(),
                        "union_over_n_read_masked": _kept(rows[rows[:, 4] > 0])})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a trained model directory (final/)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        records = read_picks(args.checkpoint, args.rows, args.seq_len)
    except (FileNotFoundError, ValueError) as error:
        print(f"picks: {error}", file=sys.stderr)
        return 2
    if not records:
        print("picks: the model made no top-k read (no topk, or every read dense)",
              file=sys.stderr)
        return 2
    table = summary(records)
    print("| compress ratio | block start | blocks | read masked | n_read | union | "
          "union / n_read, masked blocks |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['compress_ratio']} | {r['block_start']} | {r['blocks']} | "
              f"{r['masked_share']:.2f} | {r['n_read_mean']:.0f} | {r['union_mean']:.1f} | "
              f"{r['union_over_n_read_masked']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
