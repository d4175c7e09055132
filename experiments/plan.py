"""The study driver's `only=plan`: every step `only=all` would run (each training run, the steps
of every registered evaluation tool in the order the driver runs them, each lm-eval read, the
report), with its action and reason, decided by the code the run itself uses (`Study.decide`
for training, `EvaluationSteps.tool_steps` and `experiments.freshness.step_decision` for the
evaluations), without doing any of it."""

from __future__ import annotations

from typing import Any

from .evaluations import LM_EVAL
from .freshness import step_decision
from .tools import OVER_MODELS, EvaluationTool, tools


def plan_study(study) -> list[dict]:
    """The plan of `study` (an `experiments.run.Study`), printed one line a step and returned
    as rows (run, action, reason). A step that reads a checkpoint trained first runs after it."""
    rows = _plan_training(study)
    pending = sorted(r["run"] for r in rows
                     if r["action"] not in ("skip", "refuse", "config_error"))
    return rows + _plan_evaluations(study, pending) + [
        plan_row("report", "run", "rebuilt from what the study holds, every run")]


def plan_row(step: str, action: str, reason: str, **extra: Any) -> dict:
    """One line of the plan, printed and returned."""
    word = action.upper().replace("_", " ")
    print(f"[study] plan {step}: {word} - {reason}", flush=True)
    return {"run": step, "action": action, "reason": reason, **extra}


def _plan_training(study) -> list[dict]:
    """The training runs: skip, train, resume, reuse, rerun, refuse or config error."""
    rows = []
    errors = study.config_errors()
    for job_name, seed, label in study.runs():
        if job_name in errors:
            rows.append(plan_row(label, "config_error", f"config error: {errors[job_name]}"))
            continue
        action, digest, reason = study.decide(job_name, seed, label)
        source = study.reusable(digest) if action == "train" else None
        if source is not None:
            action, reason = "reuse", f"the same training run is done in {source}; copy it"
        rows.append(plan_row(label, action, reason, hash=digest))
    return rows


def _plan_step(study, step: dict) -> dict:
    """The plan's line for one prepared evaluation step."""
    action, reason = step_decision(step, study.repair, study.coverage())
    return plan_row(step["key"], action, reason, hash=step["hash"])


def _plan_evaluations(study, pending: list[str]) -> list[dict]:
    """The evaluation steps: those that read a checkpoint of `pending` run after its
    training; the others are decided now, from what is on disk."""
    rows = []
    for tool in tools():
        if study.spec.evaluations.get(tool.name) is not None and study.selected(tool.name):
            rows += _plan_tool(study, tool, pending)
    real_text = study.spec.evaluations.get("real_text")
    if real_text is not None and (real_text.lm_eval_modes or real_text.lm_eval_turn_modes) \
            and study.selected(LM_EVAL):
        if pending:
            rows.append(plan_row("lm_eval", "run", f"after training {', '.join(pending)}"))
        else:
            for tasks_step, runs in study._lm_eval_steps():
                rows += [_plan_step(study, step) for step in (tasks_step, *runs)]
            left_out = study.lm_eval_others()[1]
            if left_out:
                rows.append(plan_row("lm_eval", "run", f"its tables leave out "
                                     f"{', '.join(left_out)} (not done, outside jobs=)"))
        refusal = study.lm_eval_refusal()
        if refusal:
            rows.append(plan_row("lm_eval", "refuse", refusal))
    return rows


def _plan_tool(study, tool: EvaluationTool, pending: list[str]) -> list[dict]:
    """The steps of one tool: one over every model runs after any pending training; a per
    model step runs after its own model's, and its merge (`EvaluationTool.merge`) after the
    steps it merges."""
    if tool.scope == OVER_MODELS and pending:
        refusal = study.narrowed(tool.name)
        return [plan_row(tool.name, "refuse", refusal) if refusal else
                plan_row(tool.name, "run", f"after training {', '.join(pending)}")]
    rows = [] if tool.scope == OVER_MODELS else [
        plan_row(f"{tool.name}/{label}", "run", f"after training {label}") for label in pending]
    steps, why = study.tool_steps(tool)
    rows += [_plan_step(study, step) for step in steps if step["run"] not in pending]
    if tool.merge and (steps or pending):
        rows.append(_plan_merge(study, tool, steps, pending))
    return rows or [plan_row(tool.name, "skip", why)]


def _plan_merge(study, tool: EvaluationTool, steps: list[dict], pending: list[str]) -> dict:
    """The merge of a per model tool (`EvaluationTool.merge`): decided now when its steps are
    done; else it runs after this invocation's steps and training (refused if it would read
    fewer models than it last did), or waits (skipped) for a step this invocation does not
    run (a job outside `jobs=`)."""
    merge, waiting, _ = study.merge_step(tool)
    if merge is not None and not pending:
        return _plan_step(study, merge)
    runs_now = {step["key"] for step in steps} | {f"{tool.name}/{label}" for label in pending}
    if set(waiting) <= runs_now:
        refusal = study.narrowed(tool.name)
        return (plan_row(tool.name, "refuse", refusal) if refusal else
                plan_row(tool.name, "run", "merges the steps above once they are done"))
    return plan_row(tool.name, "skip", f"waits: {', '.join(sorted(set(waiting) - runs_now))} "
                                       "not done and not run by this invocation")
