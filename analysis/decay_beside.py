"""What `analysis.decay` puts beside its real-text cells: the synthetic suite's N* at the same
geometry (`synthetic_beside_text`, decay_synthetic.csv) and the cells of the same W and decoder
depth whose encoders differ (`encoder_effect`, decay_encoder.csv: the encoder's effect on real
text, e.g. real_text_law's T8_W8 (L_e = 8) beside real_text's ced_L8 (L_e = 2) at L_d = 8);
and a checkpoint's geometry (`shape_of`), which both read.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ced.checkpoint import CheckpointError, load_config
from ced.config import exact_replay_length
from ced.run_id import RunId
from evals.suites.stats import seed_t_test


def shape_of(path: Path) -> dict:
    """W, L_d, L_e and R_exact of the checkpoint directory `path`."""
    try:
        cfg = load_config(path)
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    return {"W": cfg.window, "L_d": cfg.n_decoder_layers, "L_e": cfg.n_encoder_layers,
            "R_exact": exact_replay_length(cfg)}



def _spread(values: np.ndarray, name: str) -> dict:
    """{name_min, name_median, name_max} over the finite values (NaN for none)."""
    finite = values[np.isfinite(values)]
    stats = (finite.min(), np.median(finite), finite.max()) if finite.size else (math.nan,) * 3
    return {f"{name}_{k}": float(v) for k, v in zip(("min", "median", "max"), stats)}


SYNTHETIC_REQUIRED = ("job", "seed", "N_star", "largest_competent_d", "horizon")
SYNTHETIC_COLUMNS = ["cell", "W", "L_d", "L_e", "R_exact", "n_star_text", "n_star_text_over_W",
                     "text_tau_over_W", "text_models", "synthetic_job", "synthetic_models",
                     "synthetic_n_star_min", "synthetic_n_star_median", "synthetic_n_star_max",
                     "largest_competent_d_median", "horizon", "synthetic_n_star_over_W"]


def synthetic_beside_text(synthetic: pd.DataFrame, runs: dict, cells: pd.DataFrame
                          ) -> pd.DataFrame:
    """decay_synthetic.csv: per real-text cell and synthetic job of the same W, L_d and L_e
    (rows: such pairs; SYNTHETIC_COLUMNS) the synthetic suite's N* per model (min, median,
    max) and the median over W, its
    largest competent distance and horizon (its N* is censored there), beside the cell's
    N*_text and its grid's end (R_exact) and tau / W. synthetic: `analysis.reach`'s models.csv
    (one row a model; N_star NaN where no bin was competent); runs: the synthetic study's
    `runs_of`, for each job's geometry; cells: `cell_table` with n_star_text. ValueError for a
    synthetic model (any of a job's seeds) without a trained run in `runs`."""
    missing = [c for c in SYNTHETIC_REQUIRED if c not in synthetic]
    if missing:
        raise ValueError(f"--synthetic: no column(s) {missing} (analysis.reach's models.csv)")
    if synthetic[["job", "seed"]].isna().any(axis=None):
        raise ValueError("--synthetic: a row without a job or seed (analysis.reach's "
                         "models.csv names every model)")
    rows = []
    for job, part in synthetic.groupby("job", sort=True):
        labels = [RunId(str(job), int(seed)).model for seed in part["seed"]]
        if gone := [m for m in labels if (runs or {}).get(m, {}).get("final") is None]:
            raise ValueError(f"--synthetic: model(s) {gone} have no final/config.json under "
                             "--synthetic-study (its archive or study directory)")
        shape = shape_of(runs[labels[0]]["final"])
        same = cells[(cells["W"] == shape["W"]) & (cells["L_d"] == shape["L_d"])
                     & (cells["L_e"] == shape["L_e"])]
        n_star = part["N_star"].to_numpy(float)
        for cell in same.itertuples():
            rows.append({"cell": cell.job, **shape, "n_star_text": cell.n_star_text,
                         "n_star_text_over_W": cell.n_star_text / shape["W"],
                         "text_tau_over_W": cell.tau_over_W_mean, "text_models": cell.models,
                         "synthetic_job": job, "synthetic_models": len(part),
                         **_spread(n_star, "synthetic_n_star"),
                         "largest_competent_d_median": float(
                             part["largest_competent_d"].median()),
                         "horizon": float(part["horizon"].max())})
    frame = pd.DataFrame(rows, columns=SYNTHETIC_COLUMNS[:-1])
    frame["synthetic_n_star_over_W"] = frame["synthetic_n_star_median"] / frame["W"]
    return frame


ENCODER_SIDE = ["{}", "{}_L_e", "{}_models", "{}_tau_over_W", "{}_kl", "{}_kl_t_low",
                "{}_kl_t_high", "{}_dppl", "{}_dppl_t_low", "{}_dppl_t_high"]
ENCODER_COLUMNS = ["W", "L_d", "replay", *[c.format("base") for c in ENCODER_SIDE],
                   *[c.format("deeper") for c in ENCODER_SIDE], "kl_ratio", "kl_ratio_ci_low",
                   "kl_ratio_ci_high", "dppl_ratio", "dppl_ratio_ci_low", "dppl_ratio_ci_high"]


def _encoder_side(cell: pd.DataFrame, side: str, alpha: float) -> dict:
    """One cell's columns of decay_encoder.csv (ENCODER_SIDE named for `side`); cell: its
    models with kl and dppl at the replay read (the columns describe those read there)."""
    read = cell.dropna(subset=["kl"])
    row = {side: cell["job"].iloc[0], f"{side}_L_e": int(cell["L_e"].iloc[0]),
           f"{side}_models": len(read), f"{side}_tau_over_W": float(read["tau_over_W"].mean())}
    for name in ("kl", "dppl"):
        values = cell[name].dropna().to_numpy(float)
        low, high, _ = seed_t_test(values, 1 - alpha) if values.size else (math.nan,) * 3
        row |= {f"{side}_{name}": float(values.mean()) if values.size else math.nan,
                f"{side}_{name}_t_low": low, f"{side}_{name}_t_high": high}
    return row


def encoder_effect(classes: pd.DataFrame, models: pd.DataFrame, replay: str = "W",
                   resamples: int = 2000, alpha: float = 0.05, seed: int = 0) -> pd.DataFrame:
    """decay_encoder.csv: per pair of cells at the same W and L_d whose encoders differ (rows:
    pairs; `base` the shallower encoder, `deeper` the other), at the read replay `replay` (a
    form such as "W"): each cell's models read there, their mean KL per byte and relative
    change of perplexity exp(dnll_mean) - 1 with Student t intervals over models, and mean tau
    / W; and the deeper cell's mean over the base cell's, for both, with a bootstrap interval
    that draws models within each cell (none where a cell has fewer than two models read: its
    spread would be missing from it; a change of perplexity near 0 in the base cell makes its
    ratio unstable). A pair from two studies may differ in more than the encoder (steps,
    precision, reading settings): the caller states it. classes: `read_classes` rows; models:
    `fit_models`."""
    at = classes[classes["replay"] == replay].set_index("checkpoint")
    frame = models.assign(kl=models["checkpoint"].map(at["kl_mean"]).astype(float),
                          dppl=np.expm1(models["checkpoint"].map(at["dnll_mean"]).astype(float)))
    rng, rows = np.random.default_rng(seed), []
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    for (window, l_d), part in frame.groupby(["W", "L_d"], sort=True):
        encoders = part.groupby("job")["L_e"].first().sort_values(kind="stable")
        for i, base in enumerate(encoders.index):
            for deeper in encoders.index[i + 1:]:
                if encoders[deeper] == encoders[base]:
                    continue
                cells = [part[part["job"] == job] for job in (base, deeper)]
                row = {"W": int(window), "L_d": int(l_d), "replay": replay,
                       **_encoder_side(cells[0], "base", alpha),
                       **_encoder_side(cells[1], "deeper", alpha)}
                for name in ("kl", "dppl"):
                    a, b = (c[name].dropna().to_numpy(float) for c in cells)
                    if a.size:
                        row[f"{name}_ratio"] = b.mean() / a.mean() if b.size else math.nan
                    if min(a.size, b.size) < 2:     # one side without a spread: no interval
                        continue
                    draws = (b[rng.integers(0, b.size, (resamples, b.size))].mean(1)
                             / a[rng.integers(0, a.size, (resamples, a.size))].mean(1))
                    row |= {f"{name}_ratio_ci_low": np.percentile(draws, lo),
                            f"{name}_ratio_ci_high": np.percentile(draws, hi)}
                rows.append(row)
    return pd.DataFrame(rows, columns=ENCODER_COLUMNS)
