"""A mode is data downstream: `evals.modes.mode_columns` writes a Mode as typed columns, a label
(an archive written before the columns existed) gives the same columns back through the mode
module alone, the suite writes them beside its labels, and no tool outside the mode module
parses a mode string."""

from __future__ import annotations

import csv
import dataclasses
import io
import random
import re
from pathlib import Path

import pandas as pd
import pytest

from ced.checkpoint import save_model
from ced.inference import POLICIES
from conftest import make_model, tiny_config
from evals.modes import (MODE_COLUMNS, POLICY_EXACT, label_columns, mode_columns,
                         mode_from_columns, mode_sort_keys, named_mode, parse_mode,
                         promises_exact, replay_lengths, with_mode_columns)

ROOT = Path(__file__).resolve().parents[2]
FORMS = [1, 3, 8, 16, 40, "exact", "W", "W/2", "2W", "3W/2"]


def random_modes(rng: random.Random, count: int) -> list:
    """Modes over every field of the grammar, named by format_mode (long and short)."""
    modes = []
    for _ in range(count):
        replay = rng.choice([None, *FORMS])
        if rng.random() < 0.4:
            modes.append(named_mode(replay=replay if replay is not None else rng.choice(FORMS)))
            continue
        cache = rng.random() < 0.8
        modes.append(named_mode(replay=replay, turn=rng.randint(1, 64),
                                policy=rng.choice([None, *POLICIES]),
                                encoder_replay=rng.choice([None, *FORMS]) if cache else None,
                                prefix_cache=cache, short=rng.random() < 0.5))
    return [named_mode(), *modes]


@pytest.mark.parametrize("window,r_exact", [(None, None), (4, 7), (8, 15), (16, 31),
                                            (16, 1), (32, 141)])
def test_columns_of_a_mode_equal_the_columns_recovered_from_its_label(window, r_exact):
    modes = random_modes(random.Random(f"{window}-{r_exact}"), 300)
    for mode in modes:
        assert parse_mode(mode.name) == mode            # named_mode is what the label parses to
        columns = mode_columns(mode, r_exact, window)
        assert list(columns) == list(MODE_COLUMNS)
        assert label_columns(mode.name, r_exact, window) == columns
        assert mode_from_columns(columns, mode.name) == mode
        assert dataclasses.replace(mode_from_columns(columns), name=mode.name) == mode
    # a table: the written columns (read back from a CSV, numbers only as floats) and the
    # columns recovered from the labels alone are the same typed values
    written = pd.DataFrame([{"mode": m.name, **mode_columns(m, r_exact, window)} for m in modes])
    labels = written[["mode"]]
    from_labels = with_mode_columns(labels, r_exact, window)
    read_back = pd.read_csv(io.StringIO(written.to_csv(index=False)))
    from_columns = with_mode_columns(read_back, r_exact, window)
    pd.testing.assert_frame_equal(from_labels, from_columns[from_labels.columns])


def test_replay_n_resolves_forms_on_the_model_and_reads_one_turn_at_most_r_exact():
    cases = {"full": "", "replay=8": 8, "replay=exact": 15, "replay=W/2": 4, "replay=3W": 15,
             "replay=40": 15, "turn=4,policy=suffix_only,replay=40": 40,
             "turn=4,policy=cached_hidden,replay=exact": 15}
    for label, n in cases.items():
        assert label_columns(label, r_exact=15, window=8)["replay_n"] == n, label
    assert label_columns("replay=exact")["replay_n"] == ""        # R_exact not known
    assert label_columns("replay=W")["replay_n"] == ""            # W not known
    assert label_columns("yoco_early_exit") is None
    assert mode_from_columns({}, "yoco_early_exit") is None


def test_sort_key_and_replay_length_read_the_columns():
    labels = ["turn=2,policy=suffix_only,replay=4", "replay=exact", "replay=16", "full",
              "replay=4", "yoco_early_exit", "replay=W"]
    table = pd.DataFrame({"mode": labels, "job": ["a"] * len(labels)})
    ordered = table.assign(key=mode_sort_keys(table)).sort_values("key")["mode"].tolist()
    assert ordered == ["full", "replay=4", "replay=16", "replay=exact",
                       "replay=W", "turn=2,policy=suffix_only,replay=4", "yoco_early_exit"]
    n = replay_lengths(table, r_exact=31, window=16)
    assert n.fillna(-1).tolist() == [-1, 31, 16, -1, 4, -1, 16]
    # a written column stands; a row without one (an older run in the same table) is filled
    mixed = pd.DataFrame({"mode": ["replay=4", "replay=8"], "replay_n": [3.0, float("nan")]})
    assert replay_lengths(mixed).tolist() == [3.0, 8.0]


# Files under evals/, analysis/ and experiments/ that may parse a mode string, and why.
PARSE_ALLOWED = {
    "evals/lmeval/model.py": "user input: the mode written in lm-eval's model_args",
}
PARSERS = re.compile(r"\b(parse_mode|replay_of|mode_order|_replay_value)\b")


def test_no_tool_parses_a_mode_string_outside_the_mode_module():
    found = []
    for folder in ("evals", "analysis", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name == "evals/modes.py" or name in PARSE_ALLOWED:
                continue
            found += [f"{name}:{i}: {line.strip()}"
                      for i, line in enumerate(path.read_text().splitlines(), 1)
                      if PARSERS.search(line)]
    assert not found, ("a mode is parsed outside evals/modes.py; read its columns "
                       "(evals.modes.with_mode_columns) instead:\n" + "\n".join(found))


def test_the_suite_writes_the_columns_beside_each_label(tmp_path):
    """W = 6, 2 decoder layers: R_exact = 11; a top-k and a KV override on the run."""
    from evals.suites import SuiteConfig, run_suite
    cfg = tiny_config(vocab_size=259, n_encoder_layers=2, n_decoder_layers=2, window=6,
                      topk=3, global_from_layer=1, encoder_kv_groups=1, max_seq_len=256)
    checkpoint = save_model(make_model(cfg, 0), tmp_path / "final")
    out = tmp_path / "run"
    run_suite(SuiteConfig(str(checkpoint), ["W/2", "W"], str(out), examples=1,
                          families=["recall", "multiturn"], turns=[3], plot=False, wandb=False,
                          quiet=True, topk="2", kv="window:fp8", decoder_global="off"))
    header = next(csv.reader(open(out / "results.csv")))
    assert [c for c in header if c not in MODE_COLUMNS or c in ("turn", "policy")] == [
        "id", "family", "x_name", "x", "seed", "mode", "replay", "turn", "policy", "distance",
        "length", "beyond_replay", "target", "prediction", "correct", "nll", "kl_answer",
        "logit_diff", "chance"]                               # every earlier column, in order
    for name in ("results", "summary"):
        table = pd.read_csv(out / f"{name}.csv", dtype={"x": str})
        assert set(MODE_COLUMNS) <= set(table.columns), name
        written = with_mode_columns(table)
        from_labels = with_mode_columns(table[["mode"]], r_exact=11, window=6)
        columns = [c for c in MODE_COLUMNS if c not in ("topk_read", "kv", "decoder_global")]
        pd.testing.assert_frame_equal(written[columns], from_labels[columns])
        assert set(written["topk_read"]) == {"2"} and set(written["kv"]) == {"window:fp8"}
        assert set(written["decoder_global"]) == {"off"}
        by_label = written.drop_duplicates("mode").set_index("mode")
        assert by_label.loc["replay=3", ["replay_given", "replay_n"]].tolist() == ["3", 3.0]
        assert by_label.loc["replay=exact", "replay_n"] == 11.0
        assert by_label.loc["full"][["replay_given", "replay_n", "turn"]].isna().all()
        turn = by_label.loc["turn=3,policy=suffix_only,replay=6"]
        assert (turn["turn"], turn["policy"], turn["encoder_replay"], turn["prefix_cache"]) == (
            3.0, "suffix_only", "exact", 1.0)


def test_every_policy_has_one_exactness_rule_and_an_unknown_policy_is_refused():
    """`promises_exact` reads a new turn's exactness from POLICY_EXACT, one rule per policy in
    ced.inference.POLICIES; a policy without one is a one-line error naming the table, not
    suffix_only's rule by default (which would flag or hide exact-mode violations)."""
    assert set(POLICY_EXACT) == set(POLICIES)
    r_exact = 15
    for policy in POLICIES:
        for replay, turn in ((r_exact, 4), (r_exact, 30), (4, 30)):
            mode = named_mode(replay=replay, turn=turn, policy=policy)
            expected = replay >= r_exact and (policy != "suffix_only" or replay <= turn)
            assert promises_exact(mode, r_exact) == expected, (mode.name, expected)
    assert not promises_exact(named_mode(replay=r_exact, turn=30, policy="encoder_replay",
                                         encoder_replay=4), r_exact)
    stranger = dataclasses.replace(named_mode(replay=r_exact, turn=4), policy="new_policy")
    with pytest.raises(ValueError, match="no exactness rule; add it to evals.modes.POLICY_EXACT"):
        promises_exact(stranger, r_exact)
