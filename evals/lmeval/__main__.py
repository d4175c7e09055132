"""`python -m evals.lmeval <lm_eval arguments>`: lm_eval's CLI with `--model ced` registered.

    python -m evals.lmeval --model ced --model_args checkpoint=/path/final,replay=8 \
        --include_path /tmp/ced_tasks --tasks ced_recall ced_needle
    python -m evals.lmeval write-tasks --checkpoint /path/final --replay 8 --out /tmp/ced_tasks
    python -m evals.lmeval write-code-tasks --checkpoint /path/final --out /tmp/code_tasks

lm_eval 0.4.13 finds models only in its registry (no entry-point/plugin discovery), and its
CLI resolves `--model` before it loads task code, so the bare `lm_eval` command cannot see a
model that nothing imported. This wrapper imports the registration and hands over.
"""

import argparse
import os
import sys
from pathlib import Path

from ced.writable import OutputDirError, check_output_dir
from evals.lmeval.model import ModelArgsError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _index_included_tasks_only(argv: list[str]) -> None:
    """lm-eval's CLI indexes every task file it ships (thousands of YAMLs: seconds per run,
    most of a small run's time) before it looks up the tasks asked for. When every --tasks name
    is a task or group of --include_path (as the ced tasks are), its task manager indexes that
    path alone: the same tasks are found, and nothing else is read."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tasks", "-t", nargs="*", default=[])
    parser.add_argument("--include_path", default=None)
    known, _ = parser.parse_known_args(argv)
    asked = {name for item in known.tasks for name in item.split(",") if name}
    if not asked or known.include_path is None:
        return
    # lazy: lm_eval.tasks costs ~0.4 s to import, and only a run with --include_path needs it
    import lm_eval.tasks

    shipped = lm_eval.tasks.TaskManager

    class IncludedOnly(shipped):
        def __init__(self, *args, include_defaults: bool = False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    if asked <= set(IncludedOnly(include_path=known.include_path).all_tasks):
        lm_eval.tasks.TaskManager = IncludedOnly


def _check_output_path(argv: list[str]) -> None:
    """--output_path (a directory, or a .json file in one) checked before the model loads and
    the tasks run: one line and exit 2 when it cannot be written, instead of lm-eval's
    traceback at the end of the evaluation."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_path", "-o", default=None)
    known, _ = parser.parse_known_args(argv)
    if known.output_path is None:
        return
    path = Path(known.output_path)
    try:
        check_output_dir(path.parent if path.suffix == ".json" else path, "--output_path")
    except OutputDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    if sys.argv[1:2] == ["write-tasks"]:           # python -m evals.lmeval write-tasks ...
        # lazy: evals.lmeval.tasks costs ~0.2 s to import, and only this sub-command needs it
        from evals.lmeval.tasks import main as write_tasks_main
        sys.exit(write_tasks_main(sys.argv[2:]))
    if sys.argv[1:2] == ["write-code-tasks"]:      # the real-text tasks of held-out files
        # lazy: it imports evals.lmeval.tasks (~0.2 s), and only this sub-command needs it
        from evals.lmeval.code_tasks import main as write_code_tasks_main
        sys.exit(write_code_tasks_main(sys.argv[2:]))
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        # lm-eval's own help follows; it cannot know our extra sub-command.
        print("python -m evals.lmeval write-tasks --checkpoint DIR --replay N [N ...] --out DIR "
              "[--examples K] [--families F ...] [--per-point]\n"
              "    writes the edge-case families as lm-eval tasks (ced_<family>, groups "
              "ced_suite and ced_suite_gen); `write-tasks --help` for every option.\n"
              "python -m evals.lmeval write-code-tasks --checkpoint DIR --out DIR "
              "[--examples K] [--context B]\n"
              "    writes tasks from held-out stdlib files (group ced_code; ced_code_turn for "
              "the multi-turn modes); `write-code-tasks --help`.\n"
              "python -m evals.lmeval --model ced --model_args checkpoint=DIR,replay=N "
              "--include_path DIR --tasks ced_suite\n"
              "    lm-eval's CLI with --model ced registered; its options:\n", flush=True)
    _check_output_path(sys.argv[1:])
    import evals.lmeval  # noqa: F401  registers --model ced
    # lazy: lm-eval's CLI module is for this path only; the sub-commands above exit without it
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"
    _index_included_tasks_only(sys.argv[1:])
    try:
        cli_evaluate()
    except ModelArgsError as exc:   # a typo in --model_args, a bad mode or checkpoint: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
