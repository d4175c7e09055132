# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Analysis of a `ced` study
#
# Loads the outputs of one study (`python -m experiments.run study=<name>`, or `make demo`)
# from its directory and reproduces the report's key plots with the report's own plotting
# functions (`evals.plots`): the headline (accuracy against N per family, seeds as bands),
# divergence of bounded replay against N per variant, accuracy against distance per family
# and inference mode, the cost-quality frontier and the training curves.
#
# Set the study directory below or through the `CED_STUDY_DIR` environment variable.
# This file is paired with `analysis.ipynb` by jupytext: edit either, then
# `jupytext --sync notebooks/study_analysis.py`.

# %% tags=["parameters"]
import os
from pathlib import Path

STUDY_DIR = os.environ.get("CED_STUDY_DIR", "../outputs/studies/demo")
SAVE_DIR = os.environ.get("CED_NOTEBOOK_OUT", "")   # if set, the figures are saved there too

# %%
from io import BytesIO

import pandas as pd
from IPython.display import Image, display

from analysis import plots as P
from evals import plots as EP
from analysis import report as R

study = Path(STUDY_DIR).expanduser().resolve()
saved = []


def show(fig, name):
    """Display a figure of evals.plots and, if SAVE_DIR is set, save it as
    SAVE_DIR/<name>.png."""
    if fig is None:
        print(f"{name}: nothing to plot")
        return
    if SAVE_DIR:
        Path(SAVE_DIR).mkdir(parents=True, exist_ok=True)
        saved.append(P.save(fig, Path(SAVE_DIR) / f"{name}.png", dpi=80))
    png = BytesIO()
    fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
    display(Image(png.getvalue()))


status = R.load_status(study)
print(f"study {status.get('study', study.name)!r} at {study}")
pd.DataFrame([{"step": k, **{c: v.get(c) for c in ("state", "seconds", "returncode")}}
              for k, v in status.get("steps", {}).items()])

# %% [markdown]
# ## The answer: accuracy against the replay length N
# Suite accuracy pooled over distances, a panel per job and a line per family (mean over seeds,
# band min-max over seeds), the window W and R_exact marked: the report's headline plot.

# %%
runs = R.load_runs(study)
suite, _, info = R.load_suite(study)
drops = R.pooled_drops(study)   # paired within each seed, pooled over seeds
points, marks = R.headline_points(suite, info)
show(P.headline_figure(points, marks), "headline_accuracy_vs_N")
pd.DataFrame({"summary": R.headline_summary(
    points, marks, R.divergence_table(R.load_divergence(study)), drops)})

# %% [markdown]
# ## Training curves
# `runs/<job>/seed<k>/metrics.jsonl`: one line per step, validation loss every `train.eval_every`.

# %%
show(P.training_figure(runs), "training_curves")
R.training_table(runs)

# %% [markdown]
# ## Divergence against the replay length N
# `divergence/summary.json`: mean and bootstrap CI over prompts per checkpoint, T, mode, metric
# and step. Step 0 is the first generated token.

# %%
div = R.load_divergence(study)
show(EP.divergence_figure(div), "divergence_vs_N")
print(R.divergence_table(div).to_string(max_rows=40) if not div.empty else "no divergence")

# %% [markdown]
# ## Accuracy against distance (edge-case suite)
# `suite/<label>/summary.json`: accuracy per family, distance and mode, with the replay lengths,
# window and R_exact of the run (dashed: replay starts; a fact at distance > N lies before it).

# %%
for label, run_info in info.items():
    s = run_info["settings"]
    part = suite[(suite["label"] == label) & (suite["x_name"] == "distance")]
    show(EP.accuracy_figure(part, replays=s["replays"], window=s["window"],
                            r_exact=s.get("r_exact"), title=label, max_families=3),
         f"accuracy_{R.file_label(label)}")
R.pooled_accuracy(suite)

# %% [markdown]
# ## Cost-quality frontier
# Analytic prefill FLOPs of each mode (`ced.cost.prefill_flops`) at the suite's mean prompt
# length, against the mode's accuracy averaged over families.

# %%
cost = R.cost_table(study, runs, suite, info)
show(P.frontier_figure(cost), "cost_quality_frontier")
cost

# %% [markdown]
# ## Capability drops
# Cells where a mode is significantly below the exact model on the same examples, pooled over
# seeds (exact McNemar, Holm over distances, p < 0.05), each seed's difference beside.

# %%
drops if not drops.empty else "no significant capability drop"

# %%
print(f"{len(saved)} figures saved" + (f" to {SAVE_DIR}" if SAVE_DIR else ""))
