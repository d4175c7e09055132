"""Inference modes used by every evaluation: exact modes reproduce the full forward, bounded
ones do not, and the mode grammar rejects what it cannot run."""

from __future__ import annotations

import pytest
import torch

from ced import InferenceEngine
from conftest import make_model, random_ids, tiny_config
from evals.modes import exact_logits, mode_logits, parse_mode


@pytest.mark.parametrize("text,exact", [
    ("full", True), ("replay=exact", True), ("replay=2", False),
    ("turn=3,policy=cached_hidden,replay=exact", True),
    ("turn=3,policy=suffix_only,replay=exact", False),
    ("turn=3,policy=keep_decoder_swa,replay=exact,prefix_cache=0", True),
    ("turn=3,policy=encoder_replay,replay=exact,encoder_replay=2", False),
])
def test_modes_against_the_full_forward(text, exact):
    model = make_model(tiny_config(topk=3, window=4), 0)
    ids = random_ids(2, 40, 0)
    context, continuation = ids[:, :34], ids[:, 34:]
    got = mode_logits(InferenceEngine(model), context, continuation, parse_mode(text))
    want = exact_logits(model, context, continuation)
    assert got.shape == want.shape == (2, 6, model.cfg.vocab_size)
    assert ((got - want).abs().max() < 1e-10) == exact


@pytest.mark.parametrize("text", ["replay", "turn=3,policy=magic", "policy=suffix_only",
                                  "colour=red"])
def test_bad_modes_are_refused(text):
    with pytest.raises(ValueError, match="mode"):
        parse_mode(text)
