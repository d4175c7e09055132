"""Sweeps, studies and wandb through the real entry points, with seconds-long jobs
(model=tiny debug=fast): a multirun whose first job fails still runs the second; a resumed run
continues the same wandb run id; the study driver as a Hydra multirun, with a study file whose
typo is rejected in one line; seeds; finished steps skipped by config hash, and a changed
config refused or rerun as asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_SILENT": "true",
       "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FAST = ["model=tiny", "debug=fast", "train.threads=1"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_multirun_with_a_failing_job_runs_the_others_and_names_runs_by_what_varies(tmp_path):
    sweep = tmp_path / "sweep"
    # Sixteen overrides made the per-job folder name too long for the file system before
    # hydra.sweep.subdir became the job number.
    many = ["optim.lr=0.003", "optim.weight_decay=0.1", "optim.beta1=0.9", "optim.beta2=0.95",
            "optim.eps=1e-8", "optim.min_lr_ratio=0.1", "optim.grad_clip=1.0",
            "train.indexer_kl_weight=1.0", "train.keep_last=2", "train.grad_accum=1",
            "train.replay.length=8", "train.replay.min_length=1",
            "train.replay.distribution=uniform", "train.replay.starts_per_sequence=1",
            "model.dropout=0.0", "model.rope_theta=10000.0"]
    done = run("ced.train", "-m", *FAST, *many, "logging.group=sweep-test",
               "train.steps=0,2", f"hydra.sweep.dir={sweep}")
    assert done.returncode != 0                       # the sweep reports its failed job ...
    assert "config error: train.steps: must be >= 1; got 0" in done.stderr
    assert "Error executing job with overrides" in done.stderr
    # folders and run names say what varies: the 16 shared overrides stay out
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_train.steps=0",
                                                                      "1_train.steps=2"]
    assert not (sweep / "0_train.steps=0" / "final").exists()
    assert (sweep / "1_train.steps=2" / "final" / "model.safetensors").exists()  # ran the other
    import yaml
    config = yaml.safe_load((sweep / "1_train.steps=2" / "config.yaml").read_text())
    assert config["logging"]["name"] == "train.steps=2"
    assert config["optim"]["beta2"] == 0.95 and config["model"]["rope_theta"] == 10000.0


def test_single_run_still_exits_2_with_one_line(tmp_path):
    done = run("ced.train", *FAST, "train.steps=0", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines == ["config error: train.steps: must be >= 1; got 0"]


def test_resumed_run_continues_the_same_wandb_run(tmp_path):
    common = [*FAST, "logging.wandb=true", "logging.mode=offline", "train.save_every=2",
              f"hydra.run.dir={tmp_path}"]
    first = run("ced.train", *common, "train.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run("ced.train", *common, "train.steps=4", "train.resume=auto",
                 "train.allow_config_change=[train.steps]")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout + second.stderr
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    ids = {r.name.rsplit("-", 1)[1] for r in runs}
    assert len(ids) == 1, runs
    (run_id,) = ids
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "trainer_state.json")
                       .read_text())
    assert state["wandb_run_id"] == run_id and state["step"] == 4
    # the allowed change of train.steps travels with the run's checkpoints
    assert [c["changed"] for c in state["config_changes"]] == [{"train.steps": [2, 4]}]
    lineage = json.loads((tmp_path / "final" / "wandb.json").read_text())
    assert lineage["artifact"] == f"model-{run_id}:latest"


def test_starting_from_another_runs_checkpoint_starts_a_new_wandb_run(tmp_path):
    """A checkpoint of another run directory seeds the weights, not the wandb history."""
    common = [*FAST, "logging.wandb=true", "logging.mode=offline", "train.save_every=2"]
    first = run("ced.train", *common, "train.steps=2", f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-2000:]
    start = tmp_path / "a" / "checkpoints" / "step_00000002"
    second = run("ced.train", *common, "train.steps=4", f"train.resume={start}",
                 f"hydra.run.dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-2000:]
    old = json.loads((start / "trainer_state.json").read_text())["wandb_run_id"]
    new = json.loads((tmp_path / "b" / "checkpoints" / "step_00000004" / "trainer_state.json")
                     .read_text())["wandb_run_id"]
    assert new != old


def study_file(path: Path, steps: int) -> Path:
    path.write_text(f"name: mini\nseeds: [0, 1]\n"
                    f"train: [model=tiny, debug=fast, train.steps={steps}]\n"
                    f"jobs:\n  - {{name: a, overrides: []}}\n")
    return path


def test_study_driver_multirun_seeds_and_config_hash(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: typo\njobs:\n  - {name: a, overides: [model=yoco]}\n")
    mini = study_file(tmp_path / "mini.yaml", steps=2)
    out = tmp_path / "out"
    common = [f"out={out}", "only=train", "wandb=false", "threads=1"]

    # A Hydra multirun over two studies: the one with a typo fails in one line, the other runs.
    first = run("experiments.run", "-m", f"study={typo},{mini}", *common)
    assert first.returncode != 0
    assert ("study error: study typo: jobs[0].overides: unknown key; allowed keys of jobs[0]: "
            "['name', 'overrides', 'seeds']") in first.stderr
    losses = {}
    for seed in (0, 1):
        run_dir = out / "runs" / "a" / f"seed{seed}"
        assert (run_dir / "final" / "model.safetensors").exists(), first.stdout[-3000:]
        assert f"seed: {seed}" in (run_dir / "config.yaml").read_text()
        losses[seed] = [json.loads(ln)["loss"] for ln in
                        (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] != losses[1]                     # the seeds are different runs

    # Same config: skipped by hash, nothing retrained.
    stamp = (out / "runs" / "a" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = run("experiments.run", f"study={mini}", *common)
    assert again.returncode == 0, again.stdout[-2000:]
    assert "train a/seed0: done before with the same config (hash" in again.stdout
    assert (out / "runs" / "a" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp

    # Changed config: refused by default, the old run kept, and the log says why.
    study_file(mini, steps=3)
    refused = run("experiments.run", f"study={mini}", *common)
    assert refused.returncode == 1
    assert ("train a/seed0: REFUSED: config changed since it was trained" in refused.stdout
            and "train.steps: 2 -> 3" in refused.stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["train/a/seed0"]["state"] == "refused"
    assert (out / "runs" / "a" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp

    # Overrides written another way that compose to the config it trained (here a key set
    # to its default, and train.steps=2 back): the same runs, skipped, their stamps rehashed.
    mini.write_text(mini.read_text().replace("train.steps=3]", "train.steps=2, train.grad_accum=1]"))
    same = run("experiments.run", f"study={mini}", *common)
    assert same.returncode == 0, same.stdout[-2000:]
    assert "train a/seed0: done before: the overrides changed" in same.stdout
    assert "compose to the config it trained" in same.stdout
    assert (out / "runs" / "a" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    rehashed = json.loads((out / "runs" / "a" / "seed0" / "study_step.json").read_text())
    assert "rehashed_from" in rehashed and "train.grad_accum=1" in rehashed["overrides"]
    again = run("experiments.run", f"study={mini}", *common)
    assert "train a/seed0: done before with the same config (hash" in again.stdout
    study_file(mini, steps=3)

    # only=plan says the same and changes nothing; a refused step fails the plan (exit 2).
    plan = run("experiments.run", f"study={mini}", *common, "only=plan")
    assert plan.returncode == 2
    assert "steps: 3" in plan.stdout or "train.steps=3" in plan.stdout
    assert "[study] plan a/seed1: REFUSE - config changed" in plan.stdout

    # ... or rerun when asked, with the old run moved aside.
    rerun = run("experiments.run", f"study={mini}", *common, "on_change=rerun")
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "train a/seed1: config changed" in rerun.stdout and "RERUNNING" in rerun.stdout
    steps = [json.loads(ln)["step"] for ln in
             (out / "runs" / "a" / "seed1" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert list((out / "runs" / "a").glob("seed1.old-*"))


def test_study_continues_a_raised_train_steps_on_the_runs_own_schedule(tmp_path):
    """on_change=continue: a study that raises train.steps trains its
    finished runs on from where they ended (train.extend_to), not from step 0; the plan says
    so; the run's record and its config changes say it was extended; the learning rate of the
    added step is the schedule's final one (no jump back up); an interrupted continuation
    resumes; any other change is still refused."""
    mini = study_file(tmp_path / "mini.yaml", steps=2)
    out = tmp_path / "out"
    common = [f"study={mini}", f"out={out}", "only=train", "wandb=false", "threads=1",
              "seeds=[0]"]
    first = run("experiments.run", *common)
    assert first.returncode == 0, first.stdout[-2000:]
    run_dir = out / "runs" / "a" / "seed0"
    before = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]

    study_file(mini, steps=3)
    plan = run("experiments.run", *common, "only=plan", "on_change=continue")
    assert plan.returncode == 0, plan.stdout[-2000:]
    assert ("[study] plan a/seed0: CONTINUE - train.steps raised 2 -> 3: steps 3-3 train on "
            "at the end of the run's own 2-step schedule (train.extend_to=3)") in plan.stdout

    extended = run("experiments.run", *common, "on_change=continue")
    assert extended.returncode == 0, extended.stdout[-3000:]
    assert "train a/seed0: CONTINUING (on_change=continue)" in extended.stdout
    after = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in after] == [1, 2, 3] and after[:2] == before
    # tiny's schedule: lr 0.003, min_lr_ratio 0.1; step 3 runs at the final rate
    assert abs(after[2]["lr"] - 0.1 * 0.003) < 1e-12, after[2]
    stamp = json.loads((run_dir / "study_step.json").read_text())
    assert stamp["extended"] == {"schedule_steps": 2, "ends_at": 2, "wanted": 3}
    assert "extending" not in stamp
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["train/a/seed0"]["extended"]["wanted"] == 3
    [change] = [json.loads(ln) for ln in (run_dir / "config_changes.jsonl").read_text()
                .splitlines()]
    assert change["changed"] == {"train.extend_to": [None, 3]}

    # done: the same study skips it, with or without on_change=continue
    again = run("experiments.run", *common, "on_change=continue")
    assert "train a/seed0: done before with the same config" in again.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3

    # a continuation cut off before its end (the old final/ still there) resumes
    (run_dir / "study_step.json").write_text(json.dumps(
        {**stamp, "extending": stamp["extended"]}))
    plan = run("experiments.run", *common, "only=plan")
    assert ("[study] plan a/seed0: CONTINUE - interrupted while continuing to step 3"
            in plan.stdout), plan.stdout[-2000:]
    (run_dir / "study_step.json").write_text(json.dumps(stamp))

    # anything else changed is refused under on_change=continue, saying why
    mini.write_text(mini.read_text().replace("train.steps=3]", "train.steps=4, optim.lr=0.001]"))
    refused = run("experiments.run", *common, "on_change=continue")
    assert refused.returncode == 1
    assert "REFUSED" in refused.stdout
    assert "on_change=continue continues only a raised train.steps" in refused.stdout
