"""The command-line applications of ced: `ced.cli.train` (`python -m ced.train`, `ced-train`)
and `ced.cli.cost` (`python -m ced.cost`, `ced-cost`), the Hydra entry points, kept apart
from the library they drive (ced/train's training loop, ced/cost's cost model).

And what every Hydra entry point does with a failure: one line naming the key and what is
allowed, then exit with a code (a single run) or raise (a job of a multirun, so that Hydra's
launcher records the failure and runs the sweep's other jobs)."""

from __future__ import annotations

import sys
from dataclasses import fields, is_dataclass


class JobFailed(RuntimeError):
    """A job of a multirun that stopped on a bad config or a failed run; its message is the
    same one line a single run prints."""


def is_multirun() -> bool:
    # lazy: Hydra costs ~0.2 s to import, and ced.cli.tracking, which imports this package,
    # never composes a config
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_override_keys(overrides: list[str], schema, groups: tuple[str, ...] = (),
                        also: tuple[str, ...] = ()) -> None:
    """Overrides checked before Hydra composes, whose own messages span several lines and exit
    1: each `key=value` must parse in Hydra's override grammar, and each key `a.b.c` must name a
    field of `schema` (a dataclass instance) at every level; a key below a field that is not a
    dataclass (a free-form dict such as `data.tasks`) passes, and so do `hydra...` keys and
    `+`/`~` ones, which Hydra adds or removes. `groups`: the config groups a one-part key
    chooses (`model=tiny`) when the config has them; `also`: group-like keys the tool expands
    itself (listed as allowed). A ConfigError (one line naming the key) otherwise."""
    # lazy: Hydra's override parser and ced.train_config (which loads OmegaConf) cost ~0.25 s
    # together; ced.cli.cost and ced.cli.tracking import this package and never call this
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from ced.train_config import ConfigError
    parser = OverridesParser.create()
    for item in overrides:
        if "=" not in item or item.startswith("-"):
            continue
        key = item.split("=", 1)[0]
        try:
            parser.parse_overrides([item])
        except OverrideParseException as exc:
            raise ConfigError(f"{key.lstrip('+~')}: cannot parse {item!r} "
                              f"({str(exc).splitlines()[0]}); a list is written [a,b], "
                              f"quoted for the shell") from None
        if item[0] in "+~" or item.startswith("hydra"):
            continue
        parts = key.split(".")
        if len(parts) == 1 and groups:
            if key not in groups:
                raise ConfigError(f"{key}: unknown config group; allowed: "
                                  f"{list(groups) + list(also)}")
            continue
        node = schema
        for depth, part in enumerate(parts):
            if not is_dataclass(node):
                break
            names = {f.name for f in fields(node)}
            if part not in names:
                where = ".".join(parts[:depth]) or "the config"
                raise ConfigError(f"{key}: unknown key; allowed keys of {where}: {sorted(names)}")
            node = getattr(node, part)


def fail(line: str, code: int) -> None:
    """Print the one-line reason; a single run exits with `code`, a multirun job raises."""
    print(line, file=sys.stderr, flush=True)
    if is_multirun():
        raise JobFailed(line) from None
    sys.exit(code)
