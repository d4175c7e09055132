"""lm-eval's tables across a lost study directory: `analysis.archive` keeps every lm-eval run it
was given, a study put back and read again joins the runs it no longer holds
(`analysis.real_text.with_earlier_runs`), and the tables come out as if every run were there."""

from __future__ import annotations

import json
import random
import shutil

import pandas as pd
import pytest

from analysis.archive import archive_lm_eval
from analysis.real_text import main, write_lm_eval
from evals.lm_eval_outcomes import (LM_EVAL_OUTCOMES, LM_EVAL_RUN, read_lm_eval, read_outcomes,
                                    with_earlier_runs)

MODES = {"ced_code": ("full", "replay=W", "replay=2W"),
         "ced_code_turn": ("full", "turn=8,policy=cached_hidden,replay=W")}
FAMILIES = {"ced_code": ("code_close", "code_identifier"), "ced_code_turn": ("code_turn",)}


def write_runs(root, models, seed: int, flip: float = 0.3) -> None:
    """lm-eval run directories as the driver leaves them (mode.txt, a samples file per task)
    for `models` ((job, train seed) pairs): 30 documents a task in two distance bins, `full`
    right with probability 0.7, a replay mode flipping full's answer with probability `flip`."""
    rng = random.Random(seed)
    for job, train_seed in models:
        for group, modes in MODES.items():
            full = {(f, i): rng.random() < 0.7 for f in FAMILIES[group] for i in range(30)}
            for mode in modes:
                run = root / job / f"seed{train_seed}" / group / mode.replace(",", "+")
                run.mkdir(parents=True)
                for family in FAMILIES[group]:
                    with open(run / f"samples_ced_{family}_x.jsonl", "w") as handle:
                        for i in range(30):
                            right = full[family, i] ^ (mode != "full" and rng.random() < flip)
                            doc = {"family": family, "x": 32 if i % 2 else 64,
                                   "file": f"f{i % 7}.py", "byte": 100 * i, "distance": 20 + i}
                            handle.write(json.dumps({"doc": doc, "acc": int(right)}) + "\n")
                (run / "mode.txt").write_text(mode + "\n")


MODELS = [("T4_W8", 0), ("T4_W8", 1), ("T4_W16", 0), ("T4_W16", 1)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_study_put_back_keeps_the_runs_only_its_archive_holds(tmp_path, seed):
    """Every model's runs read, tables written and archived; the study directory lost, T4_W16
    put back and read again: the study's own tables then hold T4_W16 alone; the archive keeps
    every run's documents, and `write_lm_eval(earlier=archive)` writes the same bytes as the
    tables of every run read at once."""
    whole, study, archive = tmp_path / "whole", tmp_path / "study", tmp_path / "archive"
    write_runs(whole / "lm_eval", MODELS, seed)
    write_lm_eval(whole / "lm_eval", whole)
    archive.mkdir()
    archive_lm_eval(whole, archive)
    # the study directory lost; T4_W16's runs read again (the same documents and answers)
    shutil.copytree(whole / "lm_eval" / "T4_W16", study / "lm_eval" / "T4_W16")
    write_lm_eval(study / "lm_eval", study)
    assert set(pd.read_csv(study / "lm_eval.csv")["job"]) == {"T4_W16"}
    archive_lm_eval(study, archive)
    joined = tmp_path / "joined"
    write_lm_eval(study / "lm_eval", joined, earlier=archive / LM_EVAL_OUTCOMES)
    assert sorted(p.name for p in archive.iterdir()) == [LM_EVAL_OUTCOMES]
    for name in ("lm_eval.csv", "lm_eval_accuracy.csv"):
        assert (joined / name).read_bytes() == (whole / name).read_bytes(), name
    rows = read_outcomes(archive / LM_EVAL_OUTCOMES)
    pd.testing.assert_frame_equal(
        rows.sort_values(["run", "family", "mode", "id"]).reset_index(drop=True),
        read_lm_eval(whole / "lm_eval").sort_values(["run", "family", "mode", "id"])
        .reset_index(drop=True))
    # archiving the same study again changes nothing
    before = {p.name: p.read_bytes() for p in archive.iterdir()}
    archive_lm_eval(study, archive)
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == before


def test_a_run_read_again_replaces_the_archived_one(tmp_path):
    """Where the study and the archive both hold a run, the study's documents are the run's:
    nothing of the archived run survives, and runs only the archive holds are kept whole."""
    old, new = tmp_path / "old", tmp_path / "new"
    write_runs(old, MODELS, seed=5, flip=0.0)
    write_runs(new, MODELS[:2], seed=6, flip=0.5)
    joined = with_earlier_runs(read_lm_eval(new), read_lm_eval(old))
    runs = joined[LM_EVAL_RUN].drop_duplicates()
    assert len(runs) == len(read_lm_eval(old)[LM_EVAL_RUN].drop_duplicates())
    for (run, family, mode), part in joined.groupby(LM_EVAL_RUN):
        source = read_lm_eval(new if run.startswith("T4_W8/") else old)
        theirs = source[(source["run"] == run) & (source["family"] == family)
                        & (source["mode"] == mode)]
        assert part["correct"].tolist() == theirs["correct"].tolist(), (run, family, mode)


def test_outcomes_of_another_layout_are_refused(tmp_path):
    write_runs(tmp_path / "runs", MODELS[:1], seed=0)
    fresh = read_lm_eval(tmp_path / "runs")
    with pytest.raises(ValueError, match=r"no column\(s\) \['distance'\]"):
        with_earlier_runs(fresh, fresh.drop(columns="distance"))


def test_the_command_writes_the_joined_tables_and_names_a_missing_file(tmp_path, capsys):
    write_runs(tmp_path / "all", MODELS, seed=9)
    write_lm_eval(tmp_path / "all", tmp_path / "archive")
    shutil.copytree(tmp_path / "all" / "T4_W16", tmp_path / "study" / "T4_W16")
    assert main(["--lm-eval", str(tmp_path / "study"), "--earlier",
                 str(tmp_path / "archive" / LM_EVAL_OUTCOMES), "--out",
                 str(tmp_path / "out")]) == 0
    assert "of 4 models" in capsys.readouterr().out
    assert (tmp_path / "out" / "lm_eval.csv").read_bytes() == \
        (tmp_path / "archive" / "lm_eval.csv").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["--lm-eval", str(tmp_path / "study"), "--earlier", str(tmp_path / "nope.csv.gz"),
              "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--earlier" in capsys.readouterr().err
