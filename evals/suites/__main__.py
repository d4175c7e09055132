"""python -m evals.suites --checkpoint DIR --replay 8 16 --out DIR [--examples 50] ...

Runs the edge-case suite on one checkpoint and writes into --out:
  data/<family>.jsonl     the documents evaluated (deterministic in the settings)
  results.csv             one row per example x mode (correct, nll, kl_answer: KL(full || mode)
                          over the answer tokens, prediction, logit_diff, ...)
  summary.csv/.json       accuracy per family x point x mode (and pooled, x=all), Wilson 95% CI
  paired_tests.csv        every mode vs full on the same examples (exact McNemar)
  capability_drop.csv     the cells where a mode is significantly below full (p < alpha)
  accuracy.png            accuracy vs distance (or T) per family, a line per mode
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: an --out that holds a run (without --overwrite) and a
    malformed replay form are one-line errors with exit code 2."""
    args = _parser().parse_args(argv)
    held = [n for n in ("results.csv", "summary.json") if (Path(args.out) / n).exists()]
    if held and not args.overwrite:
        print(f"error: --out {args.out} already holds a suite run ({', '.join(held)}); choose "
              f"another --out, or pass --overwrite to replace it", file=sys.stderr)
        sys.exit(2)
    from ced.config import parse_replay_form
    try:
        args.replay = [parse_replay_form(v, "--replay") for v in args.replay]
        args.sweep_replays = (None if args.sweep_replays is None else
                              [parse_replay_form(v, "--sweep-replays") for v in args.sweep_replays])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    return args


def _parser() -> argparse.ArgumentParser:
    from .families import FAMILIES

    p = argparse.ArgumentParser(prog="python -m evals.suites", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="directory written by ced.checkpoint."
                   "save_model (e.g. a training run's final/)")
    p.add_argument("--replay", nargs="+", required=True, metavar="N",
                   help="bounded replay lengths to test: N, W, W/k, kW, kW/d or R_exact, "
                        "resolved against the checkpoint (replay=exact and full always run)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--examples", type=int, default=50, help="examples per family x point")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=None,
                   help="default: all")
    p.add_argument("--turns", type=int, nargs="+", default=[], metavar="M",
                   help="new-turn sizes for the multiturn family (default: min(N) // 2)")
    p.add_argument("--distances", type=int, nargs="+", default=[], metavar="D",
                   help="extra distances for the distance families")
    p.add_argument("--max-length", type=int, default=None,
                   help="cap on prompt length (default: max_seq_len - 8)")
    p.add_argument("--needle-distractors", type=int, default=None,
                   help="default: topk + 1")
    p.add_argument("--state-length", type=int, default=None, metavar="T",
                   help="running_count/_parity/_bracket prompts of at least T tokens (a longer "
                        "random prefix before `|`; default: as short as the window allows)")
    p.add_argument("--sweep-replays", nargs="+", default=None, metavar="N",
                   help="place the distance and window sweeps' points around these replay "
                        "lengths only (default: every --replay); every --replay is still "
                        "evaluated on every document")
    p.add_argument("--topk", default=None, help="override the checkpoint's top-k (int or 'all')")
    p.add_argument("--kv", default=None,
                   help="override KV storage formats, e.g. window:fp8,global:fp4_block16,"
                        "indexer:fp4_block32 (fake quantisation at the storage points)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the drops")
    p.add_argument("--seed-offset", type=int, default=0, help="first example seed")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-wandb", dest="wandb", action="store_false",
                   help="do not log to wandb (by default the tables and the plot are logged, "
                        "offline unless WANDB_MODE is set, as training and divergence do)")
    p.add_argument("--wandb", dest="wandb", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the suite run already in --out (by default it is refused, as "
                        "ced.train refuses a run directory that holds a run)")
    p.add_argument("--wandb-project", default="ced", help="the one project of every ced run")
    p.add_argument("--wandb-group", default=None,
                   help="wandb group (default: $WANDB_RUN_GROUP, else 'suite')")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from .runner import format_table, run_suite

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run_suite(
            args.checkpoint, args.replay, args.out, examples=args.examples,
            families=args.families, turns=args.turns, batch_size=args.batch_size,
            dtype=args.dtype, device=args.device, topk=args.topk, kv=args.kv,
            extra_distances=args.distances, max_length=args.max_length,
            needle_distractors=args.needle_distractors,
            sweep_replays=args.sweep_replays, state_length=args.state_length,
            alpha=args.alpha,
            seed_offset=args.seed_offset, make_plot=not args.no_plot, wandb=args.wandb,
            wandb_project=args.wandb_project, wandb_group=args.wandb_group,
            progress=not args.quiet)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(format_table(result["summary"], result["tests"]))
        print(f"\n{result['seconds']:.1f}s; wrote " + ", ".join(
            str(p) for p in result["paths"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
