"""A tool's command line, built from the dataclass that configures it.

A tool is configured by one dataclass (e.g. `evals.suites.runner.SuiteConfig`). Its fields are
what the study driver writes as JSON for `python -m experiments.job` and what a user types on
the command line, so the two cannot drift apart: `build_parser` makes the argparse parser from
the fields, `config_from_args` turns the parsed namespace back into the dataclass.

A field declares its command-line side through `option(...)`:

    examples: int = option(50, help="examples per family x point")

Rules, from the field's type and default:
- the flag is `--<name>` with dashes (`flag=` renames it, e.g. `--replay` for `replays`);
- a field without a default is a required option;
- `List[T]` takes one or more values (`nargs="+"`) of type T;
- `Optional[T]` is T with None as its default;
- a bool that defaults to False is a switch `--<name>`; one that defaults to True is switched
  off by `--no-<name>`;
- `choices` may be a list or a function returning one (read when the parser is built).

`list_written` runs a tool's write step and lists what it wrote, one `[tool] name: path` line
each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Sequence

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, *, help: str = "", flag: str | None = None,
           metavar: str | None = None, choices: Sequence | Callable[[], Sequence] | None = None,
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its command-line description. `default` (or `factory`, for a
    list) makes it optional; without either the option is required."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the element type, is a list) of a field's annotation, Optional removed."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) in (list, typing.List):
        inner = typing.get_args(annotation)
        return (inner[0] if inner else str), True
    return annotation, False


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not _MISSING:          # type: ignore[misc]
        return f.default_factory()                 # type: ignore[misc]
    return f.default


def build_parser(cls: type, prog: str, description: str | None = None,
                 hidden: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argparse parser of dataclass `cls` (fields made with `option`); fields named in
    `hidden` are left out (set by the caller, not the user)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in hidden:
            continue
        meta = dict(f.metadata)
        kind, many = _unwrap(hints[f.name])
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        required = f.default is _MISSING and f.default_factory is _MISSING  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help") or None}
        if kind is bool and not many:
            on = not required and _default_of(f) is True
            parser.add_argument(("--no-" + flag[2:]) if on else flag, action=(
                "store_false" if on else "store_true"), **kwargs)
            continue
        choices = meta.get("choices")
        kwargs.update(type=kind if kind in (int, float) else str,
                      choices=choices() if callable(choices) else choices,
                      metavar=meta.get("metavar"), required=required)
        if many:
            kwargs["nargs"] = "+"
        if not required:
            kwargs["default"] = _default_of(f)
        parser.add_argument(flag, **kwargs)
    return parser


def config_from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The dataclass `cls` from a namespace `build_parser(cls, ...)` parsed; `fixed` sets the
    hidden fields."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
    return cls(**{**values, **fixed})


def unknown_keys(cls: type, keys: Sequence[str]) -> list[str]:
    """The keys that are not fields of dataclass `cls` (for a config error naming them)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return sorted(k for k in keys if k not in names)


def list_written(tag: str, write, errors: tuple = (FileNotFoundError,)) -> int:
    """Run `write()` (-> {name: path}) and print each path as `[tag] name: path`; a missing
    input (FileNotFoundError, or any of `errors`) is one line and exit code 2."""
    try:
        written = write()
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"[{tag}] {name}: {path}")
    return 0
