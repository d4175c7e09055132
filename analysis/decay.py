"""How the cost of bounded replay on real text decays with distance: `python -m analysis.decay`.

    python -m analysis.decay --kl-by-position findings/real_text/kl_by_position.csv \
        --study findings/real_text/archive --out /tmp/decay [--floor 1e-9] [--resamples 2000] \
        [--kl-by-class findings/real_text/kl_by_class.csv [--bar 0.001] [--to-window 128]]

(several readings at once: a kl_by_position.csv and kl_by_class.csv each, and each study's
directory or archive in --study, e.g. real_text_law's and real_text's for the encoder's effect
at L_d = 8.)

Reads one or more `kl_by_position.csv` of `evals.real_text` (per checkpoint and distance d: the
mean KL(exact || replay) of the bytes whose decoder windows are cut d bytes back, i.e. the cost
of a replay of N = d). Each checkpoint's W, L_d, L_e and R_exact come from its config
(`ced.checkpoint.load_config` of the checkpoint directory; where that directory is gone, of
`--study`'s runs/<job>/seed<k>/final, as `analysis.report.load_runs` finds them: study
directories or their archives), its job and seed from its path (`ced.tracking.job_and_seed`).

Per model, least squares of log kl_mean(d) = log A - (d - W) / tau over the distances
W <= d < R_exact whose kl_mean is above `--floor` (below W the first window is cut too; from
R_exact on the replay is exact and the KL is rounding), weighted by bytes: tau, A, the
distances used, R^2 and the per-byte factor exp(1/tau) by which the KL falls per byte of
replay. `--fit-until K` fits W <= d < K W only: the decay need not be one exponential (on
real_text_law's models it steepens past 2W), and the near range is where N*_text falls. Per
cell (a job: one W, L_d, L_e): the mean tau and tau / W over its models, with a bootstrap CI
over models and the t-interval.

The two laws, at each depth (L_d, L_e) whose cells span two windows or more, on its own (cells
of another depth would put depth into the fit; a depth of one window is named as not compared):
  per_token    tau = tau0       log tau = c            the decay is a number of tokens
  per_window   tau = k W        log tau = log W + c    the decay is a number of windows
decided by (a) the exponent beta of tau = k W^beta (least squares of log tau on log W over
models; beta near 0: per token, near 1: per window) and (b) held-out cells
(`analysis.laws.held_out`: each cell left out, each law fitted on the other cells' models
predicts its mean log tau; the RMSE over cells, in log tau). Every CI of the laws draws models
within cells (`analysis.laws.within_cells`). Where no depth has two windows the per-model and
per-cell tables are written and the laws refused (exit 2); a depth of one window beside one
that has two is named as not compared (decay.md and stderr).

N*_text, with `--kl-by-class` (the same readings' kl_by_class.csv): per cell and read replay N,
each model's relative change of perplexity over every scored byte, exp(dnll_mean) - 1, and its
Student t interval over the cell's models; N*_text is the smallest N read whose upper bound is
at most `--bar` (0.1%). Its extrapolation to a wider window (`--to-window`, V4.1's 128) under
each law: per model the distance at which its fitted KL falls to `--bar` nats a byte,
W + tau ln(A / bar) (W where A is already below), i.e. an excess of replay over W; per token
the excess is a number of bytes (N = W' + excess), per window a number of windows
(N = W' (1 + excess / W)); the estimate averages a depth's cells (each cell's mean over its
models), its interval draws models within cells. A KL of `bar` nats a byte is about a `bar`
relative change of perplexity (exp(dnll) - 1 ~ dnll ~ KL when the exact model is close to the
text's law); the grid's N*_text beside it is the measured check.

The synthetic suite beside it, with `--synthetic findings/encoder_w/models.csv --synthetic-study
findings/encoder_w/archive`: per real-text cell, every synthetic job of the same W, L_d and L_e
(E4_L4 beside T4_W8, E8_L8_s2500 beside T8_W8), its N* per model (min, median, max; the
median over W) and the distance it is censored at, beside N*_text.

The encoder's effect, with `--kl-by-class`: cells of the same W and L_d whose encoders differ
(from two studies, e.g. real_text_law's T8_W8 and real_text's ced_L8) are paired at N = W: each
cell's mean KL per byte and change of perplexity, and the deeper encoder's over the shallower's
with intervals (`analysis.decay_beside.encoder_effect`).

Writes decay_models.csv, decay_cells.csv, decay_laws.csv (rows per depth), decay.png (log KL
against d - W per model with its fit; tau against W per model with each depth's fits) and
decay.md into --out (with --kl-by-class a third panel: the change of perplexity against N / W per
cell, beside the bar); with --kl-by-class also decay_replays.csv (per cell and N: the change of
perplexity and its interval), N*_text in decay_cells.csv, decay_extrapolation.csv (rows per
depth) and decay_encoder.csv; with --synthetic, decay_synthetic.csv.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from ced.run_id import RunId
from ced.tracking import job_and_seed
from evals.suites.stats import bootstrap_means, percentile_interval, seed_t_test

from .laws import (Law, add_bootstrap_options, bootstrap_scores, held_out, scores,
                   within_cells)
from .decay_beside import encoder_effect, shape_of, synthetic_beside_text
from .publish import markdown
from .report import load_runs

REQUIRED = ("checkpoint", "distance", "bytes", "kl_mean")
# At R_exact and beyond the KL is zero up to rounding (about 1e-14 in findings/real_text); a
# mean KL at or below FLOOR is taken as rounding, not as decay, and left out of the fit.
FLOOR = 1e-9
LAWS = (Law("per_token", "tau = tau0", "zero", False),
        Law("per_window", "tau = k W", "log_W", False))
GEOMETRY = ("job", "seed", "W", "L_d", "L_e", "R_exact")
DEPTH = ("L_d", "L_e")
# The change of perplexity an engine accepts from bounded replay: 0.1% (N*_text's bar: the
# smallest N whose relative change of perplexity stays under it), and V4.1's window, where
# N*_text is extrapolated.
BAR, V41_WINDOW = 0.001, 128
CLASS_REQUIRED = ("checkpoint", "job", "level", "replay", "N", "group", "dnll_mean",
                  "kl_mean")


def read_readings(paths: list[Path], required: tuple[str, ...], name: str,
                  key: str | None = None) -> pd.DataFrame:
    """The rows of every file (evals.real_text's `name`, e.g. kl_by_position.csv), one table
    with string checkpoints; a missing column of `required`, or (with `key`) a (checkpoint,
    key) given twice (the same model in two tables), is a ValueError."""
    parts = []
    for path in paths:
        table = pd.read_csv(path)
        missing = [c for c in required if c not in table]
        if missing:
            raise ValueError(f"{path}: no column(s) {missing} (evals.real_text's {name} has "
                             f"{list(required)})")
        parts.append(table.assign(checkpoint=table["checkpoint"].astype(str)))
    table = pd.concat(parts, ignore_index=True)
    twice = table.duplicated(["checkpoint", key]) if key else None
    if twice is not None and twice.any():
        row = table[twice].iloc[0]
        raise ValueError(f"checkpoint {row['checkpoint']}: {key} {row[key]} given twice (the "
                         f"same model in two {name} tables?)")
    return table


def read_tables(paths: list[Path]) -> pd.DataFrame:
    """The kl_by_position rows of every file, one table (rows: checkpoint x distance)."""
    return read_readings(paths, REQUIRED, "kl_by_position.csv", key="distance")


def geometry(checkpoint: str, runs: dict | None) -> dict:
    """job, seed, W, L_d, L_e and R_exact of one checkpoint: its own config.json, else the
    config of its run in `runs` (`load_runs` of --study, by `<job>/seed<k>`)."""
    job, seed = job_and_seed(checkpoint)
    path = Path(checkpoint)
    if not (path / "config.json").is_file():
        run = (runs or {}).get(RunId(job, seed).model, {}) if seed is not None else {}
        if run.get("final") is None:
            raise FileNotFoundError(f"{checkpoint}: no config.json there, nor a run {job}/seed"
                                    f"{seed} with final/config.json under --study")
        path = run["final"]
    return {"job": job, "seed": seed, **shape_of(path)}


def fit_decay(distance: np.ndarray, kl: np.ndarray, weight: np.ndarray, window: int,
              r_exact: int, floor: float = FLOOR, until: float | None = None) -> dict:
    """One model's fit of log kl = log A - (d - W) / tau over W <= d < R_exact with kl > floor
    (distance, kl, weight: shape (distances,)), and d < until * W where `until` is given (the
    near range only: the decay need not be one exponential all the way): tau, A, distances
    (how many were used), last_distance (the largest used), r2, per_byte_factor (NaN with
    fewer than two usable distances; tau NaN where the KL does not fall)."""
    end = r_exact if until is None else min(r_exact, until * window)
    keep = (distance >= window) & (distance < end) & (kl > floor)
    x, w = distance[keep] - float(window), weight[keep].astype(float)
    out = {"tau": math.nan, "A": math.nan, "distances": int(keep.sum()),
           "last_distance": float(distance[keep].max()) if keep.any() else math.nan,
           "r2": math.nan, "per_byte_factor": math.nan}
    if len(np.unique(x)) < 2:
        return out
    y = np.log(kl[keep])
    # Weighted by bytes: each kl_mean averages `bytes` readings, so the variance of its log
    # falls as 1/bytes (for a like spread of KL at each distance); these are inverse-variance
    # weights. The byte counts differ by a few per cent between distances (passes, row ends).
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    slope = float((w * (x - xm) * (y - ym)).sum() / (w * (x - xm) ** 2).sum())
    log_a = ym - slope * xm
    total = float((w * (y - ym) ** 2).sum())
    residual = float((w * (y - log_a - slope * x) ** 2).sum())
    tau = -1.0 / slope if slope < 0 else math.nan
    return {**out, "tau": tau, "A": math.exp(log_a), "r2": 1 - residual / total if total else
            math.nan, "per_byte_factor": math.exp(1 / tau) if slope < 0 else math.nan}


def fit_models(table: pd.DataFrame, runs: dict | None, floor: float = FLOOR,
               until: float | None = None) -> pd.DataFrame:
    """decay_models.csv: per checkpoint (rows: models) its geometry and `fit_decay` (over
    W <= d < until * W where `until` is given)."""
    rows = []
    for checkpoint, part in table.groupby("checkpoint", sort=True):
        info = geometry(checkpoint, runs)
        fit = fit_decay(part["distance"].to_numpy(float), part["kl_mean"].to_numpy(float),
                        part["bytes"].to_numpy(float), info["W"], info["R_exact"], floor,
                        until)
        rows.append({"checkpoint": checkpoint, **info, **fit,
                     "tau_over_W": fit["tau"] / info["W"]})
    return pd.DataFrame(rows).sort_values(["W", "L_d", "L_e", "job", "seed"],
                                          ignore_index=True)


def _mean_intervals(values: np.ndarray, name: str, resamples: int, alpha: float,
                    seed: int) -> dict:
    """{name_mean, name_ci_low/high (bootstrap over models), name_t_low/high} of one cell's
    per-model values (shape (models,))."""
    low, high = percentile_interval(bootstrap_means(values, resamples, seed), 1 - alpha)
    t_low, t_high, _ = seed_t_test(values, 1 - alpha)
    return {f"{name}_mean": float(values.mean()), f"{name}_ci_low": low,
            f"{name}_ci_high": high, f"{name}_t_low": t_low, f"{name}_t_high": t_high}


def cell_table(models: pd.DataFrame, resamples: int = 2000, alpha: float = 0.05,
               seed: int = 0) -> pd.DataFrame:
    """decay_cells.csv: per job (rows: cells) the models with a tau, mean tau and tau / W with
    their CIs, and the per-byte factor of the mean tau. ValueError for a cell without a tau."""
    rows = []
    for job, part in models.groupby("job", sort=False):
        fitted = part.dropna(subset=["tau"])
        if fitted.empty:
            raise ValueError(f"cell {job}: no model with a decay fit (no two distances "
                             "W <= d < R_exact, and below --fit-until's end where given, above "
                             "the floor with a falling KL)")
        first = part.iloc[0]
        tau = _mean_intervals(fitted["tau"].to_numpy(float), "tau", resamples, alpha, seed)
        rows.append({"job": job, **{k: int(first[k]) for k in ("W", "L_d", "L_e", "R_exact")},
                     "models": len(part), "fitted": len(fitted), **tau,
                     **_mean_intervals(fitted["tau_over_W"].to_numpy(float), "tau_over_W",
                                       resamples, alpha, seed),
                     "per_byte_factor": math.exp(1 / tau["tau_mean"])})
    return pd.DataFrame(rows)


def law_frame(models: pd.DataFrame) -> pd.DataFrame:
    """The models with a tau (rows) and what the laws read: log_tau, log_W and zero (the
    per-token law's covariate). ValueError with fewer than two distinct W."""
    frame = models.dropna(subset=["tau"]).reset_index(drop=True)
    windows = sorted(frame["W"].unique())
    if len(windows) < 2:
        raise ValueError(f"the laws need two windows: every fitted model has W = "
                         f"{', '.join(map(str, windows)) or 'none'}")
    return frame.assign(log_tau=np.log(frame["tau"]), log_W=np.log(frame["W"]), zero=0.0)


def exponent(frame: pd.DataFrame) -> float:
    """beta of log tau = log k + beta log W, least squares over models (frame: rows models)."""
    return float(np.polyfit(frame["log_W"], frame["log_tau"], 1)[0])


def exponent_t_interval(frame: pd.DataFrame, alpha: float = 0.05) -> tuple[float, float]:
    """Student t interval of beta from the least squares over models (frame: rows models;
    df = models - 2): with three models a cell the within-cell bootstrap runs narrow (it
    covered the truth in about 80% of fabricated tables, this in about 97%)."""
    x, y = frame["log_W"].to_numpy(float), frame["log_tau"].to_numpy(float)
    if len(x) < 3:
        return math.nan, math.nan
    slope, intercept = np.polyfit(x, y, 1)
    spread = ((y - intercept - slope * x) ** 2).sum() / (len(x) - 2)
    # lazy: scipy.stats costs ~0.6 s to import, and only the interval over models needs it
    from scipy import stats
    half = float(stats.t.ppf(1 - alpha / 2, len(x) - 2)) * math.sqrt(
        spread / ((x - x.mean()) ** 2).sum())
    return float(slope - half), float(slope + half)


def per_depth(models: pd.DataFrame, build: Callable[[pd.DataFrame], pd.DataFrame]
              ) -> tuple[pd.DataFrame | None, list[str]]:
    """`build(part)` (a DataFrame) at each depth (L_d, L_e) of `models` on its own, the rows
    led by L_d and L_e, and why each depth where `build` raised ValueError has none; (None,
    why) where no depth has rows."""
    tables, why = [], []
    for (l_d, l_e), part in models.groupby(list(DEPTH), sort=True):
        try:
            tables.append(build(part).assign(L_d=int(l_d), L_e=int(l_e)))
        except ValueError as error:
            why.append(f"L_d = {l_d}, L_e = {l_e}: {error}")
    if not tables:
        return None, why
    table = pd.concat(tables, ignore_index=True)
    return table[[*DEPTH, *[c for c in table if c not in DEPTH]]], why


def law_table(models: pd.DataFrame, resamples: int = 2000, alpha: float = 0.05
              ) -> tuple[pd.DataFrame | None, list[str]]:
    """decay_laws.csv over each depth (L_d, L_e) whose fitted models span two windows or more,
    rows led by L_d and L_e (`compare_laws` per depth: the laws ask how tau grows with W at one depth, and cells of
    another depth would put depth into beta), and why each other depth was not compared;
    (None, why) where none was."""
    return per_depth(models, lambda part: compare_laws(law_frame(part), resamples, alpha)[0])


def law_draws(frame: pd.DataFrame, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Shape (resamples, 3): beta, tau0 and k of each `within_cells` draw of models."""
    cell = frame["job"].to_numpy(str)
    out = np.empty((resamples, 3))
    for i, pick in enumerate(within_cells(cell, resamples, rng)):
        drawn = frame.iloc[pick]
        out[i] = (exponent(drawn), *(math.exp(law.fit(drawn[law.covariate].to_numpy(float),
                                                      drawn["log_tau"].to_numpy(float)))
                                     for law in LAWS))
    return out


def compare_laws(frame: pd.DataFrame, resamples: int = 2000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(decay_laws.csv, the held-out errors per law and cell). Rows of decay_laws: exponent
    (estimate beta; its bootstrap CI and its t-interval), per_token (estimate tau0),
    per_window (estimate k), each with its bootstrap CI;
    the laws with their held-out RMSE of the cell mean log tau, its CI, and the difference to
    the best law with its CI."""
    errors = held_out(frame, list(LAWS), target="log_tau")
    point = {law: rmse for law, (rmse, _) in scores(errors).items()}
    best = min(point, key=point.get)
    rng = np.random.default_rng(seed)
    draws = {k: v[:, 0] for k, v in bootstrap_scores(frame, list(LAWS), resamples, rng,
                                                       target="log_tau").items()}
    constants = law_draws(frame, resamples, rng)
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    base = {"cells": frame["job"].nunique(), "models": len(frame)}
    rows = [{"law": "exponent", "formula": "tau = k W^beta", "estimate": exponent(frame),
             "estimate_ci_low": np.percentile(constants[:, 0], lo),
             "estimate_ci_high": np.percentile(constants[:, 0], hi),
             **dict(zip(("estimate_t_low", "estimate_t_high"),
                        exponent_t_interval(frame, alpha))), **base}]
    for i, law in enumerate(LAWS, start=1):
        x, y = frame[law.covariate].to_numpy(float), frame["log_tau"].to_numpy(float)
        minus = draws[law.name] - draws[best]
        rows.append({"law": law.name, "formula": law.formula,
                     "estimate": math.exp(law.fit(x, y)),
                     "estimate_ci_low": np.percentile(constants[:, i], lo),
                     "estimate_ci_high": np.percentile(constants[:, i], hi), **base,
                     "held_out_rmse": point[law.name],
                     "rmse_ci_low": np.percentile(draws[law.name], lo),
                     "rmse_ci_high": np.percentile(draws[law.name], hi),
                     "minus_best": point[law.name] - point[best],
                     "minus_best_ci_low": np.percentile(minus, lo),
                     "minus_best_ci_high": np.percentile(minus, hi),
                     "best": law.name == best})
    return pd.DataFrame(rows), errors


def read_classes(paths: list[Path]) -> pd.DataFrame:
    """The per-model rows over every scored byte (level model, group all) of one or more of
    evals.real_text's kl_by_class.csv (rows: checkpoint x replay)."""
    table = read_readings(paths, CLASS_REQUIRED, "kl_by_class.csv").astype({"replay": str})
    table = table[(table["level"] == "model") & (table["group"] == "all")]
    # (checkpoint, replay) is one row per class group: unique once the groups are filtered
    twice = table.duplicated(["checkpoint", "replay"])
    if twice.any():
        row = table[twice].iloc[0]
        raise ValueError(f"--kl-by-class: checkpoint {row['checkpoint']} replay {row['replay']} "
                         "given twice (the same model in two tables?)")
    return table


def runs_of(studies: list[Path]) -> dict | None:
    """The runs of every study directory or archive (`load_runs`), as one dict by
    `<job>/seed<k>`; None for none. A run label in two of them is a ValueError (the geometry
    of its checkpoints would be ambiguous)."""
    if not studies:
        return None
    runs: dict = {}
    for study in studies:
        found = load_runs(study)
        if clash := sorted(set(found) & set(runs)):
            raise ValueError(f"--study: run(s) {clash} in more than one study; read studies "
                             "whose jobs differ")
        runs |= found
    return runs


def replay_table(classes: pd.DataFrame, models: pd.DataFrame, bar: float = BAR,
                 alpha: float = 0.05) -> pd.DataFrame:
    """decay_replays.csv: per cell and read replay (rows) its N, the models read, their mean
    relative change of perplexity exp(dnll_mean) - 1 with its Student t interval over models,
    and `within_bar` (the upper bound at most `bar`; False with one model: no interval).
    classes: `read_classes` rows; models: `fit_models` (a checkpoint's cell is its job there).
    ValueError for a model of `classes` that `models` lacks."""
    cell_of = models.set_index("checkpoint")["job"]
    unknown = sorted(set(classes["checkpoint"]) - set(cell_of.index))
    if unknown:
        raise ValueError(f"--kl-by-class: checkpoint {unknown[0]} has no row in "
                         "--kl-by-position (read both from one evals.real_text reading)")
    rows = []
    frame = classes.assign(cell=classes["checkpoint"].map(cell_of),
                           dppl=np.expm1(classes["dnll_mean"].astype(float)))
    for (cell, replay), part in frame.groupby(["cell", "replay"], sort=False):
        low, high, _ = seed_t_test(part["dppl"].to_numpy(float), 1 - alpha)
        rows.append({"job": cell, "replay": replay, "N": int(part["N"].iloc[0]),
                     "models": len(part), "dppl_mean": float(part["dppl"].mean()),
                     "dppl_t_low": low, "dppl_t_high": high,
                     "within_bar": bool(high <= bar) if not math.isnan(high) else False})
    return pd.DataFrame(rows).sort_values(["job", "N"], ignore_index=True)


def model_n_star(classes: pd.DataFrame, bar: float = BAR) -> pd.Series:
    """Per model (index: checkpoint) the smallest N read whose own relative change of
    perplexity, exp(dnll_mean) - 1, is at most `bar` (no interval: a point reading, beside the
    cell's N*_text); NaN where none is. classes: `read_classes` rows."""
    within = classes[np.expm1(classes["dnll_mean"].astype(float)) <= bar]
    found = within.groupby("checkpoint")["N"].min()
    return found.reindex(classes["checkpoint"].unique()).astype(float)


def n_star_text(replays: pd.DataFrame) -> pd.Series:
    """Per cell (index: job) the smallest N read whose change of perplexity is within the bar
    at its upper bound; NaN where none is: N*_text lies beyond the grid, or the cell has one
    model (no interval; its model's own reading is `model_n_star`)."""
    passing = replays[replays["within_bar"]]
    found = passing.groupby("job")["N"].min()
    return found.reindex(replays["job"].unique()).astype(float)


def excess_over_window(models: pd.DataFrame, bar: float = BAR) -> np.ndarray:
    """Per model (shape (models,)): the replay beyond W at which its fitted KL falls to `bar`
    nats a byte, tau ln(A / bar), 0 where A is at most `bar` already (NaN without a fit)."""
    tau, amplitude = models["tau"].to_numpy(float), models["A"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(amplitude > bar, tau * np.log(amplitude / bar), 0.0)
    return np.where(np.isnan(tau), np.nan, excess)


def _extrapolated(frame: pd.DataFrame, window: int) -> tuple[float, float]:
    """(per token, per window) N at `window` from `frame`'s models (rows: models with columns
    job, W, excess): the mean over cells of each cell's mean excess, in bytes or in windows."""
    cells = frame.assign(windows=frame["excess"] / frame["W"]).groupby("job")
    return (window + float(cells["excess"].mean().mean()),
            window * (1 + float(cells["windows"].mean().mean())))


def extrapolate(models: pd.DataFrame, window: int = V41_WINDOW, bar: float = BAR,
                resamples: int = 2000, alpha: float = 0.05, seed: int = 0) -> pd.DataFrame:
    """decay_extrapolation.csv: per law (rows: per_token, per_window) N at `window` with its
    interval (models drawn within cells), and the excess over the window it implies.
    models: `fit_models` rows (models without a fit are left out); ValueError without one."""
    frame = models.assign(excess=excess_over_window(models, bar)).dropna(subset=["excess"])
    if frame.empty:
        raise ValueError("no model with a decay fit to extrapolate")
    point = _extrapolated(frame, window)
    rng = np.random.default_rng(seed)
    draws = np.array([_extrapolated(frame.iloc[pick], window) for pick in
                      within_cells(frame["job"].to_numpy(str), resamples, rng)])
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    return pd.DataFrame([{"law": law.name, "window": window, "bar": bar,
                          "cells": frame["job"].nunique(), "models": len(frame),
                          "N": point[i], "N_ci_low": np.percentile(draws[:, i], lo),
                          "N_ci_high": np.percentile(draws[:, i], hi),
                          "N_over_W": point[i] / window} for i, law in enumerate(LAWS)])


def extrapolate_depths(models: pd.DataFrame, window: int = V41_WINDOW, bar: float = BAR,
                       resamples: int = 2000, alpha: float = 0.05) -> pd.DataFrame:
    """decay_extrapolation.csv: `extrapolate` at each depth (L_d, L_e) on its own, rows led by
    L_d and L_e (a law's constant is a depth's: averaging over depths would mix them).
    ValueError naming the depth where one has no model with a decay fit."""
    table, why = per_depth(models, lambda part: extrapolate(part, window, bar, resamples, alpha))
    if table is None or why:
        raise ValueError(f"no extrapolation at {'; '.join(why) or 'any depth: no model'}")
    return table


def _decay_panel(ax, table: pd.DataFrame, models: pd.DataFrame, floor: float) -> None:
    """log KL against d - W per model (points above the floor), coloured by W, with its fit
    over the distances it used."""
    windows = sorted(models["W"].unique())
    colours = {w: colormaps["viridis"](k / max(1, len(windows) - 1))
               for k, w in enumerate(windows)}
    for m in models.itertuples():
        part = table[(table["checkpoint"] == m.checkpoint) & (table["kl_mean"] > floor)]
        colour = colours[m.W]
        ax.plot(part["distance"] - m.W, part["kl_mean"], ".", ms=3, color=colour, alpha=0.6)
        if not math.isnan(m.tau):
            x = np.array([0.0, m.last_distance - m.W])
            ax.plot(x, m.A * np.exp(-x / m.tau), "-", lw=1, color=colour)
    for w in windows:
        ax.plot([], [], "-", color=colours[w], label=f"W = {w}")
    ax.set_yscale("log")
    ax.set_xlabel("d - W (bytes)")
    ax.set_ylabel("mean KL(exact || replay d), nats")
    ax.legend(fontsize=7)


def _tau_panel(ax, models: pd.DataFrame, laws: pd.DataFrame | None) -> None:
    """tau per model against W (a marker per depth), with each depth's per-token and
    per-window fits where it has laws."""
    for marker, ((l_d, l_e), part) in zip(itertools.cycle("osD^v<>p*"),
                                          models.groupby(list(DEPTH))):
        ax.scatter(part["W"], part["tau"], s=14, marker=marker, color="0.3",
                   label=f"models, L_d {l_d}, L_e {l_e}")
    for (l_d, l_e), fit in (laws.groupby(list(DEPTH)) if laws is not None else ()):
        at = models[(models["L_d"] == l_d) & (models["L_e"] == l_e)]
        w, fits = np.geomspace(at["W"].min(), at["W"].max(), 20), fit.set_index("law")["estimate"]
        ax.plot(w, np.full_like(w, fits["per_token"]), "--",
                label=f"per token: tau = tau0 (L_d {l_d}, L_e {l_e})")
        ax.plot(w, fits["per_window"] * w, ":", label=f"per window: tau = k W (L_d {l_d}, "
                f"L_e {l_e})")
    ax.legend(fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("W (bytes)")
    ax.set_ylabel("tau (bytes)")


def _replay_panel(ax, replays: pd.DataFrame, cells: pd.DataFrame, bar: float) -> None:
    """Per cell the change of perplexity against N / W: its mean over models (line) and the
    upper t-bound N*_text is read at (markers), beside the bar. Values at or below 1e-8 (a
    replay at R_exact is exact up to rounding, and may read as a tiny negative) are drawn at
    1e-8."""
    shown = 1e-8
    for cell in cells.itertuples():
        part = replays[replays["job"] == cell.job].sort_values("N").drop_duplicates("N")
        x = part["N"] / cell.W
        line, = ax.plot(x, part["dppl_mean"].clip(lower=shown), "-", lw=1,
                        label=f"{cell.job} (W {cell.W}, L_d {cell.L_d}, L_e {cell.L_e})")
        ax.plot(x, part["dppl_t_high"].clip(lower=shown), "^", ms=4, color=line.get_color())
    ax.axhline(bar, color="0.4", ls="--", lw=1, label=f"bar {bar:g}")
    ax.set_yscale("log")
    ax.set_xlabel("replay N / W")
    ax.set_ylabel("perplexity change (mean; ^ upper t-bound)")
    ax.legend(fontsize=6)


def figure(table: pd.DataFrame, models: pd.DataFrame, laws: pd.DataFrame | None,
           floor: float, replays: tuple | None = None):
    """decay.png: the decay per model (left), tau against W (middle) and, given (replays,
    cells, bar), the change of perplexity against N / W per cell (right)."""
    fig = Figure(figsize=(16.5 if replays is not None else 11, 4.2))
    axes = fig.subplots(1, 3 if replays is not None else 2)
    _decay_panel(axes[0], table, models, floor)
    _tau_panel(axes[1], models, laws)
    if replays is not None:
        _replay_panel(axes[2], *replays)
    fig.suptitle("Cost of bounded replay on real text against distance, its decay length"
                 + (", and N*_text" if replays is not None else ""))
    fig.tight_layout()
    return fig


MODEL_COLUMNS = ["job", "seed", "W", "L_d", "L_e", "R_exact", "distances", "last_distance",
                 "tau", "A", "r2", "per_byte_factor", "n_star_point"]
CELL_COLUMNS = ["job", "W", "L_d", "L_e", "models", "fitted", "tau_mean", "tau_ci_low",
                "tau_ci_high", "tau_t_low", "tau_t_high", "tau_over_W_mean",
                "tau_over_W_ci_low", "tau_over_W_ci_high", "tau_over_W_t_low",
                "tau_over_W_t_high", "per_byte_factor"]


def _n_star_markdown(replays: pd.DataFrame, extrapolation: pd.DataFrame, level: str,
                     synthetic: pd.DataFrame | None = None) -> list:
    """decay.md's N*_text part: the change of perplexity per cell and N, the extrapolation and,
    given, the synthetic suite's N* beside it."""
    bar, window = extrapolation["bar"].iloc[0], int(extrapolation["window"].iloc[0])
    md = ["", f"## N*_text: relative change of perplexity per read replay ({level} Student t "
          f"over models; within_bar: upper bound <= {bar:g})", "",
          markdown(replays, list(replays.columns), digits=5),
          f"## N*_text extrapolated to W = {window} (each model's fitted KL down to {bar:g} "
          "nats a byte; intervals draw models within cells)", "",
          markdown(extrapolation, list(extrapolation.columns), digits=4)]
    if synthetic is not None:
        md += ["## The synthetic suite's N* beside N*_text (cells of the same W, L_d and L_e; "
               "a synthetic N* is censored at its largest competent distance, N*_text at "
               "R_exact; a blank N*_text: beyond the grid, or one model, without an interval)",
               "",
               markdown(synthetic, list(synthetic.columns), digits=4) if not synthetic.empty
               else "No synthetic job shares a real-text cell's W, L_d and L_e."]
    return md


def report(sources: list[Path], floor: float, resamples: int, alpha: float,
           models: pd.DataFrame, cells: pd.DataFrame, laws: pd.DataFrame | None,
           why: list[str], n_star: tuple | None = None, until: float | None = None,
           encoder: pd.DataFrame | None = None) -> str:
    """decay.md: the fits per model, the cells, the laws per depth (and why a depth has none)
    and, given (replays, extrapolation[, synthetic]) as `n_star`, N*_text (and the synthetic N*
    beside), and the encoder's effect (`encoder_effect`)."""
    level = f"{100 * (1 - alpha):.0f}%"
    md = ["# How the cost of bounded replay decays with distance (python -m analysis.decay)",
          "", f"From {', '.join(map(str, sources))}. Per model, log mean KL = log A - (d - W)"
          f" / tau over W <= d < R_exact{'' if until is None else f' and d < {until:g} W'} with"
          f" mean KL > {floor:g}, least squares weighted by bytes; per_byte_factor = "
          "exp(1/tau), the factor the KL falls by per byte.", "",
          "## Models", "", markdown(models, [c for c in MODEL_COLUMNS if c in models], digits=4),
          f"## Cells ({level} CIs: ci, bootstrap over models, {resamples} draws; t, "
          "Student t over models)", "",
          markdown(cells, [c for c in [*CELL_COLUMNS, "n_star_text", "n_star_text_over_W"]
                           if c in cells], digits=4),
          "## The laws (per depth L_d, L_e)", ""]
    if laws is not None:
        md += [f"log tau per cell held out in turn; {level} CIs from {resamples} draws of "
               "models within cells.", "",
               markdown(laws, [c for c in laws.columns if c not in ("cells",)], digits=4)]
    md += [f"Not compared at {reason}." for reason in why]
    if n_star is not None:
        md += _n_star_markdown(*n_star[:2], level, *n_star[2:])
    if encoder is not None:
        md += ["", "## The encoder's effect (cells at the same W and L_d, encoders of "
               f"different depth, read at N = W; {level} Student t over models; the ratios "
               "deeper / base with bootstrap intervals drawing models within each cell; cells "
               "of two studies may also differ in steps, precision and reading settings)", "",
               markdown(encoder, list(encoder.columns), digits=4) if not encoder.empty
               else "No two cells share W and L_d with encoders of different depth."]
    return "\n".join(md) + "\n"


def n_star_tables(classes_paths: list[Path], models: pd.DataFrame, cells: pd.DataFrame,
                  bar: float, window: int, resamples: int, alpha: float) -> tuple:
    """(replays, extrapolation, the classes read) of `replay_table` and `extrapolate_depths`;
    adds n_star_text and
    n_star_text_over_W to `cells` and each model's own point reading, n_star_point, to
    `models` in place."""
    classes = read_classes(classes_paths)
    models["n_star_point"] = models["checkpoint"].map(model_n_star(classes, bar))
    replays = replay_table(classes, models, bar, alpha)
    found = n_star_text(replays)
    cells["n_star_text"] = cells["job"].map(found)
    cells["n_star_text_over_W"] = cells["n_star_text"] / cells["W"]
    return replays, extrapolate_depths(models, window, bar, resamples, alpha), classes


def write(sources: list[Path], out: Path, studies: list[Path] = (), floor: float = FLOOR,
          resamples: int = 2000, alpha: float = 0.05, classes: list[Path] = (),
          bar: float = BAR, window: int = V41_WINDOW,
          synthetic: tuple[Path, list[Path]] | None = None,
          until: float | None = None) -> tuple[dict, pd.DataFrame | None, list[str]]:
    """Every output into `out`: ({name: path}, the laws of `law_table` (None where no depth
    has them), why each depth without laws was not compared). `studies`: study
    directories or archives whose runs give the geometry of checkpoints that are gone;
    `classes`: the readings' kl_by_class.csv, for N*_text and its extrapolation to `window`;
    `synthetic`: (analysis.reach's models.csv, its study's directories or archives), for
    `synthetic_beside_text` (needs `classes`); `until`: fit W <= d < until * W only."""
    if synthetic is not None and not classes:
        raise ValueError("--synthetic needs --kl-by-class (N*_text is what it is put beside)")
    table = read_tables(sources)
    runs = runs_of(list(studies))
    models = fit_models(table, runs, floor, until)
    cells = cell_table(models, resamples, alpha)
    n_star = encoder = None
    if classes:
        *n_star, read = n_star_tables(list(classes), models, cells, bar, window, resamples,
                                      alpha)
        encoder = encoder_effect(read, models, "W", resamples, alpha)
    if n_star is not None and synthetic is not None:      # before anything is written
        n_star = (*n_star, synthetic_beside_text(pd.read_csv(synthetic[0]),
                                                 runs_of(list(synthetic[1])), cells))
    laws, why = law_table(models, resamples, alpha)
    out.mkdir(parents=True, exist_ok=True)
    written = {name: out / f"decay_{name}.csv" for name in ("models", "cells", "laws")}
    models.to_csv(written["models"], index=False, float_format="%.6g")
    cells.to_csv(written["cells"], index=False, float_format="%.6g")
    (laws if laws is not None else pd.DataFrame(columns=["law"])).to_csv(
        written["laws"], index=False, float_format="%.6g")
    tables = dict(zip(("replays", "extrapolation", "synthetic"), n_star or ()))
    for name, frame in (tables | ({"encoder": encoder} if encoder is not None else {})).items():
        written[name] = out / f"decay_{name}.csv"
        frame.to_csv(written[name], index=False, float_format="%.6g")
    written["figure"] = out / "decay.png"
    figure(table, models, laws, floor, (n_star[0], cells, bar) if n_star else None).savefig(
        written["figure"], dpi=110)
    written["markdown"] = out / "decay.md"
    written["markdown"].write_text(report(sources, floor, resamples, alpha, models, cells,
                                          laws, why, n_star, until, encoder))
    return written, laws, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.decay", description=(
        "Fit the decay of the KL of bounded replay with distance per model, and decide "
        "whether it is per token or per window."))
    parser.add_argument("--kl-by-position", required=True, nargs="+", type=Path,
                        help="evals.real_text's kl_by_position.csv (one or more)")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--study", type=Path, nargs="+", default=[], help=(
        "study directories or archives (runs/<job>/seed<k>/final/config.json), for "
        "checkpoints whose directory is gone (several: studies of different jobs, e.g. "
        "real_text_law and real_text for the encoder's effect)"))
    parser.add_argument("--floor", type=float, default=FLOOR,
                        help=f"mean KL at or below this is rounding (default {FLOOR:g})")
    parser.add_argument("--kl-by-class", type=Path, nargs="+", default=[], help=(
        "the same readings' kl_by_class.csv (one or more): N*_text per cell and its "
        "extrapolation"))
    parser.add_argument("--bar", type=float, default=BAR, help=(
        f"the relative change of perplexity N*_text allows (default {BAR:g}: 0.1%%)"))
    parser.add_argument("--to-window", type=int, default=V41_WINDOW, help=(
        f"the window N*_text is extrapolated to (default {V41_WINDOW}, V4.1's)"))
    parser.add_argument("--fit-until", type=float, default=None, metavar="WINDOWS", help=(
        "fit only W <= d < WINDOWS x W (e.g. 2: the near range, where N*_text falls; the "
        "decay steepens further out); default: up to R_exact"))
    parser.add_argument("--synthetic", type=Path, default=None, help=(
        "analysis.reach's models.csv of a synthetic study (e.g. findings/encoder_w/models.csv):"
        " its N* per model beside N*_text for cells of the same W, L_d and L_e (needs "
        "--kl-by-class and --synthetic-study)"))
    parser.add_argument("--synthetic-study", type=Path, nargs="+", default=[], help=(
        "the synthetic study's directories or archives (runs/<job>/seed<k>/final), for its "
        "jobs' geometry"))
    add_bootstrap_options(parser)
    args = parser.parse_args(argv)
    try:
        if not 0 < args.bar < 1 or args.to_window < 1:
            raise ValueError(f"--bar must lie in (0, 1) and --to-window be >= 1; got "
                             f"{args.bar}, {args.to_window}")
        if args.fit_until is not None and not args.fit_until > 1:    # NaN too
            raise ValueError(f"--fit-until must be above 1 (windows past d = W); got "
                             f"{args.fit_until}")
        if (args.synthetic is None) != (not args.synthetic_study):
            raise ValueError("--synthetic and --synthetic-study go together")
        written, laws, why = write(
            args.kl_by_position, args.out, args.study, args.floor, args.resamples, args.alpha,
            args.kl_by_class, args.bar, args.to_window, (args.synthetic, args.synthetic_study)
            if args.synthetic is not None else None, args.fit_until)
    except (FileNotFoundError, ValueError) as error:
        print(f"analysis.decay: {error}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    if laws is None:
        print(f"analysis.decay: {'; '.join(why)} (per-model and per-cell tables written)",
              file=sys.stderr)
        return 2
    for reason in why:
        print(f"analysis.decay: laws not compared at {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
