"""The study driver's `only=plan`: every step `only=all` would run (each training run, the
divergence, each suite, each erf, the real-text reading, each lm-eval read, the report), with its action
and reason, decided by the code the run itself uses (`Study.decide` for training,
`experiments.freshness.step_decision` for the evaluations), without doing any of it."""

from __future__ import annotations

from typing import Any

from .freshness import step_decision


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


def _plan_step(study, step: dict | None, none: tuple[str, str] = ("", "")) -> dict:
    """The plan's line for one prepared evaluation step, or (`none`: its name and why) for a
    step that has nothing to read."""
    if step is None:
        return plan_row(none[0], "skip", none[1])
    action, reason = step_decision(step, study.repair)
    return plan_row(step["key"], action, reason, hash=step["hash"])


def _plan_evaluations(study, pending: list[str]) -> list[dict]:
    """The evaluation steps: those that read a checkpoint of `pending` run after its
    training; the others are decided now, from what is on disk."""
    rows, after = [], f"after training {', '.join(pending)}"
    spec = study.spec
    if spec.divergence is not None:
        step, why = (None, "") if pending else study._divergence_step()
        rows.append(plan_row("divergence", "run", after) if pending else
                    _plan_step(study, step, ("divergence", why)))
    if spec.suite is not None:
        rows += [plan_row(f"suite/{label}", "run", f"after training {label}")
                 for label in pending]
        rows += [_plan_step(study, step) for step in study._suite_steps(study.checkpoints())
                 if step["run"] not in pending]
    if spec.erf is not None:
        rows += [plan_row(f"erf/{label}", "run", f"after training {label}")
                 for label in pending]
        rows += [_plan_step(study, step) for step in study._erf_steps(study.checkpoints())
                 if step["label"] not in pending]
    real_text = spec.real_text
    if real_text is not None:
        rows.append(plan_row("real_text", "run", after) if pending else
                    _plan_step(study, study._real_text_step(),
                               ("real_text", "no trained checkpoint")))
    if real_text is not None and (real_text.lm_eval_modes or real_text.lm_eval_turn_modes):
        if pending:
            rows.append(plan_row("lm_eval", "run", after))
        else:
            for tasks_step, runs in study._lm_eval_steps():
                rows += [_plan_step(study, step) for step in (tasks_step, *runs)]
    return rows
