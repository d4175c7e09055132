"""One writer per directory: a lock that a training run holds on its run directory and the
study driver on its study directory.

The lock is a kernel file lock (flock, through `filelock`) on `<directory>/.lock`: the kernel
frees it when its process ends, killed or not, so a lock is never stale. The holder removes
the file when it releases the lock, so a directory keeps only what was written into it. Who holds it is
written beside it, in `.lock.json` (process id, host, command, start time), once the lock is
taken; a second writer is refused in one line that names that holder. A holder record left by
a killed process is overwritten by the next writer, which says whose lock it was.
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

from filelock import FileLock, Timeout

LOCK = ".lock"
HOLDER = ".lock.json"


class DirectoryLocked(RuntimeError):
    """Another live process writes into the directory; the message is one line."""


def _holder(path: Path) -> dict:
    """The holder record; {} when there is none yet (the holder is between taking the lock
    and writing it) or it cannot be read."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _refusal(directory: Path, what: str, holder: dict) -> DirectoryLocked:
    command = " ".join(str(a) for a in holder.get("argv") or [])
    who = (f"process {holder.get('pid')} on {holder.get('host')} ({command}) since "
           f"{holder.get('started')}" if holder else "a process that is starting")
    return DirectoryLocked(f"{directory}: this {what} directory is in use by {who} "
                           f"({directory / LOCK}); wait for it to end or stop it")


@contextmanager
def directory_lock(directory: Path, what: str = "run") -> Iterator[Path]:
    """Hold `directory/.lock` for the duration of the block (creating the directory); a
    DirectoryLocked error if another process holds it. `what` names the directory's kind in
    the message ("run", "study")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / HOLDER
    lock = _acquire(directory, what, record)
    try:
        left = _holder(record)
        if left.get("pid") not in (None, os.getpid()):
            # the lock was free, so whoever wrote this record ended without releasing it
            print(f"warning: {directory / LOCK}: taking over the lock of process "
                  f"{left.get('pid')}, which is gone", file=sys.stderr)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[:8]}
        tmp = record.with_name(f"{HOLDER}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(me))
        os.replace(tmp, record)      # whole or absent: a refused writer never reads half
        yield directory / LOCK
    finally:
        record.unlink(missing_ok=True)   # while still held: the next holder writes its own
        # the lock file goes too, while still held, so that a run directory holds only what
        # the run wrote; a writer that opened the old file meanwhile sees it unlinked and
        # tries again (`_acquire`)
        (directory / LOCK).unlink(missing_ok=True)
        lock.release()


def _acquire(directory: Path, what: str, record: Path) -> FileLock:
    """Take `directory/.lock` without waiting; DirectoryLocked naming the holder if another
    process has it. A lock taken on a file that its holder unlinked on release (the path now
    names another file, or none) is no lock: released and taken again."""
    for _ in range(8):
        lock = FileLock(directory / LOCK)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise _refusal(directory, what, _holder(record)) from None
        if _same_file(lock, directory / LOCK):
            return lock
        lock.release()
    raise _refusal(directory, what, _holder(record))


def _same_file(lock: FileLock, path: Path) -> bool:
    """Whether the file `lock` holds is the one `path` names now. filelock keeps its file
    descriptor on a private context; without it (another filelock version) the check passes,
    as it did before the lock file was removed on release."""
    fd = getattr(getattr(lock, "_context", None), "lock_file_fd", None)
    if fd is None:
        return True
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
