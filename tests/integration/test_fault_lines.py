"""Faults outside a training run's own loop, each through its real entry point in a subprocess:
damaged study records, output directories that cannot be written, requests that cannot fit
in memory, and pre-emption during evaluation. Each ends in one line (or a one-line warning
and a result built from what survives), never a traceback.

A read-only directory is a read-only bind mount where the machine allows one (root on Linux),
else the case is a path under a regular file, which no user can write either.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_run_safety import one_line
from test_train import ENV, ROOT, TINY


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m <args>` from the repository root; its result."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


# ---- damaged study records ----------------------------------------------------------------------

TORN = '{"study": "tiny", "steps": {"train/ced/seed0": {"state": "o'   # a crash mid-write


def fabricated_study(study: Path, suite: bool = True) -> None:
    """A study directory with finished training runs ced/seed0 and yoco/seed0 (their
    study_step.json and weights) and, with `suite`, a suite run of 4 examples, as the driver
    and evals.suites leave them."""
    for job in ("ced", "yoco"):
        run_dir = study / "runs" / job / "seed0"
        (run_dir / "final").mkdir(parents=True)
        (run_dir / "final" / "model.safetensors").write_bytes(b"")
        (run_dir / "study_step.json").write_text(json.dumps({"hash": f"{job}123",
                                                             "overrides": []}))
    if not suite:
        return
    suite = study / "suite" / "ced" / "seed0"
    suite.mkdir(parents=True)
    rows = ["id,family,x,mode,correct,kl_answer"] + [
        f"recall/d=4/{i},recall,4,{mode},{ok},{kl}" for i in range(4)
        for mode, ok, kl in (("full", True, 0.0), ("replay=4", i % 2 == 0, 0.1))]
    (suite / "results.csv").write_text("\n".join(rows) + "\n")
    (suite / "summary.json").write_text(json.dumps({"run": {"settings": {"window": 4,
                                                                          "r_exact": 7}}}))


def test_findings_on_a_damaged_summary_warns_in_one_line_and_writes_what_survives(tmp_path):
    study, out = tmp_path / "study", tmp_path / "findings"
    fabricated_study(study)
    (study / "summary.json").write_text(TORN)
    done = run("evals.findings", "--study", str(study), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    warning = one_line(done.stderr)
    assert warning.startswith(f"[findings] warning: {study / 'summary.json'}: damaged record "
                              "(cut short"), warning
    assert "provenance (commands, commits, step times) is unknown" in warning
    assert "summary.json is damaged" in (out / "findings.md").read_text()
    assert (out / "accuracy.csv").exists()
    assert (study / "summary.json").read_text() == TORN       # a reader leaves it as it is


def test_the_driver_keeps_damaged_records_aside_and_rebuilds_the_steps(tmp_path):
    study = tmp_path / "study"
    fabricated_study(study, suite=False)
    (study / "summary.json").write_text(TORN)
    stamp = study / "runs" / "yoco" / "seed0" / "study_step.json"
    stamp.write_bytes(b"\x00" * 16)                              # a power cut's zeroed block
    done = run("experiments.run", "study=tiny", f"out={study}", "only=report", "wandb=false")
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stdout.splitlines() if "damaged record" in line]
    [aside] = study.glob("summary.json.damaged-*")
    [stamp_aside] = stamp.parent.glob("study_step.json.damaged-*")
    assert aside.read_text() == TORN                            # kept, never overwritten
    assert warnings == [
        f"[study] warning: {stamp}: damaged record (not valid JSON (Expecting value: line 1 "
        f"column 1 of 16 bytes)); kept aside as {stamp_aside}; the step counts as unrecorded",
        f"[study] warning: {study / 'summary.json'}: damaged record (cut short (Unterminated "
        f"string starting at: line 1 column 58 of {len(TORN)} bytes)); kept aside as {aside}; "
        "rebuilt 1 finished step(s) from their study_step.json records; lost: the earlier "
        "invocations (commands, commits, wall times), step times, and which steps failed or "
        "were refused"]
    summary = json.loads((study / "summary.json").read_text())
    assert summary["steps"]["train/ced/seed0"] == {
        "state": "ok", "run_dir": str(study / "runs" / "ced" / "seed0"), "hash": "ced123",
        "rebuilt": True, "invocation": -1}
    assert "train/yoco/seed0" not in summary["steps"]
    assert len(summary["invocations"]) == 1                     # this one; the earlier are lost


# ---- output directories that cannot be written ------------------------------------------------------

@pytest.fixture(scope="module")
def unwritable(tmp_path_factory) -> dict[str, Path]:
    """{'file': a regular file (a path under it cannot be a directory), 'read_only': a
    read-only directory (a read-only bind mount; the regular file where none can be made)}."""
    root = tmp_path_factory.mktemp("unwritable")
    regular = root / "a_file"
    regular.write_text("not a directory\n")
    source, mount = root / "source", root / "read_only"
    source.mkdir()
    mount.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(mount)],
                             capture_output=True).returncode == 0
    if mounted and subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)],
                                  capture_output=True).returncode != 0:
        subprocess.run(["umount", str(mount)], capture_output=True)
        mounted = False
    yield {"file": regular, "read_only": mount if mounted else regular}
    if mounted:
        subprocess.run(["umount", str(mount)], capture_output=True)


def _reason(path: Path, where: Path) -> str:
    """What the one line says about `path` under `where` (a fixture entry)."""
    if where.is_file():
        return f"{path} cannot be written: {where} is a regular file, not a directory"
    at = "" if path == where else f" at {where}"
    return f"{path} cannot be written: read-only file system{at}"


SUFFIX = "; choose a directory on a writable file system with free space"


@pytest.mark.parametrize("case", ["read_only/run", "read_only", "file/run"])
def test_training_refuses_a_run_directory_it_cannot_write(unwritable, case):
    kind, _, below = case.partition("/")
    where = unwritable[kind]
    run_dir = where / below if below else where
    done = run("ced.train", *TINY, f"hydra.run.dir={run_dir}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_line(done.stderr) == f"error: hydra.run.dir: {_reason(run_dir, where)}{SUFFIX}"


@pytest.mark.parametrize("tool,args,name,kind", [
    ("experiments.run", ["study=tiny", "wandb=false", "out={}"], "out", "read_only"),
    ("evals.divergence", ["checkpoints=[/nowhere]", "hydra.run.dir={}"], "hydra.run.dir",
     "file"),
    ("evals.real_text", ["--checkpoint", "/nowhere", "--out", "{}"], "--out", "read_only"),
    ("evals.lmeval", ["--model", "ced", "--model_args", "checkpoint=/nowhere", "--tasks", "t",
                      "--output_path", "{}"], "--output_path", "file"),
    ("evals.findings", ["--study", "/nowhere", "--out", "{}"], "--out", "file"),
])
def test_every_entry_point_refuses_an_output_directory_it_cannot_write(
        unwritable, tool, args, name, kind):
    path = unwritable[kind] / f"out-{uuid.uuid4().hex[:6]}"
    done = run(tool, *[a.format(path) for a in args])
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    prefix = "study error: " if tool == "experiments.run" else "error: "
    assert line == f"{prefix}{name}: {_reason(path, unwritable[kind])}{SUFFIX}", line
