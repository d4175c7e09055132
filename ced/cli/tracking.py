"""`python -m ced.tracking`: an offline wandb run's config, summary, artifacts and how it
ended, read without a wandb server (the library's reading is `ced.tracking.read_run_history`)."""

from __future__ import annotations

import argparse
import json
import sys

from ced.tracking import read_run_history


def ending(exit_code: int | None) -> str:
    """How a run ended, from its exit code (None: the process was killed before it wrote one)."""
    return ("not finished (killed)" if exit_code is None
            else "finished" if exit_code == 0 else f"failed (exit {exit_code})")


def main(argv: list[str] | None = None) -> int:
    """`python -m ced.tracking RUN [RUN ...] [--json]`: print an offline run's config,
    summary, artifacts and how it ended, without a wandb server. RUN is a training run's
    directory, its wandb/ folder or its offline-run-* folders: a resumed run's several folders
    are read as one run's history."""
    p = argparse.ArgumentParser(prog="python -m ced.tracking", description=main.__doc__)
    p.add_argument("run", nargs="+", help="a run directory, its wandb/ folder, or "
                                          "wandb/offline-run-* folders of one run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        info = read_run_history(args.run)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    folders = info["folders"]
    spans = ("" if len(folders) == 1 else f" over {len(folders)} offline folders (" + ", ".join(
        f"{f['name']}: {ending(f['exit_code'])}, {f['history']} rows" for f in folders) + ")")
    print(f"run {info['id']}: {ending(info['exit_code'])}; {info['history']} history rows"
          f"{spans}; artifacts: {info['artifacts'] or 'none'}")
    summary = {k: v for k, v in info["summary"].items() if not k.startswith("_")}
    for key in sorted(summary):
        print(f"  summary {key}: {summary[key]}")
    for key in sorted(k for k in info["config"] if not k.startswith("_")):
        print(f"  config {key}: {info['config'][key]}")
    return 0

