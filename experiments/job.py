"""`python -m experiments.job KIND CONFIG.json [THREADS]`: one evaluation tool run on the config
the study driver wrote as JSON, in its own process (a crash cannot take the driver down).

KIND names the tool; CONFIG.json holds the fields of its config dataclass, the same fields its
command line is built from (`evals.cli`):

    suite        evals.suites.runner.SuiteConfig   -> run_suite
    divergence   evals.divergence.DivergenceConfig -> run
    real_text    evals.real_text.RealTextConfig    -> run
    erf          evals.erf.ErfConfig               -> run_config

A key that is not a field is an error naming it and the allowed fields.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable


def _suite() -> tuple[type, Callable[[Any], Any]]:
    from evals.suites.runner import SuiteConfig, run_suite
    return SuiteConfig, run_suite


def _divergence() -> tuple[type, Callable[[Any], Any]]:
    from evals.divergence import DivergenceConfig, run
    return DivergenceConfig, lambda config: run(config, Path(config.out_dir))


def _real_text() -> tuple[type, Callable[[Any], Any]]:
    from evals.real_text import RealTextConfig, run
    return RealTextConfig, run


def _erf() -> tuple[type, Callable[[Any], Any]]:
    from evals.erf import ErfConfig, run_config
    return ErfConfig, run_config


JOBS: dict[str, Callable[[], tuple[type, Callable[[Any], Any]]]] = {
    "suite": _suite, "divergence": _divergence, "real_text": _real_text, "erf": _erf}
# the tools whose batch loops stop at a SIGTERM/SIGINT (`ced.signals.stop_point`); the others
# keep the signals' default effect
STOPS_BETWEEN_BATCHES = ("suite", "divergence", "real_text")


def load_job(kind: str, raw: dict) -> tuple[Any, Callable[[Any], Any]]:
    """(the config of tool `kind` built from `raw`, the function that runs it). Unknown kinds
    and keys are ValueErrors naming them."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from evals.cli import unknown_keys

    if kind not in JOBS:
        raise ValueError(f"KIND: one of {sorted(JOBS)}; got {kind!r}")
    cls, run = JOBS[kind]()
    if bad := unknown_keys(cls, list(raw)):
        allowed = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ValueError(f"{kind} config: unknown key(s) {bad}; allowed: {allowed}")
    # OmegaConf checks every value against the field's type (and fills nested dataclasses)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw)), run
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ValueError(f"{kind} config: {key}: {str(exc).splitlines()[0]}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(argv) not in (2, 3):
        print(f"usage: python -m experiments.job {{{','.join(JOBS)}}} CONFIG.json [THREADS]",
              file=sys.stderr)
        return 2
    try:
        config, run = load_job(argv[0], json.loads(Path(argv[1]).read_text()))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(argv) == 3:
        import torch
        torch.set_num_threads(int(argv[2]))
    from ced.signals import Interrupted, StopSignals, continue_command
    try:
        with StopSignals(enabled=argv[0] in STOPS_BETWEEN_BATCHES):
            run(config)
    except Interrupted as exc:
        print(f"{argv[0]} {exc} at a batch boundary; nothing was written as finished; to "
              f"continue, run again: {continue_command()}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
