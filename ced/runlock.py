"""One writer per directory: a lock file that a training run holds on its run directory and the
study driver on its study directory.

The lock is a file `.lock` holding the owner's process id, host and start time, created with
O_CREAT | O_EXCL (atomic: of two processes racing for it, exactly one creates it) and removed
when the owner exits, also on an error. A lock whose process is gone (same host, no such pid)
is stale: the next writer takes it over with a warning. A lock of another host is never taken
over: that process cannot be checked from here, so the message says how to remove it by hand.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = ".lock"
# A lock file still empty after this many seconds was left by a process that died between
# creating it and writing its owner (a few microseconds apart): stale.
EMPTY_LOCK_GRACE_S = 10.0


class DirectoryLocked(RuntimeError):
    """Another live process writes into the directory; the message is one line."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's live process
        return True
    return True


def _holder(path: Path) -> dict | None:
    """The lock's owner record; {} for an empty or unreadable file; None if it is gone."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stale(path: Path, holder: dict) -> bool:
    if not holder:
        try:
            return time.time() - path.stat().st_mtime > EMPTY_LOCK_GRACE_S
        except FileNotFoundError:
            return True
    pid = holder.get("pid")
    return (holder.get("host") == socket.gethostname() and isinstance(pid, int)
            and not _alive(pid))


@contextmanager
def directory_lock(directory: Path, what: str = "run") -> Iterator[Path]:
    """Hold `directory/.lock` for the duration of the block (creating the directory); a
    DirectoryLocked error if a live process holds it. `what` names the directory's kind in
    the message ("run", "study")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[:8]}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                continue                       # released meanwhile: try again
            if not _stale(path, holder):
                who = (f"process {holder.get('pid')} on {holder.get('host')} since "
                       f"{holder.get('started')}" if holder else "a process that is starting")
                remote = holder and holder.get("host") != socket.gethostname()
                raise DirectoryLocked(
                    f"{directory}: this {what} directory is in use by {who} ({path}); wait for "
                    f"it to end or stop it" + (f"; if that host is gone, delete {path}"
                                               if remote else "")) from None
            print(f"warning: {path}: taking over the lock of process {holder.get('pid')}, "
                  f"which is gone", file=sys.stderr)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(me))
        break
    else:
        raise DirectoryLocked(f"{directory}: could not take the lock {path} (it changed hands "
                              f"three times while trying); try again")
    try:
        yield path
    finally:
        if (_holder(path) or {}).get("pid") == me["pid"]:
            path.unlink(missing_ok=True)
