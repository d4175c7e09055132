"""How far back each model reads its evidence, and what replay keeps it: `python -m analysis.reach`.

    python -m analysis.reach --study outputs/studies/ladder --out findings/ladder \
        [--erf findings/ladder/archive/erf_shares.csv]

Reads a finished study whose suite ran the running families on a grid of span starts that
reaches past R_exact (`suite.options.span_grid: uncensored`, `evals.suites.families
.uncensored_span_starts`) and, beside the seed-pooled tables of `analysis.findings` (run first,
into the same --out), writes the trained model as the unit, one distance bin at a time:

  bins.csv     per model x family x span start d (a bin): examples, `full` accuracy, whether
               the model is competent on the bin (full >= COMPETENT, per bin, not pooled),
               the drop at N = W, N*(d) (the smallest N on the study's replay grid from which
               on the drop on the bin is at most STAR_MAX_DROP: every larger N on the grid
               keeps it too, so one lucky N below a failing one does not count) and the margin
               N*(d) - d
  models.csv   per model: N* (the largest N*(d) over its competent bins), the largest
               competent d (the reach the model uses: beyond it the suite cannot say what a
               replay costs), the grid's horizon (its largest d), the drop at N = W on its
               competent bins split into evidence inside the replay (d <= W) and beyond it
               (d > W), whether it fails beyond (an exact McNemar p < 0.05 and a drop over 1
               point), `full` on the recall family (does its global path retrieve?) and, with
               --erf, its share of decoder influence beyond W
  cells.csv    per job: models, N* (median, min, max) and the largest competent d, the drop at
               N = W inside and beyond with the example-level 95% CI (Agresti-Min over the
               pooled pairs) and the model-level one (`analysis.tables.model_level_columns`:
               a bootstrap over models and their documents), the failures beyond W with an
               exact Clopper-Pearson CI, recall and the influence share beyond W
  steps.csv    job against job (each job against the next, and --compare pairs): the change
               in the mean drop at N = W inside and beyond, with a bootstrap CI over models
               and Welch's p, and over the seeds both jobs have, the paired change with its
               seed-level t CI and p (`job_steps`)
  margins.csv  per job x family x d: N*(d) - d over the models competent on the bin (median,
               min, max) and how many of them need N*(d) >= d - W (`margin_table`)
  margin.png   N*(d) - d against d, each job's median over its models, one panel a family
  drop_at_W.png   the drop at N = W inside and beyond per job, models as points, with the
               model-level CI
  reach.md     the tables in Markdown, with the provenance and the prediction check of
               `analysis.findings`

A model's N* is censored by its own reach, not by the suite's: a bin where `full` is below
COMPETENT says nothing of replay, and models.csv says how far the competent bins go.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from evals.cli import list_written
from evals.erf import erf_shares
from evals.plots import save
from evals.suites.stats import binomial_two_sided, clopper_pearson, seed_t_test, welch_p

from . import findings, publish, tables
from .per_model import COMPETENT, FAIL_MIN_DROP, STAR_MAX_DROP, replay_length_by_job

RUNNING = ("running_count", "running_bracket")
RECALL = "recall"
FULL = "full"


def paired_outcomes(results: pd.DataFrame, marks: dict,
                    families: tuple[str, ...] = RUNNING) -> pd.DataFrame:
    """Per model x document x single-turn replay mode of `families`: job, seed, family, id, d
    (the span start), N, full and mode (bool), diff (mode - full in {-1, 0, +1})."""
    part = results[results["family"].isin(families)]
    full = part[part["mode"] == FULL][["job", "train_seed", "family", "id", "x", "correct"]]
    full = full.rename(columns={"correct": "full"})
    rows = part[part["mode"] != FULL].copy()
    rows["N"] = replay_length_by_job(rows, marks)
    rows = rows[rows["N"].notna()]
    rows = rows.merge(full, on=["job", "train_seed", "family", "id", "x"], how="inner")
    out = pd.DataFrame({"job": rows["job"], "seed": rows["train_seed"].astype(int),
                        "family": rows["family"], "id": rows["id"],
                        "d": pd.to_numeric(rows["x"]).astype(int), "N": rows["N"].astype(int),
                        "full": rows["full"].astype(bool), "mode": rows["correct"].astype(bool)})
    out["diff"] = out["mode"].astype(int) - out["full"].astype(int)
    return out.reset_index(drop=True)


def n_star_of_bin(by_n: pd.Series, max_drop: float = STAR_MAX_DROP) -> float:
    """N*(d) from one bin's drop at each N (a Series indexed by N): the smallest N from which
    on every N of the grid loses at most `max_drop`; NaN if even the largest does not."""
    star = math.nan
    for n in sorted(by_n.index, reverse=True):
        if by_n[n] < -max_drop:
            break
        star = n
    return float(star)


def bin_table(paired: pd.DataFrame, results: pd.DataFrame, marks: dict,
              max_drop: float = STAR_MAX_DROP, competent: float = COMPETENT) -> pd.DataFrame:
    """bins.csv (see module doc): one row per model x family x d."""
    rows = []
    for (job, seed, family, d), part in paired.groupby(["job", "seed", "family", "d"], sort=True):
        w = marks.get(job, {}).get("W")
        by_n = part.groupby("N")["diff"].mean()
        first = part[part["N"] == part["N"].iloc[0]]
        acc_full = float(first["full"].mean())
        star = n_star_of_bin(by_n, max_drop)
        at_w = part[part["N"] == w] if w is not None else part.iloc[:0]
        rows.append({"job": job, "seed": int(seed), "family": family, "d": int(d),
                     "W": w, "R_exact": marks.get(job, {}).get("R_exact"), "n": len(first),
                     "acc_full": acc_full, "competent": acc_full >= competent,
                     "beyond_W": w is not None and d > w,
                     "drop_at_W": float(at_w["diff"].mean()) if len(at_w) else math.nan,
                     "N_star_d": star, "margin": star - d,
                     "grid": " ".join(str(int(n)) for n in sorted(by_n.index))})
    return pd.DataFrame(rows)


def _pairs(part: pd.DataFrame) -> dict:
    """n, the paired difference and the discordant counts of `diff` rows."""
    b, c = int((part["diff"] < 0).sum()), int((part["diff"] > 0).sum())
    n = len(part)
    return {"n": n, "b": b, "c": c, "drop": (c - b) / n if n else math.nan,
            "p": binomial_two_sided(b, b + c)}


def model_table(paired: pd.DataFrame, bins: pd.DataFrame, results: pd.DataFrame,
                marks: dict, erf: pd.DataFrame | None = None) -> pd.DataFrame:
    """models.csv (see module doc): one row per model."""
    recall = results[(results["family"] == RECALL) & (results["mode"] == FULL)]
    recall_acc = recall.groupby(["job", "train_seed"])["correct"].mean()
    rows = []
    for (job, seed), mine in bins.groupby(["job", "seed"], sort=True):
        w = marks.get(job, {}).get("W")
        good = mine[mine["competent"]]
        ok_bins = set(zip(good["family"], good["d"]))
        at_w = paired[(paired["job"] == job) & (paired["seed"] == seed) & (paired["N"] == w)]
        keep = [(f, d) in ok_bins for f, d in zip(at_w["family"], at_w["d"])]
        at_w = at_w[keep]
        inside, beyond = _pairs(at_w[at_w["d"] <= w]), _pairs(at_w[at_w["d"] > w])
        row = {"job": job, "seed": int(seed), "W": w, "R_exact": marks.get(job, {}).get("R_exact"),
               "N_star": float(good["N_star_d"].max()) if len(good) else math.nan,
               "largest_competent_d": int(good["d"].max()) if len(good) else math.nan,
               "horizon": int(mine["d"].max()), "competent_bins": len(good),
               "bins": len(mine)}
        row["N_star_over_W"] = row["N_star"] / w if w else math.nan
        for side, pairs in (("inside", inside), ("beyond", beyond)):
            row.update({f"{k}_{side}": v for k, v in pairs.items()})
        row["fails_beyond"] = bool(beyond["n"] and beyond["p"] < 0.05
                                   and beyond["drop"] < -FAIL_MIN_DROP)
        row["recall_full"] = float(recall_acc.get((job, seed), math.nan))
        rows.append(row)
    table = pd.DataFrame(rows)
    if erf is not None and not erf.empty and not table.empty:
        table = table.merge(erf[["job", "seed", "share_beyond_W"]], on=["job", "seed"],
                            how="left")
    return table


def cell_table(paired: pd.DataFrame, models: pd.DataFrame, bins: pd.DataFrame,
               marks: dict) -> pd.DataFrame:
    """cells.csv (see module doc): one row per job."""
    rows = []
    for job, mine in models.groupby("job", sort=False):
        w = marks.get(job, {}).get("W")
        ok = bins[(bins["job"] == job) & bins["competent"]][["seed", "family", "d"]]
        at_w = paired[(paired["job"] == job) & (paired["N"] == w)].merge(
            ok, on=["seed", "family", "d"], how="inner")
        stars = mine["N_star"].dropna()
        row = {"job": job, "W": w, "R_exact": marks.get(job, {}).get("R_exact"),
               "models": len(mine), "horizon": int(mine["horizon"].max()),
               "N_star_median": float(stars.median()) if len(stars) else math.nan,
               "N_star_min": float(stars.min()) if len(stars) else math.nan,
               "N_star_max": float(stars.max()) if len(stars) else math.nan,
               "largest_competent_d_median": float(mine["largest_competent_d"].median())}
        for side, part in (("inside", at_w[at_w["d"] <= w]), ("beyond", at_w[at_w["d"] > w])):
            pairs = _pairs(part)
            _, low, high = tables.paired_difference(pairs["b"], pairs["c"], pairs["n"])
            diffs = part.set_index(["seed", "id"])["diff"]
            level = tables.model_level_columns(diffs) if len(diffs) else {
                "seeds": 0, "seed_ci_low": math.nan, "seed_ci_high": math.nan}
            row.update({f"drop_{side}": pairs["drop"], f"ci_low_{side}": low,
                        f"ci_high_{side}": high, f"models_{side}": level["seeds"],
                        f"seed_ci_low_{side}": level["seed_ci_low"],
                        f"seed_ci_high_{side}": level["seed_ci_high"], f"n_{side}": pairs["n"]})
        judged = mine[mine["n_beyond"] > 0]
        k, n = int(judged["fails_beyond"].sum()), len(judged)
        low, high = clopper_pearson(k, n)
        row.update({"failed_beyond": k, "judged_beyond": n, "fail_rate_low": low,
                    "fail_rate_high": high,
                    "recall_full_mean": float(mine["recall_full"].mean())})
        if "share_beyond_W" in mine:
            row["share_beyond_W_mean"] = float(mine["share_beyond_W"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def pooled_cells(paired: pd.DataFrame, models: pd.DataFrame, bins: pd.DataFrame,
                 marks: dict, pools: dict[str, list[str]]) -> pd.DataFrame:
    """cells.csv rows of cells pooled from several jobs (`--pool`, `tables.pooled`), each
    named by its cell and listing its jobs in `pooled`; the jobs must share W and R_exact."""
    rows = []
    for cell, jobs in pools.items():
        shapes = {(marks.get(j, {}).get("W"), marks.get(j, {}).get("R_exact")) for j in jobs}
        if len(shapes) != 1:
            raise ValueError(f"--pool {cell}: jobs of different (W, R_exact) {sorted(shapes)}")
        table = cell_table(tables.pooled(paired, cell, jobs), tables.pooled(models, cell, jobs),
                           tables.pooled(bins, cell, jobs), {cell: marks[jobs[0]]})
        rows.append(table.assign(pooled="+".join(jobs)))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def job_steps(models: pd.DataFrame, pairs: list[tuple[str, str]] | None = None,
              resamples: int = 4000, seed: int = 0) -> pd.DataFrame:
    """steps.csv: job against job, the trained model as the unit. For each pair (A, B) (by
    default each job against the next, in the order of `models`): the difference B - A of the
    mean drop at N = W over their models, inside and beyond the replay, with a 95% bootstrap
    CI that resamples each job's models independently, and Welch's two-sided p. Where the two
    jobs share seeds (the same data order, and the same initialisation where the model's
    shape is the same), also the paired reading over those seeds (`_paired_columns`)."""
    jobs = list(dict.fromkeys(models["job"]))
    pairs = pairs if pairs is not None else list(zip(jobs, jobs[1:]))
    rng = np.random.default_rng(seed)
    rows = []
    for a, b in pairs:
        missing = [j for j in (a, b) if j not in jobs]
        if missing:
            raise ValueError(f"compare: no job {', '.join(missing)}; jobs: {', '.join(jobs)}")
        row = {"from": a, "to": b}
        for side in ("inside", "beyond"):
            x = models[models["job"] == a][f"drop_{side}"].dropna().to_numpy()
            y = models[models["job"] == b][f"drop_{side}"].dropna().to_numpy()
            row.update({f"models_{side}": f"{len(x)} + {len(y)}",
                        f"change_{side}": float(y.mean() - x.mean()) if len(x) and len(y)
                        else math.nan})
            if len(x) and len(y):
                boot = (rng.choice(y, (resamples, len(y))).mean(1)
                        - rng.choice(x, (resamples, len(x))).mean(1))
                row[f"ci_low_{side}"], row[f"ci_high_{side}"] = (
                    float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
            else:
                row[f"ci_low_{side}"] = row[f"ci_high_{side}"] = math.nan
            row[f"welch_p_{side}"] = welch_p(x, y)
            row.update(_paired_columns(models, a, b, side))
        rows.append(row)
    return pd.DataFrame(rows)


def _paired_columns(models: pd.DataFrame, a: str, b: str, side: str) -> dict:
    """The paired reading of job B against job A on one side of the replay, over the seeds both
    have a drop for: how many (paired_seeds), the mean of the per-seed differences B - A
    (paired_change), its Student t 95% CI over seeds and the two-sided p of the paired t test
    (`seed_t_test`; NaN below two seeds). A pair shares what the seed fixes, so the spread
    between seeds cancels: a job that changes one thing the seed does not fix (a precision, a
    step count) is read this way."""
    def by_seed(job: str) -> pd.Series:
        rows = models[models["job"] == job].dropna(subset=[f"drop_{side}"])
        return rows.set_index("seed")[f"drop_{side}"]
    x, y = (by_seed(a), by_seed(b)) if "seed" in models.columns else (pd.Series(), pd.Series())
    shared = sorted(set(x.index) & set(y.index))
    differences = (y.loc[shared] - x.loc[shared]).to_numpy(dtype=float)
    low, high, p = seed_t_test(differences)
    return {f"paired_seeds_{side}": len(shared),
            f"paired_change_{side}": float(differences.mean()) if len(shared) else math.nan,
            f"paired_ci_low_{side}": low, f"paired_ci_high_{side}": high,
            f"paired_p_{side}": p}


def _palette() -> list[str]:
    """The ten tab10 colours, one per job in order."""
    return [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink",
                                 "gray", "olive", "cyan")]


def margin_table(bins: pd.DataFrame) -> pd.DataFrame:
    """N*(d) - d per job, family and span start d, over the models competent on that bin:
    columns job, family, d, W, models, margin_median, margin_min, margin_max and
    past_d_minus_W (how many of those models need N*(d) >= d - W: the replay must reach back
    to within one window of the span's start). bins: `bin_table`'s rows."""
    good = bins[bins["competent"] & bins["N_star_d"].notna()]
    if good.empty:
        return pd.DataFrame(columns=["job", "family", "d", "W", "models", "margin_median",
                                     "margin_min", "margin_max", "past_d_minus_W"])
    good = good.assign(past=good["N_star_d"] >= good["d"] - good["W"])
    return (good.groupby(["job", "family", "d"], sort=False)
            .agg(W=("W", "first"), models=("seed", "nunique"),
                 margin_median=("margin", "median"), margin_min=("margin", "min"),
                 margin_max=("margin", "max"), past_d_minus_W=("past", "sum"))
            .reset_index().sort_values(["job", "family", "d"], kind="stable")
            .reset_index(drop=True))


def margin_figure(bins: pd.DataFrame) -> Figure | None:
    """N*(d) - d against d on competent bins, one panel per family: each job's median over its
    models as a line, every model as a faint point."""
    good = bins[bins["competent"]]
    if good.empty:
        return None
    families = [f for f in RUNNING if f in set(good["family"])] or sorted(set(good["family"]))
    fig = Figure(figsize=(5.5 * len(families), 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(families), sharey=True))
    palette = _palette()
    colours = {job: palette[i % len(palette)]
               for i, job in enumerate(dict.fromkeys(good["job"]))}
    for ax, family in zip(axes, families):
        mine = good[good["family"] == family]
        medians = margin_table(mine)
        for job, part in mine.groupby("job", sort=False):
            ax.scatter(part["d"], part["margin"], s=8, alpha=0.25, color=colours[job])
            median = medians[medians["job"] == job]
            ax.plot(median["d"], median["margin_median"], marker="o", ms=3, color=colours[job],
                    label=f"{job} ({part['seed'].nunique()} models)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("span start d (tokens before the answer)")
        ax.set_title(family, fontsize=9)
    axes[0].set_ylabel("N*(d) - d (median over models; points: models)")
    axes[0].legend(fontsize=7)
    fig.suptitle("replay past the evidence that loses nothing, on competent bins", fontsize=9)
    fig.tight_layout()
    return fig


def drop_figure(models: pd.DataFrame, cells: pd.DataFrame) -> Figure | None:
    """The drop at N = W inside and beyond the replay per job: models as points, the
    model-level CI as a bar."""
    if cells.empty:
        return None
    fig = Figure(figsize=(max(5, 1.1 * len(cells) + 2), 4))
    ax = fig.subplots()
    jobs = list(cells["job"])
    for offset, side, colour in ((-0.15, "inside", "tab:blue"), (0.15, "beyond", "tab:red")):
        for i, job in enumerate(jobs):
            cell = cells[cells["job"] == job].iloc[0]
            mine = models[models["job"] == job]
            ax.scatter(np.full(len(mine), i + offset), mine[f"drop_{side}"], s=12, color=colour,
                       alpha=0.6, label=f"d {'<=' if side == 'inside' else '>'} W"
                       if i == 0 else None)
            low, high = cell[f"seed_ci_low_{side}"], cell[f"seed_ci_high_{side}"]
            if not (math.isnan(low) or math.isnan(high)):
                ax.plot([i + offset] * 2, [low, high], color=colour, lw=2)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(jobs)), jobs, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("drop at N = W (replay - full)")
    ax.set_title("N = W on competent bins: evidence inside / beyond the replay", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def read_erf(path: Path | None) -> pd.DataFrame | None:
    """Per model: the share of decoder influence at distance >= W, from an `evals.erf` output
    directory or an archived erf_shares.csv (`evals.erf.erf_shares`)."""
    if path is None:
        return None
    table = pd.read_csv(path) if path.is_file() else erf_shares(path)
    if "share_beyond_W" not in table:
        raise ValueError(f"--erf {path}: no share_beyond_W column (an evals.erf output "
                         f"directory, or the erf_shares.csv of analysis.archive --erf)")
    return table[["job", "seed", "share_beyond_W"]]


def write(study: Path, out: Path, erf: Path | None = None, alpha: float = 0.05,
          compare: list[tuple[str, str]] | None = None,
          pools: dict[str, list[str]] | None = None) -> dict:
    """Every table and figure of the module doc into `out` (cells.csv with a row per pooled
    cell of `pools` after the jobs' own); returns {name: path}."""
    written = findings.write_findings(study, out, alpha)
    results = tables.load_results(study)
    marks = tables.geometry(study)
    paired = paired_outcomes(results, marks)
    if paired.empty:
        raise ValueError(f"{study}: no running_count / running_bracket results with a replay "
                         "mode (run the study's suite with those families)")
    bins = bin_table(paired, results, marks)
    models = model_table(paired, bins, results, marks, read_erf(erf))
    cells = cell_table(paired, models, bins, marks)
    if pools:
        cells = pd.concat([cells, pooled_cells(paired, models, bins, marks, pools)],
                          ignore_index=True)
    steps = job_steps(models)
    if compare:     # a pair may name a pooled cell: its models under the cell's name
        named = pd.concat([models, *[tables.pooled(models, cell, jobs)
                                     for cell, jobs in (pools or {}).items()]],
                          ignore_index=True)
        steps = pd.concat([steps, job_steps(named, compare)], ignore_index=True)
    margins = margin_table(bins)
    for name, table in (("bins", bins), ("models", models), ("cells", cells), ("steps", steps),
                        ("margins", margins)):
        written[name] = out / f"{name}.csv"
        table.to_csv(written[name], index=False, float_format="%.6g")
    own = cells[~cells["job"].isin(pools or {})]       # the figure shows each job's models
    for name, figure in (("margin", margin_figure(bins)), ("drop_at_W", drop_figure(models, own))):
        if figure is not None:
            written[name] = save(figure, out / f"{name}.png", dpi=110)
    written["reach"] = out / "reach.md"
    written["reach"].write_text(_markdown(cells, models, steps, margins,
                                          publish.provenance(study)))
    return written


def _markdown(cells: pd.DataFrame, models: pd.DataFrame, steps: pd.DataFrame,
              margins: pd.DataFrame, info: dict) -> str:
    lines = ["# Reach: where each model reads its evidence, and what replay keeps it", "",
             "Drops at N = W on competent bins (full >= 0.9 per bin), inside (d <= W) and "
             "beyond (d > W) the replay; example CI Agresti-Min, model CI the bootstrap over "
             "models and documents. N* is censored at each model's largest competent d.", "",
             publish.markdown(cells, [c for c in (
                 "job", "W", "R_exact", "models", "horizon", "largest_competent_d_median",
                 "N_star_median", "N_star_min", "N_star_max", "drop_inside", "seed_ci_low_inside",
                 "seed_ci_high_inside", "drop_beyond", "ci_low_beyond", "ci_high_beyond",
                 "seed_ci_low_beyond", "seed_ci_high_beyond", "failed_beyond", "judged_beyond",
                 "recall_full_mean", "share_beyond_W_mean", "pooled") if c in cells]), "",
             "## Per model", "",
             publish.markdown(models, [c for c in (
                 "job", "seed", "N_star", "largest_competent_d", "horizon", "competent_bins",
                 "drop_inside", "drop_beyond", "fails_beyond", "recall_full", "share_beyond_W")
                 if c in models]), "",
             "## Job against job (models as the unit; bootstrap CI over models, Welch p)", "",
             publish.markdown(steps, list(steps.columns)) if not steps.empty else "(one job)\n",
             "", "## N*(d) - d per span start (competent models; past_d_minus_W: how many need "
             "N*(d) >= d - W)", "",
             publish.markdown(margins, list(margins.columns)) if not margins.empty
             else "(no competent bin)\n", "", "## Provenance", ""]
    return "\n".join(lines + publish.provenance_markdown(info))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.reach", description=(
        "Per distance bin and per model: competence, N*(d), the margin N*(d) - d, N* and the "
        "largest competent d, and the drop at N = W inside and beyond the replay, of a study "
        "read with the uncensored suite."))
    parser.add_argument("--study", required=True, help="a study directory or its archive")
    parser.add_argument("--out", required=True, help="output directory (e.g. findings/ladder)")
    parser.add_argument("--erf", default=None, help=(
        "an evals.erf output directory or an archived erf_shares.csv (the share of decoder "
        "influence beyond W per model)"))
    parser.add_argument("--alpha", type=float, default=0.05, help="significance level")
    parser.add_argument("--compare", nargs="*", default=[], metavar="A:B", help=(
        "job pairs compared in steps.csv beside each job against the next, e.g. "
        "R0_base:R0_shift0"))
    tables.add_pool_option(parser, "a row of cells.csv after the jobs' own")
    args = parser.parse_args(argv)
    erf = Path(args.erf) if args.erf else None
    try:
        pools = tables.parse_pools(args.pool)
    except ValueError as error:
        parser.error(str(error))
    pairs = []
    for item in args.compare:
        a, sep, b = item.partition(":")
        if not (sep and a and b):
            parser.error(f"--compare: expected JOB_A:JOB_B, got {item!r}")
        pairs.append((a, b))
    return list_written("reach", lambda: write(Path(args.study), Path(args.out), erf,
                                                        args.alpha, pairs, pools),
                                 errors=(FileNotFoundError, ValueError))


if __name__ == "__main__":
    raise SystemExit(main())
