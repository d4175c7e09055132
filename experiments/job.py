"""`python -m experiments.job KIND CONFIG.json [THREADS] [--module MODULE] [--merge]`: one
evaluation tool run on the config the study driver wrote as JSON, in its own process (a crash
cannot take the driver down). With --merge, the tool's merge (`EvaluationTool.merge`) runs
instead: CONFIG.json is {"config": the config's fields, "readings": the folders it merges}.

KIND names a registered evaluation tool (`experiments.tools`: divergence, suite, erf,
real_text); CONFIG.json holds the fields of its config dataclass, the same fields its command
line is built from (`evals.cli`). MODULE (the driver passes the tool's own) is imported first:
a tool registered outside `experiments.tools` registers itself there. A key that is not a
field is an error naming it and the allowed fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced.signals import Interrupted, StopSignals, continue_command
from evals.cli import unknown_keys

from .tools import TOOLS, EvaluationTool

USAGE = ("usage: python -m experiments.job KIND CONFIG.json [THREADS] [--module MODULE] "
         "[--merge]")


def find_tool(kind: str, module: str | None = None) -> EvaluationTool:
    """The registered tool `kind`, after importing `module` (where a tool registered outside
    `experiments.tools` registers itself); an unknown kind is a ValueError naming the known."""
    if module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"--module {module}: {exc}") from None
    if kind not in TOOLS:
        raise ValueError(f"KIND: one of {sorted(TOOLS)}; got {kind!r}")
    return TOOLS[kind]


def load_job(kind: str, raw: dict, module: str | None = None) -> tuple[Any, Callable[[Any], Any]]:
    """(the config of tool `kind` built from `raw`, the function that runs it), after
    importing `module` (`find_tool`). Unknown kinds and keys are ValueErrors naming them."""
    cls, run = find_tool(kind, module).load()
    if bad := unknown_keys(cls, list(raw)):
        allowed = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ValueError(f"{kind} config: unknown key(s) {bad}; allowed: {allowed}")
    # OmegaConf checks every value against the field's type (and fills nested dataclasses)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw)), run
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ValueError(f"{kind} config: {key}: {str(exc).splitlines()[0]}") from None


def load_merge(kind: str, raw: dict, module: str | None = None) -> tuple[Any, Callable]:
    """(the config of tool `kind` built from raw["config"], the function that merges
    raw["readings"] with it: the tool's `merge`); a tool without one, or a JSON without both
    keys, is a ValueError."""
    tool = find_tool(kind, module)
    if not tool.merge:
        raise ValueError(f"--merge: tool {kind!r} has no merge")
    if not (isinstance(raw, dict) and set(raw) == {"config", "readings"}
            and isinstance(raw["readings"], list)):
        raise ValueError("--merge: CONFIG.json holds {\"config\": {...}, \"readings\": "
                         f"[folders]}}; got {str(raw)[:200]}")
    config, _ = load_job(kind, raw["config"], module)
    merge = getattr(importlib.import_module(tool.module), tool.merge)
    readings = [str(r) for r in raw["readings"]]
    return config, lambda cfg: merge(cfg, readings)


def parse_args(argv: list[str]) -> tuple[list[str], str | None, bool]:
    """(KIND, CONFIG.json and THREADS as given, the --module value or None, whether --merge
    was given); a malformed command line is a ValueError with the usage."""
    args, module = list(argv), None
    merge = "--merge" in args
    if merge:
        args.remove("--merge")
    if "--module" in args:
        at = args.index("--module")
        if at + 1 >= len(args):
            raise ValueError(f"--module: needs a module name\n{USAGE}")
        module = args[at + 1]
        del args[at:at + 2]
    if len(args) not in (2, 3):
        raise ValueError(USAGE)
    return args, module, merge


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        args, module, merge = parse_args(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    kind = args[0]
    try:
        raw = json.loads(Path(args[1]).read_text())
        if merge:
            config, run = load_merge(kind, raw, module)
        else:
            config, run = load_job(kind, raw, module)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(args) == 3:
        torch.set_num_threads(int(args[2]))
    try:
        with StopSignals(enabled=TOOLS[kind].stops_between_batches):
            run(config)
    except Interrupted as exc:
        print(f"{kind} {exc} at a batch boundary; nothing was written as finished; to "
              f"continue, run again: {continue_command()}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
