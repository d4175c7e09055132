"""How a study step runs: its subprocess (output copied to the console and a log), its banner,
and the stamp a finished step leaves in its directory (`experiments.freshness` reads it back).
The bottom of the driver: `experiments.training_runs`, `experiments.evaluations` and
`experiments.run` build on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ced.records import write_json

from .freshness import STAMP

ROOT = Path(__file__).resolve().parents[1]
TAIL_BYTES = 4000


def stream(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str]:
    """Run `cmd`, copying its output (stdout and stderr) to ours and to `log` as it comes;
    returns (return code, the last lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = b""
    with open(log, "wb") as handle:
        handle.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        assert proc.stdout is not None
        while True:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            handle.write(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]
        code = proc.wait()
    text = tail.decode(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if ln.strip()][-12:]
    return code, "\n".join(lines)


def banner(text: str) -> None:
    print(f"\n=== [study] {text} ===", flush=True)


def step_record(step: dict, **extra: Any) -> dict:
    """The record a finished evaluation step leaves in its directory: its hash, the inputs
    the hash covers and what the study file wrote for it (so a rerun can name what changed)."""
    return {"hash": step["hash"], "inputs": step["inputs"], "written": step.get("written"),
            **extra}


def write_stamp(directory: Path, payload: dict) -> None:
    """Write a step's record (`step_record`, or a training run's) as `directory`'s stamp."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / STAMP, payload)
