"""A suite family asked for by name that has no points for the settings is an error (it would
otherwise evaluate nothing and exit 0); left to the default "every family", it is skipped with
a warning."""

from __future__ import annotations

import pytest

from ced import ModelConfig
from evals.suites.families import SuiteSettings, build_documents


def settings(replays):
    cfg = ModelConfig(variant="ced", vocab_size=259, d_model=32, n_heads=2, n_encoder_layers=2,
                      n_decoder_layers=2, window=8, topk=8, global_from_layer=1,
                      encoder_kv_groups=1, indexer_heads=2, indexer_dim=8, max_seq_len=256)
    return SuiteSettings.from_config(cfg, replays)


def test_requested_family_without_points_is_an_error_naming_what_it_needs():
    with pytest.raises(ValueError) as err:
        build_documents(settings([4]), 1, families=["recall", "short"])
    message = str(err.value)
    assert message.startswith("family short: no points for these settings (replays [4]")
    assert "short needs a replay N >= 6" in message and "\n" not in message


def test_the_same_family_with_a_long_enough_replay_has_documents():
    docs = build_documents(settings([4, 8]), 1, families=["short"])
    assert docs and all(d["length"] <= 8 for d in docs)


def test_default_families_skip_an_empty_one_with_a_warning(capsys):
    docs = build_documents(settings([4]), 1, families=None)
    assert docs and not any(d["family"] == "short" for d in docs)
    assert "warning: family short: no points" in capsys.readouterr().err
