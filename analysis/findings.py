"""Seed-pooled statistics of a finished study, for FINDINGS.md: `python -m analysis.findings`.

    python -m analysis.findings --study outputs/studies/replay_length --out findings/replay_length \
        [--compare sim_fixed_W:sim_uniform ...]

Reads what the study driver wrote (`suite/<job>/seed<k>[@topk=K][@kv=SPEC]/results.csv`: one row per
example and mode; `divergence/divergence.parquet`; `runs/<job>/seed<k>/final/config.json`) and
writes into --out:

  accuracy.csv          per job x family x x (distance, or `all` pooled over x) x mode: the
                        accuracy pooled over seeds with its Wilson 95% CI, its seed-level CI,
                        the mean over seeds and each seed's accuracy
  capability_drop.csv   every mode against `full` on the same examples, pooled over seeds: the
                        paired difference (mode - full) with its 95% CI (Agresti-Min: the
                        paired Wald interval with 0.5 added to each cell), the exact McNemar
                        p-value and its Holm correction over the x of one job x family x mode;
                        the seed-level CI and p (below); and each seed's difference and p-value
  competence.csv        per job x family: `full` accuracy pooled over seeds and distances, and
                        whether the exact model is competent (>= COMPETENT) there, so that a
                        drop is only read where there is something to lose
  divergence.csv        per job x T x mode: first-token KL(exact || mode) and top-1 agreement
                        at the cut of a validation prompt (evals.divergence), mean over prompts
                        and seeds with a bootstrap 95% CI over (seed, prompt), each seed's mean
  override_drop.csv     runs with evaluation-time overrides (`@topk=K`, `@kv=SPEC`), every
                        mode against the unmodified model's `full` on the same examples
                        (`reference_drop_table`); only when the study has such runs
  needle_ids.csv        needle family only: `full` accuracy by how far the needle's id is
                        from the nearest other line's (`shared_suffix`: the longest id suffix
                        another line shares; `one_digit_away`: whether a line's id differs in
                        one digit), pooled over seeds (Wilson CI) and per seed, and what the
                        wrong answers are (one wrong digit, taken from the nearest id's line,
                        another line's code)
  answer_kl.csv         per job x family x mode: KL(full || mode) at the suite's answers
                        (teacher-forced, summed over the answer's tokens), mean over examples
                        and seeds with a bootstrap 95% CI, each seed's mean
  accuracy_vs_N.png     accuracy against the replay length N per family, a line per job
                        (pooled over seeds and distances, band: min-max over seeds), W and
                        R_exact marked; `full` as a dashed level
  kl_vs_N.png           KL against N per job (at a prompt cut; at the answer, per family),
                        next to the accuracy drop of the same N (pooled over families the
                        exact model is competent in)
  model_drops.csv       the trained model as the unit (analysis.per_model): per job x seed x
                        family x replay mode, the model's own paired drop, McNemar p, Holm over
                        the families it is competent in, and whether it fails
  failure_rate.csv      per job x replay mode: models that fail, with the exact Clopper-Pearson
                        95% CI of the rate
  n_star.csv            one row per model: job, arm, seed, L_d, W, R_exact, N* (the smallest N
                        from W to R_exact within 0.5 point and 0.01 nats on every competent
                        family), the drop and failure at N = W
  exact_violations.csv  modes that the contract makes exact (evals.modes.promises_exact) but
                        that changed answers against `full` (also printed as a warning); only
                        when there are any
  arms.csv              job against job (`analysis.arms`): for every two jobs whose training
                        settings differ in one key (e.g. model.topk: 2 -> 4), and each
                        --compare FROM:TO pair, per family x mode x metric (accuracy, the drop
                        against full, answer KL) pooled over distances: both jobs' values, the
                        difference (to - from) with its example-level CI (paired by document
                        where both read the same documents) and its model-level CI, Welch's p
                        over the models, and the model counts; only when the study has such a
                        pair
  arms.png              the differences of arms.csv in accuracy and answer KL against N, with
                        the model-level CI
  provenance.json       the study's commands, git commits and step times (summary.json)
  findings.md           the tables above in Markdown, for FINDINGS.md, headed by the
                        provenance

A `real_text` study (real_text/ and no suite/) is published by `analysis.real_text.publish`
instead: its tables and plots, training.csv and training_curves.png, provenance.json and
findings.md (then, as for a suite study, its registered prediction's check).

The statistics themselves, and how to read their two levels of confidence interval, are in
analysis/tables.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from ced.records import write_json
from ced.writable import OutputDirError, check_output_dir
from evals.cli import list_written

from . import arms, per_model, plots, predictions
from .publish import markdown, provenance, provenance_markdown
from .real_text import publish
from .tables import (FULL, accuracy_table, answer_kl_table, capability_drop_table,
                     competence_table, divergence_table, exact_mode_check, geometry,
                     load_needle_documents, load_results, needle_id_table, per_model_tables,
                     reference_drop_table, trained_jobs, with_replay_length, write_seed_t)

def write_findings(study: Path, out: Path, alpha: float = 0.05,
                   compare: list[tuple[str, str]] | None = None) -> dict[str, Path]:
    """Compute every table and figure of the module doc for `study` into `out`; `compare`:
    job pairs (from, to) for arms.csv beside those that differ in one setting."""
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(study)
    marks = geometry(study)
    accuracy = accuracy_table(results)
    tables = {"accuracy": accuracy, "capability_drop": capability_drop_table(results, alpha),
              "competence": competence_table(accuracy), "divergence": divergence_table(study),
              "answer_kl": answer_kl_table(results),
              "override_drop": reference_drop_table(results, alpha),
              "needle_ids": needle_id_table(results, load_needle_documents(study)),
              **per_model_tables(results, study, marks, alpha),
              "arms": arms.arms_table(results, arms.job_pairs(
                  study, trained_jobs(results), compare), marks)}
    tables["exact_violations"] = exact_mode_check(tables["capability_drop"], marks)
    for _, row in tables["exact_violations"].iterrows():
        print(f"[findings] WARNING: {row['job']} {row['family']} `{row['mode']}` is exact by "
              f"the contract but changed {row['full_only'] + row['mode_only']} of {row['n']} "
              f"answers against full (exact_violations.csv)", file=sys.stderr)
    written = {}
    optional = ("override_drop", "needle_ids", "model_drops", "failure_rate", "n_star",
                "exact_violations", "arms")
    for name, table in tables.items():
        if name in optional and table.empty:
            continue
        written[name] = out / f"{name}.csv"
        table.to_csv(written[name], index=False, float_format="%.6g")
    written.update(_write_figures(tables, marks, out))
    info = provenance(study)
    written["provenance"] = out / "provenance.json"
    write_json(written["provenance"], info)
    written["findings"] = out / "findings.md"
    written["findings"].write_text(_findings_markdown(study, info, marks, tables, alpha))
    return add_prediction_check(info, out, written)


def add_prediction_check(info: dict, out: Path, written: dict[str, Path]) -> dict[str, Path]:
    """Where the study has a registered prediction (`check_prediction`): its check as
    prediction_check.json in `out` and a last section of written["findings"]. Returns
    `written`, with the check's path added."""
    check = check_prediction(info, out)
    if check is not None:
        written["prediction_check"] = out / "prediction_check.json"
        write_json(written["prediction_check"], check.to_dict())
        with open(written["findings"], "a") as fh:
            fh.write(f"\n## Registered prediction\n\n{check.line()}\n")
        print(f"[findings] {check.line()}", file=sys.stderr)
    return written


def publish_real_text(study: Path, out: Path) -> dict[str, Path]:
    """`analysis.real_text.publish` of a real-text study, then its prediction's check."""
    written = publish(study, out)
    return add_prediction_check(provenance(study), out, written)


def check_prediction(info: dict, out: Path):
    """`analysis.predictions.check` of `findings/predictions/<study>.md` against the study's
    invocations (`info`: `provenance`), in the git repository that holds `out` (else this
    checkout); None when the study has no registered prediction."""
    study = info.get("study")
    here = Path(__file__).resolve().parents[1]
    repo = next((p for p in [out.resolve(), *out.resolve().parents] if (p / ".git").exists()),
                here)
    path = predictions.prediction_for(repo, study) if study else None
    if path is None:
        return None
    return predictions.check(repo, path, info.get("invocations", []))


def _write_figures(tables: dict, marks: dict, out: Path) -> dict[str, Path]:
    """accuracy_vs_N.png, kl_vs_N.png (the drops only where the exact model is competent) and,
    with job pairs, arms.png."""
    accuracy, drops = tables["accuracy"], tables["capability_drop"]
    divergence, competence = tables["divergence"], tables["competence"]
    written = {}
    pooled = accuracy[accuracy["x"] == "all"]
    figure = plots.findings_accuracy_figure(with_replay_length(pooled, marks),
                                            pooled[pooled["mode"] == FULL], marks)
    if figure is not None:
        written["accuracy_vs_N"] = plots.save(figure, out / "accuracy_vs_N.png", title_room=True)
    kl = divergence[divergence["metric"] == "kl"] if not divergence.empty else divergence
    competent = competence[competence["competent"]][["job", "family"]]
    drop_points = (drops[drops["x"] == "all"].merge(competent, on=["job", "family"])
                   if not drops.empty else drops)
    written["kl_vs_N"] = plots.save(plots.findings_divergence_figure(
        with_replay_length(kl, marks), with_replay_length(drop_points, marks), marks,
        answer_kl=with_replay_length(tables["answer_kl"], marks)), out / "kl_vs_N.png")
    figure = plots.arms_figure(tables["arms"])
    if figure is not None:
        written["arms_png"] = plots.save(figure, out / "arms.png", title_room=True)
    return written


def _findings_markdown(study: Path, info: dict, marks: dict, tables: dict,
                       alpha: float) -> str:
    """findings.md: the tables of write_findings, each under a heading that says what it is."""
    drops, violations = tables["capability_drop"], tables["exact_violations"]
    against_base, needle_ids = tables["override_drop"], tables["needle_ids"]
    pooled_drops = drops[drops["x"] == "all"] if not drops.empty else drops
    md = [f"# {study.name}: seed-pooled findings tables (python -m analysis.findings)", "",
          *provenance_markdown(info),
          f"Geometry per job: {json.dumps(marks)}", "",
          "## Competence of the exact model (`full`, pooled over distances and seeds)", "",
          markdown(tables["competence"], ["job", "family", "seeds", "n", "accuracy", "ci_low",
                                           "ci_high", "seed_ci_low", "seed_ci_high", "per_seed",
                                           "competent"]),
          "## Capability drop pooled over distances (mode - full, paired, pooled over seeds)",
          "", markdown(pooled_drops, ["job", "family", "mode", "seeds", "n", "acc_full",
                                       "acc_mode", "difference", "ci_low", "ci_high",
                                       "seed_ci_low", "seed_ci_high", "p_value", "seed_p",
                                       "per_seed_difference", "per_seed_p"]),
          "## Significant drops at single distances (Holm over distances, p < "
          f"{alpha})", "",
          markdown(drops[(drops["x"] != "all") & drops["significant"]] if not drops.empty
                    else drops, ["job", "family", "x", "mode", "n", "acc_full", "acc_mode",
                                 "difference", "ci_low", "ci_high", "p_holm",
                                 "per_seed_difference"])]
    if not against_base.empty:
        md += ["## Evaluation-time overrides against the unmodified model (pooled over "
               "distances; `full` of an override is its cost alone)", "",
               markdown(against_base[against_base["x"] == "all"],
                         ["job", "family", "mode", "n", "acc_full", "acc_mode", "difference",
                          "ci_low", "ci_high", "p_value", "agree", "per_seed_difference"])]
    if not needle_ids.empty:
        md += ["## Needle: `full` accuracy by the nearest distractor id, and what the wrong "
               "answers are", "",
               markdown(needle_ids, ["job", "slice", "n", "accuracy", "ci_low", "ci_high",
                                      "per_seed", "wrong", "one_wrong_digit",
                                      "digit_from_nearest", "other_line_code"])]
    md += ["## Exact modes (N >= R_exact, or a policy that rebuilds every state exactly)", "",
           "Every exact mode gave `full`'s answer on every example.\n" if violations.empty
           else "**Exact modes that changed answers** (a bug, or round-off at near-ties):\n\n"
           + markdown(violations, ["job", "family", "mode", "n", "full_only", "mode_only"])]
    md += _per_model_markdown(tables) + _arms_markdown(tables["arms"])
    md += ["## KL(full || mode) at the answer (suite examples, teacher-forced; mean over "
           "examples and seeds, bootstrap 95% CI)", "",
           markdown(tables["answer_kl"], ["job", "family", "mode", "seeds", "n", "mean",
                                           "ci_low", "ci_high", "seed_ci_low", "seed_ci_high",
                                           "per_seed"], 3),
           "## First-token divergence at a validation prompt's cut (mean over prompts and "
           "seeds, bootstrap 95% CI)", "",
           markdown(tables["divergence"], ["job", "T", "mode", "metric", "seeds", "n", "mean",
                                            "ci_low", "ci_high", "seed_ci_low", "seed_ci_high",
                                            "per_seed"], 3)]
    return "\n".join(md)


def _arms_markdown(table: pd.DataFrame) -> list[str]:
    """The job-against-job section of findings.md (none without a pair of jobs)."""
    if table.empty:
        return []
    return ["## Job against job (to - from, pooled over distances; example-level CI paired by "
            "document where both jobs read the same ones, model-level CI and Welch p with the "
            "models as the unit)", "",
            markdown(table, ["from", "to", "differs", "family", "mode", "metric", "models_from",
                              "models_to", "value_from", "value_to", "difference", "ci_low",
                              "ci_high", "seed_ci_low", "seed_ci_high", "welch_p", "pairing"])]


def _per_model_markdown(tables: dict) -> list[str]:
    """The failure rate and N* sections of findings.md (none where no model was judged)."""
    if tables["failure_rate"].empty:
        return []
    return ["## Models that fail (the trained model as the unit: a significant drop, Holm "
            f"over its competent families, larger than {per_model.FAIL_MIN_DROP:g}; "
            "Clopper-Pearson 95% CI)", "",
            markdown(tables["failure_rate"], ["job", "mode", "N", "models", "failed", "rate",
                                               "rate_low", "rate_high", "failed_seeds"]),
            "## N* per model (smallest N from W with every competent family within "
            f"{per_model.STAR_MAX_DROP:g} of `full` and answer KL <= "
            f"{per_model.STAR_MAX_KL:g} nats)", "",
            markdown(tables["n_star"], ["job", "arm", "seed", "L_d", "W", "R_exact", "N_star",
                                         "drop_at_W", "failed_at_W", "grid"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", help="a study directory (outputs/studies/<name>)")
    p.add_argument("--out", help="output directory (e.g. findings/<name>)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--compare", nargs="*", default=[], metavar="FROM:TO",
                   help="job pairs for arms.csv beside the jobs whose training settings differ "
                        "in one key, e.g. no_sim:sim_fixed_W")
    p.add_argument("--seed-t", metavar="FINDINGS_DIR", type=Path,
                   help="instead: add seed-level t intervals to an existing findings directory "
                        "whose study directory is gone (writes <dir>/seed_level.csv)")
    args = p.parse_args(argv)
    if args.seed_t is not None:
        target = ("--seed-t", args.seed_t)
    elif not args.study or not args.out:
        p.error("--study and --out are required (or --seed-t FINDINGS_DIR)")
    else:
        target = ("--out", args.out)
    try:
        check_output_dir(target[1], target[0])
    except OutputDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seed_t is not None:
        return list_written("findings", lambda: write_seed_t(args.seed_t))
    study = Path(args.study)
    if not (study / "suite").is_dir() and (study / "real_text").is_dir():
        return list_written("findings", lambda: publish_real_text(study, Path(args.out)))
    if not (study / "suite").is_dir():
        p.error(f"--study {study}: no suite/ or real_text/ directory (is it a study "
                "directory?)")
    pairs = [tuple(item.split(":")) for item in args.compare]
    bad = [item for item, pair in zip(args.compare, pairs) if len(pair) != 2 or not all(pair)]
    if bad:
        print(f"error: --compare: expected FROM:TO (two job names), got {bad[0]!r}",
              file=sys.stderr)
        return 2
    return list_written("findings", lambda: write_findings(study, Path(args.out), args.alpha,
                                                           pairs),
                        errors=(FileNotFoundError, arms.CompareError))


if __name__ == "__main__":
    sys.exit(main())
