"""Code, configs and tests carry no history: no "issue N" reference, no "this session", no
measured-on date. Dated measurements live in findings/ and benchmarks/README.md, where their
command and commit stand beside them; git log is the changelog."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("ced", "experiments", "evals", "analysis", "conf", "tests", "benchmarks", "notebooks")
SUFFIXES = {".py", ".yaml", ".yml", ".ipynb"}
HISTORY = re.compile(r"\bissue \d+|\bthis session\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
# a fixture's fabricated date (a git repository made by the test), not a measurement
THIS = Path(__file__).resolve()       # its own examples below
ALLOWED = {("tests/unit/test_predictions.py", "## Amendment (2000-01-01)")}


def test_no_issue_numbers_sessions_or_dates_in_code_configs_and_tests():
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix not in SUFFIXES or "results" in path.parts or path == THIS:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if HISTORY.search(line) and not any(rel == f and s in line for f, s in ALLOWED):
                    found.append(f"{rel}:{number}: {line.strip()[:100]}")
    assert not found, "history in code (move it to findings/ or benchmarks/README.md):\n" + \
        "\n".join(found)


def test_the_pattern_catches_what_it_is_for():
    for line in ("# measured 2026-12-04 on two cores", '"""Issue 11, class 5: ...',
                 "# added this session"):
        assert HISTORY.search(line), line
    for line in ("a multi-turn session of two turns", "tissue 4", "see docs/api.md"):
        assert not HISTORY.search(line), line
