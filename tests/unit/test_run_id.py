"""Which model and overrides a study folder holds is read from its run.json (`ced.run_id`), never
from the folder's name: readers given folders whose names say one thing and whose run.json says
another follow run.json; folders of an older driver (no run.json) are still read, by the one
legacy reader; and no other module parses a job, a seed or an override out of a path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from ced.run_id import (IDENTITY, RunId, identified, legacy_run_id, of_checkpoint, read_run_id,
                        write_run_id)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("run_id, label, group", [
    (RunId("L8_sim", 0), "L8_sim/seed0", "L8_sim"),
    (RunId("k4", 12, topk=2), "k4/seed12@topk=2", "k4@topk=2"),
    (RunId("k4", 3, kv="int8"), "k4/seed3@kv=int8", "k4@kv=int8"),
    (RunId("k4", 3, topk=1, kv="int4"), "k4/seed3@topk=1@kv=int4", "k4@topk=1@kv=int4"),
])
def test_labels_groups_and_records_round_trip(run_id, label, group, tmp_path):
    assert (run_id.label, run_id.group, run_id.model) == (label, group, label.split("@")[0])
    assert RunId.of_record(json.loads(json.dumps(run_id.record()))) == run_id
    assert run_id.trained == RunId(run_id.job, run_id.seed)
    write_run_id(tmp_path / "any" / "name", run_id)
    assert read_run_id(tmp_path / "any" / "name") == run_id
    # the name an older driver gave the same folder means the same model
    assert legacy_run_id(tmp_path / run_id.label) == run_id


@pytest.mark.parametrize("job, seed, message", [
    ("", 0, "RunId.job"), ("a/b", 0, "RunId.job"), ("a@topk=2", 0, "RunId.job"),
    ("k4", -1, "RunId.seed"), ("k4", "0", "RunId.seed"), ("k4", True, "RunId.seed"),
])
def test_a_bad_identity_is_refused_naming_the_field(job, seed, message):
    with pytest.raises(ValueError, match=message):
        RunId(job, seed)


def test_an_unknown_override_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['window'\]; allowed: "
                                         r"\['topk', 'kv'\]"):
        RunId("k4", 0).under(window=4)
    assert RunId("k4", 0).under(topk=None, kv=None) == RunId("k4", 0)


def test_run_json_is_read_before_the_name_and_set_aside_folders_are_left_out(tmp_path):
    write_run_id(tmp_path / "suite" / "renamed" / "seed5", RunId("k4", 3, topk=2))
    (tmp_path / "suite" / "L2" / "seed1").mkdir(parents=True)        # an older driver's
    (tmp_path / "suite" / "L2" / "seed0.old-abc123").mkdir(parents=True)
    (tmp_path / "suite" / "L2" / "seedless").mkdir(parents=True)     # no model's folder
    found = {run_id.label: folder.relative_to(tmp_path).as_posix()
             for run_id, folder in identified(tmp_path / "suite")}
    assert found == {"L2/seed1": "suite/L2/seed1", "k4/seed3@topk=2": "suite/renamed/seed5"}


def test_a_checkpoint_names_its_job_and_seed_by_its_runs_record(tmp_path):
    from ced.tracking import job_and_seed
    from evals.erf import job_of
    run = tmp_path / "runs" / "folder_name" / "seed9"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step_100").mkdir(parents=True)
    assert job_and_seed(run / "final") == ("folder_name", 9)          # no run.json: the name
    write_run_id(run, RunId("E8_L8", 2))
    for checkpoint in (run / "final", run / "checkpoints" / "step_100", run):
        assert of_checkpoint(checkpoint) == RunId("E8_L8", 2)
        assert job_and_seed(checkpoint) == ("E8_L8", 2)
    assert job_of(run / "final") == "E8_L8"
    assert job_and_seed(tmp_path / "elsewhere" / "final") == ("elsewhere", None)


def _suite_folder(folder: Path, run_id: RunId | None, window: int) -> None:
    folder.mkdir(parents=True)
    if run_id is not None:
        write_run_id(folder, run_id)
    rows = [{"id": f"d{i}", "family": "running_count", "x": "4", "mode": mode,
             "correct": bool(i % 2) or mode == "full", "kl_answer": 0.0, "target": "1",
             "prediction": "1"} for i in range(4) for mode in ("full", "replay=4")]
    pd.DataFrame(rows).to_csv(folder / "results.csv", index=False)
    (folder / "summary.json").write_text(json.dumps(
        {"run": {"settings": {"window": window, "r_exact": 2 * window - 1}}}))


def test_the_tables_follow_run_json_not_the_folder_name(tmp_path):
    from analysis.tables import geometry, load_results, run_traits, trained_jobs
    study = tmp_path / "study"
    _suite_folder(study / "suite" / "misnamed" / "seed7@topk=9", RunId("k4", 3, topk=2), 8)
    _suite_folder(study / "suite" / "k4" / "seed3", RunId("k4", 3), 8)
    _suite_folder(study / "suite" / "old_job" / "seed1@kv=int8", None, 16)
    runs = study / "runs" / "misnamed_run" / "seed0"
    runs.mkdir(parents=True)
    write_run_id(runs, RunId("k4", 3))
    (runs / "config.yaml").write_text("model:\n  n_decoder_layers: 2\n  window: 8\n")
    results = load_results(study)
    seen = results[["job", "base_job", "train_seed", "run"]].drop_duplicates()
    assert sorted(map(tuple, seen.values.tolist())) == [
        ("k4", "k4", 3, "k4/seed3"), ("k4@topk=2", "k4", 3, "k4/seed3@topk=2"),
        ("old_job@kv=int8", "old_job", 1, "old_job/seed1@kv=int8")]
    assert sorted(trained_jobs(results)) == ["k4"]
    assert geometry(study) == {"k4": {"W": 8, "R_exact": 15},
                               "k4@topk=2": {"W": 8, "R_exact": 15},
                               "old_job@kv=int8": {"W": 16, "R_exact": 31}}
    traits = run_traits(study)
    assert traits[["job", "seed", "L_d"]].values.tolist() == [["k4", 3, 2]]


def test_the_report_pools_seeds_by_run_json(tmp_path):
    from analysis.report import load_suite, seed_spread
    study = tmp_path / "study"
    for seed in (0, 1):
        folder = study / "suite" / "x" / f"seed{seed}"
        folder.mkdir(parents=True)
        write_run_id(folder, RunId("k4", seed, topk=2))
        (folder / "summary.json").write_text(json.dumps({"run": {}, "summary": [
            {"family": "running_count", "x": "all", "mode": "full", "accuracy": 0.5 + seed / 4}]}))
    suite, _, info = load_suite(study)
    assert sorted(info) == ["k4/seed0@topk=2", "k4/seed1@topk=2"]
    assert set(suite["group"]) == {"k4@topk=2"} and set(suite["model"]) == {"k4/seed0",
                                                                             "k4/seed1"}
    spread = seed_spread(suite, {})
    assert spread[["job", "seeds"]].values.tolist() == [["k4@topk=2", 2]]


# what reading a job, a seed or an override out of a path looks like
PATH_PARSERS = re.compile(r"""seed\(\?P<|seed\(\\d|seed\\d|startswith\("seed"\)|"@topk|"@kv"""
                          r"""|\.split\("@"\)|label\.split\("/"\)|partition\("/seed"\)"""
                          r"""|_LABEL\b""")


def test_no_module_reads_a_model_out_of_a_folder_name():
    found = []
    for folder in ("ced", "evals", "analysis", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name == "ced/run_id.py":
                continue
            found += [f"{name}:{i}: {line.strip()}"
                      for i, line in enumerate(path.read_text().splitlines(), 1)
                      if PATH_PARSERS.search(line)]
    assert not found, ("a job, seed or override is read out of a folder name outside "
                       f"ced/run_id.py; read the folder's {IDENTITY} (ced.run_id) instead:\n"
                       + "\n".join(found))
