"""ModelConfig.shift_tokens: the input's short causal token mixing (CEDModel.embed_tokens).

It must be a function of the token ids alone: the embedding of positions [start, T) computed
from any start equals the slice of the whole sequence's, it never looks ahead, and the engine
(which embeds only new or replayed positions) matches the parallel forward under replay.
Float64 throughout; tolerance TOL = 1e-10 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import TOL, VOCAB, engine_logits, make_model, random_ids, tiny_config


@pytest.mark.parametrize("shift", [1, 2, 5])
@pytest.mark.parametrize("seed", range(4))
def test_embedding_from_any_start_is_the_slice_of_the_whole(shift, seed):
    model = make_model(tiny_config("ced", shift_tokens=shift), seed)
    ids = random_ids(3, 17, seed)
    whole = model.embed_tokens(ids)
    assert whole.shape == (3, 17, model.cfg.d_model)
    for start in range(17):
        assert (model.embed_tokens(ids, start) - whole[:, start:]).abs().max() < TOL


@pytest.mark.parametrize("shift", [1, 3])
def test_embedding_is_causal_and_reaches_exactly_shift_tokens_back(shift):
    model = make_model(tiny_config("ced", shift_tokens=shift), 0)
    ids = random_ids(2, 20, 1)
    base = model.embed_tokens(ids)
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % VOCAB
    moved = (model.embed_tokens(changed) - base).abs().amax(dim=(0, 2))
    touched = (moved > TOL).nonzero().flatten().tolist()
    assert touched == list(range(8, 8 + shift + 1))


def test_zero_shift_weights_equal_the_plain_embedding():
    model = make_model(tiny_config("ced", shift_tokens=2), 0)
    with torch.no_grad():
        model.shift_weights.zero_()
    ids = random_ids(2, 12, 0)
    assert torch.equal(model.embed_tokens(ids), model.embed(ids))


@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
@pytest.mark.parametrize("seed", range(3))
def test_engine_matches_forward_under_replay(variant, seed):
    cfg = tiny_config(variant, shift_tokens=2, topk=None if variant != "ced" else 3)
    model = make_model(cfg, seed)
    ids = random_ids(2, 20, seed)
    parallel = model(ids)[:, 13:]
    assert (engine_logits(model, ids, 14) - parallel).abs().max() < TOL
    if cfg.has_decoder:
        for n in (1, 2, 5):
            truncated = model(ids, decoder_replay_start=14 - n)[:, 13:]
            assert (engine_logits(model, ids, 14, replay=n) - truncated).abs().max() < TOL


@pytest.mark.parametrize("bad", [-1, 9, 1.5, True, "2"])
def test_bad_shift_tokens_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="ModelConfig.shift_tokens"):
        tiny_config("ced", shift_tokens=bad)
