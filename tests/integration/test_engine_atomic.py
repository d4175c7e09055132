"""The engine checks its inputs up front (clear one-line ValueErrors for ids
outside [0, vocab), float or bool dtypes, a batch size other than the cache's), and every call
is all-or-nothing on the cache: a call that fails leaves the cache bitwise as it was, so the
next call computes what it would have computed had the failed call never happened."""

from __future__ import annotations

import pytest
import torch

from ced import InferenceEngine
from conftest import VOCAB, make_model, random_ids, tiny_config


@pytest.fixture(scope="module")
def model():
    return make_model(tiny_config(topk=3, encoder_compress_ratio=3, window=4), 0)


def fingerprint(cache) -> list:
    """Every tensor of the cache (cloned) and every flag, in a fixed order."""
    out = [cache.tokens.clone(), None if cache.encoder_hidden is None
           else cache.encoder_hidden.clone(), cache.encoder_windows_evicted,
           cache.decoder_windows_evicted, len(cache.state.windows), len(cache.state.sources)]
    for w in cache.state.windows:
        out += [None] if w is None else [w.k.clone(), w.v.clone(), w.positions.clone()]
    for s in cache.state.sources:
        out += [s.k.clone(), s.v.clone(), None if s.index_keys is None else s.index_keys.clone(),
                s.pending_tokens.clone(), s.pending_gates.clone()]
    return out


def assert_bitwise_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)
        else:
            assert x == y


BAD_IDS = [
    (lambda ids: ids.clone().index_fill_(1, torch.tensor([0]), -1),
     r"token ids must lie in \[0, 61\); got values from -1"),
    (lambda ids: ids.clone().index_fill_(1, torch.tensor([0]), VOCAB),
     r"token ids must lie in \[0, 61\); got values from \d+ to 61"),
    (lambda ids: ids.double(), r"token ids must have an integer dtype \(torch.long\); got "
                               r"torch.float64"),
    (lambda ids: ids > 3, r"token ids must have an integer dtype \(torch.long\); got torch.bool"),
    (lambda ids: ids[:1], r"(batch size 1 does not match the cache's 2|expected LongTensor\[B\] "
                          r"with B=2; got shape \(1,\))"),
]


@pytest.mark.parametrize("make_bad,message", BAD_IDS[:4])
def test_prefill_refuses_bad_token_ids(model, make_bad, message):
    with pytest.raises(ValueError, match=rf"^input_ids: {message}") as info:
        InferenceEngine(model).prefill(make_bad(random_ids(2, 8, 0)))
    assert "\n" not in str(info.value)


def test_int32_ids_are_accepted_and_give_the_same_logits(model):
    engine = InferenceEngine(model)
    ids = random_ids(2, 8, 0)
    out32 = engine.prefill(ids.int())
    out64 = engine.prefill(ids)
    assert torch.equal(out32.logits, out64.logits)
    assert out32.cache.tokens.dtype == torch.long


@pytest.mark.parametrize("make_bad,message", BAD_IDS)
@pytest.mark.parametrize("call", ["decode", "extend_live", "extend_prefix"])
def test_a_refused_call_leaves_the_cache_bitwise_unchanged(model, call, make_bad, message):
    engine = InferenceEngine(model)
    ids = random_ids(2, 24, 1)
    cache = engine.prefill(ids[:, :16]).cache
    if call == "extend_prefix":
        cache = cache.as_prefix_cache()
    before = fingerprint(cache)
    name = "next_ids" if call == "decode" else "suffix_ids"
    with pytest.raises(ValueError, match=rf"^{name}: {message}"):
        if call == "decode":
            engine.decode(make_bad(ids[:, 16:17])[:, 0], cache)
        else:
            engine.extend(make_bad(ids[:, 16:19]), cache, policy="suffix_only", replay=6,
                          encoder_replay=None if call == "extend_live" else 8)
    assert_bitwise_equal(fingerprint(cache), before)


@pytest.mark.parametrize("policy", ["keep_decoder_swa", "suffix_only", "cached_hidden",
                                    "encoder_replay"])
def test_a_failure_inside_the_model_restores_the_cache(model, policy, monkeypatch):
    """A call that fails half-way (here the decoder raises after the encoder has already
    appended to the cache) is undone; the next call then matches a cache that never saw it."""
    engine = InferenceEngine(model)
    ids = random_ids(2, 24, 2)
    cache = engine.prefill(ids[:, :16]).cache
    reference = engine.prefill(ids[:, :16]).cache
    prefix_cache = policy == "encoder_replay"
    if prefix_cache:
        cache, reference = cache.as_prefix_cache(), reference.as_prefix_cache()
    before = fingerprint(cache)
    real = model.run_layers

    def fails_in_decoder(part, *args, **kwargs):
        if part == "decoder":
            raise RuntimeError("simulated failure (out of memory)")
        return real(part, *args, **kwargs)

    kwargs = dict(policy=policy, replay=6, encoder_replay=8 if prefix_cache else None)
    with monkeypatch.context() as patch:
        patch.setattr(model, "run_layers", fails_in_decoder)
        with pytest.raises(RuntimeError, match="simulated failure"):
            engine.extend(ids[:, 16:19], cache, **kwargs)
        if not prefix_cache:
            with pytest.raises(RuntimeError, match="simulated failure"):
                engine.decode(ids[:, 16], cache)
    assert_bitwise_equal(fingerprint(cache), before)
    assert torch.equal(engine.extend(ids[:, 16:19], cache, **kwargs),
                       engine.extend(ids[:, 16:19], reference, **kwargs))
    assert_bitwise_equal(fingerprint(cache), fingerprint(reference))


def test_decode_on_a_prefix_cache_stays_refused_after_a_failed_extend(model):
    engine = InferenceEngine(model)
    ids = random_ids(2, 24, 3)
    prefix = engine.prefill(ids[:, :16]).cache.as_prefix_cache()
    bad = ids[:, 16:19].clone()
    bad[0, 1] = VOCAB + 5
    with pytest.raises(ValueError, match=r"suffix_ids: token ids must lie in"):
        engine.extend(bad, prefix, policy="encoder_replay", replay=6, encoder_replay=8)
    with pytest.raises(ValueError, match=r"suffix_ids: batch size 3 does not match"):
        engine.extend(ids[:, 16:19].repeat(2, 1)[:3], prefix, policy="encoder_replay", replay=6,
                      encoder_replay=8)
    assert prefix.encoder_windows_evicted and prefix.decoder_windows_evicted
    with pytest.raises(ValueError, match=r"decode: this is a prefix cache"):
        engine.decode(ids[:, 16], prefix)


@pytest.mark.parametrize("bad,message", [
    ([1, 2], r"next_ids: expected LongTensor\[B\] with B=2; got shape list"),
    (torch.tensor([1.0, 2.0]), r"next_ids: token ids must have an integer dtype"),
    (torch.tensor([True, False]), r"next_ids: token ids must have an integer dtype"),
])
def test_decode_refuses_non_tensor_and_non_integer_ids(model, bad, message):
    engine = InferenceEngine(model)
    cache = engine.prefill(random_ids(2, 8, 4)).cache
    before = fingerprint(cache)
    with pytest.raises(ValueError, match=message):
        engine.decode(bad, cache)
    assert_bitwise_equal(fingerprint(cache), before)


@pytest.mark.parametrize("bad,message", [
    (torch.full((2, 5), 61), r"^input_ids: token ids must lie in \[0, 61\) \(ModelConfig."
                             r"vocab_size\); got values from 61 to 61$"),
    (torch.full((2, 5), -3), r"got values from -3 to -3$"),
    (torch.ones(2, 5), r"^input_ids: token ids must have an integer dtype"),
])
def test_the_parallel_forward_refuses_bad_ids_in_one_line(model, bad, message):
    """The forward that training and every evaluation call checks ids as the engine does,
    instead of failing deep in the embedding with an IndexError."""
    with pytest.raises(ValueError, match=message):
        model(bad)


def test_generate_refuses_bad_ids_before_any_work(model):
    with pytest.raises(ValueError, match=r"input_ids: token ids must lie in \[0, 61\)"):
        InferenceEngine(model).generate(torch.full((1, 4), 99), max_new_tokens=2)
