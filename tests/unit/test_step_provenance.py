"""The study driver records which code every step ran.

Each step is a fresh process that imports the checkout as it is when the step starts, so a
commit made while a long study runs changes what its later steps run. summary.json must say so
per step (`source`), and flag and announce a step whose source differs from the invocation's.
The git calls are replaced by a fake whose answer the test changes between steps.
"""

from __future__ import annotations

import json

import pytest

import experiments.run as driver
from experiments.study import load_study

START = {"commit": "a" * 40, "dirty": False}


@pytest.fixture
def study(tmp_path, monkeypatch):
    current = dict(START)
    monkeypatch.setattr(driver, "source_version", lambda: dict(current))
    made = driver.Study(load_study("tiny", "demo"), tmp_path / "study", threads=1, wandb=False)
    return made, current


def steps(study) -> dict:
    return json.loads((study.out / "summary.json").read_text())["steps"]


def test_a_step_on_unchanged_code_records_its_source_and_no_flag(study):
    made, _ = study
    made.record("train/a/seed0", "ok", seconds=1.0)
    entry = steps(made)["train/a/seed0"]
    assert entry["source"] == START and "source_changed" not in entry


@pytest.mark.parametrize("change", [{"commit": "b" * 40}, {"dirty": True}])
def test_a_step_after_a_commit_or_an_edit_is_flagged_and_announced(study, change, capsys):
    made, current = study
    made.record("train/a/seed0", "ok")
    current.update(change)
    made.record("train/a/seed1", "failed", returncode=1)
    entry = steps(made)["train/a/seed1"]
    assert entry["source"] == {**START, **change} and entry["source_changed"] is True
    assert "train/a/seed0" in steps(made) and "source_changed" not in steps(made)["train/a/seed0"]
    out = capsys.readouterr().out
    assert "warning: train/a/seed1 ran" in out and "commit aaaaaaa" in out


def test_steps_that_did_not_run_record_no_source(study):
    made, current = study
    current["commit"] = "c" * 40
    for state in ("skipped", "reused", "refused"):
        made.record(f"suite/{state}", state)
        assert "source" not in steps(made)[f"suite/{state}"]


def test_outside_a_git_checkout_nothing_is_flagged(study):
    made, current = study
    current.clear()                        # source_version() gives {} outside a checkout
    made.record("train/a/seed0", "ok")
    entry = steps(made)["train/a/seed0"]
    assert entry["source"] == {} and "source_changed" not in entry


def test_failures_are_split_by_the_invocation_that_recorded_them(study):
    """A failure kept from an earlier invocation (or from a summary.json written before steps
    recorded their invocation) is not reported as this invocation's own."""
    made, _ = study
    made.invocations = [{"command": "first"}, {"command": "second"}]
    made.status = {"suite/old": {"state": "failed"},
                   "train/a/seed0": {"state": "failed", "invocation": 1},
                   "train/a/seed1": {"state": "ok", "invocation": 0}}
    made.record("train/a/seed2", "failed", seconds=1.0)
    made.record("train/a/seed1", "refused", reason="overrides changed")
    assert steps(made)["train/a/seed2"]["invocation"] == 2
    assert made.failed(earlier=False) == ["train/a/seed1", "train/a/seed2"]
    assert made.failed(earlier=True) == ["suite/old", "train/a/seed0"]
    assert sorted(made.failed()) == ["suite/old", "train/a/seed0", "train/a/seed1",
                                     "train/a/seed2"]


def test_summary_json_is_replaced_whole_or_not_at_all(study, monkeypatch):
    """A crash while summary.json is written (here: os.replace failing) leaves the previous
    record readable, not a torn file the next invocation would discard."""
    made, _ = study
    made.record("train/a/seed0", "ok", seconds=1.0)
    before = (made.out / "summary.json").read_text()

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(driver.os, "replace", crash)
    with pytest.raises(OSError):
        made.record("train/a/seed1", "ok", seconds=1.0)
    assert (made.out / "summary.json").read_text() == before
    assert "train/a/seed1" not in json.loads(before)["steps"]
