"""Job against job: the arms of a study compared with each other (`arms.csv` of analysis.findings).

`python -m analysis.findings` compares each replay mode with `full` within a job; an ablation asks
another question: does k4 lose less than k2, does replay simulation help? This module answers
it for every pair of jobs the study compares:

- by default every two jobs whose training settings differ in exactly one key (`job_settings`:
  the overrides the driver recorded in each run's study_step.json, else the runs' config.yaml),
  e.g. `model.topk: 2 -> 4`;
- and any pair asked for by name (`analysis.findings --compare FROM:TO`; analysis.depth asks for each
  depth's `no_sim` against its `sim`, whose settings differ in two keys).

For each pair (from, to), family and mode both jobs ran (pooled over the family's distances),
three metrics of `to` against `from`: `accuracy`, `drop` (each model's mode - full on the same
document: the cost of the replay, compared between the arms; not for `full`) and `kl_answer`
(KL(full || mode) at the answer; not for `full`). Each row has:

  value_from, value_to, difference   pooled over each job's models and documents (to - from)
  ci_low, ci_high     the example-level 95% CI: a bootstrap over documents with the models
                      fixed; paired by document id where both jobs' models all read the same
                      documents (`pairing` = paired: the per-document difference is drawn),
                      each job's examples drawn on their own otherwise (unpaired)
  seed_ci_low, seed_ci_high   the model-level 95% CI, the model as the unit: each job's models
                      drawn on their own, with the shared documents drawn once for both
                      (crossed, `stats.crossed_difference`) or each model's own examples
                      within it (nested, `stats.hierarchical_bootstrap`); `seed_ci_method`
  welch_p             Welch's two-sided p over the two jobs' per-model values
  models_from, models_to, n_from, n_to, documents   the model counts, the examples, and the
                      shared documents (paired only)

A claim about the recipe (not these checkpoints) needs the model-level CI; with one or two
models a job it is only as wide as those models' spread.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from ced.records import DamagedRecord, read_json
from ced.run_id import identified, read_run_id
from evals.modes import mode_sort_keys
from evals.suites.stats import (bootstrap_means, crossed_difference, hierarchical_bootstrap,
                                percentile_interval, welch_p)

from .per_model import replay_length_by_job

FULL = "full"
METRICS = ("accuracy", "drop", "kl_answer")
RESAMPLES = 2000
COLUMNS = ["from", "to", "differs", "family", "mode", "N", "metric", "models_from", "models_to",
           "value_from", "value_to", "difference", "ci_low", "ci_high", "seed_ci_low",
           "seed_ci_high", "welch_p", "pairing", "documents"]
# what differs between the runs of one job, or says how a run goes, not what it trains
_NOT_SETTINGS = ("train.seed", "data.seed", "train.threads", "train.resume", "train.progress",
                 "logging", "hydra")


class CompareError(ValueError):
    """A job pair names a job the study has no suite results for."""


def _is_setting(key: str) -> bool:
    return not any(key == k or key.startswith(k + ".") for k in _NOT_SETTINGS)


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: value as text}."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _run_settings(run: Path) -> tuple[dict | None, dict | None]:
    """(the overrides of the run's study_step.json, its config.yaml as flat keys); either is
    None where the run lacks it."""
    overrides = config = None
    try:
        stamp = read_json(run / "study_step.json")
    except DamagedRecord:
        stamp = None
    if stamp and isinstance(stamp.get("overrides"), list):
        overrides = {}
        for item in stamp["overrides"]:
            key, _, value = str(item).partition("=")
            overrides[key.lstrip("+~")] = "(deleted)" if key.startswith("~") else value
    if (run / "config.yaml").exists():
        config = _flat(OmegaConf.to_container(OmegaConf.load(run / "config.yaml"),
                                              resolve=False))
    return overrides, config


def job_settings(study: Path) -> dict[str, dict[str, str]]:
    """Per job of `study/runs`: its training settings as {key: value}. From the overrides the
    driver recorded for each run (study_step.json) where every run has them, else from every
    run's config.yaml (an archive keeps only those); without the seed and bookkeeping keys,
    and without a key whose value differs between the job's own runs."""
    read = {run_id: _run_settings(run) for run_id, run in identified(study / "runs")}
    use = 0 if read and all(o is not None for o, _ in read.values()) else 1
    per_job: dict[str, list[dict]] = {}
    for run_id, sources in read.items():
        if sources[use] is not None:
            per_job.setdefault(run_id.job, []).append(sources[use])
    settings = {}
    for job, mine in per_job.items():
        first = mine[0]
        settings[job] = {k: v for k, v in first.items()
                         if _is_setting(k) and all(m.get(k) == v for m in mine)}
    return settings


def differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The keys whose value differs between two jobs' settings, as `key: A -> B` (`-`: unset)."""
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [f"{k}: {a.get(k, '-')} -> {b.get(k, '-')}" for k in keys]


def job_order(study: Path, jobs: list[str]) -> list[str]:
    """`jobs` in the study's order (the driver's training steps in summary.json), the rest by
    name."""
    try:
        steps = (read_json(study / "summary.json") or {}).get("steps", {})
    except DamagedRecord:
        steps = {}
    # a training step's record names its run folder (`ced.run_id`: which job it trained)
    trained = [read_run_id(Path(step["run_dir"])) for key, step in steps.items()
               if key.startswith("train/") and isinstance(step, dict) and step.get("run_dir")]
    order = list(dict.fromkeys(run_id.job for run_id in trained if run_id is not None))
    return [j for j in order if j in jobs] + sorted(j for j in jobs if j not in order)


def job_pairs(study: Path, jobs: list[str],
              compare: list[tuple[str, str]] | None = None) -> list[tuple[str, str, str]]:
    """(from, to, what differs) of every two of `jobs` (jobs as trained,
    `analysis.tables.trained_jobs`) whose settings differ in exactly one key (in the study's
    order), then each `compare` pair not already there. A pair naming a job that is not in
    `jobs` is a CompareError of one line."""
    settings = job_settings(study)
    ordered = job_order(study, jobs)
    pairs = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            diff = differences(settings[a], settings[b]) \
                if a in settings and b in settings else []
            if len(diff) == 1:
                pairs.append((a, b, diff[0]))
    for a, b in compare or []:
        missing = [j for j in (a, b) if j not in jobs]
        if missing:
            raise CompareError(f"--compare {a}:{b}: no job {', '.join(missing)} with suite "
                             f"results; jobs: {', '.join(sorted(jobs))}")
        if not any((a, b) == p[:2] for p in pairs):
            diff = differences(settings.get(a, {}), settings.get(b, {}))
            pairs.append((a, b, "; ".join(diff) or "asked for"))
    return pairs


def metric_values(results: pd.DataFrame) -> pd.DataFrame:
    """Long per-example values of METRICS: job, train_seed, family, mode, id, metric, value.
    `drop` pairs each example with the same model's `full` answer on the same document."""
    keys = ["job", "train_seed", "family", "id"]
    frames = [results[keys + ["mode"]].assign(metric="accuracy",
                                              value=results["correct"].astype(float))]
    replay = results[results["mode"] != FULL]
    full = results[results["mode"] == FULL][keys + ["correct"]].rename(
        columns={"correct": "full"})
    paired = replay.merge(full, on=keys, how="inner")
    frames.append(paired[keys + ["mode"]].assign(
        metric="drop", value=paired["correct"].astype(float) - paired["full"].astype(float)))
    if "kl_answer" in replay:
        kl = replay[replay["kl_answer"].notna()]
        frames.append(kl[keys + ["mode"]].assign(metric="kl_answer",
                                                  value=kl["kl_answer"].astype(float)))
    return pd.concat(frames, ignore_index=True)


def _same_documents(a: pd.Series, b: pd.Series) -> bool:
    """Whether every model of both jobs read one and the same set of documents."""
    ids = [g.index.get_level_values(1) for _, g in [*a.groupby(level=0), *b.groupby(level=0)]]
    first = frozenset(ids[0])
    return all(len(i) == len(first) and frozenset(i) == first for i in ids)


def compare_values(before: pd.Series, after: pd.Series, resamples: int = RESAMPLES,
                   seed: int = 0) -> dict:
    """The columns of one arms.csv row (see module doc) from two jobs' per-example values,
    each indexed by (train_seed, id)."""
    groups = [[g.to_numpy(dtype=float) for _, g in s.groupby(level=0)] for s in (before, after)]
    row = {"models_from": len(groups[0]), "models_to": len(groups[1]), "n_from": len(before),
           "n_to": len(after), "value_from": float(before.mean()),
           "value_to": float(after.mean())}
    row["difference"] = row["value_to"] - row["value_from"]
    if _same_documents(before, after):
        a, b = before.unstack(level=1), after.unstack(level=1)
        b = b[a.columns]
        per_document = b.mean(axis=0).to_numpy() - a.mean(axis=0).to_numpy()
        example = bootstrap_means(per_document, resamples, seed)
        model = crossed_difference(a.to_numpy(), b.to_numpy(), resamples, seed)
        row.update(pairing="paired", documents=a.shape[1], seed_ci_method="crossed")
    else:
        example = (bootstrap_means(after.to_numpy(dtype=float), resamples, seed)
                   - bootstrap_means(before.to_numpy(dtype=float), resamples, seed + 1))
        model = (hierarchical_bootstrap(groups[1], resamples, seed)
                 - hierarchical_bootstrap(groups[0], resamples, seed + 1))
        row.update(pairing="unpaired", documents=math.nan, seed_ci_method="nested")
    row["ci_low"], row["ci_high"] = percentile_interval(example)
    row["seed_ci_low"], row["seed_ci_high"] = percentile_interval(model)
    row["welch_p"] = welch_p([g.mean() for g in groups[0]], [g.mean() for g in groups[1]])
    return row


def arms_table(results: pd.DataFrame, pairs: list[tuple[str, str, str]], marks: dict,
               resamples: int = RESAMPLES) -> pd.DataFrame:
    """arms.csv (see module doc): one row per pair x family x mode x metric, for the modes and
    families both jobs ran. `results`: `analysis.tables.load_results`; `marks`: per job W and
    R_exact (`analysis.tables.geometry`), for N (NaN where the two jobs' N differ)."""
    if not pairs:
        return pd.DataFrame(columns=COLUMNS)
    values = metric_values(results[results["job"].isin({j for p in pairs for j in p[:2]})])
    cells = {key: part.set_index(["train_seed", "id"])["value"]
             for key, part in values.groupby(["job", "family", "mode", "metric"], sort=False)}
    rows = []
    for before, after, differs in pairs:
        for (job, family, mode, metric), mine in cells.items():
            theirs = cells.get((after, family, mode, metric))
            if job != before or theirs is None:
                continue
            rows.append({"from": before, "to": after, "differs": differs, "family": family,
                         "mode": mode, "N": math.nan, "metric": metric,
                         **compare_values(mine, theirs, resamples)})
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    table = pd.DataFrame(rows)
    n_from = replay_length_by_job(table, marks, "from")
    n_to = replay_length_by_job(table, marks, "to")
    table["N"] = np.where(n_from == n_to, n_from, math.nan)   # NaN where the two jobs' N differ
    order = {p[:2]: i for i, p in enumerate(pairs)}
    table["_pair"] = [order[(a, b)] for a, b in zip(table["from"], table["to"])]
    table["_metric"] = table["metric"].map(METRICS.index)
    table["_mode"] = mode_sort_keys(table)
    table = table.sort_values(["_pair", "family", "_metric", "_mode"], kind="stable")
    return table[COLUMNS + [c for c in table.columns if c not in COLUMNS
                            and not c.startswith("_")]].reset_index(drop=True)
