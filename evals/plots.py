"""The measuring tools' figures, one function each: data in, a matplotlib `Figure` out (None when
there is nothing to draw); `save` lays a figure out and writes it as a PNG. `grid`,
`log2_if_wide` and `finish` are the layout the analysis floor's figures (analysis/plots.py)
share.

The figures are plain `matplotlib.figure.Figure` objects, made without pyplot: no backend is
needed (the command-line tools run headless) and nothing is left open in pyplot's registry.

Used by `evals.divergence` (kl_vs_replay.png, top1_agree_vs_replay.png,
layer_error_by_offset.png), `evals.suites.runner` (accuracy.png), `evals.erf` (erf.png),
`evals.real_text` (kl_by_position.png, kl_by_class.png), and by `analysis.report`, which draws
the divergence and accuracy figures again in report.html.

    from evals import plots
    fig = plots.divergence_figure(summary)          # summary.json of evals.divergence
    plots.save(fig, "divergence_vs_N.png")
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pandas as pd
from matplotlib.figure import Figure

from ced.inference import POLICIES
from ced.tracking import checkpoint_label
from evals.modes import with_mode_columns

FULL = "full"
DIVERGENCE_METRICS = {"kl": "KL(exact || replay N), first token",
                      "top1_agree": "top-1 agreement with exact"}
_T_STYLES = ["-", "--", ":", "-."]


def save(fig: Figure, path: str | Path, dpi: int = 100, title_room: bool = False) -> Path:
    """Lay `fig` out (leaving room for a suptitle if `title_room`) and write it as a PNG."""
    fig.tight_layout(rect=(0, 0, 1, 0.96) if title_room else None)
    fig.savefig(path, dpi=dpi)
    return Path(path)


def grid(panels: int, width: float, height: float, max_cols: int = 3):
    """A figure with `panels` axes in rows of at most `max_cols` (unused axes hidden)."""
    cols = min(max_cols, max(1, panels))
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(width * cols, height * rows))
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[panels:]:
        ax.axis("off")
    return fig, axes[:panels]


def log2_if_wide(ax, xs: Iterable[float]) -> None:
    xs = [float(x) for x in xs]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 8:
        ax.set_xscale("log", base=2)


# ---- divergence ------------------------------------------------------------------------------

def divergence_figure(summary: pd.DataFrame | Sequence[Mapping],
                      metrics: Sequence[str] = ("kl", "top1_agree"),
                      title: str | None = "Divergence of bounded replay from the exact model",
                      ) -> Figure | None:
    """Divergence of bounded replay against N at the first generated token: a panel per metric
    (`kl`, `top1_agree`), a line per run (colour) and prompt length T (line style) with the
    bootstrap 95% interval as error bars, the run's R_exact dotted.

    summary: evals.divergence's summary.json rows (or the report's DataFrame of them): columns
    checkpoint, T, mode, N, metric, step, mean, ci_low, ci_high, r_exact. Modes other than
    `replay=...` (`replay=exact` sits at N = R_exact) and steps other than 0 are ignored. None
    if no row is left."""
    table = pd.DataFrame(summary)
    if table.empty:
        return None
    modes = with_mode_columns(table)
    rep = table[modes["replay_given"].notna() & modes["turn"].isna() & (table["step"] == 0)]
    if rep.empty:
        return None
    # a checkpoint's label reads its run's record: once per checkpoint, not per row
    rep = rep.assign(run=rep["checkpoint"].map(
        {c: checkpoint_label(c) for c in rep["checkpoint"].unique()}))
    fig, axes = grid(len(metrics), 5.5, 4, max_cols=len(metrics))
    for ax, metric in zip(axes, metrics):
        _divergence_panel(ax, rep[rep["metric"] == metric], sorted(rep["T"].unique()))
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-8)
            ax.set_ylim(bottom=0)
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel(DIVERGENCE_METRICS.get(metric, metric))
    if title:
        fig.suptitle(title)
    return fig


def _divergence_panel(ax, rows: pd.DataFrame, lengths: list) -> None:
    for ci, (run, part) in enumerate(rows.groupby("run", sort=False)):
        for li, length in enumerate(lengths):
            pts = part[part["T"] == length].sort_values("N")
            if pts.empty:
                continue
            ax.errorbar(pts["N"], pts["mean"],
                        yerr=[pts["mean"] - pts["ci_low"], pts["ci_high"] - pts["mean"]],
                        color=f"C{ci % 10}", ls=_T_STYLES[li % 4], marker="o", ms=4, capsize=2,
                        label=f"{run} T={length}")
        r_exact = part["r_exact"].dropna()
        if len(r_exact):
            ax.axvline(float(r_exact.iloc[0]), color=f"C{ci % 10}", ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decoder replay N (dotted: R_exact)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def layer_error_figure(table: pd.DataFrame) -> Figure | None:
    """Per decoder layer, the relative L2 error of the replayed hidden states (solid) and window
    K/V (dashed) against the exact model, by offset inside the replay segment, at the longest
    bounded replay N (it shows the most offsets).

    table: evals.divergence's tidy rows (columns metric, layer, offset, N, value); None without
    `hidden_rel_l2` / `kv_rel_l2` rows."""
    rows = table[table["metric"].isin(["hidden_rel_l2", "kv_rel_l2"])] if len(table) else table
    if not len(rows):
        return None
    longest = rows[rows["N"] == rows["N"].max()]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for (metric, layer), part in longest.groupby(["metric", "layer"]):
        curve = part.groupby("offset")["value"].mean()
        style = "-" if metric == "hidden_rel_l2" else "--"
        what = "hidden state" if metric == "hidden_rel_l2" else "window K/V"
        ax.plot(curve.index, curve.values, style, marker=".",
                label=f"decoder layer {int(layer)}: {what}")
    if (longest["value"] > 0).any():       # exact replay (yoco) errs by exactly zero
        ax.set_yscale("log")
    ax.set_xlabel(f"offset inside the replay segment (N={int(longest['N'].iloc[0])}; "
                  "0 = replay start)")
    ax.set_ylabel("relative L2 error vs the exact model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


# ---- accuracy against distance -----------------------------------------------------------------

def accuracy_figure(summary: pd.DataFrame | Sequence[Mapping], *, replays: Sequence[int],
                    window: int, r_exact: int | None = None, title: str = "",
                    max_families: int | None = None) -> Figure | None:
    """Edge-case suite accuracy against x (a fact's distance from the prompt's end, or the
    prompt length) per family, a panel each: a line per inference mode with its 95% Wilson band
    (black: `full`, the exact model; grey dashed: `replay=exact`), the chance level dotted, and
    vertical lines at the replay starts N (dashed), the window W (purple) and R_exact (brown).

    summary: evals.suites' summary rows (columns family, x_name, x, mode, accuracy, ci_low,
    ci_high, chance); rows pooled over x (x = "all") are skipped. replays, window, r_exact: the
    run's settings (SuiteSettings, or its `settings` in summary.json). None if nothing is left."""
    table = pd.DataFrame(summary)
    if table.empty:
        return None
    cells = [s for s in with_mode_columns(table).to_dict("records") if str(s["x"]) != "all"]
    families = list(dict.fromkeys(s["family"] for s in cells))[:max_families]
    if not families:
        return None
    fig, axes = grid(len(families), 6, 4.2)
    colors = {n: f"C{i % 10}" for i, n in enumerate(replays)}
    for ax, family in zip(axes, families):
        part = [s for s in cells if s["family"] == family]
        many = _accuracy_panel(ax, part, colors)
        _mark_geometry(ax, replays, window, r_exact, colors)
        log2_if_wide(ax, [s["x"] for s in part])
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(family)
        x_name = part[0]["x_name"]
        ax.set_xlabel(x_name + (" (tokens from the end)" if x_name == "distance" else " T"))
        ax.set_ylabel("exact match")
        ax.legend(fontsize=5.5 if many else 6.5, ncol=2 if many else 1, loc="best",
                  framealpha=0.6)
    if title:
        fig.suptitle(title)
    return fig


def _mode_style(cell: Mapping, index: int, colors: Mapping[int, str]) -> dict:
    """A mode's line, from a summary row with the mode's columns (`with_mode_columns`)."""
    if cell["mode"] == FULL:
        return dict(color="black", lw=2.2, marker="o", zorder=5)
    if cell["replay_given"] == "exact" and math.isnan(cell["turn"]):
        return dict(color="0.5", lw=1.5, ls="--", marker="s")
    if math.isnan(cell["turn"]):
        n = cell["replay_n"]
        return dict(color="C9" if math.isnan(n) else colors.get(int(n), "C9"), lw=1.6,
                    marker="^")
    return dict(color=f"C{index % 10}", lw=1.0, marker=".",
                ls=[":", "-.", "--", "-"][POLICIES.index(cell["policy"]) % 4])


def _accuracy_panel(ax, cells: list[dict], colors: Mapping[int, str]) -> bool:
    """A line (and, unless there are many multi-turn modes, a band) per mode; returns whether
    the panel has many modes (a smaller legend)."""
    modes = list(dict.fromkeys(s["mode"] for s in cells))
    many = len(modes) > 6
    for i, mode in enumerate(modes):
        pts = sorted((s for s in cells if s["mode"] == mode), key=lambda s: float(s["x"]))
        xs = [float(s["x"]) for s in pts]
        style = _mode_style(pts[0], i, colors)
        ax.plot(xs, [s["accuracy"] for s in pts], label=mode, **style)
        if not many or math.isnan(pts[0]["turn"]):
            ax.fill_between(xs, [s["ci_low"] for s in pts], [s["ci_high"] for s in pts],
                            color=style["color"], alpha=0.08)
    chance = [s["chance"] for s in cells if s.get("chance") not in ("", None)
              and s["chance"] == s["chance"]]
    if chance:
        ax.axhline(sum(chance) / len(chance), color="0.6", ls=":", lw=1, label="chance")
    return many


def _mark_geometry(ax, replays: Sequence[int], window: int, r_exact: int | None,
                   colors: Mapping[int, str]) -> None:
    """Vertical lines: replay starts N (dashed), window W (purple), R_exact (brown)."""
    for n in replays:
        ax.axvline(n, color=colors[n], ls="--", lw=0.9, alpha=0.8, label=f"N={n}")
    ax.axvline(window, color="tab:purple", ls=":", lw=1.1, label=f"W={window}")
    if r_exact:
        ax.axvline(r_exact, color="tab:brown", ls="-.", lw=1.0, label=f"R_exact={r_exact}")


# ---- layout shared with analysis/plots.py ------------------------------------------------------

def mark_first_geometry(ax, marks: Mapping[str, Mapping[str, int | None]]) -> None:
    """W (dotted) and R_exact (dashed) of the first job, as vertical lines labelled."""
    first = next(iter(marks.values()), {})
    for key, style in (("W", ":"), ("R_exact", "--")):
        if first.get(key):
            ax.axvline(first[key], color="grey", linestyle=style, linewidth=1)
            ax.text(first[key], 0.02, f" {key}", color="grey", fontsize=8,
                    transform=ax.get_xaxis_transform())


def finish(axes, marks: Mapping[str, Mapping[str, int | None]]) -> None:
    """W and R_exact of the first job, a light grid and a small legend on every panel."""
    for ax in axes:
        mark_first_geometry(ax, marks)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)


# ---- effective receptive field --------------------------------------------------------------

def erf_figure(table: pd.DataFrame, marks: Mapping[str, Mapping[str, int | None]],
               divergence: pd.DataFrame | None = None) -> Figure:
    """The decoder's effective receptive field (evals.erf), a line per job and decoder layer:
    left, the gradient of log p(top-1) at the last position with respect to each decoder
    layer's input, as a share of its total over d >= 1 (mean over prompts and seeds); middle,
    KL after removing the cached window entry at distance d from one layer (or all); right,
    KL of bounded replay N = d (everything at distance >= N dropped), with the first-token KL
    of evals.divergence dashed when given. W and R_exact of the first job marked."""
    fig, axes = grid(3, 5.0, 3.6)
    floor = 1e-18
    jobs = list(dict.fromkeys(table["job"]))
    styles = ["-", "--", ":", "-."]
    grad = table[(table["view"] == "gradient") & (table["distance"] >= 1)]
    for (job, layer), part in grad.groupby(["job", "layer"], sort=False):
        mean = part.groupby("distance")["value"].mean()
        share = mean / mean.sum() if mean.sum() > 0 else mean
        layers = list(dict.fromkeys(grad.loc[grad["job"] == job, "layer"]))
        axes[0].plot(share.index, share.where(share > 0), color=f"C{jobs.index(job)}",
                     linestyle=styles[layers.index(layer) % 4],
                     label=f"{job}: {'decoder input' if layer == 'total' else f'layer {layer}'}")
    axes[0].set(yscale="log", xlabel="distance d from the last position",
                ylabel="share of gradient influence (0 not drawn)",
                title="gradient (window paths)")
    reach = max((m.get("R_exact") or 0) for m in marks.values()) if marks else 0
    if reach:
        axes[0].set_xlim(0, reach + 3)
    for view, ax, title in (("cache_drop", axes[1], "drop the cached entry at d"),
                            ("replay", axes[2], "drop all state at distance >= N")):
        part = table[(table["view"] == view) & (table["metric"] == "kl")]
        for (job, layer), line in part.groupby(["job", "layer"], sort=False):
            mean = line.groupby("distance")["value"].mean()
            layers = list(dict.fromkeys(part.loc[part["job"] == job, "layer"]))
            ax.plot(mean.index, mean.clip(lower=floor), marker=".", color=f"C{jobs.index(job)}",
                    linestyle=styles[layers.index(layer) % 4],
                    label=f"{job}: {'all layers' if layer == 'all' else f'layer {layer}'}")
        ax.set(yscale="log", ylabel="KL(full || ablated), last position", title=title,
               xlabel="distance d" if view == "cache_drop" else "replay length N")
    if divergence is not None and not divergence.empty:
        for job, line in divergence.groupby("job", sort=False):
            color = f"C{jobs.index(job)}" if job in jobs else "black"
            axes[2].plot(line["N"], line["value"].clip(lower=floor), linestyle="--",
                         color=color, marker="x", label=f"{job}: evals.divergence (first token)")
    finish(axes, marks)
    return fig


def real_text_position_figure(position: pd.DataFrame, marks: Mapping[str, Mapping[str, int]]
                              ) -> Figure | None:
    """Mean and p99 KL(exact || replay) against the byte's distance from the replay start, one
    line per checkpoint, one panel per job (`position`: kl_by_position.csv with a job column;
    marks: per job its W and R_exact, drawn as vertical lines)."""
    if position.empty:
        return None
    jobs = sorted(position["job"].unique())
    fig, axes = grid(len(jobs), 4.2, 3.2)
    for ax, job in zip(axes, jobs):
        for k, (checkpoint, rows) in enumerate(position[position["job"] == job]
                                               .groupby("checkpoint")):
            rows = rows.sort_values("distance")
            positive = rows[rows["kl_mean"] > 0]
            ax.plot(positive["distance"], positive["kl_mean"], color=f"C{k}", lw=1,
                    label="mean" if k == 0 else None)
            p99 = rows[rows["kl_p99"] > 0]
            ax.plot(p99["distance"], p99["kl_p99"], color=f"C{k}", lw=0.8, ls=":",
                    label="p99" if k == 0 else None)
        for name, style in (("W", "--"), ("R_exact", "-.")):
            if job in marks and marks[job].get(name):
                ax.axvline(marks[job][name], color="0.5", ls=style, lw=0.8)
        if (position[position["job"] == job]["kl_mean"] > 0).any():
            ax.set_yscale("log")
        else:          # an exact early exit (yoco): every KL is zero
            ax.text(0.5, 0.5, "KL = 0 at every distance", transform=ax.transAxes,
                    ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{job} (W, R_exact dashed)", fontsize=9)
        ax.set_xlabel("distance from the replay start (bytes)")
        ax.set_ylabel("KL(exact || replay), nats")
        ax.legend(fontsize=7)
    return fig


def real_text_class_figure(classes: pd.DataFrame) -> Figure | None:
    """Mean KL with its CI per replay length N and token class group, one panel per job, from
    the seed-level rows of kl_by_class.csv."""
    pooled = classes[classes["level"] == "seeds"]
    if pooled.empty:
        return None
    jobs = sorted(pooled["job"].unique())
    fig, axes = grid(len(jobs), 4.2, 3.2)
    for ax, job in zip(axes, jobs):
        rows = pooled[pooled["job"] == job]
        for k, (group, part) in enumerate(rows.groupby("group")):
            part = part.sort_values("N")
            ax.errorbar(part["N"], part["kl_mean"],
                        yerr=[(part["kl_mean"] - part["kl_ci_low"]).clip(lower=0),
                              (part["kl_ci_high"] - part["kl_mean"]).clip(lower=0)],
                        color=f"C{k}", marker="o", ms=3, lw=1, capsize=2, label=group)
        if (rows["kl_mean"] > 0).any():
            ax.set_yscale("log")
        log2_if_wide(ax, rows["N"])
        ax.set_title(f"{job}: the G bytes after a replay of N", fontsize=9)
        ax.set_xlabel("replay length N (bytes)")
        ax.set_ylabel("mean KL, nats (95% CI)")
        ax.legend(fontsize=7)
    return fig
