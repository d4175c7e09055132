"""analysis.findings: the seed-pooled statistics FINDINGS.md cites, on fabricated suite results
whose counts are known, so every number can be checked by hand."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from analysis.findings import main
from analysis.tables import (accuracy_table, answer_kl_table, capability_drop_table,
                             competence_table, paired_difference, reference_drop_table)
from ced.run_id import RunId, write_run_id
from evals.suites.stats import binomial_two_sided, wilson_interval


def fake_results(cells: dict) -> pd.DataFrame:
    """cells: (seed, x) -> list of (full correct, replay=4 correct) per example."""
    rows = []
    for (seed, x), pairs in cells.items():
        for i, (full, mode) in enumerate(pairs):
            for name, ok in (("full", full), ("replay=4", mode)):
                # KL at the answer: 0 for full; for the mode, 0.1 * (seed + 1) per example
                kl = 0.0 if name == "full" else 0.1 * (seed + 1)
                rows.append({"id": f"recall/d={x}/{i}", "family": "recall", "x": str(x),
                             "mode": name, "correct": bool(ok), "job": "ced",
                             "train_seed": seed, "run": f"ced/seed{seed}", "kl_answer": kl})
    return pd.DataFrame(rows)


# seed 0 at x=5: 10 both right, 3 full-only, 1 mode-only; seed 1 at x=5: 8 both, 4 full-only
# x=9: identical scorings on both seeds
CELLS = {(0, 5): [(1, 1)] * 10 + [(1, 0)] * 3 + [(0, 1)],
         (1, 5): [(1, 1)] * 8 + [(1, 0)] * 4,
         (0, 9): [(1, 1)] * 6 + [(0, 0)] * 2,
         (1, 9): [(1, 1)] * 7 + [(0, 0)] * 1}


def test_drops_pool_pairs_over_seeds_and_keep_each_seed_beside():
    drops = capability_drop_table(fake_results(CELLS))
    row = drops[(drops["x"] == "5")].iloc[0]
    assert (row["n"], row["full_only"], row["mode_only"]) == (26, 7, 1)
    assert row["difference"] == pytest.approx((1 - 7) / 26)
    assert row["p_value"] == pytest.approx(binomial_two_sided(7, 8))
    assert row["per_seed_difference"] == f"{(1 - 3) / 14:+.3f} {-4 / 12:+.3f}"
    assert row["per_seed_p"] == f"{binomial_two_sided(3, 4):.3g} {binomial_two_sided(4, 4):.3g}"
    same = drops[(drops["x"] == "9")].iloc[0]
    assert same["difference"] == 0 and same["p_value"] == 1.0
    # Holm over the two distances: the smaller p doubles
    assert row["p_holm"] == pytest.approx(min(1.0, 2 * row["p_value"]))
    pooled = drops[drops["x"] == "all"].iloc[0]
    assert (pooled["n"], pooled["full_only"], pooled["mode_only"]) == (42, 7, 1)
    assert pooled["p_holm"] == pooled["p_value"]            # its own test


def test_a_model_read_at_full_only_is_left_out_of_the_pairs():
    """A third model read at full and not yet under the mode (an unfinished lm-eval) changes
    nothing: the pairs, the seeds and acc_full are the two paired models' alone."""
    both = capability_drop_table(fake_results(CELLS))
    unfinished = fake_results(CELLS | {(2, 5): [(0, 0)] * 9, (2, 9): [(0, 0)] * 8})
    unfinished = unfinished[(unfinished["train_seed"] != 2) | (unfinished["mode"] == "full")]
    pd.testing.assert_frame_equal(capability_drop_table(unfinished), both)


def test_models_that_read_the_same_documents_get_the_crossed_interval():
    """x=5 has 14 examples on seed 0 and 12 on seed 1 (different ids): the model-level CI is
    nested. Where both seeds read the same 8 ids (x=9, and a cell built here) it is crossed, and
    a document every model gets wrong under the mode is one draw: with 4 models sharing the
    same 2 failing documents out of 20, the crossed interval is the documents' own bootstrap
    interval (-0.1 +- its spread), wider than the nested one."""
    drops = capability_drop_table(fake_results(CELLS))
    assert drops[drops["x"] == "5"].iloc[0]["seed_ci_method"] == "nested"
    assert drops[drops["x"] == "9"].iloc[0]["seed_ci_method"] == "crossed"
    shared = {(seed, 7): [(1, 0)] * 2 + [(1, 1)] * 18 for seed in range(4)}
    row = capability_drop_table(fake_results(shared)).iloc[0]
    assert row["seed_ci_method"] == "crossed" and row["seeds"] == 4
    assert row["difference"] == pytest.approx(-0.1)
    # all 4 models identical: the interval is the bootstrap of 20 documents, 2 of them -1
    assert row["seed_ci_low"] <= -0.2 + 1e-9 and row["seed_ci_high"] == 0.0
    from analysis.tables import model_level_columns
    diffs = pd.Series([-1.0, -1.0] + [0.0] * 18, dtype=float)
    nested = model_level_columns(pd.concat({s: diffs for s in range(4)}).iloc[
        [i for i in range(80) if i % 20 != 19 or i < 20]])   # one id missing on 3 models
    assert nested["seed_ci_method"] == "nested"
    assert nested["seed_ci_high"] - nested["seed_ci_low"] < row["seed_ci_high"] - row["seed_ci_low"]


def test_answer_kl_pools_examples_over_seeds_and_keeps_each_seed_beside():
    table = answer_kl_table(fake_results(CELLS))
    assert list(table["mode"]) == ["replay=4"]            # full is the reference, not a row
    row = table.iloc[0]
    n0, n1 = 14 + 8, 12 + 8                                # examples of seed 0 and seed 1
    assert row["n"] == n0 + n1
    assert row["mean"] == pytest.approx((0.1 * n0 + 0.2 * n1) / (n0 + n1))
    assert row["ci_low"] <= row["mean"] <= row["ci_high"]
    assert 0.1 - 1e-12 <= row["ci_low"] and row["ci_high"] <= 0.2 + 1e-12
    assert row["per_seed"] == "0.1 0.2"
    assert answer_kl_table(fake_results(CELLS).drop(columns="kl_answer")).empty


def test_paired_difference_interval_is_agresti_min():
    diff, low, high = paired_difference(7, 1, 26)
    bb, cc, nn = 7.5, 1.5, 28.0
    d = (cc - bb) / nn
    se = math.sqrt((bb + cc) - (cc - bb) ** 2 / nn) / nn
    assert diff == pytest.approx(-6 / 26)
    assert (low, high) == pytest.approx((d - 1.959963984540054 * se, d + 1.959963984540054 * se))
    # no discordant pair at all: a narrow interval around 0, not a degenerate point
    _, low, high = paired_difference(0, 0, 600)
    assert low < 0 < high and high - low < 0.02


def test_accuracy_pools_over_seeds_with_wilson_and_lists_each_seed():
    acc = accuracy_table(fake_results(CELLS))
    row = acc[(acc["x"] == "9") & (acc["mode"] == "full")].iloc[0]
    assert (row["n"], row["seeds"]) == (16, 2)
    assert row["accuracy"] == pytest.approx(13 / 16)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson_interval(13, 16))
    assert row["per_seed"] == f"{6 / 8:.3f} {7 / 8:.3f}"
    assert (row["seed_min"], row["seed_max"]) == (0.75, 0.875)
    assert list(acc["x"].drop_duplicates()) == ["5", "9", "all"]
    comp = competence_table(acc)
    assert comp.iloc[0]["accuracy"] == pytest.approx((13 + 12 + 6 + 7) / 42)
    assert bool(comp.iloc[0]["competent"]) is ((13 + 12 + 6 + 7) / 42 >= 0.9)


def write_study(study, window: int, r_exact: int) -> None:
    """The fabricated CELLS as a study directory's suite runs, read at this geometry."""
    for seed, part in fake_results(CELLS).groupby("train_seed"):
        run = study / "suite" / "ced" / f"seed{seed}"
        run.mkdir(parents=True)
        part.drop(columns=["job", "train_seed", "run"]).to_csv(run / "results.csv", index=False)
        (run / "summary.json").write_text(json.dumps(
            {"run": {"settings": {"window": window, "r_exact": r_exact}}}))


def test_cli_writes_every_table_and_plot_from_a_study_directory(tmp_path):
    study = tmp_path / "study"
    write_study(study, window=4, r_exact=7)
    out = tmp_path / "out"
    assert main(["--study", str(study), "--out", str(out)]) == 0
    assert "command and commit unknown" in (out / "findings.md").read_text()
    # the driver's summary.json: two invocations (an interrupted one and its resume)
    (study / "summary.json").write_text(json.dumps({
        "study": "fake", "scale": "full", "seeds": [0, 1],
        "steps": {"train/ced/seed0": {"state": "ok", "seconds": 120.0},
                  "train/ced/seed1": {"state": "skipped"},
                  "suite ced/seed0": {"state": "ok", "seconds": 30.0},
                  "divergence": {"state": "ok", "seconds": 12.0}},
        "invocations": [{"command": "python -m experiments.run study=fake", "commit": "a" * 40,
                         "dirty": False, "elapsed_s": 60.0},
                        {"command": "python -m experiments.run study=fake", "commit": "b" * 40,
                         "dirty": True, "elapsed_s": 102.0}]}))
    assert main(["--study", str(study), "--out", str(out)]) == 0
    for name in ("accuracy.csv", "capability_drop.csv", "competence.csv", "divergence.csv",
                 "answer_kl.csv", "accuracy_vs_N.png", "kl_vs_N.png", "findings.md",
                 "provenance.json"):
        assert (out / name).exists(), name
    text = (out / "findings.md").read_text()
    assert "replay=4" in text and '"W": 4, "R_exact": 7' in text
    assert "| `python -m experiments.run study=fake` | bbbbbbbbbb | dirty | 1.7 min |" in text
    info = json.loads((out / "provenance.json").read_text())
    assert info["step_seconds"] == {"divergence": 12.0, "suite": 30.0, "train": 120.0}
    assert info["total_step_seconds"] == 162.0
    assert info["seeds"] == [0, 1]          # no runs/: the seeds summary.json names
    # a study grown one model an invocation: summary.json names the last invocation's seeds
    # only, the header the seeds of the study's runs
    for seed in (0, 1, 2):
        write_run_id(study / "runs" / "ced" / f"seed{seed}", RunId("ced", seed))
    assert main(["--study", str(study), "--out", str(out)]) == 0
    assert json.loads((out / "provenance.json").read_text())["seeds"] == [0, 1, 2]
    assert "seeds [0, 1, 2]." in (out / "findings.md").read_text()
    with pytest.raises(SystemExit):
        main(["--study", str(tmp_path / "nothing"), "--out", str(out)])
    # both levels of CI in every drop row, and the models counted
    drops = pd.read_csv(out / "capability_drop.csv")
    for column in ("ci_low", "ci_high", "seed_ci_low", "seed_ci_high", "seed_p", "seeds"):
        assert drops[column].notna().all(), column
    assert set(drops["seeds"]) == {2}
    assert not (out / "exact_violations.csv").exists()     # replay=4 < R_exact = 7
    assert "Every exact mode gave" in text


def test_cli_flags_an_exact_mode_that_changed_answers(tmp_path, capsys):
    study = tmp_path / "study"
    write_study(study, window=2, r_exact=4)    # replay=4 is exact by the contract, yet changes
    out = tmp_path / "out"
    assert main(["--study", str(study), "--out", str(out)]) == 0
    assert "WARNING: ced recall `replay=4` is exact by the contract" in capsys.readouterr().err
    flagged = pd.read_csv(out / "exact_violations.csv")
    assert flagged[["mode", "full_only", "mode_only"]].values.tolist() == [["replay=4", 7, 1]]
    assert "Exact modes that changed answers" in (out / "findings.md").read_text()


def test_modes_are_listed_by_replay_length():
    from analysis.tables import _sorted
    modes = ["replay=exact", "replay=16", "turn=2,policy=suffix_only,replay=8", "replay=4",
             "full", "replay=1"]
    table = _sorted(pd.DataFrame({"job": "ced", "family": "recall", "x": "all",
                                  "mode": modes}))
    assert list(table["mode"]) == ["full", "replay=1", "replay=4", "replay=16", "replay=exact",
                                   "turn=2,policy=suffix_only,replay=8"]


def test_overrides_are_paired_with_the_unmodified_models_full_run():
    """A run `ced@kv=global:fp4_block16` against `ced` on the same examples: its `full` loses
    exactly the examples fabricated to be lost, per seed and pooled."""
    base = fake_results(CELLS).assign(base_job="ced", prediction="7")
    over = base.assign(job="ced@kv=global:fp4_block16",
                       run=base["run"] + "@kv=global:fp4_block16")
    # under the override, full loses the first 3 examples at x=5 that base full got right
    lost = (over["mode"] == "full") & (over["x"] == "5") & over["id"].str.endswith(
        ("/0", "/1", "/2"))
    over.loc[lost, ["correct", "prediction"]] = [False, "wrong"]
    table = reference_drop_table(pd.concat([base, over]))
    assert set(table["job"]) == {"ced@kv=global:fp4_block16"}
    row = table[(table["mode"] == "full") & (table["x"] == "all")].iloc[0]
    assert (row["n"], row["full_only"], row["mode_only"]) == (42, 6, 0)    # 3 per seed
    assert row["difference"] == pytest.approx(-6 / 42)
    assert row["agree"] == pytest.approx(36 / 42)
    assert row["per_seed_difference"] == f"{-3 / 22:+.3f} {-3 / 20:+.3f}"
    # the override's replay=4 against the unmodified full: base's own pattern (7 lost, 1 won)
    rep = table[(table["mode"] == "replay=4") & (table["x"] == "all")].iloc[0]
    assert (rep["full_only"], rep["mode_only"]) == (7, 1)
    assert reference_drop_table(base).empty


def test_needle_id_features_on_generated_documents():
    """shared_suffix and one_digit_away, checked against a brute-force reading of the ids on
    generated needle documents (uniform ids and near misses), and a clear error otherwise."""
    import re
    from ced.data import make_example
    from analysis.tables import needle_id_features
    seen = set()
    for seed in range(60):
        for near in (0, 2):
            ex = make_example("needle", seed, n_distractors=9, near_misses=near)
            got = needle_id_features(ex.context)
            ident = ex.context.rsplit("?id ", 1)[1][:-1]
            ids = [i for i, _ in re.findall(r"id (\d{3}):(\d{4})\n", ex.context) if i != ident]
            assert len(ids) == 9 and len(got["codes"]) == 9
            suffixes = [next(k for k in (2, 1, 0) if i[3 - k:] == ident[3 - k:]) for i in ids]
            assert got["shared_suffix"] == max(suffixes)
            codes = dict(re.findall(r"id (\d{3}):(\d{4})\n", ex.context))
            assert sorted(got["nearest_codes"]) == sorted(
                codes[i] for i, k in zip(ids, suffixes) if k and k == max(suffixes))
            assert got["one_digit_away"] == any(sum(a != b for a, b in zip(i, ident)) == 1
                                                for i in ids)
            assert got["one_digit_away"] or near == 0
            seen.add(got["shared_suffix"])
    assert seen == {0, 1, 2}
    with pytest.raises(ValueError, match="not a needle document"):
        needle_id_features("id 123:4567\n?id 12")


def test_needle_id_table_slices_accuracy_and_reads_the_wrong_answers():
    from analysis.tables import needle_id_table
    docs = pd.DataFrame([
        {"run": f"ced/seed{seed}", "id": doc_id, "shared_suffix": shared,
         "one_digit_away": shared == 2, "codes": [code],
         "nearest_codes": [code] if shared else []}
        for seed in (0, 1) for doc_id, shared, code in (("a", 2, "1111"), ("b", 0, "2225"))])
    rows = []
    for seed, preds in ((0, {"a": "1234", "b": "1234"}), (1, {"a": "1111", "b": "1235"})):
        for doc_id, pred in preds.items():
            for mode in ("full", "replay=1"):
                rows.append({"run": f"ced/seed{seed}", "id": doc_id, "job": "ced",
                             "train_seed": seed, "family": "needle", "mode": mode,
                             "target": "1234", "prediction": pred,
                             "correct": pred == "1234"})
    table = needle_id_table(pd.DataFrame(rows), docs).set_index("slice")
    assert table.loc["all", "n"] == 4 and table.loc["all", "accuracy"] == 0.5   # full only
    assert table.loc["all", "per_seed"] == "1.000 0.000"
    assert table.loc["all", "wrong"] == 2
    assert table.loc["all", "one_wrong_digit"] == 0.5         # 1235 yes, 1111 no
    assert table.loc["all", "other_line_code"] == 0.5         # 1111 is line a's other code
    # 1235 (document b) has its wrong digit at the last position, where b's other line has 5,
    # but that line shares no id suffix: not from a nearest line
    assert table.loc["all", "digit_from_nearest"] == 0.0
    assert table.loc["shared_suffix=2", "accuracy"] == 0.5
    assert table.loc["one_digit_away=False", "accuracy"] == 0.5
    low, high = wilson_interval(2, 4)
    assert (table.loc["all", "ci_low"], table.loc["all", "ci_high"]) == (low, high)
    assert needle_id_table(pd.DataFrame(rows).assign(family="recall"), docs).empty
    # a wrong digit that is the nearest line's digit at that position
    near = docs.assign(nearest_codes=[["9934"]] * 4, shared_suffix=1)
    mixed = pd.DataFrame(rows).assign(prediction="1934", correct=False)
    assert needle_id_table(mixed, near).set_index("slice").loc["all", "digit_from_nearest"] == 1


def test_an_exact_mode_that_changes_answers_is_flagged(tmp_path, capsys):
    """replay=exact, and a multi-turn policy that rebuilds every state, must equal `full`;
    one changed answer is flagged, a bounded N (or suffix_only, which the contract does not
    make exact) is not."""
    from analysis.tables import exact_mode_check
    rows = []
    for mode, lost in (("replay=exact", 1), ("replay=4", 3), ("replay=16", 0),
                       ("turn=2,policy=encoder_replay,replay=exact", 2),
                       ("turn=2,policy=suffix_only,replay=exact", 5)):
        for i in range(20):
            rows += [{"id": f"c/{i}", "family": "count", "x": "9", "mode": "full",
                      "correct": True, "job": "ced", "train_seed": 0, "run": "ced/seed0"},
                     {"id": f"c/{i}", "family": "count", "x": "9", "mode": mode,
                      "correct": i >= lost, "job": "ced", "train_seed": 0, "run": "ced/seed0"}]
    results = pd.DataFrame(rows).drop_duplicates(["id", "mode"])
    flagged = exact_mode_check(capability_drop_table(results), {"ced": {"R_exact": 16}})
    assert sorted(flagged["mode"]) == ["replay=exact",
                                       "turn=2,policy=encoder_replay,replay=exact"]
    assert exact_mode_check(capability_drop_table(results), {"ced": {"R_exact": 32}})[
        "mode"].tolist() == ["replay=exact", "turn=2,policy=encoder_replay,replay=exact"]


def test_seed_t_table_is_the_t_interval_of_the_per_seed_differences(tmp_path):
    from scipy import stats

    from analysis.tables import seed_t_table, write_seed_t
    drops = pd.DataFrame({"job": ["a", "b", "c"], "difference": [-0.67, 0.0, 0.0],
                          "per_seed_difference": ["-0.560 -0.802 -0.661", "+0.000 -0.000 +0.000",
                                                  None]})
    table = seed_t_table(drops)
    values = [-0.560, -0.802, -0.661]
    half = stats.t.ppf(0.975, 2) * stats.tstd(values) / 3 ** 0.5
    row = table.iloc[0]
    assert row["seeds"] == 3 and abs(row["seed_mean"] - sum(values) / 3) < 1e-12
    assert abs(row["seed_t_low"] - (sum(values) / 3 - half)) < 1e-12
    assert abs(row["seed_t_high"] - (sum(values) / 3 + half)) < 1e-12
    assert abs(row["seed_t_p"] - stats.ttest_1samp(values, 0).pvalue) < 1e-12
    assert (table.iloc[1][["seed_t_low", "seed_t_high", "seed_t_p"]] == [0.0, 0.0, 1.0]).all()
    assert table.iloc[2]["seeds"] == 0 and math.isnan(table.iloc[2]["seed_t_low"])
    drops.to_csv(tmp_path / "capability_drop.csv", index=False)
    written = write_seed_t(tmp_path)
    assert pd.read_csv(written["seed_level"])["table"].tolist() == ["capability_drop"] * 3
    with pytest.raises(FileNotFoundError):
        write_seed_t(tmp_path / "empty")
