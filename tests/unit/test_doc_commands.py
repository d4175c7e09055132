"""Every command the README, the guides and FINDINGS.md show still runs: each
`python -m <module>` answers `--help`, each `python -m ced.train ...` line's keys are keys of
the training config, each `study=<name>` is a study, and each `make <target>` is a target of
the Makefile."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "FINDINGS.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md", ROOT / "evals" / "suites" / "README.md",
        ROOT / "evals" / "tasks" / "README.md"]
MODULE = re.compile(r"(?:\.venv/bin/)?python -m ([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "OMP_NUM_THREADS": "1"}


def current_text(path: Path) -> str:
    """What a document says about the code as it is now. FINDINGS.md is a record: each section
    quotes the commands its numbers were made with, at their commits, and those stay as they
    were run; only its Reproduction section speaks for the current code."""
    text = path.read_text()
    if path.name == "FINDINGS.md":
        text = text[text.index("\n## Reproduction"):]
        text = text[:text.find("\n## ", 1)] if "\n## " in text[1:] else text
    return text


def doc_lines() -> list[tuple[str, str]]:
    """(file, line) of every line of the documents (of FINDINGS.md, its Reproduction section),
    with backslash continuations joined."""
    out = []
    for path in DOCS:
        text = current_text(path).replace("\\\n", " ")
        out += [(path.name, line) for line in text.splitlines()]
    return out


def modules() -> list[str]:
    return sorted({m for _, line in doc_lines() for m in MODULE.findall(line)})


def test_the_documents_show_commands_at_all():
    assert {"ced.train", "experiments.run", "analysis.findings", "analysis.depth"} <= set(modules())


def test_every_documented_module_answers_help():
    """Each module's `__main__` with `--help`, one after another in one fresh interpreter (see
    `answer_help` below): the imports are paid once, where a process per module paid them 21
    times. Import order and cycles are test_layering's; the entry points themselves run in the
    integration tests."""
    done = subprocess.run([sys.executable, __file__, *modules()], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert not failed, failed


def answer_help(names: list[str]) -> dict[str, str]:
    """Run `python -m <name> --help` for each name in this process; name -> why it failed
    (an exit code other than 0, an exception, or no output at all)."""
    failed = {}
    for name in names:
        out, err, code = io.StringIO(), io.StringIO(), 0
        sys.argv = [name, "--help"]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")   # runpy: a module already imported as a dependency
            try:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code or 0
            except Exception as exc:         # noqa: BLE001 - reported per module
                code = repr(exc)
        if code != 0 or not (out.getvalue() + err.getvalue()).strip():
            failed[name] = f"exit {code}: {err.getvalue()[-300:]}"
    return failed


def _train_args(line: str) -> list[str] | None:
    """The overrides of a `python -m ced.train ...` command in a line (up to a comment, a
    pipe or the end of an inline code span), or None."""
    match = re.search(r"python -m ced\.train\b([^`#|;]*)", line)
    if match is None:
        return None
    try:
        words = shlex.split(match.group(1))
    except ValueError:      # an unbalanced quote in prose
        return None
    return [w for w in words if "=" in w and not w.startswith(("-", "[")) and "<" not in w
            and "..." not in w and not w.startswith(("hydra", "+hydra"))]


def test_every_documented_training_command_uses_keys_of_the_config():
    from ced.cli.train import check_overrides, expand_experiment, free_form_overrides
    from ced.train_config import ConfigError
    bad = []
    for name, line in doc_lines():
        args = _train_args(line)
        if not args:
            continue
        try:
            check_overrides(free_form_overrides(expand_experiment(args)))
        except ConfigError as exc:
            bad.append(f"{name}: {line.strip()[:90]} -> {exc}")
    assert not bad, "\n".join(bad)


def test_every_documented_study_exists():
    known = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    named = {m for _, line in doc_lines() if "experiments.run" in line or "make study" in line
             for m in re.findall(r"\b(?:study|STUDY)=([a-z_]+)\b", line)}
    assert named and named <= known, named - known


def test_every_documented_make_target_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {t for _, line in doc_lines() for t in MAKE.findall(line)}
    assert named and named <= targets, named - targets


if __name__ == "__main__":          # the interpreter of test_every_documented_module_answers_help
    sys.path.insert(0, str(ROOT))
    print(json.dumps(answer_help(sys.argv[1:])))
