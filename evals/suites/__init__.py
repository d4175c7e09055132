"""The edge-case suite: task families built to find where bounded replay hurts (generators in
`families`, reusing `ced.data`), a runner scoring them on the engine path for every inference
mode (`runner`), and paired statistics (`stats`). CLI: `python -m evals.suites --help`."""

from .families import (FAMILIES, Family, Point, SuiteSettings, build_documents, describe,
                       prompt_ids, read_jsonl, target_ids, write_jsonl)
from .runner import (SuiteConfig, evaluate_documents, load_checkpoint, make_engine,
                     paired_tests, run_suite, suite_mode_values, suite_modes, summarize)
from .stats import holm, mcnemar_exact, wilson_interval

__all__ = ["FAMILIES", "Family", "Point", "SuiteSettings", "build_documents", "describe",
           "prompt_ids", "target_ids", "read_jsonl", "write_jsonl", "SuiteConfig", "evaluate_documents",
           "load_checkpoint", "make_engine", "paired_tests", "run_suite", "suite_mode_values",
           "suite_modes", "summarize", "holm", "mcnemar_exact", "wilson_interval"]
