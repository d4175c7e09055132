"""A step over models (a merge of per model readings, a tool over every model, lm-eval's
tables) that last read every trained model of a study is refused, its outputs kept, when an
invocation would make it read fewer: a `seeds=[1]` given to train one more model must not
replace the study's tables with those of one seed (refused, as a training run whose config
changed is). on_change=rerun allows it; a model whose weights are gone no longer counts; the
comparison is by model, so a study directory copied elsewhere is not narrowed. Read in-process
on the fabricated study of test_step_hashes (three jobs, seeds 0 and 1, every step's done file
and record written as a finished run leaves them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from evals.lm_eval_outcomes import LM_EVAL_OUTCOMES
from experiments.freshness import recorded_models, step_decision
from experiments.run import Study
from experiments.steps import step_record, write_stamp
from experiments.study import load_study
from experiments.tools import TOOLS

from test_step_hashes import fabricated_study

JOBS = ("ced", "yoco", "dense")


def finish(step: dict) -> None:
    """Leave `step` as its run does when it ends: its done file and its record (with the
    checkpoints a step over models read)."""
    step["done"].parent.mkdir(parents=True, exist_ok=True)
    step["done"].write_text("")
    paths = step["reading"].paths
    write_stamp(step["out"], step_record(step, **(
        {"checkpoints": paths} if len(paths) > 1 else {"checkpoint": paths[0]})))


def over_models_step(study: Study, kind: str) -> dict:
    """The divergence step (a tool over every model) or real_text's merge, as it would run
    now; for the merge, every per model reading it merges is finished first."""
    if kind == "divergence":
        (step,), _ = study.tool_steps(TOOLS["divergence"])
        return step
    for reading in study.tool_steps(TOOLS["real_text"])[0]:
        finish(reading)
    step, _, why = study.merge_step(TOOLS["real_text"])
    assert step is not None, why
    return step


def narrowed(study: Study, seeds: list[int], on_change: str = "refuse",
             out: Path | None = None, training: bool = False) -> Study:
    """The study directory `out` (the fabricated one), driven with `seeds=` and `on_change=`
    as given; with `training`, every run of those seeds still to train."""
    path = study.out.resolve().parent / "pinned.yaml"
    again = Study(load_study(str(path), "demo", seeds=seeds), out or study.out, 1,
                  wandb=False, on_change=on_change)
    again.config_errors = study.config_errors
    again.decide = ((lambda job, seed, label: ("train", "", "not trained yet")) if training
                    else study.decide)
    return again


def plan_actions(study: Study) -> dict[str, str]:
    return {row["run"]: row["action"] for row in study.plan()}


@pytest.mark.parametrize("kind", ["divergence", "merge"])
def test_a_step_that_would_drop_trained_models_is_refused_and_keeps_its_outputs(
        tmp_path, monkeypatch, capsys, kind):
    study = fabricated_study(tmp_path, monkeypatch, "demo")
    full = over_models_step(study, kind)
    read = sorted(full["reading"].checkpoints)
    assert {label.split("/")[1] for label in read} == {"seed0", "seed1"}
    finish(full)
    assert sorted(recorded_models({"checkpoints": full["reading"].paths})) == read
    assert step_decision(full, coverage=study.coverage())[0] == "skip"

    one_seed = narrowed(study, [1])
    step = over_models_step(one_seed, kind)
    assert step["out"] == full["out"] and step["hash"] != full["hash"]
    assert one_seed.coverage().dropped(read) == [label for label in read if "seed0" in label]
    action, reason = step_decision(step, coverage=one_seed.coverage())
    assert action == "refuse"
    assert "ced/seed0" in reason and "ced/seed1" not in reason.split("leave out")[1]
    assert "seeds=[0,1]" in reason and "only=eval on_change=rerun" in reason
    assert step_decision(step)[0] == "rerun"          # without coverage: the old decision

    # the run refuses it without running it: recorded refused, outputs and record kept
    def must_not_run():
        raise AssertionError("a refused step ran")
    assert not one_seed.execute(step, kind, must_not_run, {})
    assert full["done"].exists() and step_decision(full)[0] == "skip"
    assert f"{kind}: REFUSED: its last run read" in capsys.readouterr().out
    entry = one_seed.status[step["key"]]
    assert entry["state"] == "refused" and entry["reason"] == reason
    assert plan_actions(one_seed)[step["key"]] == "refuse"
    # ... and so does only=plan while seed 1's models are still to train
    assert plan_actions(narrowed(study, [1], training=True))[step["key"]] == "refuse"
    if kind == "merge":
        # a merge that waits for a reading of this invocation keeps the wider merge too
        (one_seed.out / "real_text" / "ced" / "seed1" / TOOLS["real_text"].done).unlink()
        one_seed._merge_tool(TOOLS["real_text"])
        assert one_seed.status["real_text"]["state"] == "skipped"
        assert full["done"].exists() and step_decision(full)[0] == "skip"
        finish(next(s for s in one_seed.tool_steps(TOOLS["real_text"])[0]
                    if s["label"] == "ced/seed1"))

    # on_change=rerun replaces the reading of every model with this one
    rerun = narrowed(study, [1], on_change="rerun")
    assert rerun.coverage() is None
    assert plan_actions(rerun)[over_models_step(rerun, kind)["key"]] == "rerun"
    assert plan_actions(narrowed(study, [1], on_change="rerun", training=True))[
        step["key"]] == "run"
    # a model whose weights are gone is not one the step drops
    for job in JOBS:
        (study.out / "runs" / job / "seed0" / "final" / "model.safetensors").unlink()
    assert step_decision(step, coverage=one_seed.coverage())[0] == "rerun"


def test_a_copied_study_reads_alike_and_a_per_model_step_is_never_narrowed(tmp_path,
                                                                           monkeypatch):
    """Records hold the paths of the copied-from directory: compared by model, the copy's
    finished step is not narrowed (a changed input reruns it), and narrowed it is refused.
    A per model step whose inputs changed is rerun under a narrower seeds=."""
    study = fabricated_study(tmp_path, monkeypatch, "demo")
    full = over_models_step(study, "divergence")
    finish(full)
    write_stamp(full["out"], {**step_record(full, checkpoints=full["reading"].paths),
                              "hash": "older"})
    copy = tmp_path / "copy"
    shutil.copytree(study.out, copy)
    same = narrowed(study, [0, 1], out=copy.resolve())
    step = over_models_step(same, "divergence")
    assert step_decision(step, coverage=same.coverage())[0] == "rerun"
    narrower = narrowed(study, [1], out=copy.resolve())
    assert step_decision(over_models_step(narrower, "divergence"),
                         coverage=narrower.coverage())[0] == "refuse"
    reading = next(s for s in narrower.tool_steps(TOOLS["real_text"])[0]
                   if s["label"] == "ced/seed1")
    finish(reading)
    write_stamp(reading["out"], {**step_record(reading, checkpoint=reading["reading"].paths[0]),
                                 "hash": "older"})
    assert step_decision(reading, coverage=narrower.coverage())[0] == "rerun"


def test_lm_evals_tables_are_not_rewritten_without_a_model_they_hold(tmp_path, monkeypatch,
                                                                    capsys):
    """lm-eval's tables (no record: their outcomes name the models) held ced/seed0 and
    ced/seed1; `seeds=[1]` would rewrite them from seed 1's runs alone: the run reads seed
    1's lm-eval and refuses the tables (not written), only=plan says so; on_change=rerun, or
    seed 0's weights gone, lets them be written."""
    import analysis.real_text

    study = fabricated_study(tmp_path, monkeypatch, "demo")
    held = study.out / "real_text" / LM_EVAL_OUTCOMES
    held.parent.mkdir(parents=True)
    pd.DataFrame({"run": ["ced/seed0", "ced/seed1"], "correct": [1, 0]}).to_csv(held,
                                                                                 index=False)
    assert study.lm_eval_refusal() == ""
    one_seed = narrowed(study, [1])
    reason = one_seed.lm_eval_refusal()
    assert "leave out ced/seed0," in reason and "seeds=[0,1]" in reason

    ran, written = [], []
    for driven in (one_seed, narrowed(study, [1], on_change="rerun")):
        monkeypatch.setattr(driven, "_code_tasks", lambda step: True)
        monkeypatch.setattr(driven, "_lm_eval_run", lambda step: ran.append(step["key"]))
    monkeypatch.setattr(analysis.real_text, "write_lm_eval", lambda *a, **k: written.append(
        k["runs"]) or {"lm_eval": held})
    one_seed.lm_eval()
    assert ran and all("/seed1/" in key for key in ran) and written == []
    assert one_seed.status["lm_eval"]["state"] == "refused"
    assert f"lm_eval: REFUSED: {reason}" in capsys.readouterr().out
    assert [row["action"] for row in one_seed.plan() if row["run"] == "lm_eval"] == ["refuse"]
    assert [row["action"] for row in narrowed(study, [1], training=True).plan()
            if row["run"] == "lm_eval"] == ["run", "refuse"]

    rerun = narrowed(study, [1], on_change="rerun")
    monkeypatch.setattr(rerun, "_code_tasks", lambda step: True)
    monkeypatch.setattr(rerun, "_lm_eval_run", lambda step: None)
    rerun.lm_eval()
    assert len(written) == 1 and rerun.status["lm_eval"]["state"] == "ok"
    (study.out / "runs" / "ced" / "seed0" / "final" / "model.safetensors").unlink()
    assert one_seed.lm_eval_refusal() == ""
