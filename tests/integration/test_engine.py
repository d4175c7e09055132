"""The engine's public behaviour beyond the equivalence invariants: clear errors for impossible
requests, greedy generation, cache accounting; and the training-mode forward (indexer KL)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ced import CEDModel, InferenceEngine
from conftest import TOL, make_model, random_ids, tiny_config


@pytest.fixture
def ced_model():
    return make_model(tiny_config(topk=3, encoder_compress_ratio=3, window=4), 0)


def test_replay_errors(ced_model):
    engine = InferenceEngine(ced_model)
    ids = random_ids(2, 10, 0)
    with pytest.raises(ValueError, match=r"replay: must be >= 1"):
        engine.prefill(ids, replay=0)
    with pytest.raises(ValueError, match=r"replay: expected None, 'exact' or an int"):
        engine.prefill(ids, replay="all")
    dense = InferenceEngine(make_model(tiny_config("dense"), 0))
    with pytest.raises(ValueError, match=r"replay: variant 'dense' has no decoder"):
        dense.prefill(ids, replay=4)
    with pytest.raises(ValueError, match=r"decoder_replay_start: variant 'swa' has no decoder"):
        make_model(tiny_config("swa"), 0)(ids, decoder_replay_start=3)


def test_length_and_cache_errors(ced_model):
    engine = InferenceEngine(ced_model)
    too_long = torch.zeros(1, ced_model.cfg.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids: the sequence would reach 257 tokens, over "
                                         r"ModelConfig.max_seq_len=256"):
        engine.prefill(too_long)
    with pytest.raises(ValueError, match=r"input_ids: length 257 exceeds"):
        ced_model(too_long)
    with pytest.raises(ValueError, match=r"decode: the cache is empty"):
        engine.decode(torch.zeros(2, dtype=torch.long), engine.new_cache(2))
    with pytest.raises(ValueError, match=r"input_ids: expected a LongTensor \[B, T\] with T >= 1"):
        engine.prefill(torch.zeros(2, 0, dtype=torch.long))
    cache = engine.prefill(random_ids(2, 10, 0)).cache
    with pytest.raises(ValueError, match=r"next_ids: expected LongTensor\[B\] with B=2"):
        engine.decode(torch.zeros(3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"decode: this is a prefix cache"):
        engine.decode(torch.zeros(2, dtype=torch.long), cache.as_prefix_cache())


def test_extend_errors(ced_model):
    engine = InferenceEngine(ced_model, hidden_tail=2)
    ids = random_ids(2, 30, 1)
    cache = engine.prefill(ids[:, :26]).cache
    suffix = ids[:, 26:28]
    with pytest.raises(ValueError, match=r"policy: must be one of"):
        engine.extend(suffix, cache, policy="magic")
    with pytest.raises(ValueError, match=r"policy 'keep_decoder_swa': this prefix cache dropped"):
        engine.extend(suffix, cache.as_prefix_cache(), encoder_replay=12)
    with pytest.raises(ValueError, match=r"encoder_replay: the cache's encoder windows were "
                                         r"evicted"):
        engine.extend(suffix, cache.as_prefix_cache(), policy="suffix_only")
    with pytest.raises(ValueError, match=r"encoder_replay: the encoder windows of this cache are "
                                         r"intact"):
        engine.extend(suffix, cache, encoder_replay=4)
    with pytest.raises(ValueError, match=r"policy 'cached_hidden': needs H_\(L_e\) of 6 cached "
                                         r"positions, the cache holds 2"):
        engine.extend(suffix, cache.as_prefix_cache(), policy="cached_hidden", replay=8,
                      encoder_replay=12)
    # P = 26 with ratio 3: the incomplete block starts at 24, so N_e must be >= 2.
    with pytest.raises(ValueError, match=r"encoder_replay: must reach back to position 24"):
        engine.extend(suffix, cache.as_prefix_cache(), policy="suffix_only", encoder_replay=1)
    engine.extend(suffix, cache.as_prefix_cache(), policy="suffix_only", encoder_replay=2)


def test_prefix_cache_is_a_copy(ced_model):
    """Extending a prefix cache must not change the live cache it was taken from."""
    engine = InferenceEngine(ced_model)
    ids = random_ids(2, 30, 2)
    cache = engine.prefill(ids[:, :20]).cache
    before = cache.nbytes()
    prefix = cache.as_prefix_cache(keep_decoder_windows=True)
    engine.extend(ids[:, 20:25], prefix, encoder_replay=10)
    assert cache.nbytes() == before and cache.length == 20
    assert (engine.decode(ids[:, 20], cache) - ced_model(ids[:, :21])[:, -1]).abs().max() < TOL


@pytest.mark.parametrize("replay", [None, 3, "exact"])
def test_generate_is_greedy_on_the_engine_path(ced_model, replay):
    engine = InferenceEngine(ced_model)
    prompt = random_ids(2, 12, 3)
    generated = engine.generate(prompt, max_new_tokens=6, replay=replay)
    assert generated.shape == (2, 6)
    start = None if replay is None else 12 - (3 if replay == 3 else 12)
    sequence = prompt
    for step in range(6):   # teacher-force the generated tokens through the parallel oracle
        logits = ced_model(sequence, decoder_replay_start=start)[:, -1]
        assert torch.equal(logits.argmax(-1), generated[:, step])
        sequence = torch.cat((sequence, generated[:, step:step + 1]), 1)
    eos = int(generated[0, 1])
    stopped = engine.generate(prompt, max_new_tokens=6, replay=replay, eos_id=eos)
    first = int((stopped[0] == eos).nonzero()[0])
    assert bool((stopped[0, first:] == eos).all())


def test_cache_bytes_match_the_layout():
    """swa after a prompt longer than the window: each layer keeps exactly W - 1 positions;
    ced additionally keeps every complete global entry and the incomplete block's tokens."""
    cfg = tiny_config("swa", window=4)
    engine = InferenceEngine(make_model(cfg, 0))
    cache = engine.prefill(random_ids(2, 20, 0)).cache
    per_layer = 2 * 2 * cfg.n_heads * (cfg.window - 1) * cfg.head_dim * 8   # K,V x B x ... x f64
    assert cache.nbytes()["window_kv"] == cfg.n_layers * per_layer
    assert cache.nbytes()["global_kv"] == 0

    cfg = tiny_config("ced", window=4, topk=2, encoder_compress_ratio=3)
    engine = InferenceEngine(make_model(cfg, 0), hidden_tail=0)
    cache = engine.prefill(random_ids(2, 20, 0), replay=2).cache
    n_groups = cfg.encoder_kv_groups
    entries = n_groups * (20 // 3) + 20          # encoder sources at ratio 3, decoder at ratio 1
    assert cache.nbytes()["global_kv"] == 2 * 2 * entries * cfg.d_model * 8
    assert cache.nbytes()["indexer_keys"] == 2 * entries * cfg.indexer_dim * 8
    pending = n_groups * (20 % 3) * 2 * (2 * cfg.d_model + cfg.n_heads) * 8
    assert cache.nbytes()["pending_blocks"] == pending
    # decoder windows hold only the 2 replayed positions; encoder windows W - 1 = 3
    window_positions = cfg.n_encoder_layers * 3 + cfg.n_decoder_layers * 2
    assert cache.nbytes()["window_kv"] == window_positions * 2 * 2 * cfg.d_model * 8


# ---- training-mode forward -------------------------------------------------------------------

def _indexer_params(model: CEDModel) -> set[str]:
    return {name for name, _ in model.named_parameters() if "index" in name}


def test_indexer_kl_trains_only_the_indexer():
    model = make_model(tiny_config(topk=2, decoder_reindex_every=1), 0).train()
    ids = random_ids(2, 30, 0)
    logits, aux = model(ids, decoder_replay_start=torch.tensor([[5, 20], [0, 12]]),
                        return_aux=True)
    kl = aux["indexer_kl"]
    assert torch.isfinite(kl) and kl.item() > 0
    indexer = _indexer_params(model)
    assert indexer
    kl_grads = torch.autograd.grad(kl, list(model.parameters()), allow_unused=True,
                                   retain_graph=True)
    for (name, _), grad in zip(model.named_parameters(), kl_grads):
        touched = grad is not None and grad.abs().sum() > 0
        assert touched == (name in indexer), name
    lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                              ids[:, 1:].reshape(-1))
    lm_grads = torch.autograd.grad(lm_loss, list(model.parameters()), allow_unused=True)
    for (name, _), grad in zip(model.named_parameters(), lm_grads):
        touched = grad is not None and grad.abs().sum() > 0
        if name in indexer:
            assert not touched, name   # selection is not differentiable
        elif "gate" not in name:
            assert touched, name


def test_dense_warmup_reads_everything_and_trains_the_indexer():
    cfg = tiny_config(topk=2)
    model = make_model(cfg, 0)
    dense = make_model(replace(cfg, topk=None), 0)
    dense.load_state_dict(model.state_dict(), strict=False)
    ids = random_ids(2, 25, 0)
    logits, aux = model(ids, dense_global_read=True, return_aux=True)
    assert (logits - dense(ids)).abs().max() < TOL
    assert torch.isfinite(aux["indexer_kl"]) and aux["indexer_kl"].item() > 0
    assert (model(ids) - dense(ids)).abs().max() > 1e-6


def test_no_indexer_means_zero_kl_and_no_indexer_parameters():
    model = make_model(tiny_config(topk=None), 0)
    _, aux = model(random_ids(1, 10, 0), return_aux=True)
    assert aux["indexer_kl"].item() == 0 and not _indexer_params(model)


def test_engine_refuses_a_training_model_with_dropout():
    model = CEDModel(tiny_config(dropout=0.1)).train()
    with pytest.raises(ValueError, match=r"call model.eval\(\) first"):
        InferenceEngine(model).prefill(random_ids(1, 5, 0))


def test_model_refuses_a_config_with_unmodelled_parts():
    """The paper-scale config prices MoE/mHC/latent parts that CEDModel does not build; building
    it would silently drop them."""
    from omegaconf import OmegaConf

    from ced import ModelConfig
    from conftest import ROOT_CONF
    cfg = ModelConfig.from_dict(OmegaConf.to_container(
        OmegaConf.load(ROOT_CONF / "model" / "deepseek_v41_flash.yaml")))
    with pytest.raises(ValueError, match=r"ModelConfig.unmodelled: describes parts"):
        CEDModel(replace(cfg, d_model=64, n_heads=2, vocab_size=300, indexer_heads=2,
                         indexer_dim=8))
