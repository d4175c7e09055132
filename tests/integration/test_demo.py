"""The study driver end to end on the `tiny` study (conf/experiment/tiny.yaml): it trains,
evaluates and reports; a job that fails (an invalid override) is recorded and does not stop the
others; a second run skips everything already done. Also the shipped studies parse."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.sections import resolve_lengths
from experiments.study import STUDY_DIR
from experiments.study import load_study
from experiments.tools import TOOLS

ROOT = Path(__file__).resolve().parents[2]


def run_study(out: Path, *extra: str, study: str = "tiny") -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "experiments.run", f"study={study}", f"out={out}",
                           "threads=1", "wandb=false", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    first = run_study(out)
    return out, first


def test_study_runs_end_to_end_and_reports_the_failed_job(tiny_study):
    out, first = tiny_study
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # one job fails
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["failed"] == ["train/broken/seed0"]
    assert steps["train/broken/seed0"]["returncode"] != 0
    assert "non-finite" in steps["train/broken/seed0"]["tail"]
    for key in ("train/yoco/seed0", "train/ced/seed0", "divergence", "suite/yoco/seed0",
                "suite/ced/seed0", "suite/ced/seed0@kv=global:fp8", "report"):
        assert steps[key]["state"] == "ok", (key, steps[key])
    settings = json.loads((out / "suite" / "ced" / "seed0@kv=global:fp8" / "summary.json")
                          .read_text())["run"]["config"]
    assert settings["global_kv_dtype"] == "fp8"
    # the override folder says what it holds as fields; the readers never parse its name
    assert json.loads((out / "suite" / "ced" / "seed0@kv=global:fp8" / "run.json").read_text()) \
        == {"job": "ced", "seed": 0, "topk": None, "kv": "global:fp8"}
    for job in ("yoco", "ced"):
        assert (out / "runs" / job / "seed0" / "final" / "model.safetensors").exists()
        assert (out / "runs" / job / "seed0" / "metrics.jsonl").exists()
        assert (out / "suite" / job / "seed0" / "capability_drop.csv").exists()
    assert (out / "divergence" / "divergence.parquet").exists()
    assert f"report: {out / 'report' / 'report.html'}" in first.stdout


def test_report_has_every_section_and_embedded_plots(tiny_study):
    out, _ = tiny_study
    report = out / "report"
    md = (report / "report.md").read_text()
    page = (report / "report.html").read_text()
    for title in ("Status", "Training", "Divergence", "Accuracy against distance",
                  "Cost-quality frontier", "Capability drop"):
        assert f"## {title}" in md
        assert f"<h2>{title}</h2>" in page
    assert "Failed: train/broken" in md and "Failed: train/broken" in page
    for png in ("training_curves", "divergence_vs_N", "accuracy_ced_seed0", "accuracy_yoco_seed0",
                "cost_quality_frontier"):
        assert (report / f"{png}.png").stat().st_size > 1000
        assert f"({png}.png)" in md
    # the answer first: the summary and the headline plot, before the sections
    assert (report / "headline_accuracy_vs_N.png").stat().st_size > 1000
    assert md.index("## Summary") < md.index("(headline_accuracy_vs_N.png)") < md.index("## Status")
    assert page.index("<h2>Summary</h2>") < page.index("<img") < page.index("<h2>Status</h2>")
    assert "<details><summary>Divergence table" in page
    # self-contained: every image is inline
    # headline, training, divergence, frontier and one accuracy plot per suite run (yoco, ced,
    # and each again under the eval-time storage override)
    assert page.count("src='data:image/png;base64,") == 8
    assert (report / "accuracy_ced_seed0_kv=global:fp8.png").stat().st_size > 1000
    assert ".png'" not in page
    cost = (report / "cost_quality.csv").read_text()
    assert "prefill_flops" in cost and "replay=exact" in cost


def test_notebook_executes_on_the_study_outputs(tiny_study, tmp_path, monkeypatch):
    """notebooks/study_analysis.ipynb runs on a study's outputs without errors and draws its plots
    (the study has a failed job, which the notebook must pass over)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    study, _ = tiny_study
    figures = tmp_path / "figures"
    monkeypatch.setenv("CED_STUDY_DIR", str(study))
    monkeypatch.setenv("CED_NOTEBOOK_OUT", str(figures))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / "study_analysis.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()           # raises CellExecutionError on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 4
    names = {p.stem for p in figures.glob("*.png")}
    assert {"training_curves", "divergence_vs_N", "cost_quality_frontier"} <= names
    assert any(n.startswith("accuracy_") for n in names)


def test_rerun_skips_what_is_done(tiny_study):
    out, _ = tiny_study
    metrics = out / "runs" / "ced" / "seed0" / "metrics.jsonl"
    stamp = metrics.stat().st_mtime_ns
    second = run_study(out)
    assert second.returncode == 1
    for line in ("train yoco/seed0: done before with the same config (hash",
                 "train ced/seed0: done before with the same config (hash",
                 "divergence: done before with the same inputs (hash",
                 "suite ced/seed0: done before with the same inputs (hash"):
        assert line in second.stdout
    assert "train broken/seed0: FAILED" in second.stdout
    assert metrics.stat().st_mtime_ns == stamp
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert steps["train/ced/seed0"]["state"] == "skipped"
    assert steps["report"]["state"] == "ok"
    # both invocations are on record, with the commit that ran (FINDINGS.md cites it)
    runs = summary["invocations"]
    assert len(runs) == 2 and all("study=tiny" in r["command"] for r in runs)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    if head:
        assert runs[-1]["commit"] == head and isinstance(runs[-1]["dirty"], bool)


def test_another_study_directory_reuses_runs_of_the_same_training_hash(tiny_study, tmp_path):
    first, _ = tiny_study
    plan = run_study(tmp_path / "again", f"reuse=[{first}]", "only=plan")
    assert "plan ced/seed0: REUSE" in plan.stdout and "plan broken/seed0: TRAIN" in plan.stdout
    done = run_study(tmp_path / "again", f"reuse=[{first}]", "only=train")
    steps = json.loads((tmp_path / "again" / "summary.json").read_text())["steps"]
    for job in ("yoco", "ced"):
        assert steps[f"train/{job}/seed0"]["state"] == "reused", steps
        copied = tmp_path / "again" / "runs" / job / "seed0" / "final" / "model.safetensors"
        assert copied.read_bytes() == (first / "runs" / job / "seed0" / "final"
                                       / "model.safetensors").read_bytes()
    assert steps["train/broken/seed0"]["state"] == "failed"
    assert "copied, not retrained" in done.stdout
    # a seed the first study never trained is trained, not reused
    other = run_study(tmp_path / "seed1", f"reuse=[{first}]", "only=plan", "seeds=[1]")
    assert "plan ced/seed1: TRAIN" in other.stdout
    bad = run_study(tmp_path / "bad", f"reuse=[{tmp_path / 'nowhere'}]", "only=plan")
    assert bad.returncode == 2 and "reuse:" in bad.stderr


def changed_tiny(path: Path, old: str, new: str) -> Path:
    """conf/experiment/tiny.yaml with one edit, written to `path`."""
    text = (STUDY_DIR / "tiny.yaml").read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return path


def test_the_plan_lists_every_step_and_what_changed(tiny_study, tmp_path, capsys):
    out, _ = tiny_study
    more = changed_tiny(tmp_path / "more.yaml", "replay: [4, W]", "replay: [4, W, 3W]")
    plan = run_study(out, "only=plan", study=str(more))
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    for line in ("plan ced/seed0: SKIP - done before with the same config",
                 "plan suite/ced/seed0: RERUN - inputs changed (suite.replay gained 3W)",
                 "plan suite/ced/seed0@kv=global:fp8: RERUN - inputs changed (suite.replay "
                 "gained 3W)", "plan divergence: RUN - after training broken/seed0",
                 "plan report: RUN"):
        assert line in plan.stdout, (line, plan.stdout[-3000:])
    # a run gives the same reason, from the same decision (in-process: a run costs seconds)
    from experiments.run import Study
    study = Study(load_study(str(more)), out, 1, wandb=False)
    step = next(s for s in study.tool_steps(TOOLS["suite"])[0] if s["label"] == "ced/seed0")
    assert study._fresh("suite ced/seed0", step)[0] == "rerun"
    assert ("suite ced/seed0: inputs changed (suite.replay gained 3W); rerunning"
            in capsys.readouterr().out)


def test_a_new_multi_turn_policy_reruns_exactly_the_suites_that_read_it(tiny_study, tmp_path,
                                                                        monkeypatch):
    """The suite runs every policy of ced.inference.POLICIES on a multi-turn family: a policy
    registered after a study's suites ran makes the plan rerun those suites, naming it."""
    import ced.inference
    from experiments.run import Study
    from experiments.steps import step_record, write_stamp
    first, _ = tiny_study
    out = tmp_path / "study"
    shutil.copytree(first / "runs", out / "runs")      # the trained checkpoints and records
    multi = changed_tiny(tmp_path / "multi.yaml", "families: [recall, short]",
                         "families: [recall, short, multiturn]")
    study = Study(load_study(str(multi)), out, 1, wandb=False)
    for step in study.tool_steps(TOOLS["suite"])[0]:   # as if every suite had run
        step["done"].parent.mkdir(parents=True, exist_ok=True)
        step["done"].write_text("{}")
        write_stamp(step["out"], step_record(step, checkpoint=step["reading"].paths[0]))
    before = {r["run"]: r for r in study.plan()}
    assert before["suite/ced/seed0"]["action"] == "skip", before["suite/ced/seed0"]
    monkeypatch.setattr(ced.inference, "POLICIES", (*ced.inference.POLICIES, "dummy_policy"))
    rows = {r["run"]: r for r in study.plan()}
    suites = ("suite/ced/seed0", "suite/ced/seed0@kv=global:fp8", "suite/yoco/seed0",
              "suite/yoco/seed0@kv=global:fp8")
    for key in suites:
        assert rows[key]["action"] == "rerun", rows[key]
        assert rows[key]["reason"] == "inputs changed (policies gained dummy_policy)"
    # exactly those steps change: training, and every step that does not read the policies,
    # plan as they did before the policy was added
    assert rows.keys() == before.keys()
    changed = {k for k in rows if rows[k]["action"] != before[k]["action"]}
    assert changed == set(suites), changed
    assert all(rows[k]["action"] == "skip" for k in rows if k.startswith(("ced/", "yoco/")))
    # the tiny study reads no multi-turn family: its suites' hashes do not hold the policies
    plain = Study(load_study("tiny"), out, 1, wandb=False)
    assert all("policies" not in s["inputs"] for s in plain.tool_steps(TOOLS["suite"])[0])


def test_a_plan_that_would_refuse_a_run_exits_2(tiny_study, tmp_path):
    out, _ = tiny_study
    longer = changed_tiny(tmp_path / "longer.yaml", "train.steps=4", "train.steps=5")
    plan = run_study(out, "only=plan", study=str(longer))
    assert plan.returncode == 2, plan.stdout[-3000:] + plan.stderr[-3000:]
    assert "plan ced/seed0: REFUSE - config changed since it was trained" in plan.stdout


@pytest.mark.parametrize("name", sorted(p.stem for p in STUDY_DIR.glob("*.yaml")))
def test_every_study_parses(name):
    for scale in ("demo", "full"):
        study = load_study(name, scale)
        assert study.jobs and all(j.name for j in study.jobs) and study.seeds


def test_symbolic_replay_lengths():
    cfg = {"variant": "ced", "vocab_size": 259, "d_model": 32, "n_heads": 2,
           "n_encoder_layers": 2, "n_decoder_layers": 3, "window": 16, "topk": 4,
           "global_from_layer": 1, "encoder_kv_groups": 1, "indexer_heads": 2,
           "indexer_dim": 8, "max_seq_len": 256}
    assert resolve_lengths([1, "W/4", "W/2", "W", "2W", "R_exact", 4], cfg) == [1, 4, 8, 16, 32, 46]
