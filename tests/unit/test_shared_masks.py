"""Masks shared across layers (`ced.attention.shared`) change nothing, bit for bit.

A forward or engine call builds each window, document and top-k mask once and every layer that
needs an equal mask reads it; with `ced.attention.SHARE_MASKS` off every layer and block builds
its own, as the layer-by-layer code did. Both must give identical logits, indexer KL and
parameter gradients (torch.equal, not a tolerance), in float32 and float64, over the modes that
change which masks exist: a reselection every layer or every 4 (Reuse layers share picks),
document masks, replay starts (one, per row, several per row), the three global reads, the
indexer warm-up's dense read, training, parallel evaluation and the engine's prefill with
bounded replay and decode."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

import ced.attention as attention
from conftest import engine_logits, make_model, random_ids, tiny_config

DTYPES = [torch.float32, torch.float64]


def _config(rng: random.Random, variant: str, reindex_every: int | None, global_read: str):
    topk = rng.choice([2, 3]) if variant == "ced" else None
    return tiny_config(variant, topk=topk, n_decoder_layers=5, decoder_reindex_every=reindex_every,
                       attention_block=rng.choice([4, 8]), window=rng.choice([3, 4]),
                       shift_tokens=rng.choice([0, 2]), global_read=global_read)


def _model(cfg, seed: int, dtype: torch.dtype):
    return make_model(cfg, seed).to(dtype)


def _starts(rng: random.Random, mode: str, batch: int, length: int):
    """A replay-start argument of the given kind: None, an int, one per row, several per row."""
    if mode == "none":
        return None
    if mode == "int":
        return rng.randrange(length)
    k = 1 if mode == "row" else 3
    return torch.tensor([[rng.randrange(length) for _ in range(k)] for _ in range(batch)])


@contextmanager
def _sharing(shared: bool):
    """Masks shared across layers (True, the model's way) or built by each layer (False)."""
    previous, attention.SHARE_MASKS = attention.SHARE_MASKS, shared
    try:
        yield
    finally:
        attention.SHARE_MASKS = previous


def _train_outputs(model, ids, shared: bool, **kwargs):
    """Logits, indexer KL and every parameter's gradient of one training forward and backward
    with masks shared (or not)."""
    model.zero_grad(set_to_none=True)
    with _sharing(shared):
        logits, aux = model(ids, return_aux=True, **kwargs)
        (logits.square().mean() + aux["indexer_kl"]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), aux["indexer_kl"].detach(), grads


def _assert_identical(a, b):
    logits_a, kl_a, grads_a = a
    logits_b, kl_b, grads_b = b
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(kl_a, kl_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reindex_every", [1, 4])
@pytest.mark.parametrize("global_read", ["auto", "masked", "gather", "union"])
@pytest.mark.parametrize("seed", [0, 1])
def test_training_forward_and_gradients_are_bitwise_identical(dtype, reindex_every,
                                                               global_read, seed):
    rng = random.Random(f"{seed}-{reindex_every}-{global_read}")
    cfg = _config(rng, "ced", reindex_every, global_read)
    model = _model(cfg, seed, dtype)
    batch, length = 2, 29
    ids = random_ids(batch, length, seed)
    for replay in ("none", "int", "row", "several"):
        docs = _starts(rng, rng.choice(["none", "several"]), batch, length)
        kwargs = dict(decoder_replay_start=_starts(rng, replay, batch, length),
                      encoder_replay_start=_starts(rng, rng.choice(["none", "row"]), batch,
                                                   length),
                      document_starts=docs, dense_global_read=rng.random() < 0.25)
        _assert_identical(_train_outputs(model, ids, True, **kwargs),
                          _train_outputs(model, ids, False, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["dense", "swa", "yoco"])
def test_other_variants_are_bitwise_identical(dtype, variant):
    rng = random.Random(variant)
    cfg = _config(rng, variant, None, "auto")
    model = _model(cfg, 5, dtype)
    ids = random_ids(2, 23, 5)
    for docs in (None, torch.tensor([[0, 9], [0, 14]])):
        kwargs = dict(document_starts=docs,
                      encoder_replay_start=_starts(rng, "row", 2, 23) if variant != "yoco"
                      else None)
        _assert_identical(_train_outputs(model, ids, True, **kwargs),
                          _train_outputs(model, ids, False, **kwargs))


def _run(shared: bool, fn):
    with _sharing(shared), torch.no_grad():
        return fn()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reindex_every", [1, 4])
def test_evaluation_and_engine_are_bitwise_identical(dtype, reindex_every):
    rng = random.Random(reindex_every)
    cfg = _config(rng, "ced", reindex_every, "auto")
    model = _model(cfg, 7, dtype)
    ids = random_ids(2, 30, 7)
    prompt = 24
    for replay in (None, 3, 8):     # exact, below W, a few windows
        start = None if replay is None else prompt - replay
        parallel = [_run(s, lambda: model(ids, decoder_replay_start=start)) for s in (True, False)]
        assert torch.equal(*parallel)
        engine = [_run(s, lambda: engine_logits(model, ids, prompt, replay=replay))
                  for s in (True, False)]
        assert torch.equal(*engine)
