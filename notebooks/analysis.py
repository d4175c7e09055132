# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Analysis of a `ced` study
#
# Loads the outputs of one study (`python -m experiments.run study=<name>`, or `make demo`)
# from its directory and reproduces the report's key plots: divergence of bounded replay
# against N per variant, accuracy against distance per family and inference mode, the
# cost-quality frontier and the training curves.
#
# Set the study directory below or through the `CED_STUDY_DIR` environment variable.
# This file is paired with `analysis.ipynb` by jupytext: edit either, then
# `jupytext --sync notebooks/analysis.py`.

# %% tags=["parameters"]
import os
from pathlib import Path

STUDY_DIR = os.environ.get("CED_STUDY_DIR", "../outputs/studies/demo")
SAVE_DIR = os.environ.get("CED_NOTEBOOK_OUT", "")   # if set, the figures are saved there too

# %%
import json

import matplotlib.pyplot as plt
import pandas as pd

from evals import report as R

study = Path(STUDY_DIR).expanduser().resolve()
saved = []


def show(fig, name):
    """Display a figure and, if SAVE_DIR is set, save it as SAVE_DIR/<name>.png."""
    if SAVE_DIR:
        Path(SAVE_DIR).mkdir(parents=True, exist_ok=True)
        path = Path(SAVE_DIR) / f"{name}.png"
        fig.savefig(path, dpi=80)
        saved.append(path)
    plt.show()
    plt.close(fig)


status = R.load_status(study)
print(f"study {status.get('study', study.name)!r} at {study}")
pd.DataFrame([{"step": k, **{c: v.get(c) for c in ("state", "seconds", "returncode")}}
              for k, v in status.get("steps", {}).items()])

# %% [markdown]
# ## Training curves
# `runs/<job>/seed<k>/metrics.jsonl`: one line per step, validation loss every `train.eval_every`.

# %%
runs = R.load_runs(study)
fig, ax = plt.subplots(figsize=(7, 4))
for i, (job, run) in enumerate(runs.items()):
    m = run["metrics"]
    if m.empty:
        continue
    ax.plot(m["step"], m["loss"], color=f"C{i}", label=f"{job} train")
    if "val/loss" in m:
        v = m.dropna(subset=["val/loss"])
        ax.plot(v["step"], v["val/loss"], "o--", color=f"C{i}", label=f"{job} validation")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.legend(fontsize=7)
show(fig, "training_curves")
R.training_table(runs)

# %% [markdown]
# ## Divergence against the replay length N
# `divergence/summary.json`: mean and bootstrap CI over prompts per checkpoint, T, mode, metric
# and step. Step 0 is the first generated token.

# %%
div = R.load_divergence(study)
if div.empty:
    print("no divergence results in this study")
else:
    first = div[div["mode"].str.startswith("replay=") & (div["step"] == 0)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ["kl", "top1_agree"]):
        for (job, length), part in first[first["metric"] == metric].groupby(["job", "T"]):
            part = part.sort_values("N")
            ax.errorbar(part["N"], part["mean"],
                        yerr=[part["mean"] - part["ci_low"], part["ci_high"] - part["mean"]],
                        marker="o", capsize=2, label=f"{job} T={length}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replay N")
        ax.set_ylabel(metric)
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(fontsize=7)
    show(fig, "divergence_vs_N")
    print(R.divergence_table(div).to_string(max_rows=40))

# %% [markdown]
# ## Accuracy against distance (edge-case suite)
# `suite/<label>/summary.json`: accuracy per family, distance and mode, with the replay lengths,
# window and R_exact of the run (dashed: replay starts; a fact at distance > N lies before it).

# %%
suite, drops, info = R.load_suite(study)
for label, run_info in info.items():
    part = suite[(suite["label"] == label) & (suite["x"].astype(str) != "all")
                 & (suite["x_name"] == "distance") & ~suite["mode"].str.contains("turn=")]
    families = list(dict.fromkeys(part["family"]))[:3]
    if not families:
        continue
    s = run_info["settings"]
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 3.5), squeeze=False)
    for ax, family in zip(axes[0], families):
        cells = part[part["family"] == family].copy()
        cells["xv"] = cells["x"].astype(int)
        for mode, pts in cells.groupby("mode", sort=False):
            ax.plot(pts.sort_values("xv")["xv"], pts.sort_values("xv")["accuracy"], marker="o",
                    label=mode)
        for n in s["replays"]:
            ax.axvline(n, ls="--", color="grey", lw=0.8)
        ax.axvline(s["window"], ls=":", color="purple", label=f"W={s['window']}")
        ax.set_title(f"{label}: {family}")
        ax.set_xlabel("distance")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=6)
    show(fig, f"accuracy_{R.file_label(label)}")
R.pooled_accuracy(suite)

# %% [markdown]
# ## Cost-quality frontier
# Analytic prefill FLOPs of each mode (`ced.cost.prefill_flops`) at the suite's mean prompt
# length, against the mode's accuracy averaged over families.

# %%
cost = R.cost_table(study, runs, suite, info)
if not cost.empty:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, part in cost.groupby("label", sort=False):
        part = part.sort_values("prefill_flops")
        ax.plot(part["prefill_flops"], part["accuracy"], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("prefill FLOPs")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=7)
    show(fig, "cost_quality_frontier")
cost

# %% [markdown]
# ## Capability drops
# Cells where a mode is significantly below the exact model (exact McNemar, p < 0.05).

# %%
drops if not drops.empty else "no significant capability drop"

# %%
print(f"{len(saved)} figures saved" + (f" to {SAVE_DIR}" if SAVE_DIR else ""))
