"""evals.plots draws every figure once, and the report leads with the answer: report.html
opens with a summary and the headline plot (accuracy against N per family, seeds as bands, W
and R_exact marked) and keeps the long divergence table collapsed in a <details> element."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.collections import PolyCollection

from analysis import plots as analysis_plots
from analysis import report
from evals import plots
from analysis.report import build_report, headline_points, report_scalars

W, R_EXACT, REPLAYS = 8, 20, [2, 4, 8]
FAMILIES = ["recall", "copy"]


def _suite_rows(seed: int) -> list[dict]:
    """A suite run's summary rows: per family, pooled and per-distance accuracy per mode."""
    rows = []
    for family in FAMILIES:
        for mode in ["full", *(f"replay={n}" for n in REPLAYS), "replay=exact"]:
            acc = 0.9 if mode in ("full", "replay=exact") else 0.3 + 0.05 * seed
            for x in (4, 16, "all"):
                rows.append({"family": family, "x_name": "distance", "x": x, "mode": mode,
                             "n": 10, "correct": int(acc * 10), "accuracy": acc,
                             "ci_low": acc - 0.1, "ci_high": acc + 0.1, "chance": ""})
    return rows


def _settings() -> dict:
    return {"replays": REPLAYS, "window": W, "r_exact": R_EXACT}


def _points(seeds: int) -> tuple[pd.DataFrame, dict]:
    suite = pd.concat([pd.DataFrame(_suite_rows(k)).assign(label=f"ced/seed{k}",
                                                            group="ced")
                       for k in range(seeds)], ignore_index=True)
    info = {f"ced/seed{k}": {"settings": _settings()} for k in range(seeds)}
    return headline_points(suite, info)


def _family_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_label() in FAMILIES]


def _vertical_at(ax, x: float) -> bool:
    return any(len(set(line.get_xdata())) == 1 and float(line.get_xdata()[0]) == x
               for line in ax.get_lines())


def test_headline_has_a_line_per_family_and_a_band_over_seeds():
    points, marks = _points(seeds=3)
    assert set(points["N"].dropna()) == {*REPLAYS, R_EXACT}      # replay=exact at R_exact
    fig = analysis_plots.headline_figure(points, marks)
    ax = fig.axes[0]
    lines = _family_lines(ax)
    assert sorted(line.get_label() for line in lines) == sorted(FAMILIES)
    assert list(lines[0].get_xdata()) == [*REPLAYS, R_EXACT]
    assert lines[0].get_ydata()[0] == pytest.approx(0.35)        # mean of 0.30, 0.35, 0.40
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == len(FAMILIES)
    assert _vertical_at(ax, W) and _vertical_at(ax, R_EXACT)
    labels = {line.get_label() for line in ax.get_lines()}
    assert {f"W={W}", f"R_exact={R_EXACT}"} <= labels


def test_headline_with_one_seed_has_no_band():
    points, marks = _points(seeds=1)
    ax = analysis_plots.headline_figure(points, marks).axes[0]
    assert len(_family_lines(ax)) == len(FAMILIES)
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_accuracy_figure_marks_replay_starts_window_and_r_exact(tmp_path):
    fig = plots.accuracy_figure(_suite_rows(0), replays=REPLAYS, window=W, r_exact=R_EXACT)
    assert len(fig.axes) == len(FAMILIES)
    ax = fig.axes[0]
    assert {"full", "replay=exact", "replay=2"} <= {line.get_label() for line in ax.get_lines()}
    assert all(_vertical_at(ax, x) for x in [*REPLAYS, W, R_EXACT])
    path = plots.save(fig, tmp_path / "accuracy.png")
    assert path.stat().st_size > 1000


def _write_study(study: Path, seeds: int = 2) -> None:
    """A study directory with suite runs, a divergence summary and a status, no training."""
    (study).mkdir(parents=True)
    (study / "summary.json").write_text(json.dumps(
        {"study": "fake", "description": "made by a test", "scale": "demo",
         "steps": {"divergence": {"state": "ok", "seconds": 1.0}}}))
    for k in range(seeds):
        out = study / "suite" / "ced" / f"seed{k}"
        out.mkdir(parents=True)
        run = {"checkpoint": str(study / "runs" / "ced" / f"seed{k}" / "final"),
               "config": {"variant": "ced", "window": W}, "settings": _settings()}
        out.joinpath("summary.json").write_text(json.dumps(
            {"run": run, "summary": _suite_rows(k), "capability_drop": []}))
    div = [{"checkpoint": str(study / "runs" / "ced" / f"seed{k}" / "final"), "variant": "ced",
            "window": W, "n_decoder_layers": 2, "r_exact": R_EXACT, "T": 64, "mode": mode,
            "N": n, "metric": metric, "step": 0, "mean": value, "ci_low": value,
            "ci_high": value, "n": 2}
           for k in range(seeds) for mode, n in [("replay=2", 2), ("replay=exact", R_EXACT)]
           for metric, value in [("kl", 0.1 if n == 2 else 0.0), ("top1_agree", 0.8)]]
    (study / "divergence").mkdir()
    (study / "divergence" / "summary.json").write_text(json.dumps(div))


def test_report_leads_with_the_headline_and_collapses_the_divergence_table(tmp_path):
    study = tmp_path / "study"
    _write_study(study)
    page = build_report(study, wandb=False, quiet=True).read_text()
    first_image = page.index("<img")
    assert page.index("<h2>Summary</h2>") < first_image < page.index("<h2>Status</h2>")
    assert "against the replay length N" in page[first_image:page.index("</figure>")]
    assert "ced: suite accuracy" in page[:first_image]
    details = page[page.index("<h2>Divergence</h2>"):]
    opened, closed = details.index("<details>"), details.index("</details>")
    assert opened < details.index("<table>") < closed
    assert details.index("<h2>", 1) > closed           # the table stays in its section
    assert (study / "report" / "headline_accuracy_vs_N.png").stat().st_size > 1000
    md = (study / "report" / "report.md").read_text()
    assert md.index("(headline_accuracy_vs_N.png)") < md.index("## Status")


def test_report_scalars_reuse_the_suite_and_divergence_scalars(tmp_path):
    study = tmp_path / "study"
    _write_study(study, seeds=1)
    from analysis.report import load_divergence, load_suite
    suite, _, _ = load_suite(study)
    scalars = report_scalars(suite, load_divergence(study), pd.DataFrame())
    assert scalars["acc/ced/seed0/recall/replay=2"] == pytest.approx(0.3)
    assert scalars["kl/ced/seed0/T=64/replay=2"] == pytest.approx(0.1)
    assert not [k for k in scalars if k.startswith("top1_agree") or "distance=" in k]


def test_summary_says_which_families_the_exact_model_can_do():
    points, _ = _points(seeds=2)                     # full 0.9 on every family
    line = report.competence_line("ced", points)
    assert line.startswith("ced: full reaches >= 0.8 on ") and all(f in line for f in FAMILIES)
    weak = points.assign(accuracy=points["accuracy"].where(points["mode"] != "full", 0.3))
    assert "no family reaches 0.8 in full" in report.competence_line("ced", weak)
    one = weak.copy()
    one.loc[(one["mode"] == "full") & (one["family"] == FAMILIES[0]), "accuracy"] = 0.95
    assert f"on {FAMILIES[0]};" in report.competence_line("ced", one)
