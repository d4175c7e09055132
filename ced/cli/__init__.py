"""The command-line applications of ced: `ced.cli.train` (`python -m ced.train`, `ced-train`)
and `ced.cli.cost` (`python -m ced.cost`, `ced-cost`), the Hydra entry points, kept apart
from the library they drive (ced/train.py's training loop, ced/cost.py's cost model).

And what every Hydra entry point does with a failure: one line naming the key and what is
allowed, then exit with a code (a single run) or raise (a job of a multirun, so that Hydra's
launcher records the failure and runs the sweep's other jobs)."""

from __future__ import annotations

import sys


class JobFailed(RuntimeError):
    """A job of a multirun that stopped on a bad config or a failed run; its message is the
    same one line a single run prints."""


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def fail(line: str, code: int) -> None:
    """Print the one-line reason; a single run exits with `code`, a multirun job raises."""
    print(line, file=sys.stderr, flush=True)
    if is_multirun():
        raise JobFailed(line) from None
    sys.exit(code)
