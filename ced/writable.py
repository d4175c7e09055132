"""Whether an output directory can be created and written, checked before any work.

Every entry point that writes results (training and Hydra's own log file, the study driver,
the evaluations, findings) calls `check_output_dir` on its output directory first, so that a
read-only file system, a path under a regular file or a full disk is one line naming the path
and the reason, instead of a traceback after minutes of work (or from inside Hydra's logging
setup).

The check creates nothing that stays: it probes the directory itself when it exists, else
the nearest existing ancestor (where the directory would be created), with a temporary file
or directory that it removes at once.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

# Below this much free space a directory counts as full: a run's first writes (a config, a
# log line, the first metrics) need more than nothing.
MIN_FREE_BYTES = 1 << 20
_PROBE = ".ced-write-check-"

_REASONS = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "disk quota exceeded", errno.ENOTDIR: "a parent is not a directory"}


class OutputDirError(ValueError):
    """An output directory that cannot be created or written; the message is one line naming
    the option, the path and the reason."""


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why directory `path` cannot be created or written (None if it can): a component that is
    a regular file, a read-only file system, no permission, or a full disk."""
    path = Path(path).expanduser().absolute()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        kind = "a regular file" if existing.is_file() else "not a directory"
        return f"{existing} is {kind}, not a directory"
    try:
        if existing == path:        # the directory exists: can a file be written into it?
            fd, probe = tempfile.mkstemp(prefix=_PROBE, dir=existing)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        else:                       # it would be created in `existing`: can a directory be?
            os.rmdir(tempfile.mkdtemp(prefix=_PROBE, dir=existing))
    except OSError as exc:
        reason = _REASONS.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        return f"{reason} at {existing}" if existing != path else reason
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        return f"no space left on the device ({free // 1024} KiB free at {existing})"
    return None


def check_output_dir(path: str | os.PathLike, name: str) -> Path:
    """`path` as a Path if the directory can be created and written; else OutputDirError,
    `<name>: <path> cannot be written: <reason>` (name: the option or config key that set
    it, e.g. `--out` or `hydra.run.dir`)."""
    reason = unwritable_reason(path)
    if reason is not None:
        raise OutputDirError(f"{name}: {path} cannot be written: {reason}; choose a "
                             "directory on a writable file system with free space")
    return Path(path)


def hydra_dir_to_check(value: str) -> str:
    """The part of a Hydra directory setting (hydra.run.dir / hydra.sweep.dir) that is known
    before Hydra resolves it: everything before the first interpolation (`${now:...}` and
    the like), up to the last `/`. `outputs/${hydra.job.name}/x` -> `outputs`."""
    if "${" not in value:
        return value
    head = value.split("${", 1)[0]
    if "/" not in head:
        return "."
    return head.rsplit("/", 1)[0] or "/"


def check_hydra_output(argv: list[str], config_file: str | os.PathLike) -> None:
    """Check the directory a Hydra app is about to create for its log file and `.hydra/`:
    `hydra.sweep.dir` for a multirun (-m), else `hydra.run.dir`, as the command line sets it
    or else as `config_file` does. OutputDirError naming the key otherwise."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [a.split("=", 1)[1] for a in argv
             if "=" in a and a.split("=", 1)[0].lstrip("+") == key]
    if given:
        value = given[-1]
    else:
        # lazy: OmegaConf costs ~0.1 s to import; check_output_dir, which the argparse tools
        # use, never needs it
        from omegaconf import OmegaConf
        node = OmegaConf.to_container(OmegaConf.load(config_file), resolve=False)
        for part in key.split("."):      # unresolved: ${now:...} only resolves inside Hydra
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
        value = node
    check_output_dir(hydra_dir_to_check(str(value)), key)


__all__ = ["OutputDirError", "check_output_dir", "check_hydra_output", "unwritable_reason",
           "hydra_dir_to_check", "MIN_FREE_BYTES"]
