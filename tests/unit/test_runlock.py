"""ced.runlock: one writer per directory, on a kernel file lock (`filelock`). A second writer
is refused in one line naming the holder; the lock of a killed process is free again."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ced.runlock import HOLDER, LOCK, DirectoryLocked, directory_lock

ROOT = Path(__file__).resolve().parents[2]
# takes the lock, says so, and waits to be killed
HOLD = ("import sys, time; from ced.runlock import directory_lock\n"
        "with directory_lock(sys.argv[1], 'study'):\n"
        "    print('held', flush=True); time.sleep(600)\n")


def test_a_second_writer_is_refused_in_one_line_naming_the_holder(tmp_path):
    with directory_lock(tmp_path, "study") as lock:
        assert lock == tmp_path / LOCK
        holder = json.loads((tmp_path / HOLDER).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(DirectoryLocked) as refused:
            with directory_lock(tmp_path, "study"):
                pass
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path}: this study directory is in use by process "
                              f"{os.getpid()} on {socket.gethostname()} (")
    assert f"since {holder['started']}" in message and sys.argv[0] in message
    assert not (tmp_path / HOLDER).exists()          # released: no holder left behind
    with directory_lock(tmp_path, "study"):          # and free again
        pass


def test_the_lock_of_a_killed_process_is_free_again(tmp_path, capsys):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLocked, match=f"in use by process {proc.pid} on "):
            with directory_lock(tmp_path, "study"):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert json.loads((tmp_path / HOLDER).read_text())["pid"] == proc.pid   # left behind
    with directory_lock(tmp_path, "study"):
        assert json.loads((tmp_path / HOLDER).read_text())["pid"] == os.getpid()
    assert f"taking over the lock of process {proc.pid}, which is gone" in capsys.readouterr().err


def test_a_released_lock_leaves_nothing_and_a_lock_on_an_unlinked_file_is_retaken(tmp_path):
    """The holder removes `.lock` on release, so a directory keeps only what was written into
    it; a writer whose flock landed on the file a releasing holder just unlinked holds no lock
    (another writer can create and lock a new file at the same path), so it takes it again."""
    from filelock import FileLock

    from ced import runlock
    with directory_lock(tmp_path, "run"):
        assert (tmp_path / runlock.LOCK).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    stale = FileLock(tmp_path / runlock.LOCK)
    stale.acquire(timeout=0)
    assert runlock._same_file(stale, tmp_path / runlock.LOCK)
    (tmp_path / runlock.LOCK).unlink()              # as a releasing holder does
    assert not runlock._same_file(stale, tmp_path / runlock.LOCK)
    (tmp_path / runlock.LOCK).touch()               # a new file at the same path
    assert not runlock._same_file(stale, tmp_path / runlock.LOCK)
    stale.release()
