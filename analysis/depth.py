"""Bounded replay against decoder depth, the trained model as the unit: `python -m analysis.depth`.

    python -m analysis.depth --study outputs/studies/depth --out findings/depth \
        [--erf findings/depth/erf]

Reads a finished `depth` study (conf/experiment/depth.yaml: ced at several decoder depths L_d,
each job an arm: trained without (`no_sim`) or with (`sim`) replay simulation) and writes, beside
the seed-pooled tables of `analysis.findings` (which it runs first, into the same --out):

  depth.csv        per job: L_d, arm, R_exact, N = W as a share of R_exact, models (trained),
                   competent models per family, the models that fail at N = W with the exact
                   Clopper-Pearson 95% CI of the rate (and those that fail on the documents
                   whose evidence lies inside the replay, x <= N: `analysis.per_model`), the
                   worst competent family's drop at N = W over the models (median, min), and
                   N* per model (median, min, max; as multiples of W and shares of R_exact)
  drop_at_W.csv    per job x family: the drop at N = W pooled over seeds, with its example-level
                   and seed-level CIs and the number of models (from capability_drop.csv)
  arms_at_W.csv    per depth x family, replay simulation against none (at the depths that
                   trained both arms): each arm's drop at
                   N = W, the difference sim - no_sim with its example-level CI (paired by
                   document) and model-level CI, Welch's p over the models and the model
                   counts: the `drop` rows at N = W of analysis.findings' arms.csv, which
                   compares each depth's `no_sim` job with its `sim` job (`arm_pairs`)
  failure_vs_depth.png   the failure rate at N = W against L_d per arm, with its exact CI
  n_star_vs_depth.png    N*/W and N*/R_exact against L_d, one point per model
  mechanism.csv, mechanism.png   (with --erf: a DIR written by `python -m evals.erf` over the
                   study's checkpoints, or the erf_shares.csv of an `analysis.archive`) per model,
                   the share of the decoder's gradient influence at distance >= W and >= 2W
                   beside N*, and Spearman's rank correlation of each share with N* over every
                   model and within each depth
  extrapolation.csv   per arm measured at two or more depths: the line of log(N*/W) on
                   log(L_d) read at L_d = 12 and 20 with a band from resampling models, and
                   the pooled failure rates it carries there (`extrapolation_table`)
  depth.md         the tables above in Markdown

A model fails at N = W when, on a family where it is competent (full >= 0.9), its drop is
significant after Holm correction over those families and larger than 1 point
(`analysis.per_model`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from evals.cli import list_written
from evals.erf import erf_shares
from evals.plots import save
from evals.suites.stats import clopper_pearson

from . import findings, publish, tables

ARM_STYLE = {"no_sim": ("tab:red", "o"), "sim": ("tab:blue", "s")}


def depth_table(n_star: pd.DataFrame, drops: pd.DataFrame) -> pd.DataFrame:
    """Per job (see module doc), from `n_star.csv` and `model_drops.csv` of analysis.findings."""
    rows = []
    for job, models in n_star.groupby("job", sort=False):
        w, r_exact = models["W"].iloc[0], models["R_exact"].iloc[0]
        mine = drops[drops["job"] == job]
        at_w = mine[mine["N"] == w]
        full = mine.drop_duplicates(["seed", "family"])
        competent = {f: int(part["competent"].sum()) for f, part in full.groupby("family")}
        judged = models[models["failed_at_W"].notna()]
        judged = judged[judged["seed"].isin(
            at_w[at_w["competent"]]["seed"].unique())]          # competent somewhere
        k, n = int(judged["failed_at_W"].astype(bool).sum()), len(judged)
        low, high = clopper_pearson(k, n)
        k_in = int(judged["failed_inside_at_W"].astype(bool).sum()) \
            if "failed_inside_at_W" in judged else 0
        low_in, high_in = clopper_pearson(k_in, n)
        stars = models["N_star"].dropna()
        rows.append({
            "job": job, "arm": models["arm"].iloc[0], "L_d": models["L_d"].iloc[0], "W": w,
            "R_exact": r_exact, "W_over_R_exact": w / r_exact if r_exact else math.nan,
            "models": len(models),
            "competent": " ".join(f"{f}:{c}" for f, c in sorted(competent.items())),
            "judged": n, "failed_at_W": k, "fail_rate": k / n if n else math.nan,
            "fail_rate_low": low, "fail_rate_high": high,
            "failed_inside_at_W": k_in, "fail_inside_low": low_in, "fail_inside_high": high_in,
            "drop_at_W_median": float(models["drop_at_W"].median()),
            "drop_at_W_worst": float(models["drop_at_W"].min()),
            "N_star_median": float(stars.median()) if len(stars) else math.nan,
            "N_star_min": float(stars.min()) if len(stars) else math.nan,
            "N_star_max": float(stars.max()) if len(stars) else math.nan,
            "N_star_over_W_median": float((stars / w).median()) if len(stars) else math.nan,
            "N_star_over_R_exact_median": float((stars / r_exact).median())
            if len(stars) and r_exact else math.nan})
    table = pd.DataFrame(rows)
    return table.sort_values(["arm", "L_d"], kind="stable").reset_index(drop=True) \
        if not table.empty else table


def drop_at_w_table(capability: pd.DataFrame, marks: dict, traits: pd.DataFrame) -> pd.DataFrame:
    """Per job x family, the pooled drop at N = W with both CIs (capability_drop.csv rows)."""
    rows = []
    for job, mark in marks.items():
        part = capability[(capability["job"] == job) & (capability["x"] == "all")
                          & (capability["mode"] == tables.replay_label(mark["W"]))]
        rows.append(part)
    if not rows:
        return pd.DataFrame()
    table = pd.concat(rows, ignore_index=True)
    if not traits.empty:
        info = traits.drop_duplicates("job")[["job", "L_d", "arm"]]
        table = table.merge(info, on="job", how="left")
    columns = ["job", "L_d", "arm", "family", "seeds", "n", "acc_full", "difference", "ci_low",
               "ci_high", "seed_ci_low", "seed_ci_high", "seed_ci_method", "seed_p",
               "per_seed_difference"]
    return table[[c for c in columns if c in table.columns]]


def arm_pairs(traits: pd.DataFrame) -> list[tuple[str, str]]:
    """(no_sim job, sim job) at each depth that trained both arms, for analysis.findings'
    job-against-job table (the two differ in more than one setting: the replay simulation's
    probability and length)."""
    if traits.empty:
        return []
    jobs = traits.drop_duplicates("job")
    pairs = []
    for _, part in jobs.groupby("L_d", sort=True):
        arms = dict(zip(part["arm"], part["job"]))
        if "no_sim" in arms and "sim" in arms:
            pairs.append((arms["no_sim"], arms["sim"]))
    return pairs


def arm_test_table(arms: pd.DataFrame, marks: dict, traits: pd.DataFrame) -> pd.DataFrame:
    """arms_at_W.csv (see module doc): the `drop` rows of arms.csv at N = W of each depth's
    arm pair."""
    pairs = set(arm_pairs(traits))
    if arms.empty or not pairs:
        return pd.DataFrame()
    keep = [(a, b) in pairs and metric == "drop"
            and mode == tables.replay_label(marks.get(a, {}).get("W"))
            for a, b, metric, mode in zip(arms["from"], arms["to"], arms["metric"], arms["mode"])]
    table = arms[keep].rename(columns={"from": "no_sim", "to": "sim", "value_from": "drop_no_sim",
                                       "value_to": "drop_sim"})
    depths = traits.drop_duplicates("job").set_index("job")["L_d"]
    table.insert(0, "L_d", table["no_sim"].map(depths))
    columns = ["L_d", "no_sim", "sim", "family", "mode", "models_from", "models_to",
               "drop_no_sim", "drop_sim", "difference", "ci_low", "ci_high", "seed_ci_low",
               "seed_ci_high", "welch_p", "pairing"]
    return table[columns].sort_values(["L_d", "family"], kind="stable").reset_index(drop=True)


def mechanism_table(shares: pd.DataFrame, n_star: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Per model: the erf shares beside N*; and Spearman's rho (with its p) of each share
    against N* over every model and within each L_d (NaN where N* or the share is constant)."""
    # lazy: scipy.stats costs ~0.6 s to import, and only the mechanism table needs it
    from scipy.stats import spearmanr
    table = n_star.merge(shares, on=["job", "seed"], how="inner")
    stats: dict = {}
    for share in ("share_beyond_W", "share_beyond_2W"):
        groups = {"all": table, **{f"L_d={ld}": part for ld, part in table.groupby("L_d")}}
        for name, part in groups.items():
            part = part.dropna(subset=["N_star", share])
            if len(part) < 3 or part["N_star"].nunique() < 2 or part[share].nunique() < 2:
                stats[f"{share}/{name}"] = {"models": len(part), "rho": math.nan,
                                             "p": math.nan}
                continue
            rho, p = spearmanr(part[share], part["N_star"])
            stats[f"{share}/{name}"] = {"models": len(part), "rho": float(rho), "p": float(p)}
    return table, stats


# ---- figures ------------------------------------------------------------------------------

def extrapolation_table(n_star: pd.DataFrame, targets: tuple[int, ...] = (12, 20),
                        resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """The method of the depth study's registered prediction (FINDINGS.md, "Depth"): per arm
    with models at two or more depths, the least-squares line of log(N*/W) on log(L_d), each
    trained model one point, read at each target depth; its 95% band resamples the models
    within each depth (`resamples` times). Beside it: the N* and N*/R_exact the line implies,
    the slope, and the failure rates at N = W pooled over the measured depths, all documents
    and those whose evidence lies inside the replay (exact Clopper-Pearson CIs), which the
    prediction carries to the targets unchanged. N* is read on the grid of the suite and is
    at most R_exact: at a depth where every model needs the exact replay the line is bent
    down by that ceiling. One row per arm x target; empty with fewer than two depths."""
    rows = []
    rng = np.random.default_rng(seed)
    for arm, part in n_star.groupby("arm"):
        part = part[part["N_star"].notna()]
        depths = sorted(part["L_d"].unique())
        if len(depths) < 2:
            continue
        by_depth = [np.log(part[part["L_d"] == d]["N_star_over_W"].to_numpy(float))
                    for d in depths]
        x = np.concatenate([np.full(len(v), math.log(d)) for d, v in zip(depths, by_depth)])
        slope, intercept = np.polyfit(x, np.concatenate(by_depth), 1)
        draws = []
        for _ in range(resamples):
            ys = [rng.choice(v, size=len(v), replace=True) for v in by_depth]
            draws.append(np.polyfit(x, np.concatenate(ys), 1))
        draws = np.array(draws)
        window = int(part["W"].iloc[0])
        failed = int(part["failed_at_W"].astype(bool).sum())
        inside = int(part["failed_inside_at_W"].astype(bool).sum())
        n = len(part)
        fail_low, fail_high = clopper_pearson(failed, n)
        in_low, in_high = clopper_pearson(inside, n)
        for target in targets:
            fit = math.exp(intercept + slope * math.log(target))
            band = np.exp(draws[:, 1] + draws[:, 0] * math.log(target))
            r_exact = target * (window - 1) + 1
            rows.append({"arm": arm, "L_d": target, "depths": " ".join(map(str, depths)),
                         "models": n, "slope": slope,
                         "slope_low": float(np.quantile(draws[:, 0], 0.025)),
                         "slope_high": float(np.quantile(draws[:, 0], 0.975)),
                         "N_star_over_W": fit,
                         "N_star_over_W_low": float(np.quantile(band, 0.025)),
                         "N_star_over_W_high": float(np.quantile(band, 0.975)),
                         "N_star": fit * window, "R_exact": r_exact,
                         "N_star_over_R_exact": min(fit * window / r_exact, 1.0),
                         "fail_at_W": f"{failed}/{n}", "fail_low": fail_low,
                         "fail_high": fail_high, "fail_inside_at_W": f"{inside}/{n}",
                         "fail_inside_low": in_low, "fail_inside_high": in_high})
    return pd.DataFrame(rows)


def failure_figure(depth: pd.DataFrame) -> Figure | None:
    """Failure rate at N = W against L_d, a line per arm, exact 95% CI as error bars."""
    if depth.empty:
        return None
    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.subplots()
    for i, (arm, part) in enumerate(depth.groupby("arm")):
        part = part.sort_values("L_d")
        color, marker = ARM_STYLE.get(arm, ("tab:gray", "^"))
        x = part["L_d"] * 2 ** ((i - 0.5) * 0.06)          # arms side by side
        err = [part["fail_rate"] - part["fail_rate_low"],
               part["fail_rate_high"] - part["fail_rate"]]
        ax.errorbar(x, part["fail_rate"], yerr=err, color=color, marker=marker,
                    capsize=3, label=f"{arm}, all documents (models per point: "
                    f"{'/'.join(str(int(n)) for n in part['judged'])})")
        if "failed_inside_at_W" in part:
            rate = part["failed_inside_at_W"] / part["judged"]
            err = [rate - part["fail_inside_low"], part["fail_inside_high"] - rate]
            ax.errorbar(x * 2 ** 0.03, rate, yerr=err, color=color, marker=marker, ls="--",
                        mfc="white", capsize=3,
                        label=f"{arm}, evidence inside the replay (x <= N)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(depth["L_d"].unique()))
    ax.set_xticklabels([str(int(x)) for x in sorted(depth["L_d"].unique())])
    ax.set_xlim(depth["L_d"].min() / 1.5, depth["L_d"].max() * 1.5)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("decoder layers L_d (W = 8; N = W is W / R_exact of the reach)")
    ax.set_ylabel("models that fail at N = W")
    ax.set_title("Bounded replay N = W: failure rate per trained model (exact 95% CI)",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def n_star_figure(n_star: pd.DataFrame) -> Figure | None:
    """N*/W and N*/R_exact against L_d, one point per model (arms side by side)."""
    points = n_star.dropna(subset=["N_star"])
    if points.empty:
        return None
    fig = Figure(figsize=(10, 3.8))
    axes = fig.subplots(1, 2)
    depths = sorted(points["L_d"].unique())
    for ax, column, label in ((axes[0], "N_star_over_W", "N* / W"),
                              (axes[1], "N_star_over_R_exact", "N* / R_exact")):
        for i, (arm, part) in enumerate(points.groupby("arm")):
            color, marker = ARM_STYLE.get(arm, ("tab:gray", "^"))
            offset = (i - 0.5) * 0.08
            rng = np.random.default_rng(0)
            x = part["L_d"] * 2 ** (offset + rng.uniform(-0.03, 0.03, len(part)))
            ax.scatter(x, part[column], color=color, marker=marker, alpha=0.7, label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths)
        ax.set_xticklabels([str(int(d)) for d in depths])
        ax.set_xlabel("decoder layers L_d")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if column == "N_star_over_W":
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle("N*: the smallest replay within 0.5 point and 0.01 nats of exact, per model",
                 fontsize=9)
    return fig


def mechanism_figure(table: pd.DataFrame) -> Figure | None:
    if table.empty:
        return None
    fig = Figure(figsize=(10, 3.8))
    axes = fig.subplots(1, 2)
    for ax, share in zip(axes, ("share_beyond_W", "share_beyond_2W")):
        for arm, part in table.groupby("arm"):
            color, marker = ARM_STYLE.get(arm, ("tab:gray", "^"))
            ax.scatter(part[share], part["N_star_over_W"], color=color, marker=marker,
                       alpha=0.7, label=arm)
        ax.set_xlabel(f"gradient influence at distance >= {'W' if share.endswith('_W') else '2W'}"
                      " (share)")
        ax.set_ylabel("N* / W")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Does the decoder's receptive field beyond W predict N*? (one point per model)",
                 fontsize=9)
    return fig


# ---- the whole run ----------------------------------------------------------------------------

def write(study: Path, out: Path, erf: Path | None = None, alpha: float = 0.05) -> dict:
    """analysis.findings into `out`, then the depth tables and figures; returns the paths."""
    traits = tables.run_traits(study)
    written = findings.write_findings(study, out, alpha, compare=arm_pairs(traits))
    if "n_star" not in written:
        raise FileNotFoundError(f"{study}: no per-model replay results (is it a depth study "
                                f"with its suite step run?)")
    n_star = pd.read_csv(written["n_star"])
    drops = pd.read_csv(written["model_drops"])
    capability = pd.read_csv(written["capability_drop"], dtype={"x": str})
    marks = tables.geometry(study)
    depth = depth_table(n_star, drops)
    at_w = drop_at_w_table(capability, marks, traits)
    arm_test = arm_test_table(pd.read_csv(written["arms"]) if "arms" in written
                              else pd.DataFrame(), marks, traits)
    paths = {"depth": out / "depth.csv", "drop_at_W": out / "drop_at_W.csv"}
    if not arm_test.empty:
        paths["arms_at_W"] = out / "arms_at_W.csv"
    for name, table in (("depth", depth), ("drop_at_W", at_w), ("arms_at_W", arm_test)):
        if name in paths:
            table.to_csv(paths[name], index=False, float_format="%.6g")
    for name, figure in (("failure_vs_depth", failure_figure(depth)),
                         ("n_star_vs_depth", n_star_figure(n_star))):
        if figure is not None:
            paths[name] = save(figure, out / f"{name}.png", title_room=True)
    extrapolation = extrapolation_table(n_star[n_star["arm"].isin(ARM_STYLE)])
    if not extrapolation.empty:
        paths["extrapolation"] = out / "extrapolation.csv"
        extrapolation.to_csv(paths["extrapolation"], index=False, float_format="%.6g")
    stats: dict = {}
    mechanism = pd.DataFrame()
    if erf is not None:
        shares = pd.read_csv(erf) if erf.suffix == ".csv" else erf_shares(erf)
        mechanism, stats = mechanism_table(shares, n_star)
        paths["mechanism"] = out / "mechanism.csv"
        mechanism.to_csv(paths["mechanism"], index=False, float_format="%.6g")
        (out / "mechanism.json").write_text(json.dumps(stats, indent=1) + "\n")
        figure = mechanism_figure(mechanism)
        if figure is not None:
            paths["mechanism_png"] = save(figure, out / "mechanism.png", title_room=True)
    paths["depth_md"] = out / "depth.md"
    paths["depth_md"].write_text(_depth_markdown(depth, at_w, n_star, extrapolation, stats,
                                                 arm_test))
    return paths


def _depth_markdown(depth: pd.DataFrame, at_w: pd.DataFrame, n_star: pd.DataFrame,
                    extrapolation: pd.DataFrame, stats: dict,
                    arm_test: pd.DataFrame) -> str:
    """depth.md: the tables of `write` under headings that say what they are."""
    md = ["# Bounded replay against decoder depth (python -m analysis.depth)", "",
          "## Per job: failures at N = W (Clopper-Pearson 95% CI) and N*", "",
          publish.markdown(depth, ["job", "arm", "L_d", "R_exact", "W_over_R_exact", "models",
                                     "competent", "judged", "failed_at_W", "fail_rate",
                                     "fail_rate_low", "fail_rate_high", "failed_inside_at_W",
                                     "fail_inside_low", "fail_inside_high", "drop_at_W_median",
                                     "drop_at_W_worst", "N_star_median", "N_star_min",
                                     "N_star_max", "N_star_over_W_median",
                                     "N_star_over_R_exact_median"]),
          "## The drop at N = W per family (pooled over seeds; example- and seed-level CIs)", "",
          publish.markdown(at_w, [c for c in at_w.columns if c != "per_seed_difference"]),
          "## Replay simulation against none at each depth: the drop at N = W, sim - no_sim "
          "(example-level CI paired by document; model-level CI and Welch p over the models)",
          "", publish.markdown(arm_test, list(arm_test.columns)) if not arm_test.empty
          else "(no depth with both arms)\n",
          "## N* per model", "",
          publish.markdown(n_star, ["job", "arm", "seed", "L_d", "R_exact", "N_star",
                                      "drop_at_W", "failed_at_W"])]
    if not extrapolation.empty:
        md += ["## Extrapolation of N*/W to deeper decoders (least squares in log L_d, "
               "models resampled within depth)", "",
               publish.markdown(extrapolation, ["arm", "L_d", "depths", "models", "slope",
                                                  "slope_low", "slope_high", "N_star_over_W",
                                                  "N_star_over_W_low", "N_star_over_W_high",
                                                  "N_star", "R_exact", "N_star_over_R_exact",
                                                  "fail_at_W", "fail_inside_at_W",
                                                  "fail_inside_high"])]
    if stats:
        md += ["## Mechanism: Spearman's rho of the erf share against N*", "",
               "| share | models | rho | p |", "|---|---|---|---|"]
        md += [f"| {k} | {v['models']} | {v['rho']:.3f} | {v['p']:.3g} |" for k, v in stats.items()]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.depth",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--study", required=True, help="a depth study directory")
    p.add_argument("--out", required=True, help="output directory (e.g. findings/depth)")
    p.add_argument("--erf", default=None, help="an evals.erf output directory over the "
                                               "study's checkpoints, or the erf_shares.csv an "
                                               "archive keeps (mechanism tables)")
    p.add_argument("--alpha", type=float, default=0.05)
    args = p.parse_args(argv)
    erf = Path(args.erf) if args.erf else None
    return list_written("depth", lambda: write(Path(args.study), Path(args.out), erf,
                                                        args.alpha))


if __name__ == "__main__":
    sys.exit(main())
