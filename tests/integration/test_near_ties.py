"""Exactness under near-ties. Where the same indexer score arises twice (a
repeated token with a window of 1, a repeated substring longer than the receptive field), the
parallel forward and the engine compute it with different kernels and the last bits differ.
`ced.semantics.select_entries` rounds the scores (`round_scores`) before the top-k, so both paths
choose the same entries and the exact modes stay exact on prompts full of repeats (every
exactness invariant in test_invariants.py now runs on such prompts, see conftest.random_ids)."""

from __future__ import annotations

import pytest
import torch

import ced.model as model_module
import ced.semantics as semantics_module
from ced.model import IndexerQuery
from ced.semantics import round_scores, select_entries
from conftest import TOL, engine_logits, make_model, random_ids, tiny_config

CASES = [(topk, seed) for topk in (1, 2, 3) for seed in range(4)]


def window_one_model(topk: int, seed: int):
    """W = 1 and ratio 1: an entry is a function of its token's path alone, so a repeated token
    gives global entries that are equal in exact arithmetic: ties at every repeat."""
    cfg = tiny_config(window=1, topk=topk, encoder_compress_ratio=1, decoder_compress_ratio=1,
                      n_encoder_layers=2, global_from_layer=1, encoder_kv_groups=1)
    return make_model(cfg, seed)


def paths_disagree(topk: int, seed: int) -> float:
    model = window_one_model(topk, seed)
    ids = random_ids(2, 24, seed)
    full = (engine_logits(model, ids, 16) - model(ids)[:, 15:]).abs().max().item()
    bounded = (engine_logits(model, ids, 16, replay=3)
               - model(ids, decoder_replay_start=13)[:, 15:]).abs().max().item()
    return max(full, bounded)


@pytest.mark.parametrize("topk,seed", CASES)
def test_near_ties_break_alike_in_the_engine_and_the_parallel_forward(topk, seed):
    assert paths_disagree(topk, seed) < TOL


def test_without_rounding_these_prompts_do_break_exactness(monkeypatch):
    """The cases above are real near-ties: with the rounding made a no-op (more bits than a
    float64 mantissa) most of them break exactness, as they did before the rounding."""
    monkeypatch.setitem(semantics_module.SCORE_BITS, torch.float64, 64)
    broken = sum(paths_disagree(topk, seed) > TOL for topk, seed in CASES)
    assert broken >= len(CASES) // 2, broken


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rounded_scores_do_not_depend_on_how_many_queries_or_rows_share_the_call(dtype):
    """Batch invariance: the same (query, key) gets the same rounded score whether its query is
    scored alone, in a block of queries, or in a batch of rows (the raw scores need not)."""
    torch.manual_seed(0)
    cfg = tiny_config(topk=4, indexer_heads=3, indexer_dim=8, d_model=32)
    indexer = IndexerQuery(cfg).to(dtype)
    x = torch.randn(3, 37, cfg.d_model, dtype=dtype)
    keys = torch.randn(3, 29, cfg.indexer_dim, dtype=dtype)
    visible = torch.ones(1, keys.shape[1], dtype=torch.bool)
    with torch.no_grad():
        together = round_scores(indexer.scores(x, keys), visible)
        for b in range(3):
            row = round_scores(indexer.scores(x[b:b + 1], keys[b:b + 1]), visible)
            assert torch.equal(row, together[b:b + 1])
            for c in range(0, 37, 5):
                alone = round_scores(indexer.scores(x[b:b + 1, c:c + 1], keys[b:b + 1]), visible)
                assert torch.equal(alone, together[b:b + 1, c:c + 1])


def test_rounding_keeps_clear_orders_and_makes_near_ties_exact_ties():
    """Scores that differ by more than the grid keep their order; scores within a few ulps of
    each other become one value, and the lower entry index wins among them."""
    base = torch.tensor([3.0, 1.0, 2.0, 1.0 + 1e-15, 3.0 - 2e-15, 0.5, -0.0, 0.0],
                        dtype=torch.float64)
    scores = base[None, None]
    index, valid = select_entries(scores, torch.tensor([8]), 8)
    assert index[0, 0].tolist() == [0, 4, 2, 1, 3, 5, 6, 7]
    rounded = round_scores(scores, torch.ones(1, 8, dtype=torch.bool))[0, 0]
    assert rounded[0] == rounded[4] and rounded[1] == rounded[3]
    assert rounded[2] == 2.0 and rounded[5] == 0.5
    # invisible entries neither set the grid nor get picked
    big = torch.tensor([[[1.0, 1.5, 1e30]]], dtype=torch.float64)
    index, valid = select_entries(big, torch.tensor([2]), 3)
    assert index[0, 0, :2].tolist() == [1, 0] and valid[0, 0].tolist() == [True, True, False]


def test_the_indexer_kl_still_sees_unrounded_scores():
    """Only the choice uses rounded scores; the KL loss and its gradient use the indexer's own."""
    model = make_model(tiny_config(topk=2, decoder_reindex_every=1), 0).train()
    ids = random_ids(2, 30, 0)
    selections = []
    real = model_module.Attention._select

    def spy(self, *args, **kwargs):
        selections.append(real(self, *args, **kwargs))
        return selections[-1]

    model_module.Attention._select = spy
    try:
        _, aux = model(ids, return_aux=True)
    finally:
        model_module.Attention._select = real
    picked = torch.cat([s.scores.flatten() for s in selections if s.scores is not None])
    assert picked.requires_grad and torch.isfinite(aux["indexer_kl"])
    on_grid = round_scores(picked[None, None], torch.ones(1, picked.numel(), dtype=torch.bool))
    assert not torch.equal(on_grid[0, 0], picked.detach())
