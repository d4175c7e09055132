"""Compose and check every training job of a study before any of them runs:
`python -m experiments.check_jobs [--configs] JOBS.json`.

JOBS.json: a list of {"label": "<job>/seed<k>", "overrides": [...]}, the `ced.train`
overrides of each run. Prints one JSON object per line for every job whose config is refused
({"label", "error"}: the one-line error `python -m ced.train` would print when that job's
turn came), nothing for the others; with `--configs`, also {"label", "config"} for every job
that composes (the checked TrainConfig as a dict: what the run would train). Exits 0 unless
it could not check at all. The study driver runs it in a subprocess, because composing a
training config needs a fresh Hydra while the driver itself is a Hydra app.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ced.cli.train import compose_config, set_offline_defaults
from ced.train_config import ConfigError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    configs = bool(args) and args[0] == "--configs"
    args = args[1:] if configs else args
    if len(args) != 1:
        print("usage: python -m experiments.check_jobs [--configs] JOBS.json", file=sys.stderr)
        return 2
    set_offline_defaults()
    for job in json.loads(Path(args[0]).read_text()):
        try:
            config = compose_config(list(job["overrides"]))
        except ConfigError as exc:
            print(json.dumps({"label": job["label"], "error": str(exc)}), flush=True)
            continue
        if configs:
            print(json.dumps({"label": job["label"], "config": dataclasses.asdict(config)},
                             default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
