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

import os
import sys

import torch

from ced.config import parse_replay_form
from ced.signals import Interrupted, StopSignals, continue_command
from ced.writable import check_output_dir
from evals.cli import build_parser, config_from_args

from .runner import SuiteConfig, check_out, format_table, run_suite

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_args(argv=None):
    """The command line as a `SuiteConfig`, checked: an --out that holds a run (without
    --overwrite) and a malformed replay form are one-line errors with exit code 2."""
    config = config_from_args(SuiteConfig, build_parser(
        SuiteConfig, prog="python -m evals.suites", description=__doc__).parse_args(argv))
    try:
        check_output_dir(config.out, "--out")
        check_out(config, "--out")
        config.replays = [parse_replay_form(v, "--replay") for v in config.replays]
        if config.sweep_replays is not None:
            config.sweep_replays = [parse_replay_form(v, "--sweep-replays")
                                    for v in config.sweep_replays]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    return config


def main(argv=None) -> int:
    config = parse_args(argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        with StopSignals():
            result = run_suite(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"evals.suites {exc} at a batch boundary; nothing was written as finished in "
              f"{config.out}; to continue, run again: {continue_command()}", file=sys.stderr)
        return exc.code
    if not config.quiet:
        print(format_table(result["summary"], result["tests"]))
        print(f"\n{result['seconds']:.1f}s; wrote " + ", ".join(
            str(p) for p in result["paths"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
