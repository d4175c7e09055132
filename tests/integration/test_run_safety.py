"""The training side: nothing lost, nothing silently wrong.

Class 1: a run directory that already holds a run is refused (and left untouched) unless the
run continues it (`train.resume=auto`) or replaces it (`train.overwrite=true`).
Class 2: non-finite weights are never saved nor named good, a NaN at the last step exits non-zero,
non-finite config numbers are refused.
Class 3: damaged or mismatched files give one line naming the file; `resume=auto` falls back past
damaged checkpoints, with a warning, to the newest intact one; a half-written last metrics line
is dropped; a refused resume writes nothing; orphaned temporary checkpoint folders are removed.
Class 7: the trainer runs the Hugging Face libraries offline unless the environment says not to.

Most runs go through `ced.train.train` in-process (a tiny model, a few steps, about a second
each); the entry point's one-line output and exit codes are checked through subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import ENV, ROOT, TINY, metrics, run_train

import ced.train as trainer
import ced.cli.train as trainer_cli
from ced.cli.train import CONF_DIR
from ced.train_config import validate
from ced.checkpoint import CheckpointError, load_model, save_model
from ced.train_config import ConfigError

STEPS4 = ["train.steps=4", "train.save_every=2", "train.eval_every=100", "train.keep_last=3"]
# A resume that trains on to another number of steps changes the learning-rate schedule, so it
# is a change of what the run computes and must be allowed.
EXTEND = "train.allow_config_change=[train.steps]"


def config(*overrides: str):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[o for o in TINY if not o.startswith("hydra")]
                      + list(overrides))
    return validate(cfg)


def train_in_process(run_dir: Path, *overrides: str) -> dict:
    try:
        return trainer.train(config(*overrides), run_dir)
    finally:
        torch.set_num_threads(1)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run (Hydra's own .hydra/ and train.log aside) and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and ".hydra" not in p.parts and p.name != "train.log"}


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """4 steps, checkpoints at steps 2 and 4, final/."""
    run = tmp_path_factory.mktemp("base") / "run"
    train_in_process(run, *STEPS4)
    return run


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> list[float]:
    """The loss curve of 6 uninterrupted steps of the same run."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train_in_process(run, *STEPS4, "train.steps=6")
    return [m["loss"] for m in metrics(run)]


def copy_run(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = bytes(range(64, 128))
    path.write_bytes(bytes(data))


# ---- class 1: an existing run directory ------------------------------------------------------

def test_rerun_into_a_run_directory_is_refused_and_loses_nothing_then_overwrite_replaces(tmp_path):
    run = tmp_path / "run"
    run_train(run, *STEPS4)
    before = snapshot(run)
    done = run_train(run, *STEPS4, check=False)
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert line.startswith(f"config error: {run} already holds a run")
    for choice in ("train.resume=auto", "hydra.run.dir", "train.overwrite=true"):
        assert choice in line
    assert snapshot(run) == before   # metrics, checkpoints, final/, config untouched

    # The explicit overwrite replaces the old run entirely: no old checkpoint survives pruning.
    run_train(run, "train.steps=3", "train.save_every=3", "train.eval_every=100",
              "train.overwrite=true")
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003"]
    assert "steps: 3" in (run / "config.yaml").read_text()


def test_a_directory_with_any_run_file_is_refused_in_process(base_run, tmp_path):
    for name in ("metrics.jsonl", "config.yaml", "final"):
        run = tmp_path / name.replace(".", "_")
        run.mkdir()
        src = base_run / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, run / name)
        before = snapshot(run)
        with pytest.raises(ConfigError, match="already holds a run .*train.resume=auto"):
            train_in_process(run, *STEPS4)
        assert snapshot(run) == before


def test_resuming_another_runs_checkpoint_into_a_run_directory_is_refused(base_run, tmp_path):
    other = copy_run(base_run, tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (target / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    checkpoint = other / "checkpoints" / "step_00000002"
    with pytest.raises(ConfigError, match="already holds a run"):
        train_in_process(target, *STEPS4, f"train.resume={checkpoint}")
    assert (target / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    # ... and with overwrite the old files go; the run continues from step 2 of the other run
    train_in_process(target, *STEPS4, f"train.resume={checkpoint}", "train.overwrite=true")
    assert [m["step"] for m in metrics(target)] == [3, 4]


def test_rewinding_to_an_older_checkpoint_of_the_run_needs_overwrite(base_run, tmp_path):
    """Resuming from step 2 while step 4 exists would leave the old step 4 among the new run's
    checkpoints (pruning and a later resume=auto could pick it): refused, unless overwrite
    deletes the newer ones."""
    run = copy_run(base_run, tmp_path)
    older = run / "checkpoints" / "step_00000002"
    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"train.resume: .*step_00000002 is older than this "
                                          r"run's newest checkpoint step_00000004"):
        train_in_process(run, *STEPS4, "train.steps=3", EXTEND, f"train.resume={older}")
    assert snapshot(run) == before
    train_in_process(run, *STEPS4, "train.steps=3", EXTEND, "train.save_every=3",
                     f"train.resume={older}", "train.overwrite=true")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000003"]
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]


def test_resume_auto_on_a_directory_without_a_run_starts_nothing(tmp_path):
    """A mistyped or never-started run directory is one line and exit 2, and nothing is
    written there: resume=auto never trains a new model from the default config."""
    missing = tmp_path / "typo"
    done = run_train(missing, *STEPS4, "train.resume=auto", check=False)
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr) == (
        f"config error: train.resume=auto: nothing to resume in {missing} (no config.yaml, "
        f"metrics.jsonl, checkpoints, final); drop train.resume to start a new run there")
    assert not missing.exists()
    # an existing directory without a run (only Hydra's own files): refused in-process too
    empty = tmp_path / "empty"
    (empty / ".hydra").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^train.resume=auto: nothing to resume in "):
        train_in_process(empty, *STEPS4, "train.resume=auto")
    assert [p.name for p in empty.iterdir()] == [".hydra"]
    # without hydra.run.dir a run goes to a new dated directory: nothing there to resume
    with pytest.raises(ConfigError, match=r"^train.resume=auto: nothing to resume without "
                                          r"hydra.run.dir=<run>"):
        trainer_cli.check_resume_target([*TINY, "train.resume=auto"])


def test_extend_to_continues_a_finished_run_at_the_schedules_final_learning_rate(base_run,
                                                                                 tmp_path):
    """train.extend_to=6 on a finished 4-step run: steps 5-6 at min_lr_ratio x lr (the cosine
    keeps spanning steps 1-4, so the rate does not jump up as a raised train.steps would make
    it), said in a line, and recorded as a config change."""
    run = copy_run(base_run, tmp_path)
    before = metrics(run)
    done = run_train(run, *STEPS4, "train.resume=auto", "train.extend_to=6")
    assert ("train.extend_to=6: steps 5-6 run at the schedule's final learning rate 0.0003 "
            "(optim.min_lr_ratio 0.1 x optim.lr 0.003); the warm-up and cosine decay keep "
            "spanning steps 1-4, so the rate does not jump") in done.stdout
    after = metrics(run)
    assert after[:4] == before and [m["step"] for m in after] == [1, 2, 3, 4, 5, 6]
    assert [m["lr"] for m in after[4:]] == pytest.approx([3e-4, 3e-4])
    assert after[3]["lr"] >= 3e-4
    [change] = [json.loads(line) for line in (run / "config_changes.jsonl").read_text()
                .splitlines()]
    assert change["step"] == 4 and change["changed"] == {"train.extend_to": [None, 6]}
    assert "extend_to: 6" in (run / "config.yaml").read_text()
    # a value that ends before the schedule does is refused, naming the key
    with pytest.raises(ConfigError, match=r"^train.extend_to: must be null or an int > "
                                          r"train.steps \(4\)"):
        config("train.steps=4", "++train.extend_to=3")


def test_overwrite_cannot_be_combined_with_resume_auto():
    with pytest.raises(ConfigError, match=r"^train.overwrite: true discards the checkpoints"):
        config("train.overwrite=true", "train.resume=auto")


# ---- class 2: non-finite training -----------------------------------------------------------

@pytest.mark.parametrize("override,key", [
    ("optim.lr=inf", "optim.lr"),
    ("optim.lr=nan", "optim.lr"),
    ("optim.grad_clip=inf", "optim.grad_clip"),
    ("optim.eps=-inf", "optim.eps"),
    ("train.indexer_kl_weight=inf", "train.indexer_kl_weight"),
    ("train.replay.probability=nan", "train.replay.probability"),
    ("model.rope_theta=inf", "model.rope_theta"),
    ("model.dropout=nan", "model.dropout"),
])
def test_non_finite_config_numbers_are_refused(override, key):
    with pytest.raises(ConfigError) as info:
        config(override)
    assert str(info.value).startswith(f"{key}: must be a finite number; got ")
    assert "\n" not in str(info.value)


def poison_lr_at(monkeypatch, bad_step: int) -> None:
    """An infinite learning rate at step index `bad_step`: the loss of that step is still
    finite (computed before the update); the update makes the weights non-finite."""
    real = trainer.lr_factor

    def factor(step, *args):
        return float("inf") if step == bad_step else real(step, *args)

    monkeypatch.setattr(trainer, "lr_factor", factor)


@pytest.mark.parametrize("bad_step,last_good", [
    (3, "step_00000002"),                      # the last step: its checkpoint would be NaN
    (1, "none (nothing intact saved yet)"),     # before the first save
])
def test_non_finite_weights_are_never_saved_nor_named_good(tmp_path, monkeypatch, bad_step,
                                                          last_good):
    poison_lr_at(monkeypatch, bad_step)
    pattern = (rf"non-finite weights .* after step {(bad_step // 2 + 1) * 2}.*not saved; the "
               rf"last good checkpoint is .*{re.escape(last_good)}")
    with pytest.raises(trainer.TrainingDiverged, match=pattern):
        train_in_process(tmp_path, *STEPS4)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ([] if bad_step < 2 else ["step_00000002"])
    assert not (tmp_path / "final").exists()


def test_a_non_finite_checkpoint_on_disk_is_not_named_good(base_run, tmp_path, monkeypatch):
    """A checkpoint holding NaN (from any cause) is skipped when naming the last good one."""
    from safetensors.torch import load_file, save_file
    run = copy_run(base_run, tmp_path)
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    state = load_file(str(weights))
    name = next(iter(state))
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, str(weights))
    real, calls = trainer.F.cross_entropy, {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(trainer.F, "cross_entropy", poisoned)
    with pytest.raises(trainer.TrainingDiverged, match="last good checkpoint is .*step_00000002"):
        train_in_process(run, *STEPS4, "train.steps=8", EXTEND, "train.resume=auto")


def test_nan_at_the_last_step_exits_non_zero_without_a_final_model(tmp_path):
    run = tmp_path / "run"
    code = ("import sys, ced.train as t, ced.cli.train as app; real = t.lr_factor; "
            "t.lr_factor = lambda s, *a: float('inf') if s == 3 else real(s, *a); "
            "sys.argv = ['ced.train'] + sys.argv[1:]; app.main()")
    done = subprocess.run([sys.executable, "-c", code, *TINY, f"hydra.run.dir={run}", *STEPS4],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]
    line = [x for x in done.stderr.splitlines() if x.startswith("training stopped")]
    assert len(line) == 1 and "non-finite weights" in line[0] and "step_00000002" in line[0]
    assert not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]


def test_save_model_refuses_non_finite_weights(tmp_path):
    from ced import CEDModel
    from conftest import tiny_config
    model = CEDModel(tiny_config())
    with torch.no_grad():
        model.final_norm.weight[0] = float("inf")
    with pytest.raises(CheckpointError, match="final_norm.weight holds NaN or infinite"):
        save_model(model, tmp_path / "final")
    assert not (tmp_path / "final").exists()


# ---- class 3: damaged or mismatched files ------------------------------------------------------

@pytest.mark.parametrize("damage,file", [
    (truncate, "model.safetensors"),
    (garble, "model.safetensors"),
    (truncate, "optimizer.bin"),
    (garble, "trainer_state.json"),
])
def test_resume_falls_back_past_a_damaged_checkpoint(base_run, straight_losses, tmp_path, capsys,
                                                     damage, file):
    run = copy_run(base_run, tmp_path)
    damaged = run / "checkpoints" / "step_00000004" / file
    damage(damaged)
    train_in_process(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto")
    err = capsys.readouterr().err
    assert f"warning: skipping a damaged checkpoint: {damaged}" in err
    assert "resuming from" in err and "step_00000002, the newest intact checkpoint" in err
    # the damaged one is set aside, so it can neither outrank the new step 4 in pruning nor be
    # picked by a later resume=auto
    assert (run / "checkpoints" / ".damaged-step_00000004" / file).exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_00000002", "step_00000004", "step_00000006"]
    history = metrics(run)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6]
    # bitwise the uninterrupted curve: resumed from step 2, where the warm-up makes the
    # learning rate independent of train.steps
    assert [m["loss"] for m in history] == straight_losses


def test_a_half_written_last_metrics_line_is_dropped(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "loss": 5.2, "indexer_')   # what a crash mid-write leaves
    train_in_process(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto")
    assert "dropped its half-written last line 5" in capsys.readouterr().err
    history = metrics(run)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6]
    assert history[:4] == metrics(base_run)


def test_the_report_reads_a_run_whose_last_metrics_line_is_half_written(tmp_path):
    from analysis.report import load_runs
    run = tmp_path / "study" / "runs" / "job"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert load_runs(tmp_path / "study")["job"]["metrics"]["step"].tolist() == [1]
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 1 is not a JSON record"):
        load_runs(tmp_path / "study")


def test_orphaned_temporary_checkpoint_folders_are_removed_on_resume(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path)
    orphans = [run / "checkpoints" / ".tmp-step_00000006-abcd", run / ".tmp-final-efgh",
               run / ".old-final"]
    for orphan in orphans:
        orphan.mkdir()
        (orphan / "model.safetensors").write_bytes(b"partial")
    train_in_process(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto")
    assert not any(o.exists() for o in orphans)
    assert capsys.readouterr().err.count("left by an interrupted save") == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004", "step_00000006"]


def _refused_and_untouched(run: Path, expected: str, *overrides: str) -> str:
    before = snapshot(run)
    with pytest.raises((CheckpointError, ConfigError)) as info:
        train_in_process(run, *STEPS4, *overrides)
    message = str(info.value)
    assert "\n" not in message and expected in message, message
    assert snapshot(run) == before     # nothing written before validation passed
    return message


def test_resume_with_a_different_model_shape_is_refused_without_writing(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    message = _refused_and_untouched(run, "step_00000004/model.safetensors:",
                                     "train.steps=6", EXTEND, "train.resume=auto",
                                     "model.d_model=48")
    assert "has shape" in message and "model config gives" in message


def test_resume_refuses_when_no_checkpoint_is_intact(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    truncate(run / "checkpoints" / "step_00000004" / "optimizer.bin")
    truncate(run / "checkpoints" / "step_00000002" / "model.safetensors")
    _refused_and_untouched(run, "train.resume=auto: none of the 2 checkpoints",
                           "train.steps=6", EXTEND, "train.resume=auto")


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    target = run / "checkpoints" / "step_00000002"
    truncate(target / "optimizer.bin", 0.3)
    _refused_and_untouched(run, f"{target / 'optimizer.bin'}: damaged",
                           "train.steps=6", EXTEND, f"train.resume={target}")


def test_a_garbled_metrics_line_before_the_last_is_refused_naming_it(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _refused_and_untouched(run, "metrics.jsonl: line 2 is not a JSON record",
                           "train.steps=6", EXTEND, "train.resume=auto")


def test_damaged_resume_through_the_entry_point_is_one_line(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    done = run_train(run, *STEPS4, "train.steps=6", EXTEND, "train.resume=auto",
                     "model.d_model=48", check=False)
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert line.startswith("error: train.resume=auto: ") and "model.safetensors" in line


@pytest.mark.parametrize("damage,expected", [
    (lambda d: truncate(d / "model.safetensors"), "model.safetensors: damaged"),
    (lambda d: garble(d / "model.safetensors"), "model.safetensors: damaged"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda d: (d / "config.json").write_text('{"window": 0}'),
     "config.json: not a valid model config"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda d: shutil.rmtree(d), "no such checkpoint directory"),
    (lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "d_model": 64})),
     "has shape"),
])
def test_load_model_names_the_damaged_file_in_one_line(base_run, tmp_path, damage, expected):
    final = tmp_path / "final"
    shutil.copytree(base_run / "final", final)
    load_model(final)   # intact
    damage(final)
    with pytest.raises(CheckpointError) as info:
        load_model(final)
    assert expected in str(info.value) and "\n" not in str(info.value)


# ---- class 7: offline by default ----------------------------------------------------------------

def test_offline_flags_are_defaults_the_environment_can_override(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    trainer_cli.set_offline_defaults()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"


def test_a_hub_dataset_name_fails_at_once_without_offline_flags_set(tmp_path):
    """With no flags in the environment the trainer sets them, so a hub name is refused by the
    offline check (about 2 s here) instead of after the hub client's retries (about 27 s with
    HF_HUB_OFFLINE=0 on a machine without network). Wall time is no test on a loaded machine
    (69 s once, just starting Python); the message shows that the offline path ran."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    done = subprocess.run(
        [sys.executable, "-m", "ced.train", *TINY, f"hydra.run.dir={tmp_path / 'run'}",
         "data=hf", "data.name=someone/no-such-dataset", "train.steps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_line(done.stderr)
    assert line.startswith("config error: ") and "this machine is offline" in line, line
    assert not (tmp_path / "run" / "config.yaml").exists()
