"""Which law sets the replay an engine needs: `python -m analysis.laws`.

    python -m analysis.laws --models findings/encoder_w/models.csv --out findings/encoder_w \
        [--resamples 2000] [--alpha 0.05] [--target W=128,R_exact=2541] [--jobs JOB ...]

Reads a per-model table (`analysis.reach`'s models.csv: one row per trained model, with its job,
W, R_exact and N*) and fits N* with each candidate law, each with one free constant:

  windows           N* = a * W             a fixed number of windows
  tokens            N* = W + c             a fixed number of extra tokens
  receptive_field   N* = b * R_exact       a fixed share of the decoder's receptive field
  reach             N* = d_max + c         the model's own largest competent d plus a margin
                                           (not a law of the architecture: a diagnostic of
                                           how far the trained model reads; only with a
                                           largest_competent_d column)

The laws are compared by held-out cells, not by in-sample fit: each cell (a job: one
combination of W, L_d and L_e) is left out in turn, every law is fitted on the other cells'
models, and the held-out cell's mean N* is predicted. A law's score is the root mean square of
those held-out errors over cells, in tokens, and also relative to the cell's mean N*. The
model-level CI of each score (and of each law's score minus the best law's) resamples models
within every cell (a bootstrap over models, so a cell of few models carries its uncertainty).

Least squares over models: a = sum(W N*) / sum(W^2), b = sum(R N*) / sum(R^2),
c = mean(N* - W) (or mean(N* - d_max)). A model without an N* beyond the replay is left out
and counted: one with no competent bin, and (where the table has largest_competent_d) one
competent only inside the replay (largest competent d <= W), whose N* is censored at or below W
by what it can do, not set by how far its evidence travels. With fewer than two cells left,
nothing can be held out: refused.

What each law implies for an engine: its N* at a target geometry (`--target`, default V4.1's
conf/model/deepseek_v41_flash.yaml: W = 128, R_exact = 2541), the constant fitted on every
cell, with a model-level CI from its own draws of models within cells (`within_cells`, as
the scores' CIs are drawn). That interval is the spread of the fit over the models trained,
not the error of extrapolating 16-300x beyond the cells: the held-out scores say how far to trust a law, and `reach` has no value at a target
(it reads a trained model's own reach).

Writes laws.csv (per law: the constant fitted on every cell, the held-out RMSE and relative
RMSE with their CIs, the difference to the best law with its CI, the in-sample RMSE, the
target's N* with its CI),
held_out.csv (per law and cell: observed mean N*, prediction, error), laws.png (each cell's
N* against W and against R_exact, with every law's held-out predictions) and laws.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from analysis import tables
from analysis.publish import markdown
from ced.config import ModelConfig, exact_replay_length

REQUIRED = ("job", "W", "R_exact", "N_star")


@dataclass(frozen=True)
class Law:
    """One candidate law: N* as a function of the covariate `x`, with one constant fitted by
    least squares. `scale` laws are N* = k x; the others N* = x + k."""

    name: str
    formula: str
    covariate: str          # the models.csv column the law reads
    scale: bool

    def fit(self, x: np.ndarray, n_star: np.ndarray) -> float:
        """The constant, by least squares over models (x, n_star: shape (models,))."""
        if self.scale:
            return float((x * n_star).sum() / (x * x).sum())
        return float((n_star - x).mean())

    def predict(self, constant: float, x: np.ndarray) -> np.ndarray:
        return constant * x if self.scale else x + constant


LAWS = (Law("windows", "N* = a W", "W", True),
        Law("tokens", "N* = W + c", "W", False),
        Law("receptive_field", "N* = b R_exact", "R_exact", True),
        Law("reach", "N* = d_max + c", "largest_competent_d", False))


@dataclass(frozen=True)
class Target:
    """The geometry a law is extrapolated to: the window W and the decoder's R_exact."""

    name: str
    W: int
    R_exact: int

    def covariate(self, law: Law) -> float:
        """The law's covariate at the target; NaN for `reach` (a trained model's own reach)."""
        return {"W": float(self.W), "R_exact": float(self.R_exact)}.get(law.covariate, np.nan)

    @classmethod
    def of_model(cls, name: str = "deepseek_v41_flash") -> "Target":
        """W and R_exact of conf/model/<name>.yaml (ced.config.exact_replay_length)."""
        # lazy: ced.train_config loads OmegaConf (~0.1 s), needed only to read a model file
        from ced.train_config import model_conf
        cfg = ModelConfig(**model_conf(name))
        return cls(name, cfg.window, exact_replay_length(cfg))

    @classmethod
    def parse(cls, text: str) -> "Target":
        """'W=128,R_exact=2541' (both keys, ints >= 1) or a conf/model name."""
        if "=" not in text:
            try:
                return cls.of_model(text)
            except ValueError as error:
                raise ValueError(f"--target: {error}") from None
        parts = [part.split("=", 1) for part in text.replace(" ", "").split(",")]
        fields = {part[0]: part[-1] for part in parts}
        if any(len(part) != 2 for part in parts) or set(fields) != {"W", "R_exact"} or not all(v.isdigit() and int(v) >= 1
                                                      for v in fields.values()):
            raise ValueError(f"--target: expected W=<int>,R_exact=<int> or a conf/model name; "
                             f"got {text!r}")
        return cls(text, int(fields["W"]), int(fields["R_exact"]))


def usable(models: pd.DataFrame) -> tuple[pd.DataFrame, list[Law]]:
    """The models with an N* beyond the replay (see the module doc) and the laws the table can
    fit (`reach` needs the largest competent d); raises ValueError naming a missing column or
    too few cells."""
    missing = [c for c in REQUIRED if c not in models]
    if missing:
        raise ValueError(f"--models: no column(s) {missing} (analysis.reach's models.csv has "
                         f"{list(REQUIRED)})")
    laws = [law for law in LAWS if law.covariate in models]
    kept = models.dropna(subset=["N_star", *[law.covariate for law in laws]])
    if "largest_competent_d" in kept:
        kept = kept[kept["largest_competent_d"] > kept["W"]]
    if kept["job"].nunique() < 2:
        raise ValueError(f"--models: {kept['job'].nunique()} cell(s) with an N* beyond the "
                         "replay; leaving one cell out needs at least two")
    return kept.reset_index(drop=True), laws


def held_out(models: pd.DataFrame, laws: list[Law], target: str = "N_star") -> pd.DataFrame:
    """Per law and cell: fitted on the other cells' models, the prediction of the cell's mean
    `target` (N*, or any per-model quantity a law predicts) against the observed one. Columns
    law, job, models, observed, predicted, error."""
    jobs, cell = np.unique(models["job"].to_numpy(str), return_inverse=True)
    n_star = models[target].to_numpy(float)
    rows = []
    for law in laws:
        x = models[law.covariate].to_numpy(float)
        predicted, observed, counts = _held_out_means(law, x, n_star, cell, len(jobs))
        rows += [{"law": law.name, "job": job, "models": int(k), "observed": o,
                  "predicted": p, "error": p - o}
                 for job, k, o, p in zip(jobs, counts, observed, predicted)]
    return pd.DataFrame(rows)


def _held_out_means(law: Law, x: np.ndarray, n_star: np.ndarray, cell: np.ndarray,
                    cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predicted, observed, models) per cell, each of shape (cells,): the law fitted on every
    other cell's models (x, n_star, cell: shape (models,); cell holds indices < cells)."""
    counts = np.bincount(cell, minlength=cells).astype(float)
    observed = np.bincount(cell, n_star, cells) / counts
    mean_x = np.bincount(cell, x, cells) / counts
    if law.scale:
        xy, xx = np.bincount(cell, x * n_star, cells), np.bincount(cell, x * x, cells)
        constant = (xy.sum() - xy) / (xx.sum() - xx)
        return constant * mean_x, observed, counts
    residual = np.bincount(cell, n_star - x, cells)
    constant = (residual.sum() - residual) / (counts.sum() - counts)
    return mean_x + constant, observed, counts


def _scores(predicted: np.ndarray, observed: np.ndarray) -> tuple[float, float]:
    """(RMSE over cells of predicted - observed, RMSE of that error relative to observed)."""
    error = predicted - observed
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(observed != 0, error / observed, np.nan)
    return float(np.sqrt((error ** 2).mean())), float(np.sqrt(np.nanmean(relative ** 2)))


def scores(errors: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """Per law: (held-out RMSE in tokens, RMSE of the error relative to the observed mean)."""
    return {law: _scores(part["predicted"].to_numpy(float), part["observed"].to_numpy(float))
            for law, part in errors.groupby("law", sort=False)}


def within_cells(cell: np.ndarray, resamples: int,
                 rng: np.random.Generator) -> Iterator[np.ndarray]:
    """`resamples` bootstrap draws of models that keep every cell's number of models and draw
    its models with replacement (a bootstrap over models within cells). cell: shape (models,),
    any labels; yields per draw the drawn models' indices, shape (models,), cell by cell."""
    members = [np.flatnonzero(cell == k) for k in np.unique(cell)]
    for _ in range(resamples):
        yield np.concatenate([m[rng.integers(0, len(m), len(m))] for m in members])


def bootstrap_scores(models: pd.DataFrame, laws: list[Law], resamples: int,
                     rng: np.random.Generator, target: str = "N_star") -> dict[str, np.ndarray]:
    """Per law, shape (resamples, 2): the held-out scores (of `target`'s cell means) of the
    `within_cells` draws."""
    jobs, cell = np.unique(models["job"].to_numpy(str), return_inverse=True)
    n_star = models[target].to_numpy(float)
    out = {law.name: np.empty((resamples, 2)) for law in laws}
    for i, pick in enumerate(within_cells(cell, resamples, rng)):
        for law in laws:
            x = models[law.covariate].to_numpy(float)[pick]
            predicted, observed, _ = _held_out_means(law, x, n_star[pick], cell[pick], len(jobs))
            out[law.name][i] = _scores(predicted, observed)
    return out


def bootstrap_constants(models: pd.DataFrame, laws: list[Law], resamples: int,
                        rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per law, shape (resamples,): the constant fitted on every cell's models of each
    `within_cells` draw."""
    _, cell = np.unique(models["job"].to_numpy(str), return_inverse=True)
    n_star = models["N_star"].to_numpy(float)
    out = {law.name: np.empty(resamples) for law in laws}
    for i, pick in enumerate(within_cells(cell, resamples, rng)):
        for law in laws:
            out[law.name][i] = law.fit(models[law.covariate].to_numpy(float)[pick], n_star[pick])
    return out


def compare(models: pd.DataFrame, resamples: int = 2000, alpha: float = 0.05,
            seed: int = 0, target: Target | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(laws.csv's table, held_out.csv's table) for a per-model table; see the module doc.
    target: where each law's N* is extrapolated to (default V4.1's geometry)."""
    models, laws = usable(models)
    target = target or Target.of_model()
    errors = held_out(models, laws)
    point = scores(errors)
    best = min(point, key=lambda name: point[name][0])
    draws = bootstrap_scores(models, laws, resamples, np.random.default_rng(seed))
    constants = bootstrap_constants(models, laws, resamples, np.random.default_rng(seed + 1))
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    n_star = models["N_star"].to_numpy(float)
    rows = []
    for law in laws:
        sample, x = draws[law.name], models[law.covariate].to_numpy(float)
        minus_best = sample[:, 0] - draws[best][:, 0]
        fitted = law.predict(law.fit(x, n_star), x)
        rows.append({
            "law": law.name, "formula": law.formula, "constant": law.fit(x, n_star),
            "cells": models["job"].nunique(), "models": len(models),
            "held_out_rmse": point[law.name][0],
            "rmse_ci_low": np.percentile(sample[:, 0], lo),
            "rmse_ci_high": np.percentile(sample[:, 0], hi),
            "held_out_relative_rmse": point[law.name][1],
            "relative_ci_low": np.percentile(sample[:, 1], lo),
            "relative_ci_high": np.percentile(sample[:, 1], hi),
            "minus_best": point[law.name][0] - point[best][0],
            "minus_best_ci_low": np.percentile(minus_best, lo),
            "minus_best_ci_high": np.percentile(minus_best, hi),
            "in_sample_rmse": float(np.sqrt(((fitted - n_star) ** 2).mean())),
            "best": law.name == best,
            **_at_target(law, law.fit(x, n_star), constants[law.name], target, lo, hi)})
    return pd.DataFrame(rows), errors


def _at_target(law: Law, constant: float, draws: np.ndarray, target: Target, lo: float,
               hi: float) -> dict:
    """laws.csv's target columns: the law's N* at the target, and its CI over the constants
    fitted on draws of models (draws: shape (resamples,))."""
    x = target.covariate(law)
    predicted = law.predict(draws, x)
    return {"target": target.name, "target_W": target.W, "target_R_exact": target.R_exact,
            "target_N_star": law.predict(constant, x),
            "target_ci_low": np.nan if np.isnan(x) else np.percentile(predicted, lo),
            "target_ci_high": np.nan if np.isnan(x) else np.percentile(predicted, hi)}


def figure(models: pd.DataFrame, errors: pd.DataFrame):
    """Each cell's mean N* (points: models) against W and against R_exact, with each law's
    held-out prediction of the cell (markers)."""
    # lazy: matplotlib costs ~0.3 s to import, and only drawing the figure needs it
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4))
    cells = models.groupby("job", sort=True).agg(W=("W", "first"), R=("R_exact", "first"),
                                                  N=("N_star", "mean"))
    for ax, key, label in zip(fig.subplots(1, 2), ("W", "R"), ("W", "R_exact")):
        x = models["W"] if key == "W" else models["R_exact"]
        ax.scatter(x, models["N_star"], s=12, color="0.6", label="models")
        ax.scatter(cells[key], cells["N"], s=40, color="black", label="cell mean")
        for marker, (law, part) in zip("o^sv", errors.groupby("law", sort=False)):
            ax.scatter(cells.loc[part["job"], key], part["predicted"], marker=marker,
                       facecolors="none", edgecolors=f"C{'o^sv'.index(marker)}",
                       label=f"{law} (held out)")
        ax.set_xlabel(label)
        ax.set_ylabel("N*")
    fig.axes[0].legend(fontsize=7)
    fig.suptitle("N* per cell and each law's prediction with the cell held out")
    fig.tight_layout()
    return fig


def only_jobs(models: pd.DataFrame, jobs: list[str] | None) -> pd.DataFrame:
    """The rows of the cells `jobs` (None: every row); a job the table lacks is a ValueError
    naming it and the jobs it has."""
    if not jobs:
        return models
    missing = sorted(set(jobs) - set(models["job"]))
    if missing:
        raise ValueError(f"--jobs: no model of {missing} in the table; it has "
                         f"{sorted(set(models['job']))}")
    return models[models["job"].isin(jobs)].reset_index(drop=True)


def write(models_csv: Path, out: Path, resamples: int = 2000, alpha: float = 0.05,
          target: Target | None = None, jobs: list[str] | None = None,
          pools: dict[str, list[str]] | None = None) -> dict:
    """laws.csv, held_out.csv, laws.png and laws.md into `out`, from the models of `jobs`
    (None: every job of the table), the jobs of each of `pools` first read as one cell
    (`tables.pooled`); returns {name: path}."""
    models = pd.read_csv(models_csv)
    for cell, members in (pools or {}).items():
        models = pd.concat([models[~models["job"].isin(members)],
                            tables.pooled(models, cell, members)], ignore_index=True)
    models = only_jobs(models, jobs)
    table, errors = compare(models, resamples, alpha, target=target)
    out.mkdir(parents=True, exist_ok=True)
    written = {"laws": out / "laws.csv", "held_out": out / "held_out.csv",
               "figure": out / "laws.png", "markdown": out / "laws.md"}
    table.to_csv(written["laws"], index=False, float_format="%.6g")
    errors.to_csv(written["held_out"], index=False, float_format="%.6g")
    fitted = usable(models)[0]
    figure(fitted, errors).savefig(written["figure"], dpi=110)
    dropped = len(models) - len(fitted)
    written["markdown"].write_text(
        f"# Which law sets N*\n\nFrom {models_csv}"
        f"{' (jobs ' + ', '.join(jobs) + ')' if jobs else ''}"
        + "".join(f"; {cell} pools {', '.join(m)}" for cell, m in (pools or {}).items())
        + f" ({len(models)} models, "
        f"{dropped} without an "
        f"N* beyond the replay: no competent bin, or none past W). Each cell held out in "
        f"turn; RMSE of the held-out cell means, model-level "
        f"{100 * (1 - alpha):.0f}% CIs from {resamples} draws of models within cells. "
        f"target_N_star: the law fitted on every cell, at {table['target'].iloc[0]} (W = "
        f"{table['target_W'].iloc[0]}, R_exact = {table['target_R_exact'].iloc[0]}); its CI is "
        f"the spread over models, not the extrapolation's error.\n\n"
        + markdown(table, list(table.columns)))
    return written


def _draws(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def add_bootstrap_options(parser: argparse.ArgumentParser) -> None:
    """--resamples (bootstrap draws of models within cells, at least one) and --alpha."""
    parser.add_argument("--resamples", type=_draws, default=2000,
                        help="bootstrap draws of models within cells (default 2000)")
    parser.add_argument("--alpha", type=float, default=0.05, help="1 - CI level")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.laws", description=(
        "Fit N* against W and R_exact with the candidate laws and compare them by "
        "leaving one cell out."))
    parser.add_argument("--models", required=True, type=Path,
                        help="a per-model table (analysis.reach's models.csv)")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    add_bootstrap_options(parser)
    parser.add_argument("--target", default="deepseek_v41_flash", help=(
        "where each law's N* is extrapolated: W=<int>,R_exact=<int> or a conf/model name "
        "(default deepseek_v41_flash: W = 128, R_exact = 2541)"))
    parser.add_argument("--jobs", nargs="+", metavar="JOB",
                        help="fit only these cells (default: every job of the table)")
    tables.add_pool_option(parser, "named CELL in --jobs and the tables")
    args = parser.parse_args(argv)
    try:
        written = write(args.models, args.out, args.resamples, args.alpha,
                        Target.parse(args.target), args.jobs, tables.parse_pools(args.pool))
    except (FileNotFoundError, ValueError) as error:
        print(f"analysis.laws: {error}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
