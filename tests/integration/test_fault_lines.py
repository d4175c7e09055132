"""Faults outside a training run's own loop, each through its real entry point in a subprocess:
damaged study records, output directories that cannot be written, requests that cannot fit
in memory, and pre-emption during evaluation. Each ends in one line (or a one-line warning
and a result built from what survives), never a traceback.

A read-only directory is a read-only bind mount where the machine allows one (root on Linux),
else the case is a path under a regular file, which no user can write either.
"""

from __future__ import annotations

import json
import signal
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
    done = run("analysis.findings", "--study", str(study), "--out", str(out))
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


@pytest.mark.parametrize("case", ["read_only/run", "file/run"])
def test_training_refuses_a_run_directory_it_cannot_write(unwritable, case):
    kind, _, below = case.partition("/")
    where = unwritable[kind]
    run_dir = where / below if below else where
    done = run("ced.train", *TINY, f"hydra.run.dir={run_dir}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_line(done.stderr) == f"error: hydra.run.dir: {_reason(run_dir, where)}{SUFFIX}"


SLOW = pytest.mark.slow     # 3 s of CPU each (pandas, torch); make test-slow


@pytest.mark.parametrize("tool,args,name,kind", [
    pytest.param("experiments.run", ["study=tiny", "wandb=false", "out={}"], "out", "read_only",
                 marks=SLOW),
    ("evals.divergence", ["checkpoints=[/nowhere]", "hydra.run.dir={}"], "hydra.run.dir",
     "file"),
    ("evals.suites", ["--checkpoint", "/nowhere", "--replay", "W", "--out", "{}"], "--out",
     "file"),
    pytest.param("evals.real_text", ["--checkpoint", "/nowhere", "--out", "{}"], "--out",
                 "read_only", marks=SLOW),
    ("evals.lmeval", ["--model", "ced", "--model_args", "checkpoint=/nowhere", "--tasks", "t",
                      "--output_path", "{}"], "--output_path", "read_only"),
    pytest.param("analysis.findings", ["--study", "/nowhere", "--out", "{}"], "--out", "file",
                 marks=SLOW),
])
def test_every_entry_point_refuses_an_output_directory_it_cannot_write(
        unwritable, tool, args, name, kind):
    path = unwritable[kind] / f"out-{uuid.uuid4().hex[:6]}"
    done = run(tool, *[a.format(path) for a in args])
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    prefix = "study error: " if tool == "experiments.run" else "error: "
    assert line == f"{prefix}{name}: {_reason(path, unwritable[kind])}{SUFFIX}", line


# ---- memory before allocation -------------------------------------------------------------------

def test_a_batch_that_cannot_fit_is_refused_before_any_step_naming_grad_accum(tmp_path):
    # 16000 rows: about 54 GiB to train, 8 GiB to evaluate (whole batches), so grad_accum is
    # the advice wherever 9-54 GiB are available (40000 rows needed 20 GiB to evaluate: on a
    # 24 GB machine with a study running, grad_accum could not help and was rightly not named)
    run_dir = tmp_path / "run"
    done = run("ced.train", *TINY, "train.batch_size=16000", f"hydra.run.dir={run_dir}")
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("config error: train.batch_size=16000, train.seq_len=128: training "
                           "needs about "), line
    assert " available (" in line and "set train.grad_accum=" in line, line
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_a_model_too_large_to_build_is_refused_before_it_is_built(tmp_path):
    done = run("ced.train", *TINY, "model.d_model=65536", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("config error: model: weights, gradients and AdamW state need "
                           "about "), line
    assert "parameters x 16 bytes), more than the " in line
    assert line.endswith("lower model.d_model, model.n_encoder_layers, model.n_decoder_layers "
                         "or model.d_ff"), line


def test_a_row_longer_than_the_tasks_fill_says_so(tmp_path):
    done = run("ced.train", *TINY, "train.seq_len=100000", "model.max_seq_len=100000",
               "train.batch_size=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("config error: train.seq_len=100000: longer than the tasks fill ("), \
        line
    assert "lower train.seq_len to at most " in line


OOM_RUN = """
import sys
import ced.train
ced.train.check_training_memory = lambda *a, **k: None   # an estimate that fell short
from ced.cli.train import main
sys.argv = ["ced.train", *sys.argv[1:]]
main()
"""


@pytest.mark.slow      # about 5 s of CPU; make test-slow
def test_an_out_of_memory_that_still_happens_ends_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-c", OOM_RUN, *TINY, "train.batch_size=512",
            f"hydra.run.dir={run_dir}"]
    done = subprocess.run(["bash", "-c", 'ulimit -v 2000000; exec "$@"', "oom", *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("training stopped: out of memory (could not allocate "), line
    assert "; lower train.batch_size, train.seq_len, model.d_model" in line
    assert line.endswith(f"train.resume=auto hydra.run.dir={run_dir}"), line


CALIBRATE = """
import ctypes, gc, json, sys, tempfile
from pathlib import Path
from ced import CEDModel
from ced.cli.train import compose_config
from ced.memory import Estimate, activation_bytes, evaluation_bytes, static_bytes
import ced.train as trainer

def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                if l.startswith(field))

for shape in json.loads(sys.argv[1]):
    cfg = compose_config(shape)
    t = cfg.train
    estimate = Estimate(static_bytes(cfg.model),
                        activation_bytes(CEDModel(cfg.model), t.batch_size, t.seq_len),
                        evaluation_bytes(cfg.model, t.batch_size, t.seq_len))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")      # VmHWM := VmRSS
    before = status("VmRSS")
    with tempfile.TemporaryDirectory() as d:
        trainer.train(cfg, Path(d) / "run")
    print(json.dumps({"estimate": estimate.total, "measured": status("VmHWM") - before}))
"""


@pytest.mark.slow      # three training steps, about 5 s of CPU; make test-slow
def test_the_memory_estimate_is_within_its_tolerance_of_the_measured_peak():
    from ced.memory import TOLERANCE
    one_step = [*TINY, "train.steps=1", "train.eval_every=1", "train.save_every=1000"]
    shapes = [[*one_step, "train.batch_size=64"],                      # small: fixed costs
              [*one_step, "model.d_model=64", "train.batch_size=32"],   # wider
              [*one_step, "model.d_model=64", "model.max_seq_len=512", "train.seq_len=512",
               "train.batch_size=8"]]                                     # longer rows
    done = subprocess.run([sys.executable, "-c", CALIBRATE, json.dumps(shapes)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 3
    for shape, r in zip(shapes, results):
        error = r["estimate"] / r["measured"] - 1
        assert abs(error) <= TOLERANCE, (shape[len(one_step):], r, error)


# ---- pre-emption during evaluation ------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """A small ced model with random weights (evaluation reads it as any checkpoint)."""
    from conftest import make_model, tiny_config

    from ced.checkpoint import save_model
    return save_model(make_model(tiny_config("ced", vocab_size=259), 0),
                      tmp_path_factory.mktemp("model") / "final")


def _stop_after_first_batch(command: list[str], sig: int) -> subprocess.CompletedProcess:
    """Run `command`, send `sig` once it reports its first batch, and wait for it."""
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if "prompts 0-0" in line:
            break
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(command, proc.returncode, "".join(out) + stdout, stderr)


DIVERGENCE = ["replays=[1]", "lengths=[120]", "steps=2", "greedy_steps=2", "prompts.count=64",
              "batch_size=1", "bootstrap=10", "wandb.enabled=false", "layer_errors=false"]


def test_a_sigterm_stops_divergence_at_the_next_batch_with_the_command_to_continue(
        random_checkpoint, tmp_path):
    out = tmp_path / "div"
    args = [f"checkpoints=[{random_checkpoint}]", *DIVERGENCE, f"hydra.run.dir={out}"]
    done = _stop_after_first_batch([sys.executable, "-m", "evals.divergence", *args],
                                   signal.SIGTERM)
    assert done.returncode == 75, done.stderr[-2000:]
    notice, line = [x for x in done.stderr.splitlines() if x.strip()]
    assert notice == ("SIGTERM received: finishing this batch, then stopping (Ctrl-C again to "
                      "stop at once)")
    assert line == (f"evals.divergence stopped by SIGTERM at a batch boundary; nothing was "
                    f"written to {out}; to continue, run again: python -m evals.divergence "
                    + " ".join(f"'{a}'" if "[" in a else a for a in args))
    assert not [p.name for p in out.iterdir() if p.name not in (".hydra", "divergence.log")]


def test_a_sigint_stops_a_driver_job_at_the_next_batch(random_checkpoint, tmp_path):
    out = tmp_path / "div"
    config = tmp_path / "divergence.json"
    config.write_text(json.dumps({"checkpoints": [str(random_checkpoint)], "replays": [1],
                                  "lengths": [120], "steps": 2, "greedy_steps": 2,
                                  "prompts": {"count": 64}, "batch_size": 1, "bootstrap": 10,
                                  "wandb": {"enabled": False}, "layer_errors": False,
                                  "out_dir": str(out)}))
    done = _stop_after_first_batch(
        [sys.executable, "-m", "experiments.job", "divergence", str(config), "1"], signal.SIGINT)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        f"divergence stopped by SIGINT at a batch boundary; nothing was written as finished; "
        f"to continue, run again: python -m experiments.job divergence {config} 1")
    assert not out.exists() or not (out / "summary.json").exists()


def test_the_driver_records_a_stopped_step_as_interrupted_and_stops_on_its_own_signal(tmp_path):
    from ced.signals import Interrupted, StopSignals
    from experiments.run import Study
    from experiments.study import load_study
    study = Study(load_study("tiny", "demo"), tmp_path, threads=1, wandb=False)
    study.record("suite/ced/seed0", "failed", returncode=75, tail="stopped by SIGTERM")
    study.record("train/ced/seed0", "failed", returncode=1, tail="Traceback")
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert steps["suite/ced/seed0"]["state"] == "interrupted"
    assert steps["train/ced/seed0"]["state"] == "failed"
    with StopSignals(enabled=False) as signals:      # as if the driver got a SIGTERM
        signals.received = "SIGTERM"
        with pytest.raises(Interrupted) as stopped:
            study.record("divergence", "failed", returncode=75)
    assert stopped.value.code == 75
    assert json.loads((tmp_path / "summary.json").read_text())["steps"]["divergence"][
        "state"] == "interrupted"                     # recorded before it stops


def test_a_sigterm_stops_the_suite_at_the_next_batch_and_a_rerun_finishes(
        random_checkpoint, tmp_path):
    """evals.suites stops between batches: exit 75, one line with the command to continue,
    no results.csv or summary.json (what a driver takes for finished); the same command then
    runs to the end without --overwrite."""
    out = tmp_path / "suite"
    args = ["--checkpoint", str(random_checkpoint), "--replay", "W", "--families", "recall",
            "running_count", "--examples", "4", "--batch-size", "1", "--no-plot",
            "--no-wandb", "--threads", "1", "--out", str(out)]
    command = [sys.executable, "-m", "evals.suites", *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:              # the first family's progress line: mid-run
        seen.append(line)
        if line.startswith("  recall:"):
            break
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, "".join(seen) + stderr[-2000:]
    assert stderr.splitlines()[-1] == (
        f"evals.suites stopped by SIGTERM at a batch boundary; nothing was written as finished "
        f"in {out}; to continue, run again: python -m evals.suites {' '.join(args)}")
    assert not (out / "results.csv").exists() and not (out / "summary.json").exists()
    again = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "summary.json").exists() and (out / "results.csv").exists()
