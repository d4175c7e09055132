"""Global KV entries with fewer K/V heads than query heads (ModelConfig.global_kv_heads).

The defining property: a model with G K/V heads per entry computes exactly what the multi-head
model computes when that model's source projections hold each K/V head's weights once for
every query head that reads it (query head i reads K/V head i // (H / G)). Checked in float64
to 1e-10 on the parallel forward, its gradients, and every read form (dense, top-k gathered,
top-k masked, the fused and the reference kernel); the engine's incremental path is covered by
the property tests (tests/conftest.py `configs` draws global_kv_heads)."""

from __future__ import annotations

import pytest
import torch

from ced import CEDModel, InferenceEngine, ModelConfig
from ced.cost import engine_cache_bytes, model_params
from ced.attention import attention_kernel
from tests.conftest import engine_logits, make_model, random_ids, tiny_config

TOL = 1e-10


def replicated(fewer: CEDModel) -> CEDModel:
    """The multi-head model (global_kv_heads None) equal to `fewer`: every parameter copied,
    each K/V head's projection rows and gate repeated for the query heads that read it, and
    the indexer-key projection spread over the copies (divided by their number, so that the
    indexer keys of the pooled entry are unchanged)."""
    cfg = fewer.cfg
    h, g, dh = cfg.n_heads, cfg.n_global_kv_heads, cfg.head_dim
    r = h // g
    full = CEDModel(ModelConfig.from_dict({**cfg.to_dict(), "global_kv_heads": None}))
    full = full.double().eval()
    ours = dict(fewer.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            src = ours[name]
            if name.endswith(".kv.weight"):               # rows (K|V, head, Dh)
                p.copy_(src.view(2, g, 1, dh, -1).expand(2, g, r, dh, src.shape[-1])
                        .reshape(p.shape))
            elif name.endswith(".gate.weight"):           # rows per K/V head
                p.copy_(src.repeat_interleave(r, dim=0))
            elif name.endswith(".gate_bias"):             # [m, heads]
                p.copy_(src.repeat_interleave(r, dim=1))
            elif name.endswith(".index_key.weight"):      # columns (K|V, head, Dh)
                cols = src.view(-1, 2, g, 1, dh).expand(-1, 2, g, r, dh) / r
                p.copy_(cols.reshape(p.shape))
            else:
                p.copy_(src)
    return full


CASES = [  # (variant, heads, kv heads, topk, global_read, encoder ratio, decoder ratio)
    ("ced", 2, 1, None, "auto", 2, 1),
    ("ced", 2, 1, 3, "gather", 2, 1),
    ("ced", 2, 1, 3, "masked", 3, 2),
    ("ced", 4, 1, 2, "gather", 1, 1),
    ("ced", 4, 2, 3, "gather", 2, 2),
    ("ced", 4, 2, 3, "union", 2, 1),
    ("ced", 4, 2, None, "auto", 2, 1),
    ("yoco", 4, 1, 2, "masked", 2, 1),
    ("yoco", 2, 1, None, "auto", 2, 1),
]


@pytest.mark.parametrize("variant, heads, kv_heads, topk, read, enc_m, dec_m", CASES)
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_fewer_kv_heads_equal_the_multi_head_model_with_repeated_heads(
        variant, heads, kv_heads, topk, read, enc_m, dec_m, kernel):
    for seed in range(3):
        cfg = tiny_config(variant, n_heads=heads, d_model=8 * heads, global_kv_heads=kv_heads,
                          topk=topk, global_read=read, encoder_compress_ratio=enc_m,
                          decoder_compress_ratio=dec_m, window=4, attention_block=5,
                          attention_sink=bool(seed % 2))
        fewer = make_model(cfg, seed)
        full = replicated(fewer)
        ids = random_ids(2, 23, seed)
        docs = torch.tensor([[0, 9], [0, 0]])
        with attention_kernel(kernel):
            out_f, aux_f = fewer(ids, return_aux=True, document_starts=docs)
            out_m, aux_m = full(ids, return_aux=True, document_starts=docs)
            torch.testing.assert_close(out_f, out_m, rtol=0, atol=TOL)
            torch.testing.assert_close(aux_f["indexer_kl"], aux_m["indexer_kl"], rtol=0,
                                       atol=TOL)
            # the gradients of every parameter the two models share in shape
            (out_f.square().mean() + aux_f["indexer_kl"]).backward()
            (out_m.square().mean() + aux_m["indexer_kl"]).backward()
        repeated = dict(full.named_parameters())
        for name, p in fewer.named_parameters():
            torch.testing.assert_close(p.grad, folded_grad(name, repeated[name].grad, cfg),
                                       rtol=0, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def folded_grad(name: str, grad, cfg):
    """The multi-head model's gradient of `name` as the G-head model's: the gradients of a
    K/V head's copies summed (the index-key columns were divided by the copies: / r again)."""
    h, g, dh = cfg.n_heads, cfg.n_global_kv_heads, cfg.head_dim
    r = h // g
    if name.endswith(".kv.weight"):
        return grad.view(2, g, r, dh, -1).sum(2).reshape(2 * g * dh, -1)
    if name.endswith(".gate.weight"):
        return grad.view(g, r, -1).sum(1)
    if name.endswith(".gate_bias"):
        return grad.view(grad.shape[0], g, r).sum(-1)
    if name.endswith(".index_key.weight"):
        return grad.view(grad.shape[0], 2, g, r, dh).sum(3).reshape(grad.shape[0], -1) / r
    return grad


@pytest.mark.parametrize("heads, kv_heads, topk, read", [(4, 2, 3, "auto"), (4, 1, None, "auto"),
                                                      (2, 1, 2, "auto"), (4, 2, 3, "union")])
def test_the_engine_equals_the_parallel_forward_with_fewer_kv_heads(heads, kv_heads, topk,
                                                                    read):
    """Prefill (full, bounded and exact replay) and decode steps against the parallel
    forward, with G K/V heads (the property tests draw only 1 or 2 query heads), and with the
    union read of a block's picks in both."""
    for seed in range(2):
        cfg = tiny_config("ced", n_heads=heads, d_model=8 * heads, global_kv_heads=kv_heads,
                          topk=topk, window=4, attention_block=5, global_read=read)
        model = make_model(cfg, seed)
        ids = random_ids(2, 30, seed)
        parallel = model(ids)
        for replay, start in ((None, None), ("exact", None), (3, 20 - 3)):
            got = engine_logits(model, ids, 20, replay=replay)
            if start is None:
                want = parallel[:, 19:]
            else:      # bounded replay N: the parallel forward with decoder replay start T - N
                want = model(ids, decoder_replay_start=start)[:, 19:]
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_a_multi_query_source_stores_one_head_and_the_cost_model_prices_it():
    cfg = tiny_config("ced", n_heads=4, d_model=32, global_kv_heads=1, topk=3)
    multi = tiny_config("ced", n_heads=4, d_model=32, topk=3)
    model = make_model(cfg, 0)
    cache = InferenceEngine(model).prefill(random_ids(2, 17, 0)).cache
    for source in cache.state.sources:
        assert source.k.shape[:2] == (2, 1) and source.v.shape[:2] == (2, 1)
    got = cache.nbytes()
    assert got == engine_cache_bytes(cfg, 17, batch=2, dtype="fp64")
    # a quarter of the multi-head model's global KV, the rest of the cache unchanged
    full = engine_cache_bytes(multi, 17, batch=2, dtype="fp64")
    assert 4 * got["global_kv"] == full["global_kv"]
    assert got["window_kv"] == full["window_kv"]
    assert model_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert model_params(cfg)["total"] < model_params(multi)["total"]


@pytest.mark.parametrize("value", [0, 3, -1, True, 2.0])
def test_global_kv_heads_must_divide_n_heads(value):
    with pytest.raises(ValueError, match=r"^ModelConfig.global_kv_heads: must be None or an "
                                         r"integer >= 1 that divides n_heads \(4\)"):
        tiny_config("ced", n_heads=4, d_model=32, global_kv_heads=value)
