"""A registered prediction is checked against a fabricated git history (analysis.predictions):
committed before the study's first run and only appended to after it, or flagged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from analysis import findings, predictions

PATH = Path("findings/predictions/toy.md")
TEXT = "# Prediction: toy\n\n1. N = W loses more than 0.1 at rung 3.\n"


def _git(repo: Path, *args: str, when: str = "2000-01-01T01:00:00+00:00") -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo: Path, text: str, message: str, when: str) -> str:
    (repo / PATH).parent.mkdir(parents=True, exist_ok=True)
    (repo / PATH).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message, when=when)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("toy\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-q", "-m", "start", when="2000-01-01T00:00:00+00:00")
    return tmp_path


def _run(commit: str | None, started: str) -> list[dict]:
    return [{"command": "python -m experiments.run study=toy", "commit": commit,
             "started": started}]


def test_registered_then_amended_is_ok(repo):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    runs = _run(registered, "2000-01-01T01:05:00+0000")
    _commit(repo, TEXT + "\n## Amendment (2000-01-01): the interaction job added\n",
            "amend", "2000-01-01T03:00:00+00:00")
    result = predictions.check(repo, PATH, runs)
    assert result.ok, result.line()
    assert result.registered_commit == registered
    assert len(result.amendments) == 1 and not result.edits_after
    assert "1 amendment" in result.line()


def test_edit_after_the_first_run_is_flagged(repo):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    _commit(repo, TEXT.replace("rung 3", "rung 4"), "move the goalposts",
            "2000-01-01T03:00:00+00:00")
    result = predictions.check(repo, PATH, _run(registered, "2000-01-01T01:05:00+0000"))
    assert not result.ok
    assert [c.subject for c in result.edits_after] == ["move the goalposts"]
    assert "FLAGGED" in result.line() and "move the goalposts" in result.line()


def test_an_edit_before_the_first_run_is_part_of_the_registration(repo):
    _commit(repo, TEXT, "draft", "2000-01-01T01:00:00+00:00")
    final = _commit(repo, TEXT.replace("0.1", "0.2"), "register", "2000-01-01T01:30:00+00:00")
    result = predictions.check(repo, PATH, _run(final, "2000-01-01T02:00:00+0000"))
    assert result.ok and result.registered_commit == final


def test_registered_after_the_first_run_is_flagged(repo):
    first_run_commit = _git(repo, "rev-parse", "HEAD")      # the code that trained first
    _commit(repo, TEXT, "register late", "2000-01-01T04:00:00+00:00")
    result = predictions.check(repo, PATH, _run(first_run_commit, "2000-01-01T01:05:00+0000"))
    assert not result.registered and not result.ok
    assert "not in the tree" in result.line()


def test_without_a_commit_the_start_time_decides(repo):
    _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    assert predictions.check(repo, PATH, _run(None, "2000-01-01T01:05:00+0000")).ok
    assert not predictions.check(repo, PATH, _run(None, "2000-01-01T00:30:00+0000")).ok


def test_uncommitted_change_is_flagged(repo):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    (repo / PATH).write_text(TEXT + "an unrecorded line\n")
    result = predictions.check(repo, PATH, _run(registered, "2000-01-01T01:05:00+0000"))
    assert result.uncommitted and not result.ok


def test_the_earliest_invocation_is_the_first_run(repo):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    runs = [*_run(registered, "2000-01-01T05:00:00+0000"), *_run(None, "2000-01-01T00:30:00+0000")]
    result = predictions.check(repo, PATH, runs)
    assert result.first_run == "2000-01-01T00:30:00+0000" and not result.ok


def test_no_provenance_or_file_is_said_not_raised(repo):
    assert "no run start" in predictions.check(repo, PATH, []).problem
    missing = predictions.check(repo, PATH, _run(None, "2000-01-01T01:05:00+0000"))
    assert missing.problem == "the file was never committed" and not missing.ok


def test_evals_findings_checks_the_studys_prediction(repo):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    info = {"study": "toy", "invocations": _run(registered, "2000-01-01T01:05:00+0000")}
    out = repo / "findings" / "toy"
    out.mkdir(parents=True)
    assert findings.check_prediction(info, out).ok
    _commit(repo, "rewritten\n", "rewrite", "2000-01-01T03:00:00+00:00")
    assert not findings.check_prediction(info, out).ok
    assert findings.check_prediction({**info, "study": "other"}, out) is None


def test_a_real_text_studys_findings_end_with_its_prediction_check(repo):
    """A real-text study is published by analysis.real_text.publish; analysis.findings adds
    its prediction's check after it (prediction_check.json and the last section)."""
    import json
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    info = {"study": "toy", "invocations": _run(registered, "2000-01-01T01:05:00+0000")}
    out = repo / "findings" / "toy"
    out.mkdir(parents=True)
    (out / "findings.md").write_text("# toy\n")
    written = findings.add_prediction_check(info, out, {"findings": out / "findings.md"})
    assert json.loads(written["prediction_check"].read_text())["ok"]
    text = (out / "findings.md").read_text()
    assert text.startswith("# toy\n") and "## Registered prediction" in text
    assert "prediction_check" not in findings.add_prediction_check(
        {**info, "study": "other"}, out, {"findings": out / "findings.md"})


def test_cli_exit_codes(repo, tmp_path_factory):
    registered = _commit(repo, TEXT, "register", "2000-01-01T01:00:00+00:00")
    prov = tmp_path_factory.mktemp("p") / "provenance.json"
    import json
    prov.write_text(json.dumps({"invocations": _run(registered, "2000-01-01T01:05:00+0000")}))
    assert predictions.main([str(PATH), "--provenance", str(prov), "--repo", str(repo)]) == 0
    _commit(repo, "rewritten\n", "rewrite", "2000-01-01T03:00:00+00:00")
    assert predictions.main([str(PATH), "--provenance", str(prov), "--repo", str(repo)]) == 1


def test_the_cli_checks_a_real_text_studys_prediction(tmp_path, monkeypatch):
    """`python -m analysis.findings --study DIR` on a real-text study (real_text/, no suite/)
    publishes it and then checks its prediction: prediction_check.json beside findings.md."""
    import json
    study, out = tmp_path / "study", tmp_path / "out"
    (study / "real_text").mkdir(parents=True)

    def publish(study_dir, target):
        target.mkdir(parents=True, exist_ok=True)
        (target / "findings.md").write_text("# published\n")
        return {"findings": target / "findings.md"}

    class Checked:
        def to_dict(self):
            return {"ok": True}

        def line(self):
            return "prediction toy: registered before the first run"

    monkeypatch.setattr(findings, "publish", publish)
    monkeypatch.setattr(findings, "check_prediction", lambda info, target: Checked())
    assert findings.main(["--study", str(study), "--out", str(out)]) == 0
    assert json.loads((out / "prediction_check.json").read_text()) == {"ok": True}
    assert "registered before the first run" in (out / "findings.md").read_text()
