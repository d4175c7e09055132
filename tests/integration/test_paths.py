"""evals.paths: the four readings of a suite's documents (docs/semantics.md 4.6). The `full`
and `replay` readings (parallel forward) must score every document as the suite's engine path
scored it (the same exact match, the NLL to 1e-5 in float32); the retained table counts only
documents whose evidence lies before the cut and that `full` answers; the per-job interval is
the seed-level t interval."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from ced.checkpoint import save_model
from conftest import make_model, tiny_config
from evals.paths import PathsConfig, by_job, main, retained, run


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    from evals.suites import SuiteConfig, run_suite
    tmp = tmp_path_factory.mktemp("paths")
    cfg = tiny_config(vocab_size=259, n_encoder_layers=2, n_decoder_layers=3, window=4,
                      topk=3, global_from_layer=1, encoder_kv_groups=1, max_seq_len=256)
    checkpoint = save_model(make_model(cfg, 1), tmp / "run" / "final")
    out = tmp / "suite"
    run_suite(SuiteConfig(str(checkpoint), ["W"], str(out), examples=4,
                          families=["running_count", "running_bracket"], span_grid="uncensored",
                          plot=False, wandb=False, quiet=True))
    return checkpoint, out, tmp


def test_full_and_replay_score_as_the_suite_did(suite_run):
    checkpoint, suite, tmp = suite_run
    summary = run(PathsConfig(suite=[str(suite)], out=str(tmp / "paths"), replays=["W", "2W"]))
    rows = pd.read_csv(tmp / "paths" / "rows.csv")
    results = pd.read_csv(suite / "results.csv")
    assert set(rows["N"]) == {4, 8} and set(rows["reading"]) == {"full", "replay",
                                                                  "global_cut", "both"}
    nll = {}
    for reading, mode in (("full", "full"), ("replay", "replay=4")):
        mine = rows[(rows["reading"] == reading) & (rows["N"] == 4)].set_index("id").sort_index()
        suites = results[results["mode"] == mode].set_index("id").loc[mine.index]
        assert len(mine) == len(results[results["mode"] == mode]) > 0
        assert mine["correct"].tolist() == suites["correct"].tolist()
        assert (mine["nll"] - suites["nll"]).abs().max() < 1e-5, reading
        nll[reading] = mine["nll"]
    # the comparison can tell the readings apart: the replay changes some answer's NLL
    assert (nll["full"] - nll["replay"]).abs().max() > 1e-3
    assert summary["checkpoints"] == [str(checkpoint)]
    for name in ("rows.csv", "retained.csv", "jobs.csv", "summary.json"):
        assert (tmp / "paths" / name).exists()


def test_retained_counts_only_answered_documents_beyond_the_cut():
    """Fabricated rows: 3 documents beyond N = 4 (one that full misses), 1 inside it."""
    base = {"job": "J", "seed": 0, "model": "J/seed0", "N": 4, "chance": 0.5}
    truth = {  # id: (distance, full, replay, global_cut, both)
        "a": (8, 1, 1, 0, 0), "b": (12, 1, 0, 1, 0), "c": (9, 0, 1, 1, 1), "d": (2, 1, 0, 0, 0)}
    rows = pd.DataFrame([{**base, "id": i, "distance": d, "reading": r, "correct": c}
                         for i, (d, *got) in truth.items()
                         for r, c in zip(("full", "replay", "global_cut", "both"), got)])
    table = retained(rows).set_index("reading")
    assert table["n"].tolist() == [2, 2, 2]                  # a and b only
    assert table.loc["replay", "kept"] == 1 and table.loc["global_cut", "kept"] == 1
    assert table.loc["both", "kept"] == 0
    assert (table["ci_low"] <= table["retained"]).all()
    assert (table["retained"] <= table["ci_high"]).all()


def test_by_job_is_the_mean_over_models_with_a_t_interval():
    per_model = pd.DataFrame({"job": "J", "N": 4, "reading": "replay", "chance": 0.5,
                              "retained": [0.2, 0.4, 0.6]})
    row = by_job(per_model).iloc[0]
    assert row["models"] == 3 and math.isclose(row["retained"], 0.4)
    half = 4.302652729911275 * 0.2 / math.sqrt(3)              # t(0.975, 2) * sd / sqrt(3)
    assert math.isclose(row["model_ci_low"], 0.4 - half, rel_tol=1e-9)
    assert math.isclose(row["model_ci_high"], 0.4 + half, rel_tol=1e-9)


def test_bad_input_is_named(suite_run, tmp_path, capsys):
    checkpoint, suite, _ = suite_run
    assert main(["--suite", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a finished suite run" in capsys.readouterr().err
    assert main(["--suite", str(suite), "--checkpoint", str(checkpoint), str(checkpoint),
                 "--out", str(tmp_path / "o")]) == 2
    assert "--checkpoint: one per --suite" in capsys.readouterr().err
    assert main(["--suite", str(suite), "--families", "recall", "--out", str(tmp_path / "o")]) == 2
    assert "--families: ['recall'] not read by the suite" in capsys.readouterr().err


def test_a_suite_read_under_an_override_is_refused(suite_run, tmp_path):
    from evals.suites import SuiteConfig, run_suite
    checkpoint, _, _ = suite_run
    run_suite(SuiteConfig(str(checkpoint), ["W"], str(tmp_path / "s"), examples=1,
                          families=["running_count"], topk="2", plot=False, wandb=False,
                          quiet=True))
    with pytest.raises(ValueError, match="it read the model with topk=2, the checkpoint here "
                                         "has topk=3"):
        run(PathsConfig(suite=[str(tmp_path / "s")], out=str(tmp_path / "p")))


def test_a_document_read_twice_under_one_name_is_refused():
    rows = pd.DataFrame([{"job": "J", "seed": 0, "model": "J/seed0", "N": 4, "id": "a",
                          "distance": 8, "chance": 0.5, "reading": r, "correct": 1}
                         for r in ("full", "replay", "global_cut", "both")] * 2)
    with pytest.raises(ValueError, match="4 readings of a document twice under one model name"):
        retained(rows)


def test_families_restrict_the_documents(suite_run, tmp_path):
    _, suite, _ = suite_run
    run(PathsConfig(suite=[str(suite)], out=str(tmp_path / "p"), families=["running_count"]))
    rows = pd.read_csv(tmp_path / "p" / "rows.csv")
    assert set(rows["family"]) == {"running_count"}
