"""JSON records that a crash cannot tear and a damaged copy cannot hide.

The study driver keeps its account of what ran in JSON files (`summary.json`, each step's
`study_step.json`), and `analysis.findings` and `analysis.report` read them back. A crash or a full
disk in the middle of a plain `write_text` leaves half a file, which the next reader either
chokes on (a traceback) or silently treats as absent (and then overwrites the history it held).

- `write_json` writes atomically: a temporary file beside the record, flushed to disk, then
  renamed over it, so a reader sees the old record or the new one, never half of one.
- `read_json` returns the record, None when there is none, and raises `DamagedRecord` (one
  line: the file and what is wrong with it) when it cannot be read. With `set_aside=True` the
  damaged file is first renamed to `<name>.damaged-<UTC time>`, so that whatever rewrites the
  record cannot overwrite the evidence.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

DAMAGED_INFIX = ".damaged-"


class DamagedRecord(ValueError):
    """A record that exists but cannot be read. `path`: the file; `reason`: what is wrong;
    `aside`: where it was moved (None when it was left in place). Its message is one line."""

    def __init__(self, path: Path, reason: str, aside: Path | None = None):
        self.path, self.reason, self.aside = Path(path), reason, aside
        kept = f"; kept aside as {aside}" if aside is not None else ""
        super().__init__(f"{path}: damaged record ({reason}){kept}")


def write_json(path: Path, payload: Any) -> None:
    """`payload` as indented JSON at `path`, atomically: a crash or a full disk mid-write leaves
    the old file or the new one, never half of one (the temporary file is removed on an
    error)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "w") as handle:
            handle.write(json.dumps(payload, indent=1))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def set_aside(path: Path) -> Path:
    """Rename `path` to `<name>.damaged-<UTC time>` beside it (never over an earlier one);
    returns the new path."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}{DAMAGED_INFIX}{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{DAMAGED_INFIX}{stamp}-{n}")
    os.replace(path, aside)
    return aside


def damage(path: Path, expect: type | tuple = dict) -> tuple[Any, str | None]:
    """(the parsed record, None) if `path` holds a JSON value of type `expect`, else (None,
    what is wrong: empty, not UTF-8, cut short or not JSON at line/column, another type)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or type(exc).__name__}"
    if not data.strip():
        return None, f"empty ({len(data)} bytes)"
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start} of {len(data)})"
    except json.JSONDecodeError as exc:
        # a torn write ends mid-value: the parser fails at the very end, or on a string the
        # end of the file left open
        cut = exc.msg != "Extra data" and (exc.pos >= len(data.rstrip()) - 1
                                           or exc.msg.startswith("Unterminated"))
        return None, (f"{'cut short' if cut else 'not valid JSON'} ({exc.msg}: line "
                      f"{exc.lineno} column {exc.colno} of {len(data)} bytes)")
    if not isinstance(value, expect):
        wanted = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple)
                                                   else (expect,)))
        return None, f"holds a JSON {type(value).__name__}, not a {wanted}"
    return value, None


def read_json(path: Path, *, expect: type | tuple = dict, set_aside_damaged: bool = False) -> Any:
    """The JSON record at `path` (of type `expect`), or None when there is no such file.
    A damaged one raises DamagedRecord naming the file and the damage; with
    `set_aside_damaged` it is first moved to `<name>.damaged-<UTC time>` (for a writer that
    is about to replace the record: the damaged copy is kept, never overwritten)."""
    path = Path(path)
    if not path.exists():
        return None
    value, reason = damage(path, expect)
    if reason is None:
        return value
    raise DamagedRecord(path, reason, set_aside(path) if set_aside_damaged else None)


__all__ = ["DamagedRecord", "write_json", "read_json", "set_aside", "damage", "DAMAGED_INFIX"]
