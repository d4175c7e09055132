"""A study's report, built from its run directories (not from wandb):

    python -m evals.report <study_dir> [--no-wandb] [--wandb-group G] [--wandb-project P]

Reads `runs/<job>/seed<k>/metrics.jsonl` and `final/config.json` (runs are labelled
`<job>/seed<k>`, so seeds stay apart; a `runs/<job>/` holding a run itself is labelled
`<job>`), `divergence/summary.json`, `suite/<job>/seed<k>[@topk=K]/summary.json` and
`capability_drop.csv`, `summary.json` (the driver's step status) and
prices every inference mode with the analytic cost model (`ced.cost.prefill_flops`). Writes into
`<study_dir>/report/`: PNG plots, `report.md` and `report.html` (self-contained: the PNGs are
embedded as base64, it opens from disk). The same plots and tables go to a wandb run
(offline unless WANDB_MODE says otherwise) in the study's group.

The loaders (`load_*`) and plotters (`plot_*`) are public: notebooks/analysis.py uses them.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import sys
from pathlib import Path

import pandas as pd

FULL = "full"


# ---- loaders --------------------------------------------------------------------------------

def load_status(study: Path) -> dict:
    path = Path(study) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _run_dirs(root: Path) -> list[tuple[str, Path]]:
    """(label, directory) of every run (or suite run) under `root`: `<job>/seed<k>` for the
    study driver's per-seed layout, `<job>` for a directory that holds a run itself."""
    found = []
    for top in sorted(Path(root).glob("*")):
        if not top.is_dir() or ".old-" in top.name:
            continue
        seeds = sorted((d for d in top.glob("seed*") if d.is_dir() and ".old-" not in d.name),
                       key=lambda d: (len(d.name), d.name))
        if seeds:
            found += [(f"{top.name}/{d.name}", d) for d in seeds]
        else:
            found.append((top.name, top))
    return found


def load_runs(study: Path) -> dict[str, dict]:
    """run label (`<job>/seed<k>`) -> {"config": model config (final/config.json), "metrics":
    DataFrame of metrics.jsonl, "run_dir": Path, "final": final/ or None}."""
    runs = {}
    for label, run_dir in _run_dirs(Path(study) / "runs"):
        metrics_path = run_dir / "metrics.jsonl"
        rows = []
        if metrics_path.exists():
            lines = [line for line in metrics_path.read_text().splitlines() if line.strip()]
            for number, line in enumerate(lines, 1):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    if number < len(lines):   # only a crash's half-written last line is dropped
                        raise ValueError(f"{metrics_path}: line {number} is not JSON") from None
        config = None
        final = run_dir / "final" / "config.json"
        if final.exists():
            config = json.loads(final.read_text())
        runs[label] = {"config": config, "metrics": pd.DataFrame(rows),
                       "run_dir": run_dir, "final": final.parent if config else None}
    return runs


def job_of_checkpoint(path: str) -> str:
    """.../runs/<job>/seed<k>/final -> <job>/seed<k> (.../runs/<job>/final -> <job>)."""
    p = Path(path)
    run = p.parent if p.name == "final" else p
    return f"{run.parent.name}/{run.name}" if run.name.startswith("seed") else run.name


def file_label(label: str) -> str:
    """A run or suite label as part of a file name."""
    return label.replace("@", "_").replace("/", "_")


def load_divergence(study: Path) -> pd.DataFrame:
    """divergence/summary.json as a DataFrame with a `job` column (empty if absent)."""
    path = Path(study) / "divergence" / "summary.json"
    if not path.exists():
        return pd.DataFrame()
    table = pd.DataFrame(json.loads(path.read_text()))
    if len(table):
        table["job"] = table["checkpoint"].map(job_of_checkpoint)
    return table


def load_suite(study: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(summary of every suite run with a `label` column, capability drops with `label`,
    label -> run info of the suite's summary.json)."""
    summaries, drops, info = [], [], {}
    for label, out in _run_dirs(Path(study) / "suite"):
        path = out / "summary.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        info[label] = data["run"]
        summary = pd.DataFrame(data["summary"])
        summary["label"] = label
        summaries.append(summary)
        if data.get("capability_drop"):
            d = pd.DataFrame(data["capability_drop"])
            d["label"] = label
            drops.append(d)
    summary = pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame()
    drop = pd.concat(drops, ignore_index=True) if drops else pd.DataFrame()
    return summary, drop, info


def suite_prompt_length(study: Path, label: str) -> int | None:
    """Mean prompt length (tokens) of the documents a suite run evaluated."""
    lengths = []
    for path in (Path(study) / "suite" / label / "data").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                doc = json.loads(line)
                if "length" in doc:
                    lengths.append(int(doc["length"]))
    return round(sum(lengths) / len(lengths)) if lengths else None


def mode_replay(mode: str):
    """A suite/divergence mode string -> the `replay` argument of ced.cost.prefill_flops, or
    False for modes the frontier does not price (multi-turn)."""
    from evals.modes import parse_mode
    try:
        parsed = parse_mode(mode)
    except ValueError:      # not a mode of evals.modes (e.g. divergence's yoco_early_exit)
        return False
    return False if parsed.turn is not None else parsed.replay


def cost_table(study: Path, runs: dict, suite: pd.DataFrame, info: dict) -> pd.DataFrame:
    """One row per (suite label, single-turn mode): prefill FLOPs (analytic, causal counting)
    at the suite's mean prompt length, its ratio to full, and the mode's accuracy (mean over
    families of the pooled accuracy)."""
    from ced import ModelConfig
    from ced.cost import prefill_flops
    rows = []
    if suite.empty:
        return pd.DataFrame()
    pooled = suite[suite["x"].astype(str) == "all"]
    # One prompt length for every model, so that FLOPs compare across models: the longest of
    # the suite runs' mean prompt lengths (they differ with W and R_exact).
    lengths = [suite_prompt_length(study, label) for label in info]
    common = max([n for n in lengths if n] or [0])
    for label, part in pooled.groupby("label", sort=False):
        config = info[label]["config"]
        cfg = ModelConfig(**{k: v for k, v in config.items()
                             if k in ModelConfig.__dataclass_fields__})
        length = common or cfg.window * 4
        full = prefill_flops(cfg, length, None).total
        for mode, cells in part.groupby("mode", sort=False):
            replay = mode_replay(mode)
            if replay is False:
                continue
            try:
                flops = prefill_flops(cfg, length, replay).total
            except ValueError:
                continue
            rows.append({"label": label, "job": label.split("@")[0], "variant": cfg.variant,
                         "mode": mode, "T": length, "prefill_flops": flops,
                         "flops_vs_full": flops / full,
                         "accuracy": float(cells["accuracy"].mean()),
                         "families": len(cells)})
    return pd.DataFrame(rows)


def params_of(config: dict | None) -> int | None:
    if not config:
        return None
    from ced import ModelConfig
    from ced.cost import model_params
    cfg = ModelConfig(**{k: v for k, v in config.items() if k in ModelConfig.__dataclass_fields__})
    try:
        return int(model_params(cfg)["total"])
    except Exception:
        return None


# ---- plots ----------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_divergence(div: pd.DataFrame, path: Path) -> Path | None:
    """KL and top-1 agreement at the first generated token against N, a line per job and T,
    with 95% bootstrap intervals; R_exact dotted."""
    if div.empty:
        return None
    plt = _plt()
    rep = div[div["mode"].str.startswith("replay=") & (div["step"] == 0)]
    if rep.empty:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lengths = sorted(rep["T"].unique())
    styles = ["-", "--", ":", "-."]
    for ax, (metric, label) in zip(axes, (("kl", "KL(exact || replay N), first token"),
                                          ("top1_agree", "top-1 agreement with exact"))):
        for ci, (job, part) in enumerate(rep[rep["metric"] == metric].groupby("job", sort=False)):
            for li, length in enumerate(lengths):
                pts = part[part["T"] == length].sort_values("N")
                if pts.empty:
                    continue
                ax.errorbar(pts["N"], pts["mean"],
                            yerr=[pts["mean"] - pts["ci_low"], pts["ci_high"] - pts["mean"]],
                            color=f"C{ci}", ls=styles[li % 4], marker="o", ms=4, capsize=2,
                            label=f"{job} T={length}")
            r = part["r_exact"].dropna()
            if len(r):
                ax.axvline(float(r.iloc[0]), color=f"C{ci}", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.set_ylim(bottom=0)
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("decoder replay N (dotted: R_exact)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Divergence of bounded replay from the exact model")
    return _save(fig, path)


def plot_accuracy(suite: pd.DataFrame, info: dict, label: str, path: Path,
                  max_families: int = 9) -> Path | None:
    """Accuracy against distance per family (a panel each) for one suite run, a line per
    single-turn mode (multi-turn policies in the multiturn panel); replay starts (N), window W
    and R_exact marked."""
    part = suite[(suite["label"] == label) & (suite["x"].astype(str) != "all")
                 & (suite["x_name"] == "distance")]
    if part.empty:
        return None
    plt = _plt()
    families = list(dict.fromkeys(part["family"]))[:max_families]
    cols = min(3, len(families))
    rows = math.ceil(len(families) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    settings = info[label]["settings"]
    for ax, family in zip(axes.flat, families):
        cells = part[part["family"] == family].copy()
        cells["xv"] = cells["x"].astype(int)
        modes = list(dict.fromkeys(cells["mode"]))
        if family != "multiturn":
            modes = [m for m in modes if "turn=" not in m]
        elif len(modes) > 8:
            modes = [m for m in modes if "turn=" not in m or m.endswith("replay=exact")
                     or f"replay={settings['replays'][-1]}" in m][:10]
        for i, mode in enumerate(modes):
            pts = cells[cells["mode"] == mode].sort_values("xv")
            style = dict(color="black", lw=2, marker="o") if mode == FULL else \
                dict(color="0.5", ls="--", marker="s") if mode == "replay=exact" else \
                dict(color=f"C{i % 10}", marker="^" if "turn=" not in mode else ".",
                     ls="-" if "turn=" not in mode else ":")
            ax.plot(pts["xv"], pts["accuracy"], label=mode, ms=4, **style)
        for j, n in enumerate(settings["replays"]):
            ax.axvline(n, color=f"C{j + 3}", ls="--", lw=0.8, alpha=0.8,
                       label=f"replay start N={n}")
        ax.axvline(settings["window"], color="tab:purple", ls=":", lw=1.1,
                   label=f"W={settings['window']}")
        if settings.get("r_exact"):
            ax.axvline(settings["r_exact"], color="tab:brown", ls="-.", lw=1,
                       label=f"R_exact={settings['r_exact']}")
        xs = cells["xv"]
        if len(xs) and xs.min() > 0 and xs.max() / xs.min() > 8:
            ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(family)
        ax.set_xlabel("distance of the fact from the prompt end (tokens)")
        ax.set_ylabel("exact match")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, loc="best", framealpha=0.6)
    for ax in list(axes.flat)[len(families):]:
        ax.axis("off")
    fig.suptitle(f"{label}: accuracy against distance (a fact at distance > N lies before the "
                 "replay start)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_frontier(cost: pd.DataFrame, path: Path) -> Path | None:
    """Analytic prefill FLOPs against suite accuracy, a point per (model, mode)."""
    if cost.empty:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, part) in enumerate(cost.groupby("label", sort=False)):
        part = part.sort_values("prefill_flops")
        ax.plot(part["prefill_flops"], part["accuracy"], marker="o", color=f"C{i % 10}",
                label=label)
        for _, row in part.iterrows():
            ax.annotate(row["mode"].replace("replay=", "N="), (row["prefill_flops"],
                        row["accuracy"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    T = int(cost["T"].iloc[0])
    ax.set_xlabel(f"analytic prefill FLOPs (ced.cost, causal counting) of a {T}-token prompt")
    ax.set_ylabel("suite accuracy (mean over families)")
    ax.set_ylim(bottom=0)
    ax.set_title("Cost-quality frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_training(runs: dict, path: Path) -> Path | None:
    """Training loss (and validation loss) against step, a line per job."""
    runs = {k: v for k, v in runs.items() if not v["metrics"].empty and "loss" in v["metrics"]}
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (job, run) in enumerate(runs.items()):
        m = run["metrics"]
        ax.plot(m["step"], m["loss"], color=f"C{i % 10}", lw=1, alpha=0.8, label=f"{job} train")
        if "val/loss" in m:
            v = m.dropna(subset=["val/loss"])
            ax.plot(v["step"], v["val/loss"], color=f"C{i % 10}", ls="--", marker="o", ms=4,
                    label=f"{job} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


# ---- tables ---------------------------------------------------------------------------------

def training_table(runs: dict) -> pd.DataFrame:
    rows = []
    for job, run in runs.items():
        m, cfg = run["metrics"], run["config"] or {}
        if m.empty and not cfg:
            continue        # a job that failed before its first step (see Status)
        row = {"job": job, "variant": cfg.get("variant", ""), "params": params_of(cfg),
               "steps": int(m["step"].max()) if "step" in m and len(m) else 0,
               "final_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else None}
        if "val/loss" in m and m["val/loss"].notna().any():
            last = m.dropna(subset=["val/loss"]).iloc[-1]
            row["val_loss"] = float(last["val/loss"])
            for col in m.columns:
                if col.startswith("val/acc/"):
                    row[col[4:]] = float(last[col])
        rows.append(row)
    return pd.DataFrame(rows)


def divergence_table(div: pd.DataFrame) -> pd.DataFrame:
    """Mean KL and top-1 agreement at the first generated token, per job, T and mode."""
    if div.empty:
        return pd.DataFrame()
    first = div[(div["step"] == 0) & div["metric"].isin(["kl", "top1_agree",
                                                          "greedy_agree_tokens"])]
    table = first.pivot_table(index=["job", "T", "mode", "N"], columns="metric", values="mean",
                              sort=False).reset_index()
    return table


def pooled_accuracy(suite: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per family (pooled over x) x mode, per suite label; single-turn modes."""
    if suite.empty:
        return pd.DataFrame()
    pooled = suite[(suite["x"].astype(str) == "all") & ~suite["mode"].str.contains("turn=")]
    return pooled.pivot_table(index=["label", "mode"], columns="family", values="accuracy",
                              sort=False).reset_index()


def seed_spread(suite: pd.DataFrame, runs: dict) -> pd.DataFrame:
    """Per job trained with two or more seeds: the pooled suite accuracy per family and mode
    (and the last validation loss) across seeds: mean, standard deviation, min, max, seeds.
    A run label `<job>/seed<k>[@topk=K]` belongs to job `<job>[@topk=K]`."""
    import re
    rows = []
    if not suite.empty:
        pooled = suite[(suite["x"].astype(str) == "all") & ~suite["mode"].str.contains("turn=")]
        pooled = pooled.assign(job=pooled["label"].map(lambda l: re.sub(r"/seed\d+", "", l)))
        for (job, family, mode), part in pooled.groupby(["job", "family", "mode"], sort=False):
            if part["label"].nunique() >= 2:
                acc = part["accuracy"]
                rows.append({"job": job, "what": f"acc {family}", "mode": mode,
                             "mean": acc.mean(), "sd": acc.std(ddof=1), "min": acc.min(),
                             "max": acc.max(), "seeds": part["label"].nunique()})
    losses: dict[str, list[float]] = {}
    for label, run in runs.items():
        m = run["metrics"]
        if "val/loss" in m and m["val/loss"].notna().any():
            job = re.sub(r"/seed\d+", "", label)
            losses.setdefault(job, []).append(float(m["val/loss"].dropna().iloc[-1]))
    for job, values in losses.items():
        if len(values) >= 2:
            v = pd.Series(values)
            rows.append({"job": job, "what": "val loss", "mode": "", "mean": v.mean(),
                         "sd": v.std(ddof=1), "min": v.min(), "max": v.max(),
                         "seeds": len(values)})
    return pd.DataFrame(rows)


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}" if abs(value) >= 1e4 else str(int(value))
        if abs(value) >= 1e6:
            return f"{value:.3g}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    if isinstance(value, int) and abs(value) >= 1e4:
        return f"{value:,}"
    return str(value)


def to_markdown(table: pd.DataFrame, max_rows: int = 100) -> str:
    if table is None or table.empty:
        return "_none_\n"
    cols = list(table.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + " --- |" * len(cols)]
    for _, row in table.head(max_rows).iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "\\|") for c in cols) + " |")
    if len(table) > max_rows:
        lines.append(f"\n_{len(table) - max_rows} more rows in the CSV files_")
    return "\n".join(lines) + "\n"


def to_html(table: pd.DataFrame, max_rows: int = 100) -> str:
    if table is None or table.empty:
        return "<p><em>none</em></p>"
    cols = list(table.columns)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(row[c]))}</td>" for c in cols)
                   + "</tr>" for _, row in table.head(max_rows).iterrows())
    more = (f"<p><em>{len(table) - max_rows} more rows in the CSV files</em></p>"
            if len(table) > max_rows else "")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


# ---- the report -----------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{border-bottom:2px solid #444}h2{margin-top:2em;
border-bottom:1px solid #ccc}table{border-collapse:collapse;font-size:12px;margin:.6em 0}
td,th{border:1px solid #ccc;padding:2px 7px;text-align:right}th{background:#eee}
tr:nth-child(even){background:#f8f8f8}img{max-width:100%;border:1px solid #ddd;margin:.4em 0}
.failed{color:#b00;font-weight:bold}.ok{color:#070}pre{background:#f4f4f4;padding:.5em;
overflow-x:auto;font-size:11px}.note{color:#555;font-size:13px}"""


def build_report(study: str | Path, wandb: bool = True, quiet: bool = False,
                 group: str | None = None, project: str = "ced") -> Path:
    """Write <study>/report/{report.md, report.html, *.png, *.csv}; returns report.html.
    The wandb run goes to `project`, in `group` (default: the study's name)."""
    study = Path(study).resolve()
    out = study / "report"
    out.mkdir(parents=True, exist_ok=True)
    status = load_status(study)
    runs = load_runs(study)
    div = load_divergence(study)
    suite, drops, info = load_suite(study)
    cost = cost_table(study, runs, suite, info)
    train_tab = training_table(runs)
    div_tab = divergence_table(div)
    acc_tab = pooled_accuracy(suite)
    seed_tab = seed_spread(suite, runs)
    drop_tab = drops[[c for c in ["label", "family", "x", "mode", "n", "acc_full", "acc_mode",
                                  "delta", "p", "p_holm"] if c in drops.columns]] \
        if not drops.empty else drops
    for name, table in (("training", train_tab), ("divergence", div_tab), ("accuracy", acc_tab),
                        ("seeds", seed_tab), ("cost_quality", cost),
                        ("capability_drop", drop_tab)):
        if not table.empty:
            table.to_csv(out / f"{name}.csv", index=False)

    plots: list[tuple[str, Path, str]] = []      # (section, path, caption)
    p = plot_training(runs, out / "training_curves.png")
    if p:
        plots.append(("training", p, "Training (solid) and validation (dashed) loss."))
    p = plot_divergence(div, out / "divergence_vs_N.png")
    if p:
        plots.append(("divergence", p, "KL(exact || replay N) and top-1 agreement at the "
                      "first generated token against N, mean and bootstrap 95% CI over prompts."))
    for label in info:
        p = plot_accuracy(suite, info, label, out / f"accuracy_{file_label(label)}.png")
        if p:
            plots.append(("accuracy", p, f"{label}: edge-case suite accuracy against the fact's "
                          "distance, per family and inference mode."))
    p = plot_frontier(cost, out / "cost_quality_frontier.png")
    if p:
        plots.append(("frontier", p, "Analytic prefill FLOPs of each mode against the suite's "
                      "mean accuracy."))

    steps = status.get("steps", {})
    failed = [k for k, v in steps.items() if v.get("state") in ("failed", "refused")]
    status_tab = pd.DataFrame([{"step": k, "state": v.get("state"),
                                "seconds": v.get("seconds"),
                                "detail": v.get("reason") or v.get("error") or
                                ((v.get("tail") or "").splitlines() or [""])[-1]}
                               for k, v in steps.items()])
    name = status.get("study", study.name)
    sections = [
        ("Status", "Each step of the study: `ok`, `skipped` (done by an earlier run) or "
         "`failed` (return code and the last output lines in summary.json).", status_tab,
         None),
        ("Training", "Per job: model variant, parameters (ced.cost), steps, final training "
         "loss, last validation loss and per-task validation accuracy.", train_tab, "training"),
        ("Divergence", "Bounded replay N against the exact model (evals.divergence): KL, top-1 "
         "agreement at the first generated token, greedy tokens until the first disagreement. "
         "Exact modes (replay=exact, yoco) sit at float round-off.", div_tab, "divergence"),
        ("Accuracy against distance", "Edge-case suite (evals.suites): exact match per family "
         "(pooled over distances) and mode. Dashed verticals in the plots: replay starts "
         "(a fact at distance > N lies before it); purple: window W; brown: R_exact.", acc_tab,
         "accuracy"),
        ("Seeds", "Jobs trained with several seeds (study `seeds`): pooled suite accuracy per "
         "family and mode, and the last validation loss, across seeds (mean, standard "
         "deviation, min, max). One seed per job: none.", seed_tab, None),
        ("Cost-quality frontier", "Analytic prefill FLOPs (ced.cost.prefill_flops, causal "
         "counting) of each single-turn mode at one prompt length T for every model (the "
         "longest mean prompt length of the suite runs), and the "
         "suite accuracy of that mode (mean over families).", cost, "frontier"),
        ("Capability drop", "Cells where a mode is significantly below `full` on the same "
         "examples (exact McNemar, p < 0.05; Holm-corrected p alongside).", drop_tab, None),
    ]
    md = [f"# Study `{name}`\n", f"{status.get('description', '')}\n",
          f"Study directory: `{study}`; scale `{status.get('scale', '?')}`. "
          + (f"**Failed steps: {', '.join(failed)}.**" if failed else "All steps succeeded.")
          + "\n"]
    body = [f"<h1>Study <code>{html.escape(name)}</code></h1>",
            f"<p>{html.escape(status.get('description', ''))}</p>",
            f"<p class='note'>Study directory: <code>{html.escape(str(study))}</code>; scale "
            f"<code>{html.escape(str(status.get('scale', '?')))}</code>. "
            + (f"<span class='failed'>Failed steps: {html.escape(', '.join(failed))}</span>"
               if failed else "<span class='ok'>All steps succeeded.</span>") + "</p>"]
    for title, text, table, plot_key in sections:
        md.append(f"## {title}\n\n{text}\n")
        body.append(f"<h2>{html.escape(title)}</h2><p class='note'>{html.escape(text)}</p>")
        for section, path, caption in plots:
            if section == plot_key:
                md.append(f"![{caption}]({path.name})\n\n_{caption}_\n")
                data = base64.b64encode(path.read_bytes()).decode()
                body.append(f"<figure><img alt='{html.escape(caption)}' "
                            f"src='data:image/png;base64,{data}'><figcaption class='note'>"
                            f"{html.escape(caption)}</figcaption></figure>")
        md.append(to_markdown(table))
        body.append(to_html(table))
    for key in failed:
        tail = (steps[key].get("tail") or steps[key].get("error")
                or steps[key].get("reason") or "")
        md.append(f"### Failed: {key}\n\n```\n{tail}\n```\n")
        body.append(f"<h3 class='failed'>Failed: {html.escape(key)}</h3>"
                    f"<pre>{html.escape(tail)}</pre>")
    (out / "report.md").write_text("\n".join(md))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>ced study {html.escape(name)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>")
    (out / "report.html").write_text(page)
    if wandb:
        try:
            _log_wandb(group or name, out, plots,
                       {"training": train_tab, "divergence": div_tab, "accuracy": acc_tab,
                        "seeds": seed_tab, "cost_quality": cost, "capability_drop": drop_tab},
                       config={"study_dir": str(study), **status}, project=project,
                       name=f"{name}-report", scalars=report_scalars(suite, div, seed_tab))
        except Exception as exc:     # wandb is a copy of the report; never fail it
            print(f"[report] wandb logging skipped: {exc}", file=sys.stderr)
    if not quiet:
        print(f"[report] wrote {out / 'report.md'}, {out / 'report.html'} and "
              f"{len(plots)} plots", flush=True)
    return out / "report.html"


def report_scalars(suite: pd.DataFrame, div: pd.DataFrame, seeds: pd.DataFrame) -> dict:
    """The report's numbers as flat scalars: pooled accuracy `acc/<run>/<family>/<mode>`,
    first-token KL `kl/<run>/T=<T>/<mode>`, and across seeds `seeds/<job>/<what>/<mode>/mean`
    and `.../sd`."""
    out = {}
    if not suite.empty:
        pooled = suite[suite["x"].astype(str) == "all"]
        for row in pooled.itertuples():
            out[f"acc/{row.label}/{row.family}/{row.mode}"] = row.accuracy
    if not div.empty:
        first = div[(div["step"] == 0) & (div["metric"] == "kl")]
        for row in first.itertuples():
            out[f"kl/{row.job}/T={row.T}/{row.mode}"] = row.mean
    for row in seeds.itertuples():
        key = f"seeds/{row.job}/{row.what.replace(' ', '_')}/{row.mode or 'all'}"
        out[f"{key}/mean"], out[f"{key}/sd"] = row.mean, row.sd
    return out


def _log_wandb(group: str, out: Path, plots, tables: dict, config: dict | None = None,
               project: str = "ced", name: str | None = None,
               scalars: dict | None = None) -> None:
    """The report's plots and tables as one wandb run (job_type=report) in the study's group,
    with the study's status (steps, seeds, scale) as its config; offline unless WANDB_MODE
    says otherwise."""
    import wandb
    run = wandb.init(project=project, group=group, job_type="report",
                     name=name or f"{group}-report", config=config or {},
                     mode=os.environ.get("WANDB_MODE", "offline"), dir=str(out),
                     settings=wandb.Settings(silent=True))
    log = {f"plots/{p.stem}": wandb.Image(str(p)) for _, p, _ in plots}
    for key, table in tables.items():
        if table is not None and not table.empty:
            log[f"tables/{key}"] = wandb.Table(dataframe=table.astype(str))
    run.log(log)
    from ced.tracking import log_scalars
    log_scalars(run, scalars or {})
    run.finish()


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m evals.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study_dir")
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--wandb-project", default="ced", help="the one project of every run")
    parser.add_argument("--wandb-group", default=None, help="default: the study's name")
    args = parser.parse_args(argv)
    path = build_report(args.study_dir, wandb=not args.no_wandb, group=args.wandb_group,
                        project=args.wandb_project)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
