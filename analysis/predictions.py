"""Registered predictions that cannot move: checked against git and the study's provenance.

A study's prediction lives in `findings/predictions/<study>.md`. It is committed before the
first run it predicts and never edited after: amendments are appended, each with its date and
reason. `check(repo, path, invocations)` says whether the record shows that:

  registered   the file exists at the commit of the study's first invocation (the code that
               trained the first model already held the prediction); where that commit is
               unknown, the file's first commit is older than the first invocation's start
  untouched    every later commit that changed the file only appended to it: the text as
               registered is a prefix of each later version (an amendment), and the working
               tree holds no uncommitted change to it

An edit after registration (a changed or removed line, a rewrite) is listed with its commit,
date and subject, and the prediction is flagged. `python -m analysis.findings` runs the check for
the study it reads and writes `prediction_check.json` beside its tables.

    python -m analysis.predictions findings/predictions/ladder.md --provenance findings/ladder/provenance.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

PREDICTION_DIR = Path("findings") / "predictions"


@dataclass
class Change:
    """One commit that changed a prediction file."""

    commit: str
    date: str          # committer date, ISO 8601
    subject: str
    appended: bool     # the text before it is a prefix of the text after it


@dataclass
class PredictionCheck:
    """What git says of a prediction file against the study's first run (see module doc)."""

    path: str
    first_run: str | None                 # ISO start of the study's first invocation
    first_run_commit: str | None
    registered_commit: str | None = None  # the last commit before the first run that changed it
    registered: bool = False
    untouched: bool = False
    edits_after: list[Change] = field(default_factory=list)     # changes that were not appends
    amendments: list[Change] = field(default_factory=list)      # appends after the first run
    uncommitted: bool = False
    problem: str = ""                     # why the check could not be made, if it could not

    @property
    def ok(self) -> bool:
        """Registered before the first run and never edited after it."""
        return self.registered and self.untouched and not self.problem

    def line(self) -> str:
        """One line for logs and findings.md."""
        if self.problem:
            return f"prediction {self.path}: not checked ({self.problem})"
        if self.ok:
            extra = f", {len(self.amendments)} amendment(s) appended" if self.amendments else ""
            return (f"prediction {self.path}: registered at {self.registered_commit[:10]} before "
                    f"the first run ({self.first_run}), never edited after{extra}")
        why = []
        if not self.registered:
            why.append("not in the tree when the first run started")
        why += [f"edited at {c.commit[:10]} ({c.date}: {c.subject})" for c in self.edits_after]
        if self.uncommitted:
            why.append("uncommitted changes in the working tree")
        return f"prediction {self.path}: FLAGGED: " + "; ".join(why)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "line": self.line()}


def _git(repo: Path, *args: str) -> str:
    """stdout of a git command in `repo`; a RuntimeError with git's message on failure."""
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                           else f"git {' '.join(args)} failed")
    return done.stdout


def _when(text: str) -> datetime:
    """An ISO 8601 time with offset (git's %cI, the driver's `started`, +0000 or +00:00)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def first_invocation(invocations: list[dict]) -> dict | None:
    """The invocation of a study's provenance that started first (None: none with a start)."""
    timed = [i for i in invocations if i.get("started")]
    return min(timed, key=lambda i: _when(i["started"])) if timed else None


def check(repo: Path, path: Path, invocations: list[dict]) -> PredictionCheck:
    """Check prediction file `path` (relative to `repo`, or absolute inside it) against the
    study's `invocations` (provenance.json / summary.json: dicts with `started` and `commit`).
    Never raises for a missing repository or file: the reason goes to `problem`."""
    repo = Path(repo).resolve()
    rel = Path(path).resolve().relative_to(repo) if Path(path).is_absolute() else Path(path)
    first = first_invocation(invocations)
    result = PredictionCheck(path=str(rel), first_run=first and first["started"],
                             first_run_commit=first and first.get("commit"))
    if first is None:
        result.problem = "the study's provenance names no run start"
        return result
    try:
        log = _git(repo, "log", "--follow", "--format=%H%x1f%cI%x1f%s", "--", str(rel))
    except (RuntimeError, OSError) as exc:
        result.problem = f"git: {exc}"
        return result
    history = [line.split("\x1f") for line in log.splitlines() if line.strip()][::-1]
    if not history:
        result.problem = "the file was never committed"
        return result
    start = _when(first["started"])
    commit = result.first_run_commit
    if commit and _in_tree(repo, commit, rel):
        before = [h for h in history if _is_ancestor(repo, h[0], commit)]
    else:
        before = [h for h in history if _when(h[1]) <= start]
    result.registered = bool(before)
    result.registered_commit = before[-1][0] if before else None
    previous = _show(repo, before[-1][0], rel) if before else ""
    for sha, date, subject in [h for h in history if h not in before]:
        text = _show(repo, sha, rel)
        change = Change(commit=sha, date=date, subject=subject,
                        appended=bool(before) and text.startswith(previous))
        (result.amendments if change.appended else result.edits_after).append(change)
        previous = text
    result.uncommitted = bool(_git(repo, "status", "--porcelain", "--", str(rel)).strip())
    result.untouched = not result.edits_after and not result.uncommitted
    return result


def _in_tree(repo: Path, commit: str, rel: Path) -> bool:
    try:
        _git(repo, "cat-file", "-e", f"{commit}:{rel.as_posix()}")
        return True
    except RuntimeError:
        return False


def _is_ancestor(repo: Path, ancestor: str, commit: str) -> bool:
    done = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=repo,
                          capture_output=True)
    return done.returncode == 0


def _show(repo: Path, commit: str, rel: Path) -> str:
    try:
        return _git(repo, "show", f"{commit}:{rel.as_posix()}")
    except RuntimeError:      # the file was removed in that commit
        return ""


def prediction_for(repo: Path, study: str) -> Path | None:
    """`findings/predictions/<study>.md` under `repo` if it exists."""
    path = Path(repo) / PREDICTION_DIR / f"{study}.md"
    return path if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.predictions", description=(
        "Check that a registered prediction was committed before the study's first run and "
        "only appended to after it."))
    parser.add_argument("prediction", help="findings/predictions/<study>.md")
    parser.add_argument("--provenance", required=True, help=(
        "the study's provenance.json (analysis.findings) or summary.json (the study driver)"))
    parser.add_argument("--repo", default=".", help="the git repository (default: .)")
    args = parser.parse_args(argv)
    try:
        invocations = json.loads(Path(args.provenance).read_text()).get("invocations", [])
    except (OSError, ValueError) as exc:
        print(f"error: --provenance {args.provenance}: {exc}", file=sys.stderr)
        return 2
    result = check(Path(args.repo), Path(args.prediction), invocations)
    print(result.line())
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
