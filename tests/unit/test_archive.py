"""analysis.archive: a study's per-model results in committed-size cells, read back by
analysis.findings with every paired statistic unchanged."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest

from analysis.archive import OUTCOMES, archive, cells_of, expand_cells, main
from analysis.tables import capability_drop_table, load_results
from analysis.per_model import model_drops


def fake_results(seed: int) -> pd.DataFrame:
    """Random paired outcomes over 2 families x 3 distances x 3 modes, 40 examples a cell."""
    rng = random.Random(seed)
    rows = []
    for family in ("running_count", "running_bracket"):
        for x in ("5", "9", "17"):
            for i in range(40):
                full = rng.random() < 0.9
                rows.append({"id": f"{family}/distance={x}/{i}", "family": family, "x": x,
                             "mode": "full", "correct": full, "kl_answer": 0.0})
                for mode, flip in (("replay=4", 0.4), ("replay=8", 0.05), ("replay=exact", 0)):
                    ok = (not full) if rng.random() < flip else full
                    rows.append({"id": f"{family}/distance={x}/{i}", "family": family, "x": x,
                                 "mode": mode, "correct": ok, "kl_answer": rng.random() * flip})
    return pd.DataFrame(rows)


def write_study(root, jobs_seeds):
    for job, seed in jobs_seeds:
        suite = root / "suite" / job / f"seed{seed}"
        suite.mkdir(parents=True)
        fake_results(seed).to_csv(suite / "results.csv", index=False)
        (suite / "summary.json").write_text(json.dumps(
            {"run": {"settings": {"window": 8, "r_exact": 15}}}))
        run = root / "runs" / job / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("model:\n  n_decoder_layers: 2\n")
    (root / "summary.json").write_text(json.dumps(
        {"study": "depth", "steps": {}, "invocations": [{"command": f"run {root.name}"}]}))


def test_cells_keep_every_paired_count():
    results = fake_results(0)
    back = expand_cells(cells_of(results))
    for frame in (results, back):
        frame["job"], frame["train_seed"], frame["run"] = "L2", 0, "L2/seed0"
    cols = ["family", "x", "mode", "n", "full_only", "mode_only", "acc_full", "acc_mode"]
    want, got = capability_drop_table(results), capability_drop_table(back)
    pd.testing.assert_frame_equal(want[cols], got[cols])
    marks = {"L2": {"W": 8, "R_exact": 15}}
    cols = ["family", "mode", "N", "n", "difference", "p_value", "p_holm", "fails"]
    pd.testing.assert_frame_equal(model_drops(results, marks)[cols],
                                  model_drops(back, marks)[cols])
    # the answer KL keeps each cell's mean
    kl = results[results["mode"] != "full"].groupby(["family", "x", "mode"])["kl_answer"].mean()
    kl_back = back[back["mode"] != "full"].groupby(["family", "x", "mode"])["kl_answer"].mean()
    assert kl.sort_index().to_numpy() == pytest.approx(kl_back.sort_index().to_numpy())


def test_archives_from_two_machines_read_as_one_study(tmp_path):
    first, second, into = tmp_path / "a", tmp_path / "b", tmp_path / "archive"
    write_study(first, [("L2", 0), ("L2", 1)])
    write_study(second, [("L2", 2), ("L20", 0)])
    assert archive(first, into) == ["L2/seed0", "L2/seed1"]
    assert archive(second, into) == ["L2/seed2", "L20/seed0"]
    assert not list(into.rglob("results.csv"))
    merged = load_results(into)
    assert sorted(merged["run"].unique()) == ["L2/seed0", "L2/seed1", "L2/seed2", "L20/seed0"]
    original = load_results(first)
    drops = capability_drop_table(merged[merged["run"].isin(["L2/seed0", "L2/seed1"])])
    want = capability_drop_table(original)
    assert drops["difference"].tolist() == pytest.approx(want["difference"].tolist())
    assert (into / "runs" / "L20" / "seed0" / "config.yaml").exists()
    # the per-example outcomes come back as they were: ids aligned across models
    cols = ["id", "family", "x", "mode", "correct"]
    for run in ("L2/seed0", "L2/seed1"):
        mine = merged[merged["run"] == run][cols].sort_values(["id", "mode"]).reset_index(drop=True)
        theirs = original[original["run"] == run][cols].sort_values(["id", "mode"]).reset_index(
            drop=True)
        pd.testing.assert_frame_equal(mine, theirs, check_dtype=False)
    # an older archive (cells only) still reads, with the same paired counts
    for outcomes in into.rglob(OUTCOMES):
        outcomes.unlink()
    cells_only = load_results(into)
    old = capability_drop_table(cells_only[cells_only["run"].isin(["L2/seed0", "L2/seed1"])])
    assert old["difference"].tolist() == pytest.approx(want["difference"].tolist())
    invocations = json.loads((into / "summary.json").read_text())["invocations"]
    assert [i["command"] for i in invocations] == ["run a", "run b"]


def test_an_invocation_archived_twice_while_it_ran_is_kept_once(tmp_path):
    study, into = tmp_path / "s", tmp_path / "archive"
    write_study(study, [("L2", 0)])
    running = {"command": "run", "commit": "abc", "started": "t0", "elapsed_s": 10}
    (study / "summary.json").write_text(json.dumps({"steps": {}, "invocations": [running]}))
    archive(study, into)
    (study / "summary.json").write_text(json.dumps(
        {"steps": {}, "invocations": [{**running, "elapsed_s": 99}]}))
    archive(study, into)
    invocations = json.loads((into / "summary.json").read_text())["invocations"]
    assert [i["elapsed_s"] for i in invocations] == [99]


def test_each_archived_step_names_the_invocation_that_ran_it(tmp_path):
    """Two study directories (the second begun after the first was lost), each numbering its
    invocations from 0: in the archive every step's `invocation` indexes the merged list at
    the invocation that ran it, whichever directory was archived first."""
    def directory(name, commands):
        study = tmp_path / name
        write_study(study, [("L2", 0)])
        invocations = [{"command": c, "commit": c, "started": f"t{c}"} for c in commands]
        steps = {f"step {c}": {"state": "ok", "invocation": i} for i, c in enumerate(commands)}
        steps["report"] = {"state": "ok", "invocation": -1}
        (study / "summary.json").write_text(json.dumps({"steps": steps,
                                                        "invocations": invocations}))
        return study
    first, second = directory("a", ["1", "3"]), directory("b", ["2", "4", "5"])
    for order in ((first, second), (second, first)):
        into = tmp_path / f"archive_{order[0].name}"
        for study in order:
            archive(study, into)
        summary = json.loads((into / "summary.json").read_text())
        commands = [i["command"] for i in summary["invocations"]]
        assert commands == ["1", "2", "3", "4", "5"]
        for key, record in summary["steps"].items():
            if key != "report":
                assert commands[record["invocation"]] == key.split()[1], (order, key)
        assert summary["steps"]["report"]["invocation"] == -1


def test_weights_are_kept_only_when_asked_and_read_back(tmp_path):
    """--weights keeps each archived model's final checkpoint, which loads as the original."""
    import torch
    from ced import CEDModel, ModelConfig
    from ced.checkpoint import load_model, save_model
    study, plain, kept = tmp_path / "s", tmp_path / "plain", tmp_path / "kept"
    write_study(study, [("L2", 0)])
    run = study / "runs" / "L2" / "seed0"
    torch.manual_seed(0)
    model = CEDModel(ModelConfig(variant="ced", d_model=32, n_heads=2, n_encoder_layers=2,
                                 n_decoder_layers=2, window=4, topk=4, global_from_layer=1,
                                 encoder_kv_groups=1, max_seq_len=64))
    save_model(model, run / "final")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    archive(study, plain)
    assert not (plain / "runs" / "L2" / "seed0" / "final").exists()
    archive(study, kept, weights=True)
    back = load_model(kept / "runs" / "L2" / "seed0" / "final")
    ids = torch.randint(0, 200, (2, 24))
    assert torch.equal(back(ids), model.eval()(ids))
    assert (kept / "runs" / "L2" / "seed0" / "metrics.jsonl").read_text().startswith('{"step"')


def test_the_archive_keeps_the_suites_mode_columns(tmp_path):
    """A suite that wrote a mode's typed columns (evals.modes.MODE_COLUMNS) is archived with
    them, and they read back equal to what the mode module recovers from the labels alone (an
    archive written before the columns existed)."""
    from evals.modes import MODE_COLUMNS, label_columns, with_mode_columns
    study, into = tmp_path / "study", tmp_path / "archive"
    write_study(study, [("L2", 0)])
    results = study / "suite" / "L2" / "seed0" / "results.csv"
    table = pd.read_csv(results, dtype={"x": str})
    columns = pd.DataFrame([label_columns(m, 15, 8) for m in table["mode"]])
    pd.concat([table, columns], axis=1).to_csv(results, index=False)
    archive(study, into)
    kept = pd.read_csv(next(into.rglob(OUTCOMES)))
    assert set(MODE_COLUMNS) <= set(kept.columns)
    from_columns = with_mode_columns(kept, 15, 8)
    from_labels = with_mode_columns(kept[["mode"]], 15, 8)
    for name in MODE_COLUMNS:
        pd.testing.assert_series_equal(from_columns[name], from_labels[name], check_names=False)
    assert sorted(from_columns["replay_n"].dropna().unique()) == [4, 8, 15]   # exact: R_exact


def test_archiving_again_writes_the_same_bytes_and_each_models_identity(tmp_path):
    """The archive is committed: the same results archived again (seconds later, so a gzip
    header time would differ) leave every file byte for byte as it was; every model folder
    keeps its run.json (ced.run_id), read back as the model it came from."""
    import time

    from ced.run_id import RunId, read_run_id
    study, into = tmp_path / "study", tmp_path / "archive"
    write_study(study, [("L2", 0), ("L8", 3)])
    archive(study, into)
    first = {p: p.read_bytes() for p in into.rglob("*") if p.is_file() and
             p.name != "summary.json"}
    time.sleep(1.1)
    archive(study, into)
    assert {p: p.read_bytes() for p in first} == first
    assert read_run_id(into / "suite" / "L8" / "seed3") == RunId("L8", 3)
    assert (into / "runs" / "L8" / "seed3" / "run.json").exists()


def test_an_erf_argument_without_erf_csv_is_refused_before_anything_is_written(tmp_path, capsys):
    """--erf must name an evals.erf output (its erf.csv); the driver's per-model erf/ layout
    passed there is refused with an error naming --erf, and the archive is left untouched."""
    study, into = tmp_path / "s", tmp_path / "archive"
    write_study(study, [("L2", 0)])
    (study / "erf" / "L2" / "seed0").mkdir(parents=True)
    assert main(["--study", str(study), "--into", str(into), "--erf", str(study / "erf")]) == 2
    assert "--erf" in capsys.readouterr().err
    assert not into.exists()
    assert main(["--study", str(study), "--into", str(into)]) == 0
    assert (into / "suite" / "L2" / "seed0").is_dir()
