"""The trained model as the unit: per-model drops, the failure rate at N = W, and N*.

A study trains every job once per seed; each (job, seed) is one trained model. The tables of
`analysis.findings` pool a job's seeds; the ones here keep them apart, because the question a lab
asks of bounded replay ("what share of models trained this way lose accuracy at N = W?") is a
question about models, not examples:

  model_drops     per job x seed x family x replay mode, pooled over the family's distances:
                  the model's own `full` accuracy, whether it is competent there (>= COMPETENT),
                  the paired drop (mode - full) with its exact McNemar p-value, Holm-adjusted
                  over the families where that model is competent, the mean KL(full || mode)
                  at the answer, and N (the mode's replay length)
  failure_rates   per job x replay mode: how many models fail (`model_fails`) and the exact
                  Clopper-Pearson 95% CI of the rate
  n_star          per model: N*, the smallest N on the study's grid from W to R_exact at which
                  every competent family loses at most STAR_MAX_DROP and has an answer KL of at
                  most STAR_MAX_KL nats (R_exact, exact by construction, if no smaller N does);
                  beside it the drop and the failure at N = W

A model *fails* at a mode when, on some family where it is competent, its drop is significant
after Holm correction over those families (p_holm < alpha) and larger than FAIL_MIN_DROP.
Every drop is also read on the documents whose evidence lies inside the replayed span (x <= N:
the fact, or the start of the counted span, at most N tokens back): there a bounded replay has
every token the answer needs, and a drop (`fails_inside`) is window state from beyond the
replay start that deeper decoder layers carried in, the loss the paper's receptive-field
argument is about; beyond it (x > N) the answer needs the global read to carry the evidence.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from evals.modes import replay_lengths
from evals.suites.stats import binomial_two_sided, clopper_pearson, holm

FULL = "full"
COMPETENT = 0.9          # a model's `full` accuracy on a family from which its drop counts
FAIL_MIN_DROP = 0.01     # a failure is a significant drop of more than 1 point ...
STAR_MAX_DROP = 0.005    # ... N* needs every competent family within 0.5 point of `full`
STAR_MAX_KL = 0.01       # ... and an answer KL of at most 0.01 nats


def model_drops(results: pd.DataFrame, marks: dict, alpha: float = 0.05) -> pd.DataFrame:
    """Per model (job x train_seed) x family x single-turn replay mode, pooled over distances
    (see module doc). `results`: `analysis.tables.load_results`; `marks`: per job {"W",
    "R_exact"} (`analysis.tables.geometry`). Columns: job, seed, family, mode, N, n, acc_full,
    competent, acc_mode, difference, full_only, mode_only, p_value, p_holm, kl_answer, fails.
    Multi-turn and other non-replay modes are left out (N undefined)."""
    first = results.drop_duplicates(["job", "mode"])
    lengths = dict(zip(zip(first["job"], first["mode"]), replay_length_by_job(first, marks)))
    rows = []
    for (job, seed, family), part in results.groupby(["job", "train_seed", "family"], sort=True):
        full = part[part["mode"] == FULL].set_index("id")["correct"].astype(bool)
        if full.empty:
            continue
        acc_full = float(full.mean())
        for mode, cell in part[part["mode"] != FULL].groupby("mode", sort=False):
            n_replay = lengths[(job, mode)]
            if math.isnan(n_replay):
                continue
            mine = cell.set_index("id")["correct"].astype(bool)
            ref = full.reindex(mine.index)
            keep = ref.notna()
            mine, ref = mine[keep], ref[keep].astype(bool)
            # inside: the documents whose evidence (x: the distance of the fact or of the
            # counted span's start) lies within the replayed span, x <= N; a drop there is
            # window state from beyond the replay that deeper layers carried in
            x = pd.to_numeric(cell.set_index("id")["x"].reindex(mine.index), errors="coerce")
            inside = (x <= n_replay).to_numpy()
            kl = float(cell["kl_answer"].mean()) if "kl_answer" in cell else math.nan
            rows.append({"job": job, "seed": int(seed), "family": family, "mode": mode,
                         "N": int(n_replay), "acc_full": acc_full,
                         "competent": acc_full >= COMPETENT, "acc_mode": float(mine.mean()),
                         **_paired(ref, mine), **_paired(ref[inside], mine[inside], "_inside"),
                         "kl_answer": kl})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    for suffix in ("", "_inside"):
        table[f"p_holm{suffix}"] = table[f"p_value{suffix}"]
        for _, part in table[table["competent"]].groupby(["job", "seed", "mode"]):
            table.loc[part.index, f"p_holm{suffix}"] = holm(part[f"p_value{suffix}"].tolist())
        table[f"fails{suffix}"] = (table["competent"] & (table[f"p_holm{suffix}"] < alpha)
                                   & (table[f"difference{suffix}"] < -FAIL_MIN_DROP))
    return table.sort_values(["job", "seed", "family", "N"], kind="stable").reset_index(drop=True)


def by_job(frame: pd.DataFrame, marks: dict, key: str, job: str = "job") -> list:
    """Per row of `frame`, `key` ("W" or "R_exact") of its job (column `job`) in `marks`
    (`analysis.tables.geometry`); None where unknown."""
    return [marks.get(name, {}).get(key) for name in frame[job]]


def replay_length_by_job(frame: pd.DataFrame, marks: dict, job: str = "job") -> np.ndarray:
    """Per row of `frame` (with a `mode` label and, where written, its columns), N of its
    single-turn replay mode on its job's model (`evals.modes.replay_lengths`, R_exact and W
    from `marks`); NaN for `full`, a new turn, and anything that is not a replay mode."""
    return replay_lengths(frame, by_job(frame, marks, "R_exact", job),
                          by_job(frame, marks, "W", job)).to_numpy()


def _paired(ref: pd.Series, mine: pd.Series, suffix: str = "") -> dict:
    """n, the paired difference (mode - full), the discordant counts and the exact McNemar p
    of two aligned boolean scorings, with `suffix` on every key."""
    b, c, n = int((ref & ~mine).sum()), int((mine & ~ref).sum()), int(len(mine))
    return {f"n{suffix}": n, f"difference{suffix}": (c - b) / n if n else math.nan,
            f"full_only{suffix}": b, f"mode_only{suffix}": c,
            f"p_value{suffix}": binomial_two_sided(b, b + c)}


def model_fails(drops: pd.DataFrame) -> pd.DataFrame:
    """Per model x mode: whether it fails (any competent family fails), the worst competent
    drop and how many families it is competent in."""
    rows = []
    for (job, seed, mode), part in drops.groupby(["job", "seed", "mode"], sort=False):
        competent = part[part["competent"]]
        rows.append({"job": job, "seed": seed, "mode": mode, "N": int(part["N"].iloc[0]),
                     "competent_families": len(competent),
                     "worst_drop": float(competent["difference"].min()) if len(competent)
                     else math.nan,
                     "worst_drop_inside": float(competent["difference_inside"].min())
                     if len(competent) else math.nan,
                     "failed": bool(competent["fails"].any()),
                     "failed_inside": bool(competent["fails_inside"].any())})
    return pd.DataFrame(rows)


def failure_rates(drops: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per job x mode: models (those competent in at least one family: a model competent in
    none has nothing to lose and is counted in `not_competent` instead), failed, rate and its
    Clopper-Pearson interval (rate_low, rate_high), and the seeds that failed."""
    fails = model_fails(drops)
    rows = []
    for (job, mode), every in fails.groupby(["job", "mode"], sort=False):
        part = every[every["competent_families"] > 0]
        k, n = int(part["failed"].sum()), len(part)
        low, high = clopper_pearson(k, n, confidence)
        k_in = int(part["failed_inside"].sum())
        low_in, high_in = clopper_pearson(k_in, n, confidence)
        rows.append({"job": job, "mode": mode, "N": int(every["N"].iloc[0]), "models": n,
                     "not_competent": len(every) - n,
                     "failed_inside": k_in, "rate_inside_low": low_in,
                     "rate_inside_high": high_in,
                     "failed": k, "rate": k / n if n else math.nan, "rate_low": low,
                     "rate_high": high,
                     "failed_seeds": " ".join(str(s) for s in part[part["failed"]]["seed"])})
    table = pd.DataFrame(rows)
    return table.sort_values(["job", "N"], kind="stable").reset_index(drop=True) \
        if not table.empty else table


def n_star(drops: pd.DataFrame, marks: dict, max_drop: float = STAR_MAX_DROP,
           max_kl: float = STAR_MAX_KL) -> pd.DataFrame:
    """One row per model: job, seed, W, R_exact, N* (see module doc), N*/W, N*/R_exact,
    `drop_at_W` (the worst competent family's drop at N = W), `failed_at_W`, and `grid` (the
    N evaluated from W up to R_exact). A model whose suite has no mode at N = W gets NaN
    there. A model competent in no family has no N* (NaN): nothing can be lost."""
    rows = []
    fails = model_fails(drops)
    for (job, seed), part in drops.groupby(["job", "seed"], sort=True):
        w, r_exact = marks.get(job, {}).get("W"), marks.get(job, {}).get("R_exact")
        competent = part[part["competent"]]
        grid = sorted(n for n in part["N"].unique()
                      if (w is None or n >= w) and (r_exact is None or n <= r_exact))
        star = math.nan
        if len(competent):
            for n in grid:
                cell = competent[competent["N"] == n]
                kl = cell["kl_answer"].fillna(0.0)
                if (cell["difference"] >= -max_drop).all() and (kl <= max_kl).all():
                    star = n
                    break
            else:
                star = r_exact if r_exact is not None else math.nan
        at_w = fails[(fails["job"] == job) & (fails["seed"] == seed) & (fails["N"] == w)]
        rows.append({"job": job, "seed": int(seed), "W": w, "R_exact": r_exact, "N_star": star,
                     "N_star_over_W": star / w if w else math.nan,
                     "N_star_over_R_exact": star / r_exact if r_exact else math.nan,
                     "drop_at_W": float(at_w["worst_drop"].iloc[0]) if len(at_w) else math.nan,
                     "failed_at_W": bool(at_w["failed"].iloc[0]) if len(at_w) else np.nan,
                     "drop_inside_at_W": float(at_w["worst_drop_inside"].iloc[0])
                     if len(at_w) else math.nan,
                     "failed_inside_at_W": bool(at_w["failed_inside"].iloc[0])
                     if len(at_w) else np.nan,
                     "grid": " ".join(str(int(n)) for n in grid)})
    return pd.DataFrame(rows)
