"""Issue 37: the researcher's daily loop, through the real entry points in subprocesses.

A study checks every job's config before anything trains (and in `only=plan`); a run resumes
from its own config.yaml with nothing but `train.resume=auto hydra.run.dir=<run>`; a run ends
by printing where it is and how it ended.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import ENV, ROOT, TINY, metrics, run_train


def study(path: Path, bad: str = "train.replay.probabilty=0.5") -> Path:
    path.write_text("name: typo\nseeds: [0, 1]\ntrain: [model=tiny, debug=fast, train.steps=2]\n"
                    f"jobs:\n  - {{name: good, overrides: []}}\n"
                    f"  - {{name: bad, overrides: [{bad}]}}\n")
    return path


def driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", *args, "wandb=false",
                           "threads=1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)


def test_a_typo_in_one_job_is_found_before_any_job_trains(tmp_path):
    spec, out = study(tmp_path / "typo.yaml"), tmp_path / "out"
    plan = driver(f"study={spec}", f"out={out}", "only=plan")
    assert plan.returncode == 2
    assert ("plan bad/seed0: CONFIG ERROR - config error: train.replay.probabilty: unknown "
            "key; allowed keys of train.replay:") in plan.stdout
    assert "plan good/seed0: TRAIN - not trained yet" in plan.stdout
    done = driver(f"study={spec}", f"out={out}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "study error: jobs[bad]: train.replay.probabilty: unknown key;")
    assert "(nothing was trained; 1 job(s) with a bad config" in done.stderr
    assert not (out / "runs").exists()            # the good job did not train either
    # a bad value (not only a bad key) is found the same way
    spec = study(tmp_path / "value.yaml", bad="train.replay.distribution=gaussian")
    plan = driver(f"study={spec}", f"out={tmp_path / 'out2'}", "only=plan")
    assert plan.returncode == 2 and "CONFIG ERROR - config error: train.replay.distribution" \
        in plan.stdout


def test_resume_needs_only_the_run_directory(tmp_path):
    run = tmp_path / "run"
    run_train(run, "train.steps=4", "train.save_every=2", "train.eval_every=100",
              "model.window=4")
    # nothing of the original command but the directory: the run's own config.yaml is used
    done = subprocess.run([sys.executable, "-m", "ced.train", "train.resume=auto",
                           f"hydra.run.dir={run}", "train.steps=6",
                           "train.allow_config_change=[train.steps]", "train.threads=1",
                           "train.progress=false"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in done.stdout
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert "window: 4" in (run / "config.yaml").read_text()
    # the run ends saying where it is and how it ended; no accelerate INFO chatter
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"done: {run} (step 6); validation: answer loss ")
    assert "all-token loss" in last and "accuracy " in last and last.endswith(f"{run}/final")
    assert "accelerate.checkpointing" not in done.stdout + done.stderr
    # an explicit override still changes a key, and is held to the resume rule
    refused = subprocess.run([sys.executable, "-m", "ced.train", "train.resume=auto",
                              f"hydra.run.dir={run}", "train.steps=8", "optim.lr=1e-2",
                              "train.allow_config_change=[train.steps]"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "optim.lr: 0.003 -> 0.01" in refused.stderr.strip().splitlines()[-1]


def test_a_study_job_is_checked_like_ced_train_checks_it(tmp_path):
    """The same one line as the trainer's own check (experiments.check_jobs)."""
    from ced.train import compose_config
    from ced.train_config import ConfigError
    cfg = compose_config([*[o for o in TINY if not o.startswith("hydra")], "train.steps=3"])
    assert cfg.train.steps == 3 and cfg.model.window == 8
    try:
        compose_config(["model.windw=4"])
    except ConfigError as exc:
        assert str(exc).startswith("model.windw: unknown key; allowed keys of model:")
    else:
        raise AssertionError("a typo passed")
    done = subprocess.run([sys.executable, "-m", "experiments.check_jobs", "/nonexistent"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"label": "a", "overrides": ["model=tiny", "debug=fast"]},
                                {"label": "b", "overrides": ["model=tiny", "optim.lr=-1"]}]))
    done = subprocess.run([sys.executable, "-m", "experiments.check_jobs", str(jobs)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    [line] = done.stdout.splitlines()
    assert json.loads(line)["label"] == "b" and "optim.lr" in json.loads(line)["error"]


@pytest.mark.parametrize("args,line", [
    (["ced.cost", "model.windw=64"], "config error: model.windw: unknown key; allowed keys of "
                                     "model: ['attention_block', "),
    (["ced.cost", "seq_len=abc"], "config error: seq_len: expected an int >= 1; got 'abc'"),
    (["ced.cost", "sequence=3"], "config error: sequence: unknown key; allowed: ['json', "),
    (["ced.cost", "model=ced", "model.window=0"],
     "config error: model.window: must be an integer >= 1; got 0"),
    (["evals.divergence", "checkpoints=/path"], "config error: checkpoints: Invalid value "),
])
def test_every_hydra_tool_gives_one_line_config_errors(args, line):
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(line), done.stderr[-1500:]


def test_the_cost_help_lists_only_what_the_cost_model_reads():
    done = subprocess.run([sys.executable, "-m", "ced.cost", "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for group in ("data:", "optim:", "experiment:", "logging:", "train:"):
        assert group not in done.stdout
    assert "Config group: model" in done.stdout
