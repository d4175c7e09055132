"""`VARIANT_TRAITS`, the one description of each variant, against what the model actually
builds and computes (docs/semantics.md section 1 and 4.1), and `ced.checkpoint.load_config`,
the one way to read a model config back."""

from __future__ import annotations

import json

import pytest

from ced import InferenceEngine
from ced.checkpoint import CheckpointError, load_config, save_model
from ced.config import VARIANT_TRAITS, VARIANTS, VariantTraits
from conftest import TOL, make_model, random_ids, tiny_config


def test_every_variant_is_described():
    assert VARIANTS == ("dense", "swa", "yoco", "ced")
    assert set(VARIANT_TRAITS) == set(VARIANTS)
    assert all(isinstance(t, VariantTraits) for t in VARIANT_TRAITS.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_traits_match_the_built_model(variant):
    cfg = tiny_config(variant, topk=2 if variant == "ced" else None)
    traits = cfg.traits
    assert traits is VARIANT_TRAITS[variant]
    model = make_model(cfg, 0)
    encoder, decoder = model.plan.part("encoder"), model.plan.part("decoder")
    assert cfg.has_decoder == traits.has_decoder == bool(decoder)
    assert traits.has_decoder == (model.encoder_output_norm is not None)
    assert traits.has_windows == all(s.window == cfg.window for s in encoder)
    assert (not traits.has_windows) == all(s.full_causal for s in encoder)
    assert traits.decoder_windows == any(s.window is not None for s in decoder)
    assert traits.encoder_global_kv == any(s.global_source is not None for s in encoder)
    # Every layer with window keys projects K and V besides its query.
    for spec in model.plan.layers:
        has_kv = model.blocks[spec.index].attn.has_window
        assert has_kv == (spec.window is not None or spec.full_causal)


@pytest.mark.parametrize("variant", ["yoco", "ced"])
def test_exact_early_exit_is_what_the_engine_does(variant):
    """exact_early_exit: a replay of one decoder position reproduces the full prefill (yoco);
    otherwise (ced, long prompt) it does not."""
    cfg = tiny_config(variant)
    engine = InferenceEngine(make_model(cfg, 1))
    ids = random_ids(2, 40, 2)
    gap = (engine.prefill(ids, replay=1).logits - engine.prefill(ids).logits).abs().max()
    if cfg.traits.exact_early_exit:
        assert gap < TOL
    else:
        assert gap > 1e-6


def test_top_k_study_needs_an_indexer_capable_variant():
    for variant, traits in VARIANT_TRAITS.items():
        if traits.topk_study:
            assert traits.has_decoder and traits.encoder_global_kv, variant


def test_load_config_reads_a_directory_or_its_json(tmp_path):
    cfg = tiny_config("ced", topk=3)
    directory = save_model(make_model(cfg, 0), tmp_path / "final")
    assert load_config(directory) == cfg
    assert load_config(str(directory / "config.json")) == cfg
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_config(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"variant": "ced", "windw": 4}))
    with pytest.raises(CheckpointError, match=r"not a valid model config .*windw"):
        load_config(bad)


def test_study_driver_reads_configs_through_load_config(tmp_path):
    """The study driver resolves replay lengths from the first checkpoint with a decoder."""
    from experiments.evaluations import reference_config
    from experiments.sections import resolve_lengths
    dense = save_model(make_model(tiny_config("dense"), 0), tmp_path / "dense")
    ced = save_model(make_model(tiny_config("ced", window=8), 0), tmp_path / "ced")
    reference = reference_config([load_config(dense), load_config(ced)])
    assert reference == load_config(ced)
    assert reference_config([load_config(dense)]) == load_config(dense)
    assert reference_config([]) is None
    assert resolve_lengths(["W/2", "R_exact"], reference) == [4, 15]
    # A config.json read as a dict resolves alike.
    raw = json.loads((ced / "config.json").read_text())
    assert resolve_lengths(["W/2", "R_exact"], raw) == [4, 15]
