"""The trend of bounded replay's cost with decoder depth and window: `python -m analysis.scaling`.

    python -m analysis.scaling --study outputs/studies/scaling --out findings/scaling \
        [--target-layers 20 --target-window 128]

Reads a finished `scaling` study (jobs that differ in the decoder depth L_d and the window W;
every run's `final/config.json`, `divergence/divergence.parquet`, `suite/<job>/seed<k>/
results.csv`) and, per job and seed, at N = W:

- `kl_first`: first-token KL(exact || replay N=W) at the cut of a validation prompt (mean over
  prompts, evals.divergence);
- `kl_answer`: KL(full || replay N=W) at the suite's answers (mean over examples and families);
- `drop`: suite accuracy of replay N=W minus `full` on the same examples (pooled families).

At N = W the last position's first decoder layer reads only replayed positions, so the error
comes from the L_d - 1 layers above it (`inexact layers`; with L_d = 1, N = W >= R_exact =
L_d (W - 1) + 1 and replay is exact by construction). It fits
log10 KL = a + b log10(L_d - 1) + c log10 W by least squares over every (job, seed) point with
N < R_exact (jobs with N >= R_exact are reported as exact, not fitted: their KL is round-off),
and extrapolates to V4.1's setting (L_d = 20, W = 128, N = 128) with a 95% band from a bootstrap
that resamples seeds within each job. How far to trust it: the fit's leave-one-job-out error
(each job predicted from the others, in decades), and the distance of the target from the
fitted range, are reported beside it. The accuracy drop is fitted only when some job's drop is
significantly non-zero; otherwise the finding is "no drop at N = W anywhere in the range", with
the largest CI bound.

Writes `scaling.csv` (per job and seed), `fit.json`, `scaling.md` and `scaling.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ced.checkpoint import load_config
from ced.config import exact_replay_length
from ced.run_id import of_checkpoint

from . import plots
from .tables import FULL, load_results, paired_difference, replay_label

METRICS = ("kl_first", "kl_answer")


def geometry(study: Path) -> dict[str, dict]:
    """Per job: L_d, W, R_exact and the inexact layers L_d - 1 of its trained model (any seed's
    final/config.json), and whether N = W replays exactly (W >= R_exact)."""
    out = {}
    for path in sorted(study.glob("runs/*/seed*/final/config.json")):
        job = path.parents[2].name
        if job in out:
            continue
        cfg = load_config(path)
        r_exact = exact_replay_length(cfg)
        out[job] = {"L_d": cfg.n_decoder_layers, "W": cfg.window, "R_exact": r_exact,
                    "inexact_layers": cfg.n_decoder_layers - 1, "exact": cfg.window >= r_exact}
    if not out:
        raise FileNotFoundError(f"{study}/runs: no <job>/seed<k>/final/config.json")
    return out


def points(study: Path, marks: dict[str, dict]) -> pd.DataFrame:
    """One row per (job, seed): L_d, W and the three measures at N = W (NaN when missing)."""
    rows: dict[tuple, dict] = {}

    def row(job: str, seed: int) -> dict:
        return rows.setdefault((job, seed), {"job": job, "seed": seed, **marks[job],
                                             "kl_first": math.nan, "kl_answer": math.nan,
                                             "drop": math.nan, "n": 0, "full_only": 0,
                                             "mode_only": 0})
    div_path = study / "divergence" / "divergence.parquet"
    if div_path.exists():
        div = pd.read_parquet(div_path)
        div = div[(div["metric"] == "kl") & (div["step"] == 0)]
        for checkpoint, part in div.groupby("checkpoint"):
            run_id = of_checkpoint(Path(checkpoint))
            if run_id is None or run_id.job not in marks:
                continue
            at_w = part[part["mode"] == replay_label(marks[run_id.job]["W"])]["value"]
            if len(at_w):
                row(run_id.job, run_id.seed)["kl_first"] = float(at_w.mean())
    try:
        results = load_results(study)
    except FileNotFoundError:
        results = pd.DataFrame()
    for (job, seed), part in (results.groupby(["job", "train_seed"]) if not results.empty
                              else []):
        if job not in marks:
            continue
        mode = replay_label(marks[job]["W"])
        full = part[part["mode"] == FULL].set_index(["family", "id"])["correct"].astype(bool)
        mine = part[part["mode"] == mode].set_index(["family", "id"])
        if mine.empty:
            continue
        ok = mine["correct"].astype(bool)
        ref = full.reindex(ok.index)
        r = row(job, int(seed))
        r["full_only"], r["mode_only"] = int((ref & ~ok).sum()), int((ok & ~ref).sum())
        r["n"] = len(ok)
        r["drop"] = (r["mode_only"] - r["full_only"]) / len(ok)
        if "kl_answer" in mine:
            r["kl_answer"] = float(mine["kl_answer"].mean())
    return pd.DataFrame(list(rows.values())).sort_values(["L_d", "W", "seed"]).reset_index(
        drop=True)


def fittable(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The points a trend is fitted to: replay inexact (N = W < R_exact) and a positive metric."""
    return table[~table["exact"].astype(bool) & (table[metric] > 0)]


def fit_power_law(table: pd.DataFrame, metric: str) -> np.ndarray | None:
    """Least-squares (a, b, c) of log10 metric = a + b log10(L_d - 1) + c log10 W over the
    `fittable` points, or None when fewer than 4 of them or L_d / W do not vary."""
    part = fittable(table, metric)
    if len(part) < 4 or part["L_d"].nunique() < 2 or part["W"].nunique() < 2:
        return None
    x = np.column_stack([np.ones(len(part)), np.log10(part["inexact_layers"]),
                         np.log10(part["W"])])
    coef, *_ = np.linalg.lstsq(x, np.log10(part[metric].to_numpy()), rcond=None)
    return coef


def _predict(coef: np.ndarray, layers: float, window: float) -> float:
    """log10 of the fitted metric at L_d = layers, W = N = window."""
    return float(coef[0] + coef[1] * math.log10(layers - 1) + coef[2] * math.log10(window))


def extrapolate(table: pd.DataFrame, metric: str, layers: int, window: int,
                bootstrap: int = 2000, seed: int = 0) -> dict:
    """The fit, its prediction at (layers, window) with a 95% band (seeds resampled within each
    job), and the leave-one-job-out error in decades."""
    coef = fit_power_law(table, metric)
    if coef is None:
        return {"metric": metric, "fitted": False}
    rng = np.random.default_rng(seed)
    jobs = [part for _, part in fittable(table, metric).groupby("job")]
    draws = []
    for _ in range(bootstrap):
        sample = pd.concat([part.iloc[rng.integers(0, len(part), len(part))] for part in jobs])
        c = fit_power_law(sample, metric)
        if c is not None:
            draws.append(_predict(c, layers, window))
    errors = []
    for job, _ in table.groupby("job"):
        c = fit_power_law(table[table["job"] != job], metric)
        held = fittable(table[table["job"] == job], metric)
        if c is not None and len(held):
            predicted = _predict(c, held["L_d"].iloc[0], held["W"].iloc[0])
            errors.append(abs(predicted - float(np.log10(held[metric]).mean())))
    value = _predict(coef, layers, window)
    fitted = fittable(table, metric)
    return {"metric": metric, "fitted": True,
            "coef": {"a": float(coef[0]), "b_inexact_layers": float(coef[1]),
                     "c_window": float(coef[2])},
            "target": {"L_d": layers, "W": window, "N": window},
            "log10_prediction": value, "prediction": 10 ** value,
            "band": [10 ** float(np.quantile(draws, 0.025)), 10 ** float(np.quantile(draws, 0.975))]
            if draws else None,
            "leave_one_job_out_decades": float(np.mean(errors)) if errors else None,
            "fitted_range": {"L_d": [int(fitted["L_d"].min()), int(fitted["L_d"].max())],
                             "W": [int(fitted["W"].min()), int(fitted["W"].max())]},
            "exact_jobs": sorted(table[table["exact"].astype(bool)]["job"].unique().tolist())}


def drop_summary(table: pd.DataFrame) -> list[dict]:
    """Per job: the accuracy drop at N = W pooled over seeds, with its Agresti-Min CI."""
    out = []
    for job, part in table.groupby("job", sort=False):
        b, c, n = int(part["full_only"].sum()), int(part["mode_only"].sum()), int(part["n"].sum())
        diff, low, high = paired_difference(b, c, n)
        out.append({"job": job, "L_d": int(part["L_d"].iloc[0]), "W": int(part["W"].iloc[0]),
                    "n": n, "drop": diff, "ci_low": low, "ci_high": high})
    return out


def statement(fits: dict, drops: list[dict], target: dict) -> list[str]:
    lines = []
    for metric, fit in fits.items():
        name = {"kl_first": "first-token KL at a prompt cut",
                "kl_answer": "KL at the suite's answers"}[metric]
        if not fit["fitted"]:
            lines.append(f"{name}: too few positive points to fit a trend.")
            continue
        co, rng = fit["coef"], fit["fitted_range"]
        band = fit["band"]
        exact = (f" ({', '.join(fit['exact_jobs'])}: N = W >= R_exact, exact by construction, "
                 "not fitted)" if fit.get("exact_jobs") else "")
        lines.append(
            f"{name} at N = W ~ (L_d - 1)^{co['b_inexact_layers']:.2f} W^{co['c_window']:.2f}"
            f"{exact}; at L_d = "
            f"{target['L_d']}, W = N = {target['W']} the fit predicts {fit['prediction']:.3g} "
            f"nats (95% band {band[0]:.3g}-{band[1]:.3g} from seed resampling)"
            + (f"; leave-one-job-out error {fit['leave_one_job_out_decades']:.2f} decades"
               if fit["leave_one_job_out_decades"] is not None else "")
            + f". The fit spans L_d {rng['L_d'][0]}-{rng['L_d'][1]} and W {rng['W'][0]}-"
            f"{rng['W'][1]}: the target lies {(target['L_d'] - 1) / (rng['L_d'][1] - 1):.0f}x "
            f"beyond in inexact layers and {target['W'] / rng['W'][1]:.0f}x in window, so the "
            "band states the "
            "seed noise of the fit, not the error of extrapolating a power law that far.")
    significant = [d for d in drops if d["ci_high"] < 0]
    if drops and not significant:
        worst = min(d["ci_low"] for d in drops)
        lines.append(f"Accuracy at N = W: no job drops significantly (every 95% CI includes 0; "
                     f"the lowest bound is {worst:+.4f}), so there is no trend to extrapolate.")
    elif significant:
        lines.append("Accuracy at N = W drops significantly for: " + ", ".join(
            f"{d['job']} ({d['drop']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}])"
            for d in significant) + ".")
    return lines


def write(study: Path, out: Path, layers: int = 20, window: int = 128,
          bootstrap: int = 2000) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    marks = geometry(study)
    table = points(study, marks)
    table.to_csv(out / "scaling.csv", index=False, float_format="%.6g")
    fits = {m: extrapolate(table, m, layers, window, bootstrap) for m in METRICS}
    drops = drop_summary(table)
    target = {"L_d": layers, "W": window}
    result = {"fits": fits, "drops": drops, "statement": statement(fits, drops, target)}
    (out / "fit.json").write_text(json.dumps(result, indent=1) + "\n")
    plots.save(plots.scaling_figure(table, fits, target), out / "scaling.png")
    (out / "scaling.md").write_text(
        "# Trend of bounded replay's cost with L_d and W (python -m analysis.scaling)\n\n"
        + "\n\n".join(result["statement"]) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", required=True, help="a finished scaling study directory")
    p.add_argument("--out", required=True)
    p.add_argument("--target-layers", type=int, default=20)
    p.add_argument("--target-window", type=int, default=128)
    p.add_argument("--bootstrap", type=int, default=2000)
    args = p.parse_args(argv)
    try:
        result = write(Path(args.study), Path(args.out), args.target_layers, args.target_window,
                       args.bootstrap)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in result["statement"]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
