"""Nothing lost on a shared cluster. A full disk during a checkpoint write, a changed
config at resume, two writers on one run directory, pre-emption (SIGTERM) and Ctrl-C (SIGINT):
each ends in one line, an exit code that says whether the run finished, and a run directory
whose last good checkpoint is untouched and resumable.

The disk is filled for real on a small tmpfs where the test may mount one (root on Linux),
and by a write that raises ENOSPC otherwise; locks and signals go through real subprocesses.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_run_safety import STEPS4, config, one_line, train_in_process
from test_train import ENV, ROOT, TINY, metrics, run_train

import ced.train as trainer
import ced.train.run_dir as run_files
from ced.checkpoint import StorageFull, check_training_checkpoint, load_model


def _newest(run: Path) -> list[str]:
    return [p.name for p in run_files.checkpoint_dirs(run)]


# ---- 1. a full disk -----------------------------------------------------------------------

def test_a_full_disk_during_a_checkpoint_keeps_the_last_good_one(tmp_path, monkeypatch):
    """The second checkpoint's write fails with ENOSPC after writing part of a file: the
    temporary folder is removed, step 2 stays as it was and still loads, and the error is
    StorageFull, one line naming the path and the space."""
    from accelerate import Accelerator
    real = Accelerator.save_state
    calls = {"n": 0}

    def failing(self, output_dir=None, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", failing)
    run = tmp_path / "run"
    with pytest.raises(StorageFull) as caught:
        train_in_process(run, *STEPS4)
    message = str(caught.value)
    assert "\n" not in message and "step_00000004" in message and "MiB free" in message
    assert _newest(run) == ["step_00000002"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert not (run / "final").exists()                     # the run did not finish
    from ced import CEDModel
    assert check_training_checkpoint(run / "checkpoints" / "step_00000002",
                                     CEDModel(config(*STEPS4).model)) == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MiB tmpfs (a tiny run's checkpoint is about 1.5 MiB), or skip where mounting is
    not allowed (the ENOSPC test above covers the same code path)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:80]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_really_full_disk_ends_in_one_line_and_resumes(small_disk, tmp_path):
    run = small_disk / "run"
    done = run_train(run, *STEPS4, "train.keep_last=3", check=False)
    assert done.returncode == trainer.NOT_FINISHED, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("training stopped: no space left on the device writing ")
    assert "the last checkpoint is " in line and "step_00000002" in line
    assert "resume with: python -m ced.train " in line and "train.resume=auto" in line
    assert _newest(run) == ["step_00000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # move the run to a disk with room and resume it with the printed command's overrides
    moved = tmp_path / "moved"
    subprocess.run(["cp", "-r", str(run), str(moved)], check=True)
    resumed = run_train(moved, *STEPS4, "train.keep_last=3", "train.resume=auto")
    assert "resumed from" in resumed.stdout
    assert [m["step"] for m in metrics(moved)] == [1, 2, 3, 4]


# ---- 2. a changed config at resume ------------------------------------------------------------

EXTEND = "train.allow_config_change=[train.steps]"


def test_resume_with_a_changed_data_config_is_refused_naming_the_key(tmp_path):
    from test_run_safety import snapshot

    from ced.train_config import ConfigError
    run = tmp_path / "run"
    train_in_process(run, *STEPS4, "data.only=[kv_recall,copy]")
    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"^train.resume: the run in .* was trained with "
                                          r"another config \(data.only: \['kv_recall', 'copy'\]"
                                          r" -> \['copy'\]\); .*"
                                          r"train.allow_config_change=\[data.only\]$"):
        train_in_process(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto",
                         "data.only=[copy]")
    assert snapshot(run) == before                       # refused before writing anything
    # the model's own keys are held the same way, the bookkeeping ones are free
    with pytest.raises(ConfigError, match=r"optim.lr: 0.003 -> 0.001"):
        train_in_process(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto",
                         "data.only=[kv_recall,copy]", "optim.lr=1e-3")
    train_in_process(run, *STEPS4, "train.steps=6", "train.resume=auto", "train.eval_every=3",
                     "train.allow_config_change=[train.steps,data.only]", "data.only=[copy]")
    record = json.loads((run / run_files.CONFIG_CHANGES).read_text())
    assert record["step"] == 4
    assert record["changed"] == {"data.only": [["kv_recall", "copy"], ["copy"]],
                                 "train.steps": [4, 6]}
    saved = (run / "config.yaml").read_text()
    assert "allow_config_change:\n  - train.steps\n  - data.only" in saved
    state = json.loads((run / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["config_changes"] == [record]


# ---- 3. two writers ----------------------------------------------------------------------------

def _start(run: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ced.train", *TINY, f"hydra.run.dir={run}", *overrides]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run: Path, proc: subprocess.Popen, steps: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps in {timeout} s")


LONG = ["train.steps=2000", "train.save_every=3", "train.eval_every=1000", "train.keep_last=2"]


def test_a_second_writer_is_refused_in_one_line_and_a_dead_ones_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    first = _start(run, *LONG)
    try:
        _wait_for_steps(run, first, 2)
        second = run_train(run, *LONG, "train.resume=auto", check=False, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        line = one_line(second.stderr)
        assert line.startswith(f"error: {run}: this run directory is in use by process "
                               f"{first.pid} on "), line
        assert first.poll() is None                      # the first writer goes on
    finally:
        first.kill()
        first.wait()
    # killed with SIGKILL: the kernel freed its lock; its holder record stays behind, and the
    # next writer takes the lock and says whose it was
    assert (run / ".lock.json").exists()
    third = run_train(run, *LONG, "train.steps=8", EXTEND, "train.resume=auto")
    assert f"taking over the lock of process {first.pid}" in third.stderr
    assert not (run / ".lock.json").exists()             # released at the end


def test_a_study_directory_has_one_driver(tmp_path):
    from ced.runlock import DirectoryLocked, directory_lock
    study = tmp_path / "study"
    with directory_lock(study, "study"):
        done = subprocess.run([sys.executable, "-m", "experiments.run", "study=tiny",
                               f"out={study}", "wandb=false"], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"{study}: this study directory is in use by process {os.getpid()}" in \
            one_line(done.stderr)
        with pytest.raises(DirectoryLocked):
            with directory_lock(study, "study"):
                pass
    assert not (study / ".lock.json").exists()


# ---- 4. pre-emption and Ctrl-C -----------------------------------------------------------------

@pytest.mark.parametrize("sig,code,name", [(signal.SIGTERM, trainer.NOT_FINISHED, "SIGTERM"),
                                           (signal.SIGINT, 130, "SIGINT")])
def test_a_signal_saves_a_checkpoint_at_the_step_boundary_and_says_how_to_resume(
        tmp_path, sig, code, name):
    run = tmp_path / "run"
    proc = _start(run, *LONG)
    _wait_for_steps(run, proc, 4)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-2000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    match = __import__("re").fullmatch(
        rf"training stopped by {name} at step (\d+) of 2000; the last checkpoint is (\S+); "
        rf"resume with: python -m ced\.train (.*) train\.resume=auto hydra\.run\.dir={run}",
        last)
    assert match, err[-2000:]
    step, checkpoint = int(match.group(1)), Path(match.group(2))
    assert checkpoint == run / "checkpoints" / f"step_{step:08d}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert [m["step"] for m in metrics(run)] == list(range(1, step + 1))
    # the printed command continues the run where it stopped
    given = match.group(3).split()
    assert f"hydra.run.dir={run}" not in given and "train.steps=2000" in given
    resumed = run_train(run, *[g for g in given if not g.startswith("train.steps")],
                        f"train.steps={step + 2}", EXTEND, "train.resume=auto")
    assert f"resumed from {checkpoint} at step {step}" in resumed.stdout
    assert [m["step"] for m in metrics(run)] == list(range(1, step + 3))


def test_a_stopped_run_is_not_finished_on_wandb(tmp_path, monkeypatch):
    """SIGTERM at step 2 (sent by the run to itself): the wandb run is finished with the
    requeue exit code (and marked pre-empting), not as a completed run."""
    import wandb
    finished = {}
    real_finish = wandb.sdk.wandb_run.Run.finish

    def finish(self, exit_code=None, **kw):
        finished.setdefault("exit_code", exit_code)
        return real_finish(self, exit_code=exit_code, **kw)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish", finish)
    monkeypatch.setenv("WANDB_MODE", "offline")
    real_step = trainer._train_step

    def step(run, index):
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(run, index)

    monkeypatch.setattr(trainer, "_train_step", step)
    run = tmp_path / "run"
    with pytest.raises(trainer.Stopped) as caught:
        train_in_process(run, *LONG, "logging=wandb", "logging.mode=offline")
    assert caught.value.code == trainer.NOT_FINISHED
    assert "at step 2 of 2000" in str(caught.value)
    assert finished["exit_code"] == trainer.NOT_FINISHED
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL    # handlers restored
    # what `wandb sync` will upload: the run's record log ends with the requeue code
    from ced.tracking import read_offline_run
    [offline] = (run / "wandb").glob("offline-run-*")
    # wandb's service process appends the exit record after finish() returns; on a loaded
    # machine it can land a moment later (seen once in CI): wait for it, up to 30 s
    deadline = time.monotonic() + 30
    while (read_offline_run(offline)["exit_code"] is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert read_offline_run(offline)["exit_code"] == trainer.NOT_FINISHED


# ---- 6. replay forms on the evaluation command lines -------------------------------------------

@pytest.mark.parametrize("form", ["W/0", "2W+", "0", "-3", "Wx", "exactly"])
@pytest.mark.parametrize("tool", ["evals.suites", "evals.lmeval.tasks"])
def test_a_malformed_replay_form_is_one_line_naming_the_argument(tmp_path, tool, form):
    done = subprocess.run([sys.executable, "-m", tool, "--checkpoint", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--replay", "4", form],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert one_line(done.stderr) == (f"error: --replay: expected N (an int >= 1), W, W/k, kW, "
                                     f"kW/d, R_exact or exact; got '{form}'")
