"""The figures of the analysis floor, one function each: data in, a matplotlib `Figure` out
(None when there is nothing to draw), written with `evals.plots.save`. The measuring tools'
own figures (divergence, suite accuracy, erf) and the shared layout helpers are evals/plots.py.

Used by `analysis.report` (report.html), `analysis.findings` (accuracy_vs_N.png, kl_vs_N.png,
arms.png), `analysis.scaling`, `analysis.real_text` (training_curves.png) and notebooks/study_analysis.py.
"""

from __future__ import annotations

import math
from typing import Mapping

import pandas as pd
from matplotlib.figure import Figure

from evals.plots import FULL, finish, grid, log2_if_wide, mark_first_geometry, save

__all__ = ["save", "headline_figure", "frontier_figure", "training_figure",
           "findings_accuracy_figure", "findings_divergence_figure", "scaling_figure",
           "arms_figure"]


def headline_figure(points: pd.DataFrame, marks: Mapping[str, Mapping[str, int | None]],
                    ) -> Figure | None:
    """The report's answer first: suite accuracy (pooled over distances) against the decoder
    replay length N, a panel per job and a line per family (the mean over the job's seeds);
    with two or more seeds a band from the lowest to the highest seed; the exact model's
    accuracy (`full`) a thin dashed level in the family's colour; vertical lines at the
    window W (purple, dotted) and R_exact (brown, dash-dot).

    points: columns job, family, run (the seed's run label), mode, N (the replay length;
    `replay=exact` at N = R_exact; NaN for `full`), accuracy. marks: job -> {"W", "R_exact"}.
    None if no job has a bounded-replay point."""
    if points is None or points.empty or points["N"].notna().sum() == 0:
        return None
    jobs = [j for j in dict.fromkeys(points["job"])
            if points.loc[points["job"] == j, "N"].notna().any()]
    colors = {f: f"C{i % 10}" for i, f in enumerate(dict.fromkeys(points["family"]))}
    fig, axes = grid(len(jobs), 5.5, 4)
    for ax, job in zip(axes, jobs):
        part = points[points["job"] == job]
        seeds = part["run"].nunique()
        for family, rows in part.groupby("family", sort=False):
            _headline_family(ax, family, rows, colors[family], band=seeds >= 2)
        mark = marks.get(job, {})
        if mark.get("W"):
            ax.axvline(mark["W"], color="tab:purple", ls=":", lw=1.2, label=f"W={mark['W']}")
        if mark.get("R_exact"):
            ax.axvline(mark["R_exact"], color="tab:brown", ls="-.", lw=1.2,
                       label=f"R_exact={mark['R_exact']}")
        ns = sorted(part["N"].dropna().unique())
        log2_if_wide(ax, ns)
        ax.set_xticks(ns, [str(int(n)) for n in ns])
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"{job} ({seeds} seed{'s' if seeds != 1 else ''})")
        ax.set_xlabel("decoder replay N")
        ax.set_ylabel("suite accuracy (pooled over distances)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best", framealpha=0.6)
    fig.suptitle("Suite accuracy against the replay length N\n(dashed: full, the exact model; "
                 "band: min-max over seeds)", fontsize=9)
    return fig


def _headline_family(ax, family: str, rows: pd.DataFrame, color: str, band: bool) -> None:
    """One family's line (mean over seeds against N), its min-max band, its `full` level."""
    replay = rows[rows["N"].notna()].groupby("N")["accuracy"].agg(["mean", "min", "max"])
    if len(replay):
        ax.plot(replay.index, replay["mean"], color=color, marker="o", ms=4, label=family)
        if band:
            ax.fill_between(replay.index, replay["min"], replay["max"], color=color,
                            alpha=0.2, lw=0)
    full = rows.loc[rows["mode"] == FULL, "accuracy"]
    if len(full):
        ax.axhline(float(full.mean()), color=color, ls="--", lw=0.8, alpha=0.7,
                   label=f"_{family} full")


def frontier_figure(cost: pd.DataFrame) -> Figure | None:
    """Analytic prefill FLOPs against suite accuracy, a line per suite run through its modes
    (each point annotated with its mode). cost: analysis.report's cost table (columns label, mode,
    T, prefill_flops, accuracy); None if empty."""
    if cost is None or cost.empty:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, (label, part) in enumerate(cost.groupby("label", sort=False)):
        part = part.sort_values("prefill_flops")
        ax.plot(part["prefill_flops"], part["accuracy"], marker="o", color=f"C{i % 10}",
                label=label)
        for _, row in part.iterrows():
            ax.annotate(row["mode"].replace("replay=", "N="), (row["prefill_flops"],
                        row["accuracy"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel(f"analytic prefill FLOPs (ced.cost, causal counting) of a "
                  f"{int(cost['T'].iloc[0])}-token prompt")
    ax.set_ylabel("suite accuracy (mean over families)")
    ax.set_ylim(bottom=0)
    ax.set_title("Cost-quality frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def training_figure(runs: Mapping[str, Mapping]) -> Figure | None:
    """Training loss (solid) and the validation loss that counts the same tokens (dashed, dots)
    against step, a colour per run: with `loss_on: answers` the answer tokens' loss on both
    sides (`val/answer_loss`), else every token's (`val/loss`). A model trained on answers only
    is not scored on filler it was never asked to predict. runs: run label -> {"metrics":
    DataFrame of metrics.jsonl, "loss_on": ...} (analysis.report.load_runs); None if no run has a
    loss."""
    runs = {k: v for k, v in runs.items() if not v["metrics"].empty and "loss" in v["metrics"]}
    if not runs:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    counted = set()
    for i, (job, run) in enumerate(runs.items()):
        m = run["metrics"]
        answers = run.get("loss_on", "all") == "answers"
        counted.add("answer tokens" if answers else "every token")
        ax.plot(m["step"], m["loss"], color=f"C{i % 10}", lw=1, alpha=0.8, label=f"{job} train")
        column = "val/answer_loss" if answers else "val/loss"
        if column in m:
            v = m.dropna(subset=[column])
            ax.plot(v["step"], v[column], color=f"C{i % 10}", ls="--", marker="o", ms=4,
                    label=f"{job} validation")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy (nats per {' / '.join(sorted(counted))})")
    ax.set_title("Training curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def findings_accuracy_figure(points: pd.DataFrame, full: pd.DataFrame,
                             marks: Mapping[str, Mapping[str, int | None]]) -> Figure | None:
    """Accuracy against the replay length N, a panel per family and a line per job.

    points: rows of job, family, N, accuracy (pooled over seeds and distances), seed_min,
    seed_max (the band); full: the same for mode `full` (a dashed level per job)."""
    points = points.dropna(subset=["N"]) if not points.empty else points
    if points.empty:
        return None
    families = sorted(points["family"].unique())
    fig, axes = grid(len(families), 4.6, 3.4)
    jobs = list(dict.fromkeys(points["job"]))
    for ax, family in zip(axes, families):
        for job, rows in points[points["family"] == family].groupby("job", sort=False):
            color = f"C{jobs.index(job)}"
            line = rows.sort_values("N")
            ax.plot(line["N"], line["accuracy"], marker="o", color=color, label=job)
            ax.fill_between(line["N"], line["seed_min"], line["seed_max"], color=color,
                            alpha=0.18, linewidth=0)
            level = full[(full["job"] == job) & (full["family"] == family)]
            if not level.empty:
                ax.axhline(float(level["accuracy"].iloc[0]), color=color, linestyle="--",
                           linewidth=1)
        mark_first_geometry(ax, marks)
        log2_if_wide(ax, points["N"])
        ax.set(title=family, xlabel="replay length N", ylabel="accuracy (pooled over seeds)",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("dashed: full (the exact model); band: min-max over seeds", fontsize=9)
    return fig


def findings_divergence_figure(kl: pd.DataFrame, drops: pd.DataFrame,
                               marks: Mapping[str, Mapping[str, int | None]],
                               answer_kl: pd.DataFrame | None = None) -> Figure:
    """Left: first-token KL(exact || replay N) at the cut of a validation prompt against N per
    job and prompt length T (log scale, bootstrap band); middle (when `answer_kl` has rows):
    KL(full || replay N) at the suite's answers per job and family; right: the paired
    accuracy drop at the same N per job and family with its 95% CI (only families the exact
    model is competent in)."""
    answer_kl = answer_kl if answer_kl is not None else pd.DataFrame()
    has_answer = not answer_kl.empty
    fig, axes = grid(3 if has_answer else 2, 5.0, 3.6)
    floor = 1e-18             # exact modes sit at rounding level; a log axis needs > 0
    jobs = list(dict.fromkeys([*kl.get("job", []), *answer_kl.get("job", []),
                               *drops.get("job", [])]))
    for (job, t), line in (kl.dropna(subset=["N"]).groupby(["job", "T"], sort=False)
                           if not kl.empty else []):
        line = line.sort_values("N")
        color = f"C{jobs.index(job)}"
        axes[0].plot(line["N"], line["mean"].clip(lower=floor), marker="o", color=color,
                     label=f"{job} (T={t})")
        axes[0].fill_between(line["N"], line["ci_low"].clip(lower=floor),
                             line["ci_high"].clip(lower=floor), color=color, alpha=0.18)
    axes[0].set(xscale="log", yscale="log", xlabel="replay length N",
                ylabel="KL(exact || replay N), first token", title="divergence at a prompt cut")
    if has_answer:
        for j, ((job, family), line) in enumerate(answer_kl.dropna(subset=["N"]).groupby(
                ["job", "family"], sort=False)):
            line = line.sort_values("N")
            axes[1].plot(line["N"], line["mean"].clip(lower=floor), marker="os^vD"[j % 5],
                         color=f"C{jobs.index(job)}", label=f"{job}: {family}")
            axes[1].fill_between(line["N"], line["ci_low"].clip(lower=floor),
                                 line["ci_high"].clip(lower=floor),
                                 color=f"C{jobs.index(job)}", alpha=0.12)
        axes[1].set(xscale="log", yscale="log", xlabel="replay length N",
                    ylabel="KL(full || replay N) at the answer", title="divergence at the answer")
    right = axes[-1]
    for j, ((job, family), line) in enumerate(drops.dropna(subset=["N"]).groupby(
            ["job", "family"], sort=False) if not drops.empty else []):
        line = line.sort_values("N")
        right.errorbar(line["N"] * (1 + 0.03 * j), line["difference"],
                         yerr=[line["difference"] - line["ci_low"],
                               line["ci_high"] - line["difference"]],
                         marker="os^vD"[j % 5], color=f"C{jobs.index(job)}", capsize=2,
                         label=f"{job}: {family}")
    right.axhline(0, color="black", linewidth=0.8)
    right.set(xscale="log", xlabel="replay length N",
              ylabel="accuracy(replay N) - accuracy(full)", title="capability drop (95% CI)")
    finish(axes, marks)
    return fig


def scaling_figure(table: pd.DataFrame, fits: Mapping[str, Mapping], target: Mapping) -> Figure:
    """analysis.scaling: each KL at N = W against the inexact decoder layers L_d - 1 (left) and W
    (right), a dot per seed (jobs replayed exactly, N = W >= R_exact, have no dot on a log
    axis), the fitted power law per value of the other axis, and the extrapolation to the
    target with its 95% band (a red bar at the target's L_d - 1 / W)."""
    metrics = [m for m in fits if m in table and table[m].notna().any()]
    fig, axes = grid(2 * max(1, len(metrics)), 5.0, 3.6, max_cols=2)
    depth = "inexact_layers"
    goal = {depth: target["L_d"] - 1, "W": target["W"]}
    for row, metric in enumerate(metrics):
        fit = fits[metric]
        shown = table[~table["exact"].astype(bool)]
        for col, (axis, other) in enumerate(((depth, "W"), ("W", depth))):
            ax = axes[2 * row + col]
            for i, (value, part) in enumerate(shown.groupby(other)):
                label = f"L_d - 1 = {value}" if other == depth else f"W = {value}"
                ax.scatter(part[axis], part[metric].where(part[metric] > 0), s=14,
                           color=f"C{i}", label=label)
                if fit.get("fitted"):
                    co = fit["coef"]
                    xs = pd.Series(sorted({*part[axis], goal[axis]}), dtype=float)
                    logs = (co["a"] + co["b_inexact_layers"] * (
                        xs.map(math.log10) if axis == depth else math.log10(value))
                        + co["c_window"] * (xs.map(math.log10) if axis == "W"
                                            else math.log10(value)))
                    ax.plot(xs, 10 ** logs, color=f"C{i}", linewidth=0.8, linestyle="--")
            if fit.get("fitted") and fit.get("band"):
                low, high = fit["band"]
                ax.errorbar([goal[axis]], [fit["prediction"]],
                            yerr=[[fit["prediction"] - low], [high - fit["prediction"]]],
                            color="red", marker="*", capsize=3,
                            label=f"L_d={target['L_d']}, W=N={target['W']} (extrapolated)")
            ax.set(xscale="log", yscale="log",
                   xlabel="L_d - 1 (inexact decoder layers at N = W)" if axis == depth else axis,
                   ylabel=f"{metric} at N = W (nats)",
                   title=f"{metric} against {'L_d - 1' if axis == depth else axis}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return fig


def arms_figure(arms: pd.DataFrame) -> Figure | None:
    """analysis.arms (arms.csv): job against job at each replay length N, the difference to - from
    of the accuracy (left) and of the answer KL (right) with the model-level 95% CI, a line per
    pair and family; `full`'s accuracy difference dashed at its level. None without rows."""
    if arms is None or arms.empty:
        return None
    fig, axes = grid(2, 5.0, 3.6)
    lines = list(dict.fromkeys(zip(arms["from"], arms["to"], arms["family"])))
    for ax, metric, label in ((axes[0], "accuracy", "accuracy, to - from"),
                              (axes[1], "kl_answer", "KL(full || mode) at the answer, to - from")):
        rows = arms[arms["metric"] == metric]
        for i, (before, after, family) in enumerate(lines):
            part = rows[(rows["from"] == before) & (rows["to"] == after)
                        & (rows["family"] == family)]
            color = f"C{i % 10}"
            full = part[part["mode"] == FULL]
            if not full.empty:
                ax.axhline(float(full["difference"].iloc[0]), color=color, linestyle="--",
                           linewidth=1)
            part = part.dropna(subset=["N"]).sort_values("N")
            if part.empty:
                continue
            ax.errorbar(part["N"] * (1 + 0.03 * i), part["difference"],
                        yerr=[(part["difference"] - part["seed_ci_low"]).clip(lower=0),
                              (part["seed_ci_high"] - part["difference"]).clip(lower=0)],
                        marker="os^vD"[i % 5], color=color, capsize=2,
                        label=f"{after} - {before}: {family}")
            log2_if_wide(ax, part["N"])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(xlabel="replay length N", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("job against job (arms.csv): bars, the model-level 95% CI; dashed: full",
                 fontsize=9)
    return fig
