"""lm-evaluation-harness integration: importing this package registers `--model ced`
(`CEDLM`, scored on the inference-engine path); `evals.lmeval.tasks.write_tasks` writes task
YAMLs + JSONL data for the edge-case families. Shell: `python -m evals.lmeval --model ced ...`
is lm_eval's own CLI with the model registered; see evals/tasks/README.md."""

from .model import CEDLM, build_mode


def __getattr__(name):
    if name == "write_tasks":
        # lazy, so that `python -m evals.lmeval.tasks` runs cleanly: imported here at the top,
        # the module would already be loaded when runpy runs it as __main__
        from .tasks import write_tasks
        return write_tasks
    raise AttributeError(name)


__all__ = ["CEDLM", "build_mode", "write_tasks"]
