"""ModelConfig validation, the Full/Reindex/Reuse layer plan and replay lengths
(docs/semantics.md sections 1, 3, 4)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from ced.config import (
    ModelConfig,
    build_plan,
    exact_encoder_replay_length,
    exact_replay_length,
    group_sizes,
    paper_replay_length,
)
from ced.train_config import model_conf


def load_model_conf(name: str) -> ModelConfig:
    return ModelConfig.from_dict(model_conf(name))


BASE = dict(variant="ced", vocab_size=259, d_model=32, n_heads=2, n_encoder_layers=4,
            n_decoder_layers=4, window=8, topk=None, global_from_layer=2, encoder_kv_groups=2,
            encoder_compress_ratio=2, decoder_compress_ratio=1, decoder_reindex_every=None,
            indexer_heads=2, indexer_dim=4, max_seq_len=256)


def small(**overrides) -> ModelConfig:
    """A small valid ced config, with overrides."""
    return ModelConfig(**(BASE | overrides))


# ---- 1. validation ------------------------------------------------------------------------

INVALID = [
    # (case id, field the message must name, overrides)
    ("unknown-variant", "variant", dict(variant="moe")),
    ("vocab_size-0", "vocab_size", dict(vocab_size=0)),
    ("d_model-0", "d_model", dict(d_model=0)),
    ("n_heads-0", "n_heads", dict(n_heads=0)),
    ("n_encoder_layers-0", "n_encoder_layers", dict(n_encoder_layers=0)),
    ("max_seq_len-0", "max_seq_len", dict(max_seq_len=0)),
    ("indexer_heads-0", "indexer_heads", dict(indexer_heads=0)),
    ("indexer_dim-0", "indexer_dim", dict(indexer_dim=0)),
    ("attention_block-0", "attention_block", dict(attention_block=0)),
    ("d_model-bool", "d_model", dict(d_model=True)),
    ("heads-not-dividing", "n_heads", dict(d_model=128, n_heads=3)),
    ("odd-head-dim", "n_heads", dict(d_model=12, n_heads=4)),
    ("ced-no-decoder", "n_decoder_layers", dict(variant="ced", n_decoder_layers=0)),
    ("yoco-no-decoder", "n_decoder_layers", dict(variant="yoco", n_decoder_layers=0)),
    ("dense-negative-decoder", "n_decoder_layers", dict(variant="dense", n_decoder_layers=-1)),
    ("swa-window-0", "window", dict(variant="swa", window=0)),
    ("yoco-window-0", "window", dict(variant="yoco", window=0)),
    ("ced-window-0", "window", dict(window=0)),
    ("topk-0", "topk", dict(topk=0)),
    ("topk-True", "topk", dict(topk=True)),
    ("topk-float", "topk", dict(topk=4.0)),
    ("encoder-ratio-0", "encoder_compress_ratio", dict(encoder_compress_ratio=0)),
    ("decoder-ratio-0", "decoder_compress_ratio", dict(decoder_compress_ratio=0)),
    ("reindex-every-0", "decoder_reindex_every", dict(decoder_reindex_every=0)),
    ("d_ff-0", "d_ff", dict(d_ff=0)),
    ("dropout-1", "dropout", dict(dropout=1.0)),
    ("dropout-negative", "dropout", dict(dropout=-0.1)),
    ("rope_theta-0", "rope_theta", dict(rope_theta=0.0)),
    ("rope_theta-inf", "rope_theta", dict(rope_theta=float("inf"))),
    ("rope_theta-nan", "rope_theta", dict(rope_theta=float("nan"))),
    ("yoco-decoder-ratio-2", "decoder_compress_ratio",
     dict(variant="yoco", decoder_compress_ratio=2)),
    ("ced-global-from-past-encoder", "global_from_layer",
     dict(n_encoder_layers=4, global_from_layer=5, encoder_kv_groups=1)),
    ("ced-global-from-negative", "global_from_layer", dict(global_from_layer=-1)),
    ("ced-kv-groups-over-global-layers", "encoder_kv_groups",
     dict(n_encoder_layers=4, global_from_layer=2, encoder_kv_groups=3)),
    ("ced-kv-groups-0-with-globals", "encoder_kv_groups", dict(encoder_kv_groups=0)),
    ("ced-kv-groups-negative", "encoder_kv_groups", dict(encoder_kv_groups=-1)),
    ("ced-kv-groups-without-globals", "encoder_kv_groups",
     dict(n_encoder_layers=4, global_from_layer=4, encoder_kv_groups=1)),
    ("ced-window-under-encoder-ratio", "window",
     dict(window=3, encoder_compress_ratio=4, decoder_compress_ratio=1)),
    ("ced-window-under-decoder-ratio", "window",
     dict(window=3, encoder_compress_ratio=1, decoder_compress_ratio=4)),
    ("ced-no-globals-window-under-decoder-ratio", "window",
     dict(n_encoder_layers=2, global_from_layer=2, encoder_kv_groups=0,
          window=1, decoder_compress_ratio=2)),
]


@pytest.mark.parametrize("field, overrides", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_raises_naming_the_field(field, overrides):
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{re.escape(field)}:"):
        small(**overrides)


VALID_EDGES = [
    ("base", dict()),
    ("dense-no-decoder", dict(variant="dense", n_decoder_layers=0)),
    ("swa-no-decoder", dict(variant="swa", n_decoder_layers=0)),
    ("dense-window-unused", dict(variant="dense", window=0)),
    ("ced-window-1-ratios-1", dict(window=1, encoder_compress_ratio=1, decoder_compress_ratio=1)),
    ("swa-window-1", dict(variant="swa", window=1)),
    ("ced-window-equals-ratios",
     dict(window=4, encoder_compress_ratio=4, decoder_compress_ratio=4)),
    ("ced-no-global-encoder-layers",
     dict(n_encoder_layers=4, global_from_layer=4, encoder_kv_groups=0)),
    ("ced-no-globals-window-under-encoder-ratio",
     dict(n_encoder_layers=4, global_from_layer=4, encoder_kv_groups=0,
          window=1, encoder_compress_ratio=8)),
    ("ced-all-encoder-global-one-group-each",
     dict(n_encoder_layers=4, global_from_layer=0, encoder_kv_groups=4)),
    ("yoco-ignores-kv-groups", dict(variant="yoco", global_from_layer=9, encoder_kv_groups=99)),
    ("topk-1", dict(topk=1)),
    ("reindex-every-1", dict(decoder_reindex_every=1)),
    ("dropout-0.99", dict(dropout=0.99)),
]


@pytest.mark.parametrize("overrides", [c[1] for c in VALID_EDGES], ids=[c[0] for c in VALID_EDGES])
def test_valid_edge_configs_construct(overrides):
    config = small(**overrides)
    for key, value in overrides.items():
        assert getattr(config, key) == value


def test_default_config_is_valid():
    """`ModelConfig()` must construct: the dataclass defaults are a documented ced config."""
    config = ModelConfig()
    assert config.variant == "ced"
    build_plan(config)


# ---- 2. from_dict / to_dict ---------------------------------------------------------------

def test_from_dict_rejects_unknown_keys_naming_them():
    values = small().to_dict() | {"n_layer": 8, "windw": 16}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n_layer', 'windw'\]"):
        ModelConfig.from_dict(values)


def test_from_dict_validates():
    with pytest.raises(ValueError, match=r"^ModelConfig\.window:"):
        ModelConfig.from_dict(BASE | {"variant": "swa", "window": 0})


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(variant="dense", n_decoder_layers=0, d_ff=64, topk=8),
    dict(variant="yoco", decoder_reindex_every=2, attention_sink=False, tie_embeddings=True),
    dict(n_encoder_layers=6, global_from_layer=1, encoder_kv_groups=2, dropout=0.1),
], ids=["ced", "dense", "yoco", "ced-custom"])
def test_to_dict_round_trips(overrides):
    config = small(**overrides)
    as_dict = config.to_dict()
    assert set(as_dict) == set(ModelConfig.__dataclass_fields__)
    assert ModelConfig.from_dict(as_dict) == config
    assert ModelConfig.from_dict(as_dict).to_dict() == as_dict


# ---- 3. group_sizes -----------------------------------------------------------------------

def test_group_sizes_balanced_contiguous_earlier_larger():
    for n in range(1, 41):
        for g in range(1, n + 1):
            sizes = group_sizes(n, g)
            assert len(sizes) == g, (n, g)
            assert sum(sizes) == n, (n, g)
            assert min(sizes) >= 1, (n, g)
            assert max(sizes) - min(sizes) <= 1, (n, g)
            assert sizes == sorted(sizes, reverse=True), (n, g)


@pytest.mark.parametrize("n, g, expected", [
    (18, 3, [6, 6, 6]), (6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]), (8, 3, [3, 3, 2]), (5, 5, [1] * 5),
    (5, 1, [5]),
])
def test_group_sizes_examples(n, g, expected):
    assert group_sizes(n, g) == expected


# ---- 4. build_plan ------------------------------------------------------------------------

@pytest.mark.parametrize("n_enc, n_dec", [(4, 4), (3, 0), (1, 2)])
def test_plan_dense_is_full_causal_everywhere(n_enc, n_dec):
    config = small(variant="dense", n_encoder_layers=n_enc, n_decoder_layers=n_dec)
    plan = build_plan(config)
    assert plan.sources == ()
    assert plan.decoder_source is None
    assert [spec.index for spec in plan.layers] == list(range(n_enc + n_dec))
    for spec in plan.layers:
        assert spec.full_causal is True
        assert spec.window is None
        assert spec.global_source is None and spec.global_mode is None


@pytest.mark.parametrize("n_enc, n_dec, window", [(4, 4, 32), (3, 0, 1), (1, 2, 7)])
def test_plan_swa_is_window_only_everywhere(n_enc, n_dec, window):
    config = small(variant="swa", n_encoder_layers=n_enc, n_decoder_layers=n_dec, window=window)
    plan = build_plan(config)
    assert plan.sources == ()
    assert [spec.index for spec in plan.layers] == list(range(n_enc + n_dec))
    for spec in plan.layers:
        assert spec.full_causal is False
        assert spec.window == window
        assert spec.global_source is None and spec.global_mode is None


@pytest.mark.parametrize("n_enc, n_dec, reindex_every", [(4, 4, None), (8, 8, 4), (2, 1, 1)])
def test_plan_yoco(n_enc, n_dec, reindex_every):
    config = small(variant="yoco", n_encoder_layers=n_enc, n_decoder_layers=n_dec, window=16,
                   decoder_reindex_every=reindex_every)
    plan = build_plan(config)
    encoder, decoder = plan.part("encoder"), plan.part("decoder")
    assert [s.index for s in encoder] == list(range(n_enc))
    assert [s.index for s in decoder] == list(range(n_enc, n_enc + n_dec))
    for spec in encoder:
        assert spec.window == 16 and not spec.full_causal
        assert spec.global_source is None and spec.global_mode is None

    assert len(plan.sources) == 1
    source = plan.decoder_source
    assert source is plan.sources[0]
    assert (source.part, source.compress_ratio, source.from_layer) == ("decoder", 1, None)
    for spec in decoder:
        assert spec.window is None and not spec.full_causal
        assert spec.global_source == source.index
    assert decoder[0].global_mode == "full"


def expected_decoder_modes(n_dec: int, reindex_every: int | None) -> list[str]:
    return ["full" if j == 0 else
            "reindex" if reindex_every and j % reindex_every == 0 else
            "reuse" for j in range(n_dec)]


CED_CASES = [
    # n_enc, n_dec, global_from_layer, encoder_kv_groups, reindex_every
    (4, 4, 2, 2, None),
    (8, 8, 2, 3, 4),
    (7, 5, 0, 3, 2),
    (5, 3, 1, 4, 1),
    (3, 6, 3, 0, 3),
    (20, 20, 2, 3, 4),
    (11, 1, 4, 1, None),
]


@pytest.mark.parametrize("n_enc, n_dec, gfl, groups, reindex_every", CED_CASES)
def test_plan_ced(n_enc, n_dec, gfl, groups, reindex_every):
    config = small(n_encoder_layers=n_enc, n_decoder_layers=n_dec, global_from_layer=gfl,
                   encoder_kv_groups=groups, decoder_reindex_every=reindex_every, window=8,
                   encoder_compress_ratio=4, decoder_compress_ratio=2)
    plan = build_plan(config)
    encoder, decoder = plan.part("encoder"), plan.part("decoder")
    assert [s.index for s in plan.layers] == list(range(n_enc + n_dec))
    assert [s.index for s in encoder] == list(range(n_enc))

    # Every layer computes its own SWA KV.
    assert all(s.window == 8 and not s.full_causal for s in plan.layers)

    # Encoder: no global read below global_from_layer.
    assert all(s.global_source is None and s.global_mode is None for s in encoder[:gfl])

    # Encoder groups: contiguous, balanced, led by a Full layer that feeds the source.
    encoder_sources = [s for s in plan.sources if s.part == "encoder"]
    assert len(encoder_sources) == groups
    assert [s.index for s in plan.sources] == list(range(len(plan.sources)))
    sizes = group_sizes(n_enc - gfl, groups) if groups else []
    start = gfl
    for source, size in zip(encoder_sources, sizes, strict=True):
        assert source.from_layer == start
        assert source.compress_ratio == 4
        members = encoder[start:start + size]
        assert all(s.global_source == source.index for s in members)
        assert [s.global_mode for s in members] == ["full"] + ["reuse"] * (size - 1)
        start += size
    assert start == n_enc

    # Decoder: one shared source from the encoder output, Full / Reindex / Reuse.
    source = plan.decoder_source
    assert source is plan.sources[-1]
    assert (source.part, source.compress_ratio, source.from_layer) == ("decoder", 2, None)
    assert len(plan.sources) == groups + 1
    assert all(s.global_source == source.index for s in decoder)
    assert [s.global_mode for s in decoder] == expected_decoder_modes(n_dec, reindex_every)


# ---- 5. the paper-scale config ------------------------------------------------------------

@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return load_model_conf("deepseek_v41_flash")


def test_flash_shape(flash):
    assert flash.variant == "ced"
    assert (flash.n_encoder_layers, flash.n_decoder_layers, flash.window) == (20, 20, 128)
    assert flash.topk == 512


def test_flash_schedule(flash):
    plan = build_plan(flash)
    layers = plan.layers
    assert len(layers) == 40
    assert all(s.window == 128 and not s.full_causal for s in layers)

    assert all(s.global_source is None and s.global_mode is None for s in layers[:2])

    encoder_sources = [s for s in plan.sources if s.part == "encoder"]
    assert [(s.from_layer, s.compress_ratio) for s in encoder_sources] == [(2, 2), (8, 2), (14, 2)]
    for source in encoder_sources:
        group = layers[source.from_layer:source.from_layer + 6]
        assert all(s.part == "encoder" and s.global_source == source.index for s in group)
        assert [s.global_mode for s in group] == ["full"] + ["reuse"] * 5

    decoder = plan.part("decoder")
    assert [s.index for s in decoder] == list(range(20, 40))
    source = plan.decoder_source
    assert source.compress_ratio == 1 and source.from_layer is None
    assert all(s.global_source == source.index for s in decoder)
    modes = {s.index: s.global_mode for s in decoder}
    assert modes[20] == "full"
    assert [i for i, m in modes.items() if m == "reindex"] == [24, 28, 32, 36]
    assert all(m == "reuse" for i, m in modes.items() if i not in (20, 24, 28, 32, 36))


def test_flash_replay_lengths(flash):
    assert exact_replay_length(flash) == 2541
    assert paper_replay_length(flash) == 2560
    assert exact_encoder_replay_length(flash) == 20 * 127 + 1


# ---- 6. the small configs -----------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
def test_small_model_conf_loads(variant):
    config = load_model_conf(variant)
    assert config.variant == variant
    build_plan(config)


# ---- 7. replay lengths --------------------------------------------------------------------

@pytest.mark.parametrize("n_dec, window", [(1, 1), (1, 32), (4, 32), (8, 2), (20, 128), (3, 7)])
def test_exact_replay_length_ced(n_dec, window):
    config = small(n_decoder_layers=n_dec, window=window,
                   encoder_compress_ratio=1, decoder_compress_ratio=1)
    assert exact_replay_length(config) == n_dec * (window - 1) + 1


@pytest.mark.parametrize("n_dec, window", [(1, 1), (4, 32), (20, 128)])
def test_exact_replay_length_yoco_is_one(n_dec, window):
    assert exact_replay_length(small(variant="yoco", n_decoder_layers=n_dec, window=window)) == 1


@pytest.mark.parametrize("variant", ["dense", "swa"])
def test_replay_lengths_undefined_without_decoder(variant):
    config = small(variant=variant)
    for fn in (exact_replay_length, paper_replay_length, exact_encoder_replay_length):
        with pytest.raises(ValueError, match=variant):
            fn(config)


def test_replace_revalidates():
    with pytest.raises(ValueError, match=r"^ModelConfig\.window:"):
        replace(small(), window=0)


@pytest.mark.parametrize("field", [
    "n_decoder_layers", "window", "encoder_compress_ratio", "decoder_compress_ratio",
    "decoder_reindex_every", "d_ff", "global_from_layer", "encoder_kv_groups", "topk",
    "vocab_size", "max_seq_len",
])
def test_booleans_are_not_integers(field):
    """True == 1 in Python; a YAML `true` must not silently become a window or a ratio of 1
    (decoder_reindex_every=True would make every decoder layer Reindex)."""
    base = ModelConfig(variant="ced", n_encoder_layers=5, n_decoder_layers=3, window=4,
                       global_from_layer=1, encoder_kv_groups=1, encoder_compress_ratio=1,
                       decoder_compress_ratio=1)
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{field}:"):
        replace(base, **{field: True})


def test_token_weights_select_the_loss_bearing_targets():
    """loss_on=answers: answer targets only; loss_on=all: every target, answers weighted;
    positions without a target (label -100) never carry weight."""
    from ced.train import token_weights
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        labels = torch.randint(-1, 5, (3, 17), generator=gen)
        labels[labels < 0] = -100
        answers = torch.rand(3, 17, generator=gen) < 0.3
        batch = {"labels": labels, "answer_mask": answers}
        only = token_weights(batch, "answers", 1.0)
        assert torch.equal(only, (answers & (labels != -100)).float())
        weighted = token_weights(batch, "all", 4.0)
        expected = torch.where(answers & (labels != -100), 4.0, (labels != -100).float())
        assert torch.equal(weighted, expected)
