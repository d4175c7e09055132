"""The researcher's daily loop, through the real entry points in subprocesses.

A study checks every job's config before anything trains (and in `only=plan`); a run resumes
from its own config.yaml with nothing but `train.resume=auto hydra.run.dir=<run>`; a run ends
by printing where it is and how it ended.
"""

from __future__ import annotations

import json
import shutil
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
    from ced.cli.train import compose_config
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
    # one shared check of the overrides before Hydra composes (ced.cli.check_override_keys)
    (["evals.divergence", "replay=[1,8]"],
     "config error: replay: unknown key; allowed keys of the config: ['batch_size', "),
    (["evals.divergence", "replays=[1,8"], "config error: replays: cannot parse 'replays=[1,8' "),
    # threads is a key like the other tools' threads, and checked
    (["evals.divergence", "checkpoints=[/x]", "threads=0"],
     "config error: threads: must be null or an int >= 1; got 0"),
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


def test_divergence_prompts_default_to_the_checkpoints_own_training_data(tmp_path):
    from evals.divergence import DivergenceConfig, checkpoint_data, load_prompts
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  kind: synthetic\n  only: [copy]\n  seed: 3\n")
    assert checkpoint_data(run / "final")["only"] == ["copy"]
    assert checkpoint_data(tmp_path / "elsewhere" / "final") == "synthetic"
    c = DivergenceConfig()
    assert c.prompts.data is None
    ids = load_prompts(c, 64, run / "final")
    from ced.data import build_source
    want = build_source({"kind": "synthetic", "only": ["copy"], "seed": 3},
                        "validation").rows(0, c.prompts.count, 64 + c.steps)["input_ids"]
    assert (ids == want).all()


def test_the_suite_refuses_an_existing_out_like_training_refuses_a_run(tmp_path):
    from ced.checkpoint import save_model
    from conftest import make_model, tiny_config
    model = save_model(make_model(tiny_config(window=8, vocab_size=259), 0).float(),
                       tmp_path / "model")
    out = tmp_path / "suite"
    args = [sys.executable, "-m", "evals.suites", "--checkpoint", str(model), "--out",
            str(out), "--replay", "W", "--examples", "1", "--families", "running_count",
            "--no-plot", "--quiet", "--no-wandb"]
    assert subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120).returncode == 0
    before = (out / "results.csv").read_bytes()
    again = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2
    assert one_line_of(again.stderr).startswith(f"error: --out {out} already holds a suite run")
    assert (out / "results.csv").read_bytes() == before
    replaced = subprocess.run([*args, "--overwrite"], cwd=ROOT, env=ENV, capture_output=True,
                              text=True, timeout=120)
    assert replaced.returncode == 0, replaced.stderr[-1500:]
    # logging to wandb is the default, as for training and divergence
    logged = subprocess.run([a for a in args if a != "--no-wandb"] + ["--overwrite"], cwd=ROOT,
                            env={**ENV, "WANDB_MODE": "offline"}, capture_output=True,
                            text=True, timeout=300)
    assert logged.returncode == 0, logged.stderr[-1500:]
    assert list(tmp_path.rglob("offline-run-*")), "no offline wandb run written"


def one_line_of(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_sweep_names_leave_out_what_conf_train_leaves_out():
    """ced.train.NAME_EXCLUDES repeats conf/train.yaml's exclude_keys (a sweep's command line
    replaces that list, so the code must know it)."""
    from omegaconf import OmegaConf

    from ced.cli.train import CONF_DIR, NAME_EXCLUDES, name_sweep_by_what_varies
    conf = OmegaConf.load(Path(CONF_DIR) / "train.yaml")
    assert list(conf.hydra.job.config.override_dirname.exclude_keys) == NAME_EXCLUDES
    args = name_sweep_by_what_varies(["-m", "model=tiny", "optim.lr=1e-3,3e-3",
                                      "data.only=[copy,kv_recall]", "train.steps=5"])
    excludes = args[-2]
    assert "optim.lr" not in excludes and "model," in excludes and "train.steps" in excludes
    assert "data.only" in excludes                       # a list value is one value
    assert name_sweep_by_what_varies(["model=tiny", "optim.lr=1e-3,3e-3"])[-1] == \
        "optim.lr=1e-3,3e-3"                             # not a multirun: unchanged


def test_an_offline_run_holds_its_config_summary_and_artifact(tmp_path, capsys):
    """What `wandb sync` uploads, read from the offline run's record log (the pinned wandb
    writes no config or summary into files/ until then): `python -m ced.tracking <run>`."""
    from ced.cli.tracking import main as tracking_main
    from ced.tracking import read_offline_run
    run = tmp_path / "run"
    run_train(run, "train.steps=2", "train.eval_every=2", "train.save_every=2",
              "logging=wandb", "logging.mode=offline")
    [offline] = (run / "wandb").glob("offline-run-*")
    info = read_offline_run(offline)
    assert info["exit_code"] == 0 and info["history"] == 2
    assert info["config"]["model.d_model"] == 32 and info["config"]["train.steps"] == 2
    assert info["summary"]["val/loss"]["min"] > 0       # define_metric: the best, not the last
    assert info["summary"]["val/answer_loss"] > 0
    assert info["artifacts"] == {f"model-{info['id']}": "model"}
    shown = subprocess.run([sys.executable, "-m", "ced.tracking", str(offline)], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0
    assert shown.stdout.startswith(f"run {info['id']}: finished; 2 history rows; artifacts: ")
    assert "  config model.d_model: 32" in shown.stdout
    # a resumed run writes a second folder with the same id (one per process that ran it):
    # `python -m ced.tracking <run>`, or the folders as the shell expands the glob, reads them
    # as one history, in time order (a copy stands in for the resume's folder here: a second
    # wandb start would double this test's time)
    second = offline.with_name(offline.name.replace("offline-run-", "offline-run-9"))
    shutil.copytree(offline, second)
    expected = (f"run {info['id']}: finished; 4 history rows over 2 offline folders "
                f"({offline.name}: finished, 2 rows, {second.name}: finished, 2 rows)")
    shown = subprocess.run([sys.executable, "-m", "ced.tracking", str(run)], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith(expected), shown.stderr
    assert tracking_main([str(offline), str(second)]) == 0      # the same, in-process
    assert capsys.readouterr().out.startswith(expected)
    done = subprocess.run([sys.executable, "-m", "ced.tracking", str(tmp_path)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path}: no wandb")
