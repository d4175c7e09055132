"""The real-text study (conf/experiment/real_text.yaml) end to end at its tiny scale: four
tiny byte-level models of the stdlib (ced L_d = 2 and 8, yoco, dense) trained for two steps,
then the real_text step: every table and plot, the baselines for every model, zero KL for the
for ced at and beyond R_exact (yoco and dense read for their NLL only); a second run skips
the step (same inputs), a model added later is read alone, and a stale lm-eval run of a mode
no longer asked for is not read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_study(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "experiments.run", "study=real_text",
                           "scale=tiny", f"out={out}", "threads=1", "wandb=false", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_text")
    return out, run_study(out)


def test_the_tiny_study_trains_and_reads_real_text(study):
    out, first = study
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps["real_text"]["state"] == "ok"
    rt = out / "real_text"
    for name in ("baselines.csv", "kl_by_class.csv", "kl_by_position.csv", "tokens.parquet",
                 "kl_by_position.png", "kl_by_class.png"):
        assert (rt / name).exists(), name
    base = pd.read_csv(rt / "baselines.csv")
    assert sorted(base["job"]) == ["ced_L2", "ced_L8", "dense", "yoco"]
    assert (base["bigram_nll"] < base["unigram_nll"]).all() and (base["parameters"] > 0).all()
    tokens = pd.read_parquet(rt / "tokens.parquet")
    # dense has no decoder and yoco's early exit is exact: both are read for their NLL only
    assert set(tokens["job"]) == {"ced_L2", "ced_L8"}
    ced = tokens
    assert ced[ced["distance"] >= ced["R_exact"]]["kl"].abs().max() < 1e-5
    assert ced[ced["distance"] == 1]["kl"].mean() > 1e-7
    assert {"identifier_far", "closer_before_replay", "other"} <= set(tokens["group"])
    classes = pd.read_csv(rt / "kl_by_class.csv")
    assert set(classes["replay"].astype(str)) == {"1", "W/2", "W", "2W", "3W", "4W", "R_exact"}


def test_the_code_tasks_run_through_lm_eval_for_every_mode(study):
    """lm-eval ran the group ced_code for the jobs asked (lm_eval_jobs: ced_L2 at full and
    replay=W, dense at full only); lm_eval.csv pairs every mode with full on the same
    documents. (The tiny scale runs two jobs and no turn mode: each lm-eval start costs
    seconds; tests/integration/test_lm_eval.py reads the turn policies through lm-eval.)"""
    out, _ = study
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps["lm_eval"]["state"] == "ok"
    ok = sorted(k for k, v in steps.items() if k.startswith("lm_eval/") and v["state"] == "ok")
    runs = [k for k in ok if "/ced_code/" in k]
    assert len(runs) == 2 + 1, runs
    assert len(ok) - len(runs) == 2                  # each model's tasks, written once
    drops = pd.read_csv(out / "real_text" / "lm_eval.csv")
    assert set(drops["family"]) == {"code_identifier", "code_close", "code_dedent"}
    assert set(drops["mode"]) == {"replay=W"}
    assert set(drops["job"]) == {"ced_L2"}
    pooled = drops[drops["x"] == "all"]
    assert (pooled["n"] == 4).all()           # lm_eval_examples: 4 documents per task
    accuracy = pd.read_csv(out / "real_text" / "lm_eval_accuracy.csv")
    assert set(accuracy["job"]) == {"ced_L2", "dense"}


def test_a_second_run_skips_the_step(study):
    out, _ = study
    # a run left on disk by a mode the spec no longer asks for
    stale = out / "real_text" / "lm_eval" / "ced_L2" / "seed0" / "ced_code" / "replay=1"
    shutil.copytree(stale.parent / "replay=W", stale)
    (stale / "mode.txt").write_text("replay=1\n")
    again = run_study(out, "only=eval")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "real_text: done before with the same inputs" in again.stdout      # the merge
    assert "real_text ced_L8/seed0: done before with the same inputs" in again.stdout
    assert "lm_eval tasks ced_L2/seed0: done before with the same inputs" in again.stdout
    assert "lm_eval/ced_L2/seed0/ced_code/replay=W: done before" in again.stdout
    drops = pd.read_csv(out / "real_text" / "lm_eval.csv")
    assert set(drops["mode"]) == {"replay=W"}                 # the stale replay=1 is not read


def test_lm_eval_runs_the_jobs_asked_and_keeps_the_others_finished_runs(study, tmp_path):
    """`jobs=[...]` limits lm-eval to those jobs' checkpoints, as it does every per model
    step. dense's run not done (its mode.txt gone) or done with other inputs (another hash):
    `jobs=[ced_L2]` neither plans nor runs dense, its tables hold ced_L2 alone, and the plan
    and the run name the run they leave out. dense's run done again: the same invocation keeps
    it in the tables without visiting it."""
    out, _ = study
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    run = copy / "real_text" / "lm_eval" / "dense" / "seed0" / "ced_code" / "full"
    done, stamp = run / "mode.txt", run / "study_step.json"
    mode, record = done.read_text(), stamp.read_text()
    left_out = "leave out lm_eval/dense/seed0/ced_code/full"
    done.unlink()
    plan = run_study(copy, "only=plan", "tools=[lm_eval]", "jobs=[ced_L2]")
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert "plan lm_eval/ced_L2/seed0/ced_code/replay=W" in plan.stdout
    assert "plan lm_eval/dense/seed0" not in plan.stdout and left_out in plan.stdout
    for state in ("not done", "other inputs", "done"):
        if state != "not done":
            done.write_text(mode)
        stamp.write_text(record.replace(json.loads(record)["hash"], "0" * 12)
                         if state == "other inputs" else record)
        again = run_study(copy, "only=eval", "tools=[lm_eval]", "jobs=[ced_L2]")
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
        assert "lm_eval/ced_L2/seed0/ced_code/replay=W: done before" in again.stdout
        assert "lm_eval dense/seed0" not in again.stdout, state      # not run
        assert (left_out in again.stdout) == (state != "done"), state
        accuracy = pd.read_csv(copy / "real_text" / "lm_eval_accuracy.csv")
        assert set(accuracy["job"]) == ({"ced_L2", "dense"} if state == "done"
                                        else {"ced_L2"}), state
        drops = pd.read_csv(copy / "real_text" / "lm_eval.csv")
        assert set(drops["job"]) == {"ced_L2"} and set(drops["mode"]) == {"replay=W"}


def test_each_model_is_read_once_and_a_model_added_later_is_read_alone(study, tmp_path):
    """Every model is read in its own folder (real_text/<job>/seed<k>/) and the study's
    tables are merged from them. A study holding ced_L2 read and ced_L8 trained but unread
    (`tools=[real_text]`: no lm-eval) reads ced_L8 alone, skips ced_L2, and merges both: each
    model's own rows equal those of the study that read all four."""
    out, _ = study
    for job in ("ced_L2", "ced_L8", "yoco", "dense"):
        assert (out / "real_text" / job / "seed0" / "baselines.csv").exists(), job
    grown = tmp_path / "grown"
    for part in ("runs/ced_L2/seed0", "real_text/ced_L2/seed0", "runs/ced_L8/seed0"):
        shutil.copytree(out / part, grown / part)
    again = run_study(grown, "only=eval", "tools=[real_text]")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "real_text ced_L2/seed0: done before with the same inputs" in again.stdout
    assert "=== [study] real_text ced_L8/seed0:" in again.stdout
    assert "=== [study] real_text: merge 2 models ===" in again.stdout
    assert "lm_eval" not in again.stdout
    grown_classes = pd.read_csv(grown / "real_text" / "kl_by_class.csv")
    full_classes = pd.read_csv(out / "real_text" / "kl_by_class.csv")
    assert sorted(set(grown_classes["job"])) == ["ced_L2", "ced_L8"]
    mine = grown_classes[grown_classes["level"] == "model"].drop(columns="checkpoint")
    theirs = full_classes[(full_classes["level"] == "model")
                          & full_classes["job"].isin(["ced_L2", "ced_L8"])]
    pd.testing.assert_frame_equal(mine.reset_index(drop=True),
                                  theirs.drop(columns="checkpoint").reset_index(drop=True))
    # a model trained and not read, outside jobs=: the merge waits, and the merged tables of
    # two models, which no longer cover every model, are removed
    shutil.copytree(out / "runs" / "yoco" / "seed0", grown / "runs" / "yoco" / "seed0")
    plan = run_study(grown, "only=plan", "tools=[real_text]", "jobs=[ced_L2]")
    assert "plan real_text: SKIP - waits: real_text/yoco/seed0 not done" in plan.stdout
    waits = run_study(grown, "only=eval", "tools=[real_text]", "jobs=[ced_L2]")
    assert "real_text: merge waits: real_text/yoco/seed0" in waits.stdout
    assert not (grown / "real_text" / "kl_by_class.csv").exists()
    assert (grown / "real_text" / "ced_L8" / "seed0" / "kl_by_class.csv").exists()
    # a tool name the driver does not know is refused, naming the allowed; so is tools=[]
    bad = run_study(grown, "only=eval", "tools=[real_txt]")
    assert bad.returncode != 0 and "tools: no tool(s) ['real_txt']" in bad.stdout + bad.stderr
    bad = run_study(grown, "only=eval", "tools=[]")
    assert bad.returncode != 0 and "tools: name at least one tool" in bad.stdout + bad.stderr


def test_the_archive_keeps_the_models_and_their_readings(study, tmp_path):
    """`analysis.archive --weights` on a real_text study (no suite): each model's weights,
    curve and training record, its reading's tables without the per-byte table, the merged
    tables and every lm-eval document; put back, the driver finds every run trained and
    reads the models again (their readings' records are not kept)."""
    out, _ = study
    into = tmp_path / "archive"
    done = subprocess.run([sys.executable, "-m", "analysis.archive", "--study", str(out),
                           "--into", str(into), "--weights"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 models" in done.stdout
    for job in ("ced_L2", "ced_L8", "yoco", "dense"):
        for name in ("final/model.safetensors", "metrics.jsonl", "study_step.json", "run.json"):
            assert (into / "runs" / job / "seed0" / name).exists(), (job, name)
        reading = into / "real_text" / job / "seed0"
        assert (reading / "baselines.csv").exists() and (reading / "run.json").exists()
        assert not (reading / "tokens.parquet").exists()
        assert not (reading / "study_step.json").exists()
    for name in ("kl_by_class.csv", "kl_by_position.csv", "baselines.csv"):
        assert (into / "real_text" / name).read_bytes() == (out / "real_text" / name).read_bytes()
    outcomes = pd.read_csv(into / "real_text" / "lm_eval_outcomes.csv.gz")
    assert set(zip(outcomes["job"], outcomes["mode"])) == {
        ("ced_L2", "full"), ("ced_L2", "replay=W"), ("dense", "full")}
    back = tmp_path / "back"
    shutil.copytree(into / "runs", back / "runs")
    plan = run_study(back, "only=plan", "tools=[real_text]")
    assert plan.returncode == 0, plan.stdout[-2000:]
    lines = plan.stdout.splitlines()
    for job in ("ced_L2", "ced_L8", "yoco", "dense"):
        assert any(f"plan {job}/seed0: SKIP" in line for line in lines), (job, lines)
        assert any(f"plan real_text/{job}/seed0: RUN" in line for line in lines), (job, lines)


def test_the_study_is_published_for_findings(study, tmp_path):
    """`python -m analysis.findings` on a real_text study writes findings/real_text: the tables
    and plots FINDINGS cites, one training row per run (the steps it trained), the provenance
    of the invocation, and findings.md whose competence table is baselines.csv's."""
    out, _ = study
    target = tmp_path / "findings_real_text"
    done = subprocess.run([sys.executable, "-m", "analysis.findings", "--study", str(out),
                           "--out", str(target)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("kl_by_position.csv", "kl_by_class.csv", "baselines.csv", "lm_eval.csv",
                 "kl_by_position.png", "kl_by_class.png", "training.csv",
                 "training_curves.png", "provenance.json", "findings.md"):
        assert (target / name).exists(), name
    assert not (target / "tokens.parquet").exists()         # per byte: stays in the study
    results = sorted((target / "lm_eval").rglob("results_*.json"))
    assert len(results) == 3                # lm-eval's own output: ced_L2 full, W; dense full
    assert not list((target / "lm_eval").rglob("samples_*.jsonl"))
    training = pd.read_csv(target / "training.csv")
    assert sorted(training["job"]) == ["ced_L2", "ced_L8", "dense", "yoco"]
    assert (training["step"] == 2).all() and training["val_loss"].notna().all()
    info = json.loads((target / "provenance.json").read_text())
    assert info["study"] == "real_text" and info["invocations"][0]["commit"]
    md = (target / "findings.md").read_text()
    base = pd.read_csv(target / "baselines.csv")
    for row in base.itertuples():
        assert f"| {row.job} | {row.seed} | {row.variant} | {row.parameters} | " \
               f"{row.nll_exact:.4f} |" in md
    assert "## lm-eval" in md
