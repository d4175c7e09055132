"""A study's results in a form small enough to commit, so that a study can grow across
machines whose `outputs/` do not survive: `python -m analysis.archive`.

    python -m analysis.archive --study outputs/studies/depth --into findings/depth/archive

A study directory holds per model a suite `results.csv` (one row per example and mode, megabytes
at the findings scale) and its checkpoints. The archive keeps, per model, what the statistics
of `analysis.findings` and `analysis.depth` need, as a skeleton study directory:

    suite/<job>/seed<k>/cells.csv      per family x x x mode: n examples, how many `full` and
                                       the mode answered right, the discordant pairs
                                       (full_only, mode_only) and the mean KL at the answer
    suite/<job>/seed<k>/outcomes.csv.gz  per example and mode: its id, family, x, whether the
                                       answer was right and the KL at the answer (tens of
                                       kilobytes): the per-document record a bootstrap over
                                       documents shared by the models needs (an older
                                       archive may have cells only)
    suite/<job>/seed<k>/summary.json   the suite run's checkpoint, model config and settings
                                       (W, R_exact, ...), without its tables
    suite/<job>/seed<k>/run.json       which model and overrides (`ced.run_id`), also in
                                       runs/<job>/seed<k>/
    runs/<job>/seed<k>/config.yaml     the training config (L_d, arm)
    runs/<job>/seed<k>/final/          with --weights: the final checkpoint (model.safetensors,
                                       config.json), metrics.jsonl (the training curve) and
                                       study_step.json (put back, the driver skips the run)
    summary.json                       the driver's invocations (command, commit, time) and
                                       step times, merged over every archived study directory
    real_text/<job>/seed<k>/           a real-text reading's tables per model (the driver's
                                       `real_text:` step; not tokens.parquet), real_text/ the
                                       merged tables of every model and
                                       lm_eval_outcomes.csv.gz (the lm-eval documents of the
                                       study's current runs, and of the runs archived before
                                       that the study no longer holds: job, train_seed, mode,
                                       family, distance bin x, id, correct, distance, file;
                                       the tables: `python -m analysis.real_text`)
    erf_shares.csv                     per model its decoder influence beyond W and 2W, from
                                       the study's erf/<job>/seed<k>/ (the driver's `erf:`
                                       step) and from any --erf directory

`analysis.tables.load_results` reads `outcomes.csv.gz` where there is no `results.csv` (the
same per-example rows, without the prompts), else `cells.csv`, expanding each cell into
paired examples with the same counts (`expand_cells`): every paired statistic
(accuracy, McNemar, Agresti-Min, Holm, the hierarchical bootstrap, failures, N*) is unchanged;
the answer KL keeps its per-model mean, so its example-level bootstrap CI is not available from
an archive (it comes out as a point). Archiving a model twice replaces its files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ced.run_id import identified, write_run_id
from evals.erf import erf_shares
from evals.modes import MODE_COLUMNS
from evals.lm_eval_outcomes import (LM_EVAL_OUTCOMES, read_outcomes, with_earlier_runs,
                                    write_outcomes)

CELLS = "cells.csv"
OUTCOMES = "outcomes.csv.gz"
OUTCOME_COLUMNS = ["id", "family", "x", "mode", "correct", "kl_answer"]
# what `--weights` keeps of a run: the final checkpoint and the training curve
WEIGHT_FILES = ("final/model.safetensors", "final/config.json", "metrics.jsonl")
FULL = "full"
# what the archive keeps of a real-text reading (per model and merged)
READING_FILES = ("kl_by_position.csv", "kl_by_class.csv", "baselines.csv", "settings.json")


def cells_of(results: pd.DataFrame) -> pd.DataFrame:
    """One model's suite results.csv -> its cells (see module doc); `full` appears as the
    reference of every other mode's row, not as a row of its own."""
    results = results.assign(correct=results["correct"].astype(bool), x=results["x"].astype(str))
    full = results[results["mode"] == FULL].set_index(["family", "x", "id"])["correct"]
    rows = []
    for (family, x, mode), part in results[results["mode"] != FULL].groupby(
            ["family", "x", "mode"], sort=False):
        mine = part.set_index(["family", "x", "id"])["correct"]
        ref = full.reindex(mine.index)
        keep = ref.notna()
        mine, ref = mine[keep], ref[keep].astype(bool)
        kl = part["kl_answer"] if "kl_answer" in part else pd.Series(dtype=float)
        rows.append({"family": family, "x": x, "mode": mode, "n": int(len(mine)),
                     "full_right": int(ref.sum()), "mode_right": int(mine.sum()),
                     "full_only": int((ref & ~mine).sum()), "mode_only": int((mine & ~ref).sum()),
                     "kl_answer": float(kl.mean()) if len(kl) else np.nan})
    return pd.DataFrame(rows)


def expand_cells(cells: pd.DataFrame) -> pd.DataFrame:
    """Cells -> results rows (id, family, x, mode, correct, kl_answer) with the same counts:
    in every (family, x) the first `full_right` examples are right under `full`; a mode loses
    its first `full_only` of them and wins `mode_only` of the others."""
    rows = []
    for (family, x), part in cells.groupby(["family", "x"], sort=False):
        n, right = int(part["n"].max()), int(part["full_right"].iloc[0])
        ids = [f"{family}/x={x}/{i}" for i in range(n)]
        full = np.arange(n) < right
        rows.append(pd.DataFrame({"id": ids, "family": family, "x": x, "mode": FULL,
                                  "correct": full, "kl_answer": 0.0}))
        for rec in part.to_dict("records"):
            correct = full.copy()
            correct[:rec["full_only"]] = False
            correct[right:right + rec["mode_only"]] = True
            rows.append(pd.DataFrame({"id": ids[:rec["n"]], "family": family, "x": x,
                                      "mode": rec["mode"], "correct": correct[:rec["n"]],
                                      "kl_answer": rec["kl_answer"]}))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def archive(study: Path, into: Path, weights: bool = False) -> list[str]:
    """Archive every model of `study` that has suite results into `into`; returns the labels.
    weights: also keep each model's final checkpoint (`runs/<job>/seed<k>/final/`: weights and
    model config, a few megabytes at the studies' sizes) and its training curve
    (`metrics.jsonl`), so that a later suite can read the same models without retraining."""
    done = []
    for run_id, folder in identified(study / "suite"):
        results, label = folder / "results.csv", run_id.label
        if not results.exists():
            continue
        target = into / "suite" / label
        write_run_id(target, run_id)
        table = pd.read_csv(results, dtype={"x": str, "target": str, "prediction": str},
                            low_memory=False)
        cells_of(table).to_csv(target / CELLS, index=False, float_format="%.6g")
        # a mode's typed columns where the suite wrote them (evals.modes.MODE_COLUMNS), so the
        # archive's readers need not recover them from the label
        kept = [c for c in (*OUTCOME_COLUMNS, *MODE_COLUMNS) if c in table]
        outcomes = table[kept].assign(
            correct=table["correct"].astype(bool).astype(int))
        # gzip's header time fixed, so archiving the same results again writes the same bytes
        outcomes.to_csv(target / OUTCOMES, index=False, float_format="%.6g",
                        compression={"method": "gzip", "mtime": 0})
        # the suite run's identity and settings, not its tables (the cells hold those)
        run = json.loads((results.parent / "summary.json").read_text()).get("run", {})
        keep = {k: run[k] for k in ("checkpoint", "config", "settings", "examples", "modes",
                                    "seconds") if k in run}
        (target / "summary.json").write_text(json.dumps({"run": keep}, indent=1) + "\n")
        archive_run(study, into, run_id, weights)
        done.append(label)
    # the study driver's own erf step (`erf:`): one evals.erf output per model
    for summary in sorted((study / "erf").glob("*/seed*/summary.json")):
        archive_erf(summary.parent, into)
    done += [label for label in archive_real_text(study, into, weights) if label not in done]
    _merge_summary(study / "summary.json", into / "summary.json")
    return done


def archive_run(study: Path, into: Path, run_id, weights: bool) -> None:
    """One training run's config and identity and, with `weights`, its final checkpoint,
    curve and training record (study_step.json: put back, the driver skips the run)."""
    run, kept = study / "runs" / run_id.model, into / "runs" / run_id.model
    write_run_id(kept, run_id.trained)
    for name in ("config.yaml", *(("study_step.json", *WEIGHT_FILES) if weights else ())):
        if (run / name).exists():
            (kept / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(run / name, kept / name)


def archive_real_text(study: Path, into: Path, weights: bool = False) -> list[str]:
    """A study's real-text reading (the driver's `real_text:` step): per model read, its
    tables (`READING_FILES`: not tokens.parquet, hundreds of megabytes at the findings scale,
    nor the step's record, so a study put back reads the model again) and its run
    (`archive_run`); in real_text/ the merged tables of every model and lm-eval's documents
    (`archive_lm_eval`). Returns the labels of the models archived."""
    root, done = study / "real_text", []
    for run_id, folder in identified(root):
        if not (folder / "baselines.csv").exists():
            continue
        target = into / "real_text" / run_id.label
        write_run_id(target, run_id)
        for name in READING_FILES:
            if (folder / name).exists():
                shutil.copy(folder / name, target / name)
        archive_run(study, into, run_id, weights)
        done.append(run_id.label)
    if (root / "baselines.csv").exists():        # the merged reading, and lm-eval's documents
        (into / "real_text").mkdir(parents=True, exist_ok=True)
        for name in READING_FILES:
            if (root / name).exists():
                shutil.copy(root / name, into / "real_text" / name)
        archive_lm_eval(root, into / "real_text")
    return done


def archive_lm_eval(source: Path, target: Path) -> None:
    """lm-eval's documents of a real_text study (source: its real_text/, `LM_EVAL_OUTCOMES`)
    into the archive's real_text/, with every run the archive held that the study does not
    (`evals.lm_eval_outcomes.with_earlier_runs`: a study put back from its archive holds only the runs
    read since). Not its tables: `python -m analysis.real_text --lm-eval DIR/real_text/lm_eval
    --earlier <archive>/real_text/lm_eval_outcomes.csv.gz --out DIR/real_text` writes them over
    the same runs. Nothing when the study has no lm-eval documents."""
    fresh, kept = source / LM_EVAL_OUTCOMES, target / LM_EVAL_OUTCOMES
    if not fresh.exists():
        return
    rows = read_outcomes(fresh)
    if kept.exists():
        rows = with_earlier_runs(rows, read_outcomes(kept))
    write_outcomes(rows, kept)


def archive_erf(erf_dir: Path, into: Path) -> Path:
    """Per checkpoint of an evals.erf output, the decoder's influence shares beyond W and 2W
    (`evals.erf.erf_shares`), merged into `into/erf_shares.csv` (a model measured again
    replaces its row)."""
    path = into / "erf_shares.csv"
    new = erf_shares(erf_dir)
    if path.exists():
        old = pd.read_csv(path)
        keep = ~old.set_index(["job", "seed"]).index.isin(new.set_index(["job", "seed"]).index)
        new = pd.concat([old[keep], new], ignore_index=True)
    into.mkdir(parents=True, exist_ok=True)
    new.sort_values(["job", "seed"]).to_csv(path, index=False, float_format="%.6g")
    return path


def _merge_summary(source: Path, target: Path) -> None:
    """The archive's summary.json: every invocation of every archived study directory once
    (one invocation, archived again while it ran on, keeps its latest record: same command,
    commit and start) and the steps' records, later ones replacing earlier ones of the key;
    a step's `invocation` (an index into its directory's invocations) renumbered to index the
    merged list, so that it names the invocation that ran it."""
    if not source.exists():
        return
    new = json.loads(source.read_text())
    old = json.loads(target.read_text()) if target.exists() else {}
    invocations: dict = {}
    for record in old.get("invocations", []) + new.get("invocations", []):
        invocations[_invocation_key(record)] = record
    ordered = sorted(invocations.values(), key=lambda r: r.get("started", ""))
    position = {_invocation_key(record): i for i, record in enumerate(ordered)}
    steps = {**_renumbered(old, position), **_renumbered(new, position)}
    merged = {**new, "steps": steps, "invocations": ordered}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(merged, indent=1) + "\n")


def _invocation_key(record: dict) -> tuple:
    """An invocation's identity across archivings: its command, commit and start."""
    return record.get("command"), record.get("commit"), record.get("started")


def _renumbered(summary: dict, position: dict) -> dict:
    """`summary`'s step records, each `invocation` index (into summary's own invocations) moved
    to the merged list's (`position`: invocation key -> index); an index its list does not
    hold (the driver's -1 for a rebuilt report) is left as it is."""
    own, steps = summary.get("invocations", []), {}
    for key, record in summary.get("steps", {}).items():
        index = record.get("invocation")
        if isinstance(index, int) and 0 <= index < len(own):
            record = {**record, "invocation": position[_invocation_key(own[index])]}
        steps[key] = record
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.archive",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--study", required=True, help="a study directory with suite results")
    p.add_argument("--into", required=True, help="the archive (a skeleton study directory)")
    p.add_argument("--erf", default=None, help="an evals.erf output directory over some of the "
                                               "study's checkpoints: their influence shares go "
                                               "into <into>/erf_shares.csv")
    p.add_argument("--weights", action="store_true", help=(
        "also keep each model's final checkpoint and metrics.jsonl, so that the archive can "
        "be read again by a later suite without retraining"))
    args = p.parse_args(argv)
    study = Path(args.study)
    if not (study / "suite").is_dir() and not (study / "summary.json").exists():
        print(f"error: --study {study}: not a study directory (no suite/, no summary.json)",
              file=sys.stderr)
        return 2
    if args.erf and not (Path(args.erf) / "erf.csv").exists():
        print(f"error: --erf {args.erf}: not an evals.erf output directory (no erf.csv); the "
              f"study's own erf/<job>/seed<k>/ outputs are archived without --erf",
              file=sys.stderr)
        return 2
    labels = archive(study, Path(args.into), weights=args.weights)
    if args.erf:
        archive_erf(Path(args.erf), Path(args.into))
    print(f"[archive] {len(labels)} models into {args.into}: {' '.join(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
