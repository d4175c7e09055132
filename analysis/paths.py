"""Which path carries each model's evidence past the replay start: `python -m analysis.paths`.

    python -m analysis.paths --paths DIR [DIR ...] --models findings/encoder_w/models.csv \
        --out findings/encoder_w [--jobs JOB ...] [--archive findings/encoder_w/archive]

Reads `evals.paths`' rows.csv (--paths: its --out, or an archive holding paths_rows.csv.gz;
every document read `full`, `replay`, `global_cut` and `both` at the same cut s = T - N,
docs/semantics.md 4.6) and keeps, as
`analysis.reach` does, the competent bins: per model x family x span start, `full` accuracy
>= COMPETENT. On the documents of those bins whose evidence lies before the cut (distance > N)
and that `full` answers, per model and N, the share of those answers each path keeps alone
(`retained`), beside the documents' chance level:

  global   what `replay` keeps: the decoder's global read (and the encoder) alone;
  chain    what `global_cut` keeps: the decoder's window chain (and the encoder) alone;
  encoder  what `both` keeps: the encoder's hidden state at the replayed positions alone.

The shares are not corrected for chance: a model that has lost the evidence does not guess, it
answers from what it still sees (a count of the visible span), so its retained share falls
below chance, where a chance correction would report a negative amount carried. `global` is
the bounded replay itself, so its share restates the drop at N = W; `chain` and `encoder` are
what the replay cannot show.

Beside each model its drop at N = W beyond (models.csv of `analysis.reach`, --models): does the
chain's share predict what a bounded replay loses? The correlation and the figure read each
model at the smallest N it was read at, which is W when evals.paths ran with `--replay W`
among its replays (its default); read the running families (`--families` of evals.paths), as
reach's drops are. Writes

  paths.csv        per model x N x path: documents, kept, retained with its Wilson CI,
                   chance, and the model's drop at N = W beyond
  paths_cells.csv  per job x N x path: models, mean retained with its Student t (seed-level)
                   interval, and the pooled example-level Wilson CI
  paths_by_distance.csv  per job x span start d x path at N = W: the retained share averaged
                   over the models competent on the bin (families pooled), with its min and max
  paths.md         the cells at N = W and the Spearman correlations at N = W, with the inputs
  paths.png        retained share against N per job and path, and against d at N = W; chain
                   against the drop at N = W
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from evals.cli import list_written
from evals.paths import retained
from evals.plots import grid, save
from evals.suites.stats import seed_t_test, wilson_interval

from . import tables
from .per_model import COMPETENT

PATHS = {"replay": "global", "global_cut": "chain", "both": "encoder"}


def competent_rows(rows: pd.DataFrame, competent: float = COMPETENT) -> pd.DataFrame:
    """rows (`evals.paths` rows.csv) of the bins (model x family x x) where `full` reaches
    `competent` accuracy; `full` is read once per document, so its N-copies are one."""
    full = rows[rows["reading"] == "full"].drop_duplicates(["model", "id"])
    accuracy = full.groupby(["model", "family", "x"])["correct"].mean()
    keep = accuracy[accuracy >= competent].reset_index()[["model", "family", "x"]]
    return rows.merge(keep, on=["model", "family", "x"])


def per_model(rows: pd.DataFrame, drops: pd.DataFrame | None = None,
              competent: float = COMPETENT) -> pd.DataFrame:
    """One row per model x N x path (see the module docstring); `drops`: models.csv with
    job, seed and drop_beyond (None: no drop column)."""
    table = retained(competent_rows(rows, competent))
    if table.empty:
        return table
    table["path"] = table["reading"].map(PATHS)
    if drops is not None:
        table = table.merge(drops[["job", "seed", "drop_beyond"]].rename(
            columns={"drop_beyond": "drop_at_W_beyond"}), on=["job", "seed"], how="left")
    return table


def cells(models: pd.DataFrame) -> pd.DataFrame:
    """Per job x N x path: the mean retained share over models with its seed-level t
    interval, and the example-level Wilson CI of the pooled kept / documents."""
    out = []
    for (job, n, path), group in models.groupby(["job", "N", "path"]):
        low, high, _ = seed_t_test(group["retained"])
        kept, docs = int(group["kept"].sum()), int(group["n"].sum())
        ex_low, ex_high = wilson_interval(kept, docs)
        out.append({"job": job, "N": n, "path": path, "models": len(group),
                    "retained": float(group["retained"].mean()), "model_ci_low": low,
                    "model_ci_high": high, "documents": docs, "kept": kept,
                    "example_ci_low": ex_low, "example_ci_high": ex_high,
                    "chance": float(group["chance"].mean())})
    return pd.DataFrame(out)


def by_distance(rows: pd.DataFrame, competent: float = COMPETENT) -> pd.DataFrame:
    """Per job x span start d x path, at each model's smallest N (N = W by default): the
    retained share of each model competent on the bin (families pooled), averaged over those
    models; d <= N rows are left out (nothing to cut)."""
    kept = competent_rows(rows, competent)
    kept = kept[kept["N"] == kept.groupby("model")["N"].transform("min")]
    out = []
    for d, part in kept[kept["distance"] > kept["N"]].groupby("distance"):
        shares = retained(part)
        if shares.empty:
            continue
        for (job, reading), group in shares.groupby(["job", "reading"]):
            out.append({"job": job, "distance": d, "path": PATHS[reading],
                        "models": len(group), "retained": float(group["retained"].mean()),
                        "retained_min": float(group["retained"].min()),
                        "retained_max": float(group["retained"].max()),
                        "documents": int(group["n"].sum()),
                        "chance": float(group["chance"].mean())})
    return pd.DataFrame(out, columns=["job", "distance", "path", "models", "retained",
                                      "retained_min", "retained_max", "documents", "chance"])


def correlations(models: pd.DataFrame) -> pd.DataFrame:
    """Per path at each model's smallest N (N = W on the evals.paths default): Spearman's
    rho of the retained share against the drop at N = W beyond, over the models with both
    (for `global`, the replay itself: a restatement, not a finding)."""
    from scipy.stats import spearmanr   # lazy: scipy.stats costs ~0.6 s to import
    first = models[models["N"] == models.groupby("model")["N"].transform("min")]
    out = []
    for path, group in first.groupby("path"):
        pairs = group.dropna(subset=["retained", "drop_at_W_beyond"])
        rho, p = (spearmanr(pairs["retained"], pairs["drop_at_W_beyond"])
                  if len(pairs) >= 3 and pairs["retained"].nunique() > 1
                  and pairs["drop_at_W_beyond"].nunique() > 1 else (np.nan, np.nan))
        out.append({"path": path, "models": len(pairs), "rho": float(rho), "p": float(p)})
    return pd.DataFrame(out)


def figure(models: pd.DataFrame, table: pd.DataFrame, distance: pd.DataFrame):
    """Left: retained share against N / W per job (lines: chain solid, global dashed, encoder
    dotted) with the model-level CI. Middle: at N = W, against the span start d / W. Right:
    chain's share at the smallest N against the drop at N = W beyond, a point per model."""
    fig, (left, middle, right) = grid(3, 5.0, 3.8)
    styles = {"chain": "-", "global": "--", "encoder": ":"}
    windows = models.groupby("job")["N"].min()
    for i, job in enumerate(sorted(distance["job"].unique())):
        for path, style in styles.items():
            part = distance[(distance["job"] == job) & (distance["path"] == path)]
            middle.plot(part["distance"] / windows[job], part["retained"], linestyle=style,
                        marker=".", color=f"C{i % 10}", label=job if path == "chain" else None)
    middle.axhline(0, color="black", linewidth=0.8)
    middle.set(xlabel="span start d / W (competent bins, N = W)",
               ylabel="share of full's answers kept")
    for i, job in enumerate(sorted(table["job"].unique())):
        for path, style in styles.items():
            part = table[(table["job"] == job) & (table["path"] == path)].sort_values("N")
            x = part["N"] / windows[job]
            left.errorbar(x, part["retained"], linestyle=style, color=f"C{i % 10}", marker="o",
                          yerr=[(part["retained"] - part["model_ci_low"]).fillna(0).clip(lower=0),
                                (part["model_ci_high"] - part["retained"]).fillna(0).clip(lower=0)],
                          capsize=2, label=f"{job}: {path}" if path == "chain" else None)
    left.axhline(0, color="black", linewidth=0.8)
    left.set(xlabel="cut N / W (the smallest N read)", ylabel="share of full's answers kept",
             title="solid: window chain alone; dashed: global read alone; dotted: encoder")
    first = models[(models["path"] == "chain")
                   & (models["N"] == models.groupby("model")["N"].transform("min"))]
    for i, job in enumerate(sorted(first["job"].unique())):
        part = first[first["job"] == job]
        right.scatter(part["retained"], part["drop_at_W_beyond"], color=f"C{i % 10}", label=job)
    right.set(xlabel="share the window chain alone keeps at N = W",
              ylabel="drop at N = W, evidence beyond W")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    left.title.set_fontsize(7)
    return fig


def markdown(table: pd.DataFrame, rho: pd.DataFrame, sources: dict) -> str:
    def ci(low, high):
        return "-" if pd.isna(low) else f"[{low:.2f}, {high:.2f}]"
    first = table[table["N"] == table.groupby("job")["N"].transform("min")]
    lines = ["# Which path carries the evidence past the replay start (analysis.paths)", "",
             f"Inputs: {json.dumps(sources)}", "",
             "Competent bins, evidence before the cut, answers `full` gets right: the share "
             "each path keeps alone. At the smallest N read (N = W):", "",
             "| job | path | models | retained | model CI | example CI | documents | chance |",
             "|---|---|---|---|---|---|---|---|"]
    for _, r in first.sort_values(["job", "path"]).iterrows():
        lines.append(f"| {r.job} | {r.path} | {r.models} | {r.retained:.2f} | "
                     f"{ci(r.model_ci_low, r.model_ci_high)} | "
                     f"[{r.example_ci_low:.2f}, {r.example_ci_high:.2f}] | {r.documents} | "
                     f"{r.chance:.2f} |")
    lines += ["", "Spearman, retained share at N = W against the drop at N = W beyond "
              "(global: the replay itself, a restatement):", "",
              "| path | models | rho | p |", "|---|---|---|---|"]
    lines += [f"| {r.path} | {r.models} | {r.rho:+.2f} | {r.p:.2g} |" for _, r in rho.iterrows()]
    return "\n".join(lines) + "\n"


ARCHIVED_ROWS = "paths_rows.csv.gz"
# What the analysis reads of rows.csv: the archive keeps these (not the NLL), compressed.
ROW_COLUMNS = ["job", "seed", "model", "id", "family", "x", "distance", "chance", "N", "reading",
               "correct"]


def _rows_of(folder: Path) -> pd.DataFrame:
    """The rows under `folder`: evals.paths' rows.csv, an archive's paths_rows.csv.gz, or a
    study's paths folder (the driver's step per model, <job>/seed<k>/rows.csv)."""
    found = [f for f in (folder / "rows.csv", folder / ARCHIVED_ROWS) if f.exists()]
    if found:
        return pd.read_csv(found[0], usecols=ROW_COLUMNS)
    steps = sorted(folder.glob("*/*/rows.csv"))
    if not steps:
        raise FileNotFoundError(f"{folder}: neither rows.csv (evals.paths --out), "
                                f"{ARCHIVED_ROWS} (an archive) nor <job>/seed<k>/rows.csv (a "
                                "study's paths folder)")
    return pd.concat([pd.read_csv(f, usecols=ROW_COLUMNS) for f in steps], ignore_index=True)


def read_rows(paths: Path | list[Path], jobs: list[str] | None = None) -> pd.DataFrame:
    """evals.paths' rows.csv under each of `paths`, or an archive's paths_rows.csv.gz (an
    archive beside the reads of models trained since), restricted to `jobs` (None: every
    job). A folder with neither: FileNotFoundError; a model in two folders: ValueError."""
    folders = [paths] if isinstance(paths, Path) else list(paths)
    frames = [_rows_of(folder) for folder in folders]
    seen: dict[str, Path] = {}
    for folder, frame in zip(folders, frames):
        for model in frame["model"].unique():
            if model in seen:
                raise ValueError(f"--paths: {model} is read in both {seen[model]} and {folder}")
            seen[model] = folder
    rows = pd.concat(frames, ignore_index=True)
    if jobs:
        missing = sorted(set(jobs) - set(rows["job"]))
        if missing:
            raise ValueError(f"--jobs: {missing} not in {[str(f) for f in folders]} (they "
                             f"hold {sorted(rows['job'].unique())})")
        rows = rows[rows["job"].isin(jobs)]
    return rows


def write(paths: Path | list[Path], out: Path, models_csv: Path | None = None,
          jobs: list[str] | None = None, archive: Path | None = None,
          pools: dict[str, list[str]] | None = None) -> dict[str, Path]:
    """Read evals.paths' rows under `paths` (one folder or several: `read_rows`; and
    models.csv), write the outputs into `out`
    (and, with `archive`, the rows the analysis reads as paths_rows.csv.gz there, gzip
    without a timestamp so that the same rows give the same bytes); returns {name: path}.
    `pools` (`tables.parse_pools`) add a paths_cells.csv row per cell pooled from several
    jobs (`pooled` names them). Missing inputs raise FileNotFoundError."""
    rows = read_rows(paths, jobs)
    drops = pd.read_csv(models_csv) if models_csv else None
    models = per_model(rows, drops)
    if models.empty:
        raise ValueError(f"{paths}: no competent bin with evidence before a cut")
    table = cells(models)
    for cell, members in (pools or {}).items():
        table = pd.concat([table, cells(tables.pooled(models, cell, members)).assign(
            pooled="+".join(members))], ignore_index=True)
    rho = correlations(models) if drops is not None else pd.DataFrame(
        columns=["path", "models", "rho", "p"])
    out.mkdir(parents=True, exist_ok=True)
    written = {"paths": out / "paths.csv", "paths_cells": out / "paths_cells.csv",
               "paths_by_distance": out / "paths_by_distance.csv",
               "paths_md": out / "paths.md", "paths_png": out / "paths.png"}
    models.to_csv(written["paths"], index=False)
    table.to_csv(written["paths_cells"], index=False)
    distance = by_distance(rows)
    distance.to_csv(written["paths_by_distance"], index=False)
    sources = {"paths": [str(p) for p in ([paths] if isinstance(paths, Path) else paths)],
               "models": str(models_csv) if models_csv else None}
    written["paths_md"].write_text(markdown(table, rho, sources))
    save(figure(models, table[table["job"].isin(models["job"])], distance),
         written["paths_png"])
    if archive is not None:
        archive.mkdir(parents=True, exist_ok=True)
        written["paths_rows"] = archive / ARCHIVED_ROWS
        rows.to_csv(written["paths_rows"], index=False,
                    compression={"method": "gzip", "mtime": 0})
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.paths", description=(
        "Per model and cell: the share of the evidence before a replay's cut that the "
        "decoder's window chain, its global read and the encoder each carry alone."))
    parser.add_argument("--paths", required=True, nargs="+", metavar="DIR", help=(
        "evals.paths output directories, or archives holding paths_rows.csv.gz (several: "
        "their models pooled, each model in one)"))
    parser.add_argument("--models", default=None, help=(
        "analysis.reach's models.csv (the drop at N = W beyond per model), for the "
        "correlations"))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--jobs", nargs="+", default=None, metavar="JOB",
                        help="read these jobs only (default: every job in the rows)")
    parser.add_argument("--archive", default=None, help=(
        f"also write the rows it reads, compressed, as DIR/{ARCHIVED_ROWS} (a study's "
        "archive: --paths can read it back)"))
    tables.add_pool_option(parser, "a row of paths_cells.csv after the jobs' own")
    args = parser.parse_args(argv)
    try:
        pools = tables.parse_pools(args.pool)
    except ValueError as error:
        parser.error(str(error))
    return list_written("paths", lambda: write(
        [Path(p) for p in args.paths], Path(args.out),
        Path(args.models) if args.models else None,
        args.jobs, Path(args.archive) if args.archive else None, pools),
        errors=(FileNotFoundError, ValueError))


if __name__ == "__main__":
    raise SystemExit(main())
