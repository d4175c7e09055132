"""Every command the README, the guides and FINDINGS.md show still runs: each
`python -m <module>` answers `--help`, each `python -m ced.train ...` line's keys are keys of
the training config, each `study=<name>` is a study, and each `make <target>` is a target of
the Makefile."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
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
    """All at once (each is a Python start-up of a few seconds)."""
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in modules()}
    failed = {}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or not (out + err).strip():
            failed[module] = (proc.returncode, err[-300:])
    assert not failed, failed


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
