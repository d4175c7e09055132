"""A study's report, built from its run directories (not from wandb):

    python -m analysis.report <study_dir> [--no-wandb] [--wandb-group G] [--wandb-project P]

Reads `runs/<job>/seed<k>/metrics.jsonl` and `final/config.json` (runs are labelled
`<job>/seed<k>`, so seeds stay apart; a `runs/<job>/` holding a run itself is labelled
`<job>`), `divergence/summary.json`, `suite/<job>/seed<k>[@topk=K]/summary.json` and
`results.csv` (capability drops are tested on examples paired within each seed and pooled over
seeds, as in `analysis.findings`; jobs one training setting apart are compared with each other
as in its arms.csv, `analysis.arms`), `summary.json` (the driver's step status) and
prices every inference mode with the analytic cost model (`ced.cost.prefill_flops`). Writes into
`<study_dir>/report/`: PNG plots, `report.md` and `report.html` (self-contained: the PNGs are
embedded as base64, it opens from disk). The same plots and tables go to a wandb run
(offline unless WANDB_MODE says otherwise) in the study's group.

report.html leads with the answer: a short summary and the headline plot (accuracy against N
per family, seeds as bands), then the sections; the long divergence table is collapsed. The
plots are drawn by `evals.plots`. The loaders (`load_*`) and tables are public:
notebooks/study_analysis.py uses them.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from ced import ModelConfig
from ced.cost import model_params, prefill_flops
from ced.records import DamagedRecord, read_json
from ced.run_id import RunId, identified, of_checkpoint
from ced.tracking import checkpoint_label, log_scalars
from ced.train.run_dir import metrics_records
from evals import plots as tool_plots
from evals.divergence import divergence_scalars
from evals.modes import label_columns, mode_from_columns, with_mode_columns
from evals.suites.runner import suite_scalars

from . import plots
from .arms import arms_table, job_pairs
from .tables import capability_drop_table, geometry, load_results, trained_jobs

FULL = "full"
# A family whose exact-model (`full`) accuracy is below this has no competence for bounded
# replay to lose: its "drops" are noise around an untrained model, and the summary
# says so instead of letting a zero-drop count read as "replay is harmless".
COMPETENT_ACCURACY = 0.8


# ---- loaders --------------------------------------------------------------------------------

def _record(path: Path, expect: type | tuple = dict):
    """The JSON record at `path`; None when absent or damaged (said in one warning line: the
    report shows what survives rather than failing on one torn file)."""
    try:
        return read_json(path, expect=expect)
    except DamagedRecord as exc:
        print(f"[report] warning: {exc}; left out of the report", file=sys.stderr, flush=True)
        return None


def load_status(study: Path) -> dict:
    """The driver's summary.json ({} when absent or damaged)."""
    return _record(Path(study) / "summary.json") or {}


def _run_dirs(root: Path) -> list[tuple[str, Path, RunId | None]]:
    """(label, directory, RunId) of every run (or suite run) under `root`: the study driver's
    model folders (`ced.run_id.identified`: label `RunId.label`), and a directory that holds a
    run itself (label its name, no RunId)."""
    root = Path(root)
    models = identified(root)
    held = {folder.parent for _, folder in models}
    found: list[tuple[str, Path, RunId | None]] = [
        (run_id.label, folder, run_id) for run_id, folder in
        sorted(models, key=lambda m: (m[0].job, m[0].seed, m[0].label))]
    for top in sorted(root.glob("*")):
        if top.is_dir() and ".old-" not in top.name and top not in held:
            found.append((top.name, top, None))
    return sorted(found, key=lambda f: f[1].relative_to(root).parts[0])


def group_of(label: str, run_id: RunId | None) -> str:
    """What seeds are pooled under: the model's `RunId.group`, else the label itself."""
    return run_id.group if run_id is not None else label


def load_runs(study: Path) -> dict[str, dict]:
    """run label (`<job>/seed<k>`) -> {"config": model config (final/config.json), "metrics":
    DataFrame of metrics.jsonl (read by ced.train.metrics_records: a crash's half-written last
    line is dropped, a damaged earlier line is an error), "run_dir": Path, "final": final/ or
    None, "loss_on": what the training loss counts, `answers` or `all` (the run's
    config.yaml; `all` without one)}."""
    runs = {}
    for label, run_dir, run_id in _run_dirs(Path(study) / "runs"):
        metrics_path = run_dir / "metrics.jsonl"
        rows = ([record for _, record in metrics_records(metrics_path, [])]
                if metrics_path.exists() else [])
        config = None
        final = run_dir / "final" / "config.json"
        if final.exists():
            config = _record(final)
        runs[label] = {"config": config, "metrics": pd.DataFrame(rows),
                       "run_dir": run_dir, "final": final.parent if config else None,
                       "loss_on": _loss_on(run_dir), "run_id": run_id,
                       "group": group_of(label, run_id)}
    return runs


def _loss_on(run_dir: Path) -> str:
    """train.loss_on of a run (its config.yaml), `all` if unknown."""
    path = run_dir / "config.yaml"
    try:
        return str(OmegaConf.select(OmegaConf.load(path), "train.loss_on") or "all")
    except Exception:       # no or unreadable config.yaml: the trainer's default
        return "all"


def validation_loss_column(loss_on: str) -> str:
    """The validation metric that counts what the training loss counts: `val/answer_loss`
    when training counts answer tokens only, `val/loss` (every token) otherwise."""
    return "val/answer_loss" if loss_on == "answers" else "val/loss"


def file_label(label: str) -> str:
    """A run or suite label as part of a file name."""
    return label.replace("@", "_").replace("/", "_")


def load_divergence(study: Path) -> pd.DataFrame:
    """divergence/summary.json as a DataFrame with a `job` column (empty if absent)."""
    rows = _record(Path(study) / "divergence" / "summary.json", expect=(list, dict))
    if rows is None:
        return pd.DataFrame()
    table = pd.DataFrame(rows)
    if len(table):
        # a checkpoint's label and group read its run's record: once per checkpoint
        checkpoints = table["checkpoint"].unique()
        labels = {c: checkpoint_label(c) for c in checkpoints}
        groups = {c: group_of(labels[c], of_checkpoint(Path(c))) for c in checkpoints}
        table["job"] = table["checkpoint"].map(labels)
        table["group"] = table["checkpoint"].map(groups)
    return table


def load_suite(study: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(summary of every suite run with a `label` column, capability drops with `label`,
    label -> run info of the suite's summary.json)."""
    summaries, drops, info = [], [], {}
    for label, out, run_id in _run_dirs(Path(study) / "suite"):
        data = _record(out / "summary.json")
        if data is None:
            continue
        info[label] = data["run"]
        summary = pd.DataFrame(data["summary"])
        summary["label"] = label
        summary["group"] = group_of(label, run_id)
        summary["model"] = run_id.model if run_id is not None else label
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
    """A suite/divergence mode label -> the `replay` argument of ced.cost.prefill_flops, or
    False for modes the frontier does not price (multi-turn) and labels that are not modes
    (e.g. divergence's yoco_early_exit)."""
    return replay_argument(label_columns(mode) or {}, mode)


def replay_argument(columns, label: str):
    """The `replay` argument of ced.cost.prefill_flops for a mode given by its columns (a row
    of `evals.modes.with_mode_columns`) and its label, or False for a new turn and a label
    that is not a mode."""
    mode = mode_from_columns(columns, label)
    return False if mode is None or mode.turn is not None else mode.replay


def cost_table(study: Path, runs: dict, suite: pd.DataFrame, info: dict) -> pd.DataFrame:
    """One row per (suite label, single-turn mode): prefill FLOPs (analytic, causal counting)
    at the suite's mean prompt length, its ratio to full, and the mode's accuracy (mean over
    families of the pooled accuracy)."""
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
        for mode, cells in with_mode_columns(part).groupby("mode", sort=False):
            replay = replay_argument(cells.iloc[0], mode)
            if replay is False:
                continue
            try:
                flops = prefill_flops(cfg, length, replay).total
            except ValueError:
                continue
            rows.append({"label": label, "job": part["model"].iloc[0], "variant": cfg.variant,
                         "mode": mode, "T": length, "prefill_flops": flops,
                         "flops_vs_full": flops / full,
                         "accuracy": float(cells["accuracy"].mean()),
                         "families": len(cells)})
    return pd.DataFrame(rows)


def params_of(config: dict | None) -> int | None:
    if not config:
        return None
    cfg = ModelConfig(**{k: v for k, v in config.items() if k in ModelConfig.__dataclass_fields__})
    try:
        return int(model_params(cfg)["total"])
    except Exception:
        return None


# ---- tables ---------------------------------------------------------------------------------

def training_table(runs: dict) -> pd.DataFrame:
    rows = []
    for job, run in runs.items():
        m, cfg = run["metrics"], run["config"] or {}
        if m.empty and not cfg:
            continue        # a job that failed before its first step (see Status)
        loss_on = run.get("loss_on", "all")
        row = {"job": job, "variant": cfg.get("variant", ""), "params": params_of(cfg),
               "steps": int(m["step"].max()) if "step" in m and len(m) else 0,
               "loss_on": loss_on,
               "train_loss": float(m["loss"].iloc[-1]) if "loss" in m and len(m) else None}
        paired = validation_loss_column(loss_on)
        if paired in m and m[paired].notna().any():
            evaluated = m.dropna(subset=[paired])
            last = evaluated.iloc[-1]
            row["val_loss"] = float(last[paired])          # like with like: train_loss
            if len(evaluated) > 1:      # < 0: validation was still falling at the last step
                row["val_loss_last_change"] = float(last[paired] - evaluated[paired].iloc[-2])
            if paired != "val/loss" and "val/loss" in m:
                row["val_loss_all_tokens"] = float(last["val/loss"])
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
    if "group" in div:
        table["group"] = table["job"].map(dict(zip(div["job"], div["group"])))
    return table


def pooled_single_turn(suite: pd.DataFrame) -> pd.DataFrame:
    """The suite's accuracy rows pooled over x (x = "all") of single-turn modes."""
    return suite[(suite["x"].astype(str) == "all") & with_mode_columns(suite)["turn"].isna()]


def pooled_accuracy(suite: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per family (pooled over x) x mode, per suite label; single-turn modes."""
    if suite.empty:
        return pd.DataFrame()
    return pooled_single_turn(suite).pivot_table(index=["label", "mode"], columns="family",
                                                 values="accuracy", sort=False).reset_index()


def _spread(job: str, what: str, mode: str, values: pd.Series, seeds: int) -> dict:
    return {"job": job, "what": what, "mode": mode, "mean": values.mean(),
            "sd": values.std(ddof=1), "min": values.min(), "max": values.max(), "seeds": seeds}


def seed_spread(suite: pd.DataFrame, runs: dict) -> pd.DataFrame:
    """Per job trained with two or more seeds: the pooled suite accuracy per family and mode
    (and the last validation loss) across seeds: mean, standard deviation, min, max, seeds.
    A model read under an override is a job of its own (`RunId.group`: `<job>@topk=K`)."""
    rows = []
    if not suite.empty:
        pooled = pooled_single_turn(suite)
        pooled = pooled.assign(job=pooled["group"])
        for (job, family, mode), part in pooled.groupby(["job", "family", "mode"], sort=False):
            if part["label"].nunique() >= 2:
                rows.append(_spread(job, f"acc {family}", mode, part["accuracy"],
                                    part["label"].nunique()))
    losses: dict[str, list[float]] = {}
    for label, run in runs.items():
        m = run["metrics"]
        if "val/loss" in m and m["val/loss"].notna().any():
            last = float(m["val/loss"].dropna().iloc[-1])
            losses.setdefault(run["group"], []).append(last)
    for job, values in losses.items():
        if len(values) >= 2:
            rows.append(_spread(job, "val loss", "", pd.Series(values), len(values)))
    return pd.DataFrame(rows)


def headline_points(suite: pd.DataFrame, info: dict) -> tuple[pd.DataFrame, dict]:
    """The headline plot's data (evals.plots.headline_figure): per suite run, family and
    single-turn mode, the pooled accuracy at its replay length N (`replay=exact` at R_exact,
    NaN for `full`); and per job its window W and R_exact."""
    rows, marks = [], {}
    pooled = with_mode_columns(pooled_single_turn(suite)) if not suite.empty else suite
    for rec in pooled.to_dict("records"):
        settings = info[rec["label"]]["settings"]
        replay = replay_argument(rec, rec["mode"])
        if replay is False:
            continue
        n = settings.get("r_exact") if replay == "exact" else replay
        job = rec["group"]
        rows.append({"job": job, "family": rec["family"], "run": rec["label"],
                     "mode": rec["mode"], "N": math.nan if n is None else n,
                     "accuracy": rec["accuracy"]})
        marks[job] = {"W": settings.get("window"), "R_exact": settings.get("r_exact")}
    return pd.DataFrame(rows), marks


def headline_summary(points: pd.DataFrame, marks: dict, div_tab: pd.DataFrame,
                     drop_tab: pd.DataFrame) -> list[str]:
    """The report's answer in a few lines: per job, the suite accuracy (mean over families and
    seeds) of `full` and of every replay length N; per job, the first-token KL at its
    smallest bounded N; and how many capability drops were found."""
    lines = []
    for job, part in (points.groupby("job", sort=False) if not points.empty else []):
        r_exact = marks.get(job, {}).get("R_exact")
        by_n = part[part["N"].notna()].groupby("N")["accuracy"].mean()
        steps = "".join(f"; N={int(n)}{' (R_exact)' if n == r_exact else ''} {value:.2f}"
                        for n, value in by_n.items())
        full = part.loc[part["mode"] == FULL, "accuracy"].mean()
        lines.append(f"{job}: suite accuracy (mean over {part['family'].nunique()} families, "
                     f"{part['run'].nunique()} seed(s)): full {full:.2f}{steps}.")
        lines.append(competence_line(job, part))
    if not div_tab.empty and "kl" in div_tab:
        modes = with_mode_columns(div_tab)
        bounded = div_tab[modes["turn"].isna() & modes["replay_n"].notna()
                          & (modes["replay_given"] != "exact")]
        for job, part in bounded.groupby("group", sort=False):
            smallest = part[part["N"] == part["N"].min()]
            lines.append(f"{job}: first-token KL(exact || replay N={int(smallest['N'].iloc[0])})"
                         f" up to {_fmt(float(smallest['kl'].max()))} (largest over seeds and "
                         "prompt lengths).")
    lines.append(f"Capability drops (a mode significantly below full): {len(drop_tab)}"
                 + (" cells, listed at the end." if len(drop_tab) else "."))
    return lines


def competence_line(job: str, part: pd.DataFrame) -> str:
    """Which families job's exact model can do (mean `full` accuracy over seeds >=
    COMPETENT_ACCURACY); a capability drop means something only for those."""
    full = part[part["mode"] == FULL].groupby("family")["accuracy"].mean()
    able = [family for family, accuracy in full.items() if accuracy >= COMPETENT_ACCURACY]
    if not able:
        return (f"{job}: **no family reaches {COMPETENT_ACCURACY} in full**: the model cannot do "
                "these tasks yet, so no replay length can show a capability drop; the numbers "
                "below are not findings.")
    return (f"{job}: full reaches >= {COMPETENT_ACCURACY} on {', '.join(able)}; drops in other "
            "families measure a model that cannot do them.")


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
overflow-x:auto;font-size:11px}.note{color:#555;font-size:13px}details{margin:.6em 0}
summary{cursor:pointer;color:#333}"""

# The tables written as <name>.csv beside the report.
CSV_TABLES = ("training", "divergence", "accuracy", "seeds", "cost_quality", "capability_drop",
              "arms")

# (title, text, table, plot section, collapsed in report.html), in the report's order after
# the summary.
SECTIONS = [
    ("Status", "Each step of the study: `ok`, `skipped` (done by an earlier run) or "
     "`failed` (return code and the last output lines in summary.json).", "status", None, False),
    ("Training", "Per job: model variant, parameters (ced.cost), steps, final training "
     "loss, last validation loss and per-task validation accuracy.", "training", "training",
     False),
    ("Divergence", "Bounded replay N against the exact model (evals.divergence): KL, top-1 "
     "agreement at the first generated token, greedy tokens until the first disagreement. "
     "Exact modes (replay=exact, yoco) sit at float round-off.", "divergence", "divergence",
     True),
    ("Accuracy against distance", "Edge-case suite (evals.suites): exact match per family "
     "(pooled over distances) and mode. Dashed verticals in the plots: replay starts "
     "(a fact at distance > N lies before it); purple: window W; brown: R_exact.", "accuracy",
     "accuracy", False),
    ("Seeds", "Jobs trained with several seeds (study `seeds`): pooled suite accuracy per "
     "family and mode, and the last validation loss, across seeds (mean, standard "
     "deviation, min, max). One seed per job: none.", "seeds", None, False),
    ("Cost-quality frontier", "Analytic prefill FLOPs (ced.cost.prefill_flops, causal "
     "counting) of each single-turn mode at one prompt length T for every model (the "
     "longest mean prompt length of the suite runs), and the "
     "suite accuracy of that mode (mean over families).", "cost_quality", "frontier", False),
    ("Capability drop", "Cells where a mode is significantly below `full` on the same "
     "examples, paired within each seed and pooled over seeds (difference mode - full with "
     "its Agresti-Min 95% CI, exact McNemar p Holm-corrected over the distances of a family; "
     "x = all pools the distances), each seed's difference and p beside.", "capability_drop",
     None, False),
    ("Arms compared", "Job against job (analysis.arms, as arms.csv of analysis.findings): every two "
     "jobs whose training settings differ in one key, on the same modes and documents; per "
     "family and mode (pooled over distances) the accuracy and the answer KL of each job and "
     "the difference to - from, with its example-level 95% CI (paired by document where both "
     "read the same ones) and its model-level CI (the models as the unit), Welch's p over the "
     "models and the model counts. No such pair: none.", "arms", "arms", False),
]

ARM_COLUMNS = ["from", "to", "differs", "family", "mode", "metric", "models_from", "models_to",
               "value_from", "value_to", "difference", "ci_low", "ci_high", "seed_ci_low",
               "seed_ci_high", "welch_p"]

DROP_COLUMNS = ["job", "family", "x", "mode", "n", "acc_full", "acc_mode", "difference",
                "ci_low", "ci_high", "p_holm", "per_seed_difference", "per_seed_p"]


def pooled_drops(study: Path) -> pd.DataFrame:
    """The significant capability drops of a study, tested on examples paired within each seed
    and pooled over seeds (`analysis.tables.capability_drop_table`: x = "all" pools the
    distances of a family, other rows are single distances, Holm over them), each seed's
    difference and p beside; empty when no suite has run."""
    try:
        drops = capability_drop_table(load_results(Path(study)))
    except FileNotFoundError:
        return pd.DataFrame()
    if drops.empty:
        return drops
    return drops[drops["significant"]].reset_index(drop=True)


def arm_comparisons(study: Path) -> pd.DataFrame:
    """The study's job-against-job table (`analysis.arms.arms_table` over the jobs one training
    setting apart), its accuracy and answer-KL rows; empty without such a pair or a suite."""
    try:
        results = load_results(Path(study))
    except FileNotFoundError:
        return pd.DataFrame()
    table = arms_table(results, job_pairs(Path(study), trained_jobs(results)),
                       geometry(Path(study)))
    return table[table["metric"].isin(["accuracy", "kl_answer"])].reset_index(drop=True)


@dataclass
class StudyData:
    """Everything the report reads from a study directory (see the module's docstring)."""

    study: Path
    status: dict
    runs: dict
    div: pd.DataFrame
    suite: pd.DataFrame
    drops: pd.DataFrame
    info: dict
    arms: pd.DataFrame

    @classmethod
    def load(cls, study: Path) -> "StudyData":
        suite, _, info = load_suite(study)
        return cls(study, load_status(study), load_runs(study), load_divergence(study), suite,
                   pooled_drops(study), info, arm_comparisons(study))

    @property
    def steps(self) -> dict:
        return self.status.get("steps", {})

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.steps.items() if v.get("state") in ("failed", "refused")]

    @property
    def name(self) -> str:
        return self.status.get("study", self.study.name)


def status_table(steps: dict) -> pd.DataFrame:
    """One row per study step: its state, seconds and a one-line detail."""
    return pd.DataFrame([{"step": k, "state": v.get("state"), "seconds": v.get("seconds"),
                          "detail": v.get("reason") or v.get("error") or
                          ((v.get("tail") or "").splitlines() or [""])[-1]}
                         for k, v in steps.items()])


def report_tables(data: StudyData) -> dict[str, pd.DataFrame]:
    """The report's tables by name (CSV_TABLES, and `status`)."""
    drops = data.drops
    return {
        "status": status_table(data.steps),
        "training": training_table(data.runs),
        "divergence": divergence_table(data.div),
        "accuracy": pooled_accuracy(data.suite),
        "seeds": seed_spread(data.suite, data.runs),
        "cost_quality": cost_table(data.study, data.runs, data.suite, data.info),
        "capability_drop": drops[[c for c in DROP_COLUMNS if c in drops.columns]]
        if not drops.empty else drops,
        "arms": data.arms[ARM_COLUMNS] if not data.arms.empty else data.arms,
    }


def report_plots(data: StudyData, tables: dict, out: Path) -> list[tuple[str, Path, str]]:
    """Draw and save the report's plots (evals.plots); (section, path, caption) of each, the
    headline first."""
    points, marks = headline_points(data.suite, data.info)
    figures = [
        ("summary", plots.headline_figure(points, marks), "headline_accuracy_vs_N.png",
         "Suite accuracy (pooled over distances) against the replay length N, a line per "
         "family: mean over seeds, band min-max over seeds; dashed: full (the exact model); "
         "vertical lines: window W (purple) and R_exact (brown)."),
        ("training", plots.training_figure(data.runs), "training_curves.png",
         "Training (solid) and validation (dashed) loss."),
        ("divergence", tool_plots.divergence_figure(data.div), "divergence_vs_N.png",
         "KL(exact || replay N) and top-1 agreement at the first generated token against N, "
         "mean and bootstrap 95% CI over prompts."),
    ]
    for label in data.info:
        figures.append(("accuracy", _suite_accuracy_figure(data, label),
                        f"accuracy_{file_label(label)}.png",
                        f"{label}: edge-case suite accuracy against the fact's distance, per "
                        "family and inference mode."))
    figures.append(("frontier", plots.frontier_figure(tables["cost_quality"]),
                    "cost_quality_frontier.png",
                    "Analytic prefill FLOPs of each mode against the suite's mean accuracy."))
    figures.append(("arms", plots.arms_figure(data.arms), "arms.png",
                    "Job against job: the difference to - from in accuracy and in answer KL "
                    "against N, with the model-level 95% CI; dashed: full."))
    return [(section, plots.save(fig, out / name, dpi=90 if section == "accuracy" else 100,
                             title_room=section in ("accuracy", "summary", "divergence")),
             caption) for section, fig, name, caption in figures if fig is not None]


def _suite_accuracy_figure(data: StudyData, label: str):
    """One suite run's accuracy against distance (families swept over distance, at most 9)."""
    suite = data.suite
    part = suite[(suite["label"] == label) & (suite["x_name"] == "distance")]
    settings = data.info[label]["settings"]
    return tool_plots.accuracy_figure(
        part, replays=settings["replays"], window=settings["window"],
        r_exact=settings.get("r_exact"), max_families=9,
        title=f"{label}: accuracy against distance (a fact at distance > N lies before the "
              "replay start)")


def _header(data: StudyData) -> tuple[list[str], list[str]]:
    """The title, description and status line, as (markdown, html) lines."""
    failed, status = data.failed, data.status
    md = [f"# Study `{data.name}`\n", f"{status.get('description', '')}\n",
          f"Study directory: `{data.study}`; scale `{status.get('scale', '?')}`. "
          + (f"**Failed steps: {', '.join(failed)}.**" if failed else "All steps succeeded.")
          + "\n"]
    body = [f"<h1>Study <code>{html.escape(data.name)}</code></h1>",
            f"<p>{html.escape(status.get('description', ''))}</p>",
            f"<p class='note'>Study directory: <code>{html.escape(str(data.study))}</code>; "
            f"scale <code>{html.escape(str(status.get('scale', '?')))}</code>. "
            + (f"<span class='failed'>Failed steps: {html.escape(', '.join(failed))}</span>"
               if failed else "<span class='ok'>All steps succeeded.</span>") + "</p>"]
    return md, body


def _figures(plots: list, section: str) -> tuple[list[str], list[str]]:
    """The plots of one section, as (markdown, html) lines; html embeds the PNGs."""
    md, body = [], []
    for key, path, caption in plots:
        if key != section:
            continue
        md.append(f"![{caption}]({path.name})\n\n_{caption}_\n")
        data = base64.b64encode(path.read_bytes()).decode()
        body.append(f"<figure><img alt='{html.escape(caption)}' "
                    f"src='data:image/png;base64,{data}'><figcaption class='note'>"
                    f"{html.escape(caption)}</figcaption></figure>")
    return md, body


def _summary(lines: list[str], plots: list) -> tuple[list[str], list[str]]:
    """The report's first section: the answer in a few lines, then the headline plot."""
    md_fig, html_fig = _figures(plots, "summary")
    md = ["## Summary\n", "\n".join(f"- {line}" for line in lines) + "\n", *md_fig]
    body = ["<h2>Summary</h2><ul>"
            + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>", *html_fig]
    return md, body


def _sections(tables: dict, plots: list) -> tuple[list[str], list[str]]:
    """Every section of SECTIONS with its plots and table, as (markdown, html) lines; a
    collapsed section's table sits inside <details> in the html."""
    md, body = [], []
    for title, text, key, plot_key, collapsed in SECTIONS:
        table = tables[key]
        md_fig, html_fig = _figures(plots, plot_key)
        md += [f"## {title}\n\n{text}\n", *md_fig, to_markdown(table)]
        body += [f"<h2>{html.escape(title)}</h2><p class='note'>{html.escape(text)}</p>",
                 *html_fig]
        if collapsed and not table.empty:
            body.append(f"<details><summary>{html.escape(title)} table ({len(table)} rows)"
                        f"</summary>{to_html(table)}</details>")
        else:
            body.append(to_html(table))
    return md, body


def _failures(data: StudyData) -> tuple[list[str], list[str]]:
    """The last output lines of every failed step, as (markdown, html) lines."""
    md, body = [], []
    for key in data.failed:
        step = data.steps[key]
        tail = step.get("tail") or step.get("error") or step.get("reason") or ""
        md.append(f"### Failed: {key}\n\n```\n{tail}\n```\n")
        body.append(f"<h3 class='failed'>Failed: {html.escape(key)}</h3>"
                    f"<pre>{html.escape(tail)}</pre>")
    return md, body


def write_pages(data: StudyData, tables: dict, plots: list, out: Path) -> Path:
    """Write report.md and report.html (the summary and headline plot first, then SECTIONS,
    then the failed steps' output); returns report.html."""
    points, marks = headline_points(data.suite, data.info)
    lines = headline_summary(points, marks, tables["divergence"], tables["capability_drop"])
    md, body = [], []
    for part_md, part_html in (_header(data), _summary(lines, plots), _sections(tables, plots),
                               _failures(data)):
        md += part_md
        body += part_html
    (out / "report.md").write_text("\n".join(md))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>ced study {html.escape(data.name)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>")
    (out / "report.html").write_text(page)
    return out / "report.html"


def build_report(study: str | Path, wandb: bool = True, quiet: bool = False,
                 group: str | None = None, project: str = "ced") -> Path:
    """Write <study>/report/{report.md, report.html, *.png, *.csv}; returns report.html.
    The wandb run goes to `project`, in `group` (default: the study's name)."""
    study = Path(study).resolve()
    out = study / "report"
    out.mkdir(parents=True, exist_ok=True)
    data = StudyData.load(study)
    tables = report_tables(data)
    for name in CSV_TABLES:
        if not tables[name].empty:
            tables[name].to_csv(out / f"{name}.csv", index=False)
    plots = report_plots(data, tables, out)
    page = write_pages(data, tables, plots, out)
    if wandb:
        try:
            _log_wandb(group or data.name, out, plots,
                       {name: tables[name] for name in CSV_TABLES},
                       config={"study_dir": str(study), **data.status}, project=project,
                       name=f"{data.name}-report",
                       scalars=report_scalars(data.suite, data.div, tables["seeds"]))
        except Exception as exc:     # wandb is a copy of the report; never fail it
            print(f"[report] wandb logging skipped: {exc}", file=sys.stderr)
    if not quiet:
        print(f"[report] wrote {out / 'report.md'}, {page} and {len(plots)} plots", flush=True)
    return page


def report_scalars(suite: pd.DataFrame, div: pd.DataFrame, seeds: pd.DataFrame) -> dict:
    """The report's numbers as flat scalars: pooled accuracy `acc/<run>/<family>/<mode>`
    (evals.suites' `suite_scalars` per run), first-token KL `kl/<run>/T=<T>/<mode>` (from
    evals.divergence's `divergence_scalars`), and across seeds
    `seeds/<job>/<what>/<mode>/mean` and `.../sd`."""
    out = {}
    if not suite.empty:
        pooled = suite[suite["x"].astype(str) == "all"]
        for label, part in pooled.groupby("label", sort=False):
            for key, value in suite_scalars(part.to_dict("records")).items():
                out[f"acc/{label}/{key.removeprefix('acc/')}"] = value
    if not div.empty:
        out.update({key: value for key, value in
                    divergence_scalars(div.to_dict("records")).items()
                    if key.startswith("kl/")})
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
    import wandb    # lazy: ~0.4 s to import, and only a report logged to wandb needs it
    run = wandb.init(project=project, group=group, job_type="report",
                     name=name or f"{group}-report", config=config or {},
                     mode=os.environ.get("WANDB_MODE", "offline"), dir=str(out),
                     settings=wandb.Settings(silent=True))
    log = {f"plots/{p.stem}": wandb.Image(str(p)) for _, p, _ in plots}
    for key, table in tables.items():
        if table is not None and not table.empty:
            log[f"tables/{key}"] = wandb.Table(dataframe=table.astype(str))
    run.log(log)
    log_scalars(run, scalars or {})
    run.finish()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__,
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
