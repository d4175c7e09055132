"""The real-text study published: findings/real_text from a finished `real_text` study
directory (`publish`), and the lm-eval drops over the code tasks (`write_lm_eval`). The
measurement itself (per-byte KL of bounded replay on held-out source files) is evals/real_text.py.

    python -m analysis.real_text --lm-eval DIR/real_text/lm_eval --earlier ARCHIVE/real_text/lm_eval_outcomes.csv.gz --out DIR/real_text

writes a study's lm-eval tables over its runs and the runs an archive holds that the study
directory lost (`with_earlier_runs`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd

from ced.records import write_json
from evals.lm_eval_outcomes import (LM_EVAL_OUTCOMES, LM_EVAL_RUN, lm_eval_runs, read_lm_eval,
                                    read_outcomes, with_earlier_runs, write_outcomes)

from . import plots
from .publish import markdown, provenance, provenance_markdown
from .report import load_runs, training_table
from .tables import accuracy_table, capability_drop_table


def write_lm_eval(root: Path, out: Path, runs: list[Path] | None = None,
                  earlier: Path | None = None) -> dict[str, Path]:
    """`write_lm_eval_tables` over `read_lm_eval(root, runs)` (of `runs` only, when given: the
    study driver passes the runs of its current spec) and, when `earlier` names an outcomes
    file of the same study (an archive's lm_eval_outcomes.csv.gz), every run it holds that
    `root` does not (`with_earlier_runs`)."""
    results = read_lm_eval(root, runs)
    if earlier is not None:
        results = with_earlier_runs(results, read_outcomes(earlier))
    return write_lm_eval_tables(results, out)


def write_lm_eval_tables(results: pd.DataFrame, out: Path) -> dict[str, Path]:
    """lm_eval.csv (every mode against full, paired on documents: the example-level and
    seed-level CIs, p-values and Holm of `analysis.tables.capability_drop_table`),
    lm_eval_accuracy.csv (accuracy per job, task, distance bin and mode) and
    lm_eval_outcomes.csv.gz (`results`, one row per run and document: what `analysis.archive`
    keeps) in `out`. The tables do not depend on the rows' order."""
    out.mkdir(parents=True, exist_ok=True)
    write_outcomes(results, out / LM_EVAL_OUTCOMES)
    accuracy = accuracy_table(results)
    accuracy.to_csv(out / "lm_eval_accuracy.csv", index=False)
    drops = capability_drop_table(results)
    drops.to_csv(out / "lm_eval.csv", index=False)
    return {"lm_eval": out / "lm_eval.csv", "lm_eval_accuracy": out / "lm_eval_accuracy.csv",
            "lm_eval_outcomes": out / LM_EVAL_OUTCOMES}


# the study's tables and plots that findings/real_text/ keeps (tokens.parquet, tens of MB at the
# findings scale, stays in the study directory)
PUBLISHED = ("baselines.csv", "kl_by_class.csv", "kl_by_position.csv", "lm_eval.csv",
             "lm_eval_accuracy.csv", "kl_by_position.png", "kl_by_class.png", "settings.json")


def publish(study: Path, out: Path) -> dict[str, Path]:
    """findings/real_text from a finished `real_text` study directory (`python -m
    analysis.findings --study DIR --out DIR` calls this when DIR has real_text/ and no suite/):
    the tables and plots of PUBLISHED, lm-eval's results_*.json of every run (under
    lm_eval/<job>/seed<k>/<group>/<mode>/, without the samples), training.csv (per run: parameters, steps, last
    training loss, last validation loss) and training_curves.png, provenance.json (commands,
    commits, step times) and findings.md (those tables in Markdown, headed by the provenance).
    FileNotFoundError if the study has no real_text/baselines.csv."""
    source = Path(study) / "real_text"
    if not (source / "baselines.csv").exists():
        raise FileNotFoundError(f"{source}/baselines.csv: the study's real_text step has not "
                                "run (python -m experiments.run study=real_text ...)")
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in PUBLISHED:
        if (source / name).exists():
            written[name.replace(".", "_")] = Path(shutil.copy2(source / name, out / name))
    # lm-eval's own output (results_*.json; the per-document samples stay) of the runs that
    # lm_eval_accuracy.csv read: a run of a mode the study no longer asks for is left behind
    read = set()
    if (source / "lm_eval_accuracy.csv").exists():
        table = pd.read_csv(source / "lm_eval_accuracy.csv")
        read = set(zip(table["job"], table["mode"]))
    for run_dir, job, _, mode in lm_eval_runs(source / "lm_eval"):
        if (job, mode) not in read:
            continue
        for result in sorted(run_dir.rglob("results_*.json")):
            target = out / result.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(result, target)
            written["lm_eval_results"] = out / "lm_eval"
    runs = load_runs(Path(study))
    training = training_summary(runs)
    written["training"] = out / "training.csv"
    training.to_csv(written["training"], index=False, float_format="%.6g")
    figure = plots.training_figure(runs)
    if figure is not None:
        written["training_curves"] = plots.save(figure, out / "training_curves.png")
    info = provenance(Path(study))
    written["provenance"] = out / "provenance.json"
    write_json(written["provenance"], info)
    written["findings"] = out / "findings.md"
    written["findings"].write_text(_published_markdown(Path(study), out, info, training))
    return written


def training_summary(runs: dict):
    """`analysis.report.training_table` of the runs (the report's own table: last step, training
    loss, validation loss in nats per byte, parameters), per model: its job and seed (its
    `ced.run_id.RunId`)."""
    table = training_table(runs).rename(columns={"params": "parameters", "steps": "step"})
    models = [runs[label]["run_id"] for label in table["job"]]
    table["job"] = [m.job for m in models]
    table.insert(1, "seed", [m.seed for m in models])
    table["parameters"] = table["parameters"].astype("Int64")   # none for an unfinished run
    return table


def _published_markdown(study: Path, out: Path, info: dict, training) -> str:
    """findings.md of `publish`: competence against the n-gram baselines, the seed-level KL
    per N and token class, each model's KL per N, and the lm-eval drops pooled over distance."""
    base = pd.read_csv(out / "baselines.csv")
    base = base.assign(below_bigram=base["bigram_nll"] - base["nll_exact"])
    if "xz9_nll" in base:           # readings before the xz anchor have no such column
        base = base.assign(below_xz9=base["xz9_nll"] - base["nll_exact"])
    classes = pd.read_csv(out / "kl_by_class.csv")
    seeds, models = classes[classes["level"] == "seeds"], classes[classes["level"] == "model"]
    md = [f"# {study.name}: real-text findings tables (python -m analysis.findings)", "",
          *provenance_markdown(info),
          "## Competence: held-out NLL (nats per byte) against the n-gram baselines and "
          "`xz -9` (xz9_nll: the files as one stream; xz9_scored_nll: per file, on the bytes "
          "after the context; below_xz9 > 0: the model beats the stream)", "",
          markdown(base, [c for c in ["job", "seed", "variant", "parameters", "nll_exact",
                                      "unigram_nll", "bigram_nll", "below_bigram", "xz9_nll",
                                      "xz9_scored_nll", "below_xz9", "bytes"] if c in base],
                   digits=4),
          "## Training (last logged step; val_loss_last_change < 0: validation NLL was still "
          "falling between the last two evaluations)", "",
          markdown(training, [c for c in ["job", "seed", "parameters", "step", "train_loss",
                                          "val_loss", "val_loss_last_change"] if c in training],
                   digits=4),
          "## KL(exact || replay N) per byte, pooled over each job's models (seed-level CI: "
          "models and files drawn crossed)", "",
          markdown(seeds, ["job", "replay", "N", "group", "models", "files", "bytes", "kl_mean",
                            "kl_ci_low", "kl_ci_high", "kl_median", "kl_p99", "kl_max",
                            "dnll_mean", "dnll_ci_low", "dnll_ci_high", "delta_ppl"]),
          "## Each model's KL over every scored byte (CI over files)", "",
          markdown(models[models["group"] == "all"],
                    ["checkpoint", "replay", "N", "bytes", "kl_mean", "kl_ci_low", "kl_ci_high",
                     "kl_p99", "kl_max", "delta_ppl"])]
    if (out / "lm_eval.csv").exists():
        drops = pd.read_csv(out / "lm_eval.csv")
        md += ["## lm-eval (ced_code, ced_code_turn): each mode against full, pooled over "
               "distance", "",
               markdown(drops[drops["x"].astype(str) == "all"],
                         ["job", "family", "mode", "seeds", "n", "acc_full", "acc_mode",
                          "difference", "ci_low", "ci_high", "seed_ci_low", "seed_ci_high",
                          "per_seed_difference"])]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.real_text",
                                description="a real-text study's lm-eval tables (write_lm_eval)")
    p.add_argument("--lm-eval", required=True, help="the study's lm-eval runs "
                   "(DIR/real_text/lm_eval: <job>/seed<k>/<group>/<mode>/)")
    p.add_argument("--earlier", default=None, help="an lm_eval_outcomes.csv.gz of the same "
                   "study (its archive's): its runs the study no longer holds join the tables")
    p.add_argument("--out", required=True, help="where the tables go (DIR/real_text)")
    args = p.parse_args(argv)
    earlier = Path(args.earlier) if args.earlier else None
    if earlier is not None and not earlier.exists():
        p.error(f"--earlier {earlier}: no such file")
    try:
        written = write_lm_eval(Path(args.lm_eval), Path(args.out), earlier=earlier)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = read_outcomes(written["lm_eval_outcomes"])[LM_EVAL_RUN].drop_duplicates()
    print(f"[lm_eval] {len(runs)} runs (model x task x mode) of "
          f"{runs['run'].nunique()} models: " + " ".join(str(v) for v in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
