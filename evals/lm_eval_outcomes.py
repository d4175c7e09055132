"""The documents of a study's lm-eval runs as suite-style rows (job, train_seed, run, mode,
family, x, id, correct, distance, file): read from the runs' samples files (`read_lm_eval`),
kept in an outcomes file (`LM_EVAL_OUTCOMES`, beside the tables `analysis.real_text` computes
from them) and joined with an earlier outcomes file's runs (`with_earlier_runs`), so that a
study's lm-eval survives a lost study directory through its archive (`analysis.archive`)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

# a study's lm-eval documents, one row per run and document (`read_lm_eval` of its current
# runs, and of the runs its archive held), beside the tables computed from them
LM_EVAL_OUTCOMES = "lm_eval_outcomes.csv.gz"


def lm_eval_runs(root: Path):
    """(run directory, job, training seed, mode) of every lm-eval run under
    root/<job>/seed<k>/<group>/<mode>/, in path order; mode.txt (written when the run ended)
    names its evals.modes string."""
    for mode_file in sorted(Path(root).glob("*/seed*/*/*/mode.txt")):
        run_dir = mode_file.parent
        yield (run_dir, run_dir.parents[2].name, int(run_dir.parents[1].name[len("seed"):]),
               mode_file.read_text().strip())


def read_lm_eval(root: Path, runs: list[Path] | None = None):
    """Every lm-eval run of `lm_eval_runs(root)` (its samples files come from --log_samples),
    or only those in `runs`, as suite-style results: job, train_seed, run, mode, family (the
    task without `ced_`), x (distance bin), id, correct, distance, file."""
    rows = []
    wanted = None if runs is None else {Path(r).resolve() for r in runs}
    for run_dir, job, seed, mode in lm_eval_runs(root):
        if wanted is not None and run_dir.resolve() not in wanted:
            continue
        for samples in sorted(run_dir.rglob("samples_*.jsonl")):
            with open(samples) as handle:
                for line in handle:
                    record = json.loads(line)
                    doc = record["doc"]
                    rows.append({"job": job, "train_seed": seed, "run": f"{job}/seed{seed}",
                                 "mode": mode, "family": doc["family"], "x": str(doc["x"]),
                                 "id": f"{doc['file']}:{doc['byte']}",
                                 "correct": bool(record["acc"]), "distance": doc["distance"],
                                 "file": doc["file"]})
    if not rows:
        raise FileNotFoundError(f"{root}: no <job>/seed<k>/<group>/<mode>/ lm-eval run with "
                                "samples")
    return pd.DataFrame(rows)


# one lm-eval run in the outcome tables: a model, a task family and a mode (a run directory
# holds one task group; its documents are written only once every family of it has run)
LM_EVAL_RUN = ["run", "family", "mode"]
# the text columns of an outcomes file, read back as `read_lm_eval` wrote them
OUTCOME_TEXT = {name: str for name in ("job", "run", "mode", "family", "x", "id", "file")}


def write_outcomes(rows: pd.DataFrame, path: Path) -> Path:
    """lm-eval documents (rows of `read_lm_eval`) as an outcomes file at `path`; gzip's header
    time is fixed, so the same rows write the same bytes (an archive written again is unchanged)."""
    rows.to_csv(path, index=False, compression={"method": "gzip", "mtime": 0})
    return path


def read_outcomes(path: Path) -> pd.DataFrame:
    """An outcomes file (`write_outcomes`) as `read_lm_eval` returns its rows."""
    return pd.read_csv(path, dtype=OUTCOME_TEXT)


def with_earlier_runs(fresh: pd.DataFrame, earlier: pd.DataFrame) -> pd.DataFrame:
    """The lm-eval documents `fresh` (rows of `read_lm_eval`) and, after them, those of every
    run (`LM_EVAL_RUN`) of `earlier` that `fresh` does not hold; where both hold a run, fresh's
    rows are the run's. So a study whose earlier lm-eval runs live on only in its archive (the
    study directory was lost and its models put back) keeps them in its tables. ValueError if
    `earlier` lacks a column of `fresh` (an outcomes file of another layout)."""
    missing = sorted(set(fresh.columns) - set(earlier.columns))
    if missing:
        raise ValueError(f"earlier lm-eval outcomes: no column(s) {missing}; they must have "
                         f"read_lm_eval's columns {list(fresh.columns)}")
    held = pd.MultiIndex.from_frame(fresh[LM_EVAL_RUN].astype(str))
    older = earlier[~pd.MultiIndex.from_frame(earlier[LM_EVAL_RUN].astype(str)).isin(held)]
    return pd.concat([fresh, older[list(fresh.columns)]], ignore_index=True)
