"""A step over models (a merge of per model readings, a tool over every model) that last read
every trained model of a study is refused, its outputs kept, when an invocation's `seeds=`
would make it read fewer: a `seeds=[1]` given to train one more model must not replace the
study's tables with those of one seed. on_change=rerun allows it, and a model whose weights are
gone is no longer counted. Read in-process on the fabricated study of test_step_hashes (three
jobs, seeds 0 and 1, every step's done file and record written as a finished run leaves
them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.freshness import dropped_models, step_decision
from experiments.run import Study
from experiments.steps import step_record, write_stamp
from experiments.study import load_study
from experiments.tools import TOOLS

from test_step_hashes import fabricated_study


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
    step, waiting, why = study.merge_step(TOOLS["real_text"])
    assert step is not None, why
    return step


def narrowed(study: Study, seeds: list[int], on_change: str = "refuse") -> Study:
    """The same study directory, driven with `seeds=` and `on_change=` as given."""
    again = Study(load_study(str(study.out.resolve().parent / "pinned.yaml"), "demo",
                                  seeds=seeds), study.out, 1, wandb=False,
                  on_change=on_change)
    again.config_errors = study.config_errors
    again.decide = study.decide
    return again


@pytest.mark.parametrize("kind", ["divergence", "merge"])
def test_a_step_that_would_drop_trained_models_is_refused_and_keeps_its_outputs(
        tmp_path, monkeypatch, capsys, kind):
    study = fabricated_study(tmp_path, monkeypatch, "demo")
    full = over_models_step(study, kind)
    assert {"seed0", "seed1"} <= {Path(p).parent.name for p in full["reading"].paths}
    finish(full)
    assert step_decision(full)[0] == "skip"

    one_seed = narrowed(study, [1])
    step = over_models_step(one_seed, kind)
    assert step["out"] == full["out"] and step["hash"] != full["hash"]
    dropped = sorted(dropped_models({"checkpoints": full["reading"].paths}, step))
    assert dropped == sorted(f"{Path(p).parent.parent.name}/seed0"
                             for p in full["reading"].paths if Path(p).parent.name == "seed0")
    action, reason = step_decision(step)
    assert action == "refuse"
    assert "ced/seed0" in reason and "on_change=rerun" in reason and "seeds=" in reason

    # the run refuses it without running it: recorded refused, the old outputs and record kept
    def must_not_run():
        raise AssertionError("a refused step ran")
    assert not one_seed.execute(step, kind, must_not_run, {})
    assert full["done"].exists() and step_decision(full)[0] == "skip"
    assert f"{kind}: REFUSED: it read" in capsys.readouterr().out
    entry = one_seed.status[step["key"]]
    assert entry["state"] == "refused" and "ced/seed0" in entry["reason"]
    # only=plan says the same
    plan = {row["run"]: row for row in one_seed.plan()}
    assert plan[step["key"]]["action"] == "refuse"

    # on_change=rerun replaces the reading of every model with this one
    assert step_decision(step, narrowing=True)[0] == "rerun"
    rerun = over_models_step(narrowed(study, [1], on_change="rerun"), kind)
    assert {row["run"]: row["action"] for row in
            narrowed(study, [1], on_change="rerun").plan()}[rerun["key"]] == "rerun"
    # a model whose weights are gone is not one the step drops
    for label in ("ced", "yoco", "dense"):
        (tmp_path / "out" / "runs" / label / "seed0" / "final" / "model.safetensors").unlink()
    assert dropped_models({"checkpoints": full["reading"].paths}, step) == []
    assert step_decision(step)[0] == "rerun"


def test_a_per_model_step_is_never_refused_for_narrowing(tmp_path, monkeypatch):
    """A per model step records one checkpoint: a narrower seeds= does not concern it."""
    study = fabricated_study(tmp_path, monkeypatch, "demo")
    reading = study.tool_steps(TOOLS["real_text"])[0][0]
    finish(reading)
    assert dropped_models({"checkpoint": reading["reading"].paths[0]}, reading) == []
    (reading["done"]).unlink()
    assert step_decision(reading)[0] == "run"


def test_lm_evals_tables_are_not_rewritten_without_a_model_they_hold(tmp_path, monkeypatch):
    """lm-eval's tables (no stamp: their outcomes name the models) held ced/seed0 and
    ced/seed1; `seeds=[1]` would rewrite them from seed 1's runs alone: refused, by the run
    and by only=plan, unless the left-out model's runs are stale (the tables leave those out
    and say so), its weights are gone, or on_change=rerun."""
    import pandas as pd
    from evals.real_text import LM_EVAL_OUTCOMES

    study = fabricated_study(tmp_path, monkeypatch, "demo")
    held = study.out / "real_text" / LM_EVAL_OUTCOMES
    held.parent.mkdir(parents=True)
    pd.DataFrame({"run": ["ced/seed0", "ced/seed1"], "correct": [1, 0]}).to_csv(held,
                                                                                 index=False)
    root = study.out / "real_text" / "lm_eval"
    seed1_run = [root / "ced" / "seed1" / "ced_code" / "full"]
    assert study.lm_eval_refusal([root / "ced" / f"seed{s}" / "ced_code" / "full"
                                  for s in (0, 1)], []) == ""
    one_seed = narrowed(study, [1])
    reason = one_seed.lm_eval_refusal(seed1_run, [])
    assert "ced/seed0" in reason and "ced/seed1" not in reason and "on_change=rerun" in reason
    plan = [row for row in one_seed.plan() if row["run"] == "lm_eval"]
    assert [row["action"] for row in plan] == ["refuse"] and plan[0]["reason"] == reason
    assert one_seed.lm_eval_refusal(seed1_run, ["lm_eval/ced/seed0/ced_code/full"]) == ""
    assert narrowed(study, [1], on_change="rerun").lm_eval_refusal(seed1_run, []) == ""
    (study.out / "runs" / "ced" / "seed0" / "final" / "model.safetensors").unlink()
    assert one_seed.lm_eval_refusal(seed1_run, []) == ""
