"""The report tells seeds apart (run labels `<job>/seed<k>`, pooled by `RunId.group`) and
summarises jobs trained with several seeds: mean, spread, min and max of the pooled suite accuracy and the validation loss."""

from __future__ import annotations

import pandas as pd
import pytest

from ced.tracking import checkpoint_label
from analysis.report import file_label, seed_spread


def test_labels_keep_seeds_apart():
    assert checkpoint_label("/s/runs/ced/seed1/final") == "ced/seed1"
    assert checkpoint_label("/s/runs/ced/final") == "ced"
    assert file_label("ced/seed1@topk=4") == "ced_seed1_topk=4"


def test_seed_spread_over_seeds_of_one_job():
    suite = pd.DataFrame([
        {"label": f"ced/seed{k}", "group": "ced", "family": "recall", "x": "all", "mode": mode,
         "accuracy": acc}
        for k, (a_full, a_rep) in enumerate([(0.8, 0.5), (0.6, 0.3), (0.7, 0.4)])
        for mode, acc in (("full", a_full), ("replay=4", a_rep))
    ] + [{"label": "yoco/seed0", "group": "yoco", "family": "recall", "x": "all", "mode": "full",
          "accuracy": 0.9}])
    runs = {f"ced/seed{k}": {"metrics": pd.DataFrame({"step": [1, 2], "val/loss": [3.0, v]}),
                             "group": "ced"}
            for k, v in enumerate([1.0, 2.0, 3.0])}
    table = seed_spread(suite, runs)
    full = table[(table["what"] == "acc recall") & (table["mode"] == "full")].iloc[0]
    assert full["job"] == "ced" and full["seeds"] == 3
    assert full["mean"] == pytest.approx(0.7) and full["sd"] == pytest.approx(0.1)
    assert (full["min"], full["max"]) == (pytest.approx(0.6), pytest.approx(0.8))
    loss = table[table["what"] == "val loss"].iloc[0]
    assert loss["mean"] == pytest.approx(2.0) and loss["sd"] == pytest.approx(1.0)
    assert "yoco" not in set(table["job"])          # one seed: nothing to spread


def test_report_drops_pair_within_seeds_and_pool_over_them(tmp_path):
    """Two seeds, each with a drop too small to be significant alone (exact McNemar p = 0.125
    and 0.0625), that pooled over seeds is (p = 0.004): the report lists it, seeds beside."""
    from analysis.report import pooled_drops
    for seed, losses in ((0, 4), (1, 5)):
        rows = []
        for i in range(20):
            lost = i < losses
            for mode, ok in (("full", True), ("replay=4", not lost)):
                rows.append({"id": f"recall/d=5/{i}", "family": "recall", "x": 5, "mode": mode,
                             "correct": int(ok), "target": "7", "prediction": "7"})
        run = tmp_path / "suite" / "ced" / f"seed{seed}"
        run.mkdir(parents=True)
        pd.DataFrame(rows).to_csv(run / "results.csv", index=False)
    drops = pooled_drops(tmp_path)
    assert set(drops["x"]) == {"5", "all"}
    row = drops[drops["x"] == "all"].iloc[0]
    assert (row["job"], row["mode"], row["n"]) == ("ced", "replay=4", 40)
    assert row["difference"] == pytest.approx(-9 / 40)
    assert row["p_value"] == pytest.approx(2 / 2 ** 9)
    assert row["per_seed_difference"] == "-0.200 -0.250"
    assert row["per_seed_p"] == "0.125 0.0625"
    assert pooled_drops(tmp_path / "nowhere").empty


def test_training_loss_is_tabulated_and_plotted_like_with_like():
    """A run trained on answer tokens is compared with the validation loss on answer tokens,
    not with the all-token loss over filler it never learned (which made make demo's report
    show a falling training loss beside a validation loss of 14 nats)."""
    import pandas as pd

    from analysis import plots
    from analysis.report import training_table
    metrics = pd.DataFrame([{"step": 1, "loss": 2.0},
                            {"step": 2, "loss": 0.1, "val/loss": 14.3, "val/answer_loss": 0.2,
                             "val/acc/copy": 1.0}])
    runs = {"answers/seed0": {"config": {"variant": "ced"}, "metrics": metrics,
                              "loss_on": "answers"},
            "all/seed0": {"config": {"variant": "ced"}, "metrics": metrics, "loss_on": "all"}}
    table = training_table(runs).set_index("job")
    assert table.loc["answers/seed0", "val_loss"] == 0.2
    assert table.loc["answers/seed0", "val_loss_all_tokens"] == 14.3
    assert table.loc["all/seed0", "val_loss"] == 14.3
    assert table.loc["answers/seed0", "train_loss"] == 0.1
    fig = plots.training_figure({"answers/seed0": runs["answers/seed0"]})
    line = [ln for ln in fig.axes[0].get_lines() if ln.get_label().endswith("validation")][0]
    assert list(line.get_ydata()) == [0.2]
    assert "answer tokens" in fig.axes[0].get_ylabel()


def test_training_table_says_whether_validation_was_still_falling():
    """val_loss_last_change is the last validation loss less the one before it (like with like),
    absent with a single evaluation."""
    import pandas as pd

    from analysis.report import training_table
    falling = pd.DataFrame([{"step": 1, "loss": 2.0, "val/loss": 1.50},
                            {"step": 2, "loss": 1.9},
                            {"step": 3, "loss": 1.8, "val/loss": 1.25}])
    flat = pd.DataFrame([{"step": 1, "loss": 2.0, "val/loss": 1.0},
                         {"step": 2, "loss": 1.9, "val/loss": 1.1}])
    once = pd.DataFrame([{"step": 1, "loss": 2.0, "val/loss": 1.0}])
    runs = {name: {"config": {"variant": "ced"}, "metrics": m, "loss_on": "all"}
            for name, m in (("falling/seed0", falling), ("flat/seed0", flat),
                            ("once/seed0", once))}
    table = training_table(runs).set_index("job")
    assert table.loc["falling/seed0", "val_loss_last_change"] == -0.25
    assert table.loc["flat/seed0", "val_loss_last_change"] == pytest.approx(0.1)
    assert pd.isna(table.loc["once/seed0", "val_loss_last_change"])
