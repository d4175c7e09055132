"""The semantic primitives against brute-force definitions: window lower bounds with replay
starts, complete-block visibility, top-k selection with its tie rule, and the attention
function's invariance to how queries are blocked."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ced import attention
from ced.attention import SourceKV, WindowKV, attend
from ced.semantics import (as_replay_starts, entry_visibility, round_scores, select_entries,
                           visible_entries, window_lower_bound)
from conftest import TOL, tiny_config

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(length=st.integers(1, 40), window=st.one_of(st.none(), st.integers(1, 10)),
       starts=st.lists(st.lists(st.integers(0, 45), min_size=1, max_size=3), min_size=1,
                       max_size=3))
def test_window_lower_bound_matches_definition(length, window, starts):
    width = max(len(row) for row in starts)
    padded = torch.tensor([row + [0] * (width - len(row)) for row in starts])
    lower = window_lower_bound(torch.arange(length), window, padded)
    for b, row in enumerate(starts):
        for i in range(length):
            latest = max([s for s in row if s <= i], default=0)
            expected = max(0 if window is None else i - window + 1, latest, 0)
            assert int(lower[b, i]) == expected


@given(length=st.integers(1, 60), ratio=st.integers(1, 5))
def test_visible_entries_are_complete_blocks(length, ratio):
    counts = visible_entries(torch.arange(length), ratio)
    for i in range(length):
        assert int(counts[i]) == sum(1 for j in range(length) if (j + 1) * ratio <= i + 1)


@SETTINGS
@given(seed=st.integers(0, 10_000), n_queries=st.integers(1, 6), n_entries=st.integers(1, 12),
       k=st.integers(1, 14), levels=st.integers(1, 4))
def test_select_entries_top_k_lower_index_wins_ties(seed, n_queries, n_entries, k, levels):
    """Scores drawn from a few levels (many exact ties, including -0.0 against +0.0) must give
    exactly the sorted((-score, index)) choice among visible entries."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-levels, levels + 1, (2, n_queries, n_entries), generator=gen).double()
    scores = torch.where(torch.rand(scores.shape, generator=gen) < 0.3, -0.0 * scores.abs(),
                         scores)
    n_visible = torch.randint(0, n_entries + 1, (n_queries,), generator=gen)
    index, valid = select_entries(scores, n_visible, k)
    for b in range(2):
        for q in range(n_queries):
            visible = range(int(n_visible[q]))
            want = sorted(visible, key=lambda j: (-float(scores[b, q, j]), j))[:k]
            got = [int(index[b, q, s]) for s in range(index.shape[-1]) if valid[b, q, s]]
            assert got == want


@SETTINGS
@given(seed=st.integers(0, 10_000), n_queries=st.integers(1, 6), n_entries=st.integers(1, 40),
       k=st.integers(1, 45), dtype=st.sampled_from([torch.float32, torch.float64]),
       documents=st.booleans())
def test_select_entries_equals_a_stable_sort_of_rounded_scores(seed, n_queries, n_entries, k,
                                                               dtype, documents):
    """The int64-key top-k gives slot for slot (padding slots included) what a stable sort of
    the rounded scores gives, with a document mask and scores of any scale and sign."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** float(torch.randint(-6, 7, (), generator=gen))
    scores = (torch.randn(2, n_queries, n_entries, generator=gen) * scale).to(dtype)
    scores[..., ::3] = scores[..., :1].clone()   # exact ties
    n_visible = torch.randint(0, n_entries + 1, (n_queries,), generator=gen)
    first = (torch.randint(0, n_entries + 1, (2, n_queries), generator=gen) if documents
             else None)
    index, valid = select_entries(scores, n_visible, k, first)
    visible = entry_visibility(n_entries, n_visible, first)
    key = torch.where(visible, -(round_scores(scores, visible) + 0.0), torch.inf)
    want = torch.sort(key.expand(2, -1, -1), dim=-1, stable=True).indices[..., :min(k, n_entries)]
    assert torch.equal(index, want)


def test_as_replay_starts_forms_and_errors():
    assert as_replay_starts(None, 3, "x") is None
    assert as_replay_starts(4, 3, "x").tolist() == [[4], [4], [4]]
    assert as_replay_starts(torch.tensor([1, 2]), 2, "x").tolist() == [[1], [2]]
    assert as_replay_starts(torch.tensor([[1, 5]]), 1, "x").tolist() == [[1, 5]]
    with pytest.raises(ValueError, match="decoder_replay_start: replay starts must be >= 0"):
        as_replay_starts(-1, 2, "decoder_replay_start")
    with pytest.raises(ValueError, match="decoder_replay_start: tensor must have shape"):
        as_replay_starts(torch.tensor([1, 2, 3]), 2, "decoder_replay_start")
    with pytest.raises(ValueError, match="decoder_replay_start: expected None"):
        as_replay_starts(1.5, 2, "decoder_replay_start")
    with pytest.raises(ValueError, match="integer-valued"):
        as_replay_starts(torch.tensor([1.0]), 1, "decoder_replay_start")


def _random_sources(seed: int, length: int, ratio: int):
    gen = torch.Generator().manual_seed(seed)
    cfg = tiny_config()
    h, dh = cfg.n_heads, cfg.head_dim
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    n_entries = length // ratio
    source = SourceKV(rnd(2, h, n_entries, dh), rnd(2, h, n_entries, dh), None,
                      rnd(2, 0, 2 * cfg.d_model), rnd(2, 0, h), ratio)
    positions = torch.arange(length)
    window = WindowKV(rnd(2, h, length, dh), rnd(2, h, length, dh), positions)
    return rnd(2, h, length, dh), positions, window, source, rnd(h)


@SETTINGS
@given(seed=st.integers(0, 10_000), length=st.integers(1, 30), window=st.integers(1, 8),
       ratio=st.integers(1, 3), block=st.integers(1, 9), start=st.integers(0, 30))
def test_attend_is_independent_of_query_blocking(seed, length, window, ratio, block, start):
    q, positions, keys, source, sink = _random_sources(seed, length, ratio)
    lower = window_lower_bound(positions, window, as_replay_starts(start, 2, "s"))
    one_block, _ = attend(q, positions, lower, keys, source, None, sink, block=10_000)
    blocked, _ = attend(q, positions, lower, keys, source, None, sink, block=block)
    assert (one_block - blocked).abs().max() < TOL


def test_attend_sink_only_enters_the_denominator():
    """A sink of -inf is no sink; a finite sink scales every output row by the mass it takes."""
    q, positions, keys, source, _ = _random_sources(0, 12, 2)
    lower = window_lower_bound(positions, 4, None)
    plain, _ = attend(q, positions, lower, keys, source, None, None, block=5)
    minus_inf, _ = attend(q, positions, lower, keys, source, None,
                          torch.full((2,), -torch.inf, dtype=torch.float64), block=5)
    assert (plain - minus_inf).abs().max() < TOL
    sunk, _ = attend(q, positions, lower, keys, source, None, torch.zeros(2, dtype=torch.float64),
                     block=5)
    ratio = sunk / plain
    # Same factor for every channel of a (head, query) row, and strictly below one.
    assert (ratio - ratio[..., :1]).abs().max() < 1e-8
    assert bool((ratio[..., 0] < 1).all()) and bool((ratio[..., 0] > 0).all())


def test_attend_with_a_brute_force_reference():
    """One query's output against the softmax written out by hand from docs/semantics.md 2."""
    q, positions, keys, source, sink = _random_sources(1, 15, 2)
    starts = as_replay_starts(torch.tensor([0, 9]), 2, "s")
    lower = window_lower_bound(positions, 4, starts)
    out, _ = attend(q, positions, lower, keys, source, None, sink, block=4)
    scale = q.shape[-1] ** -0.5
    for b in range(2):
        for h in range(q.shape[1]):
            for i in range(15):
                window = [p for p in range(15) if max(i - 3, 0 if b == 0 or i < 9 else 9) <= p <= i]
                entries = [j for j in range(source.n_entries) if (j + 1) * 2 <= i + 1]
                logits = [float(q[b, h, i] @ keys.k[b, h, p]) * scale for p in window]
                logits += [float(q[b, h, i] @ source.k[b, h, j]) * scale for j in entries]
                logits.append(float(sink[h]))
                weights = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                values = [keys.v[b, h, p] for p in window] + [source.v[b, h, j] for j in entries]
                expected = sum(w * v for w, v in zip(weights[:-1], values))
                assert (out[b, h, i] - expected).abs().max() < TOL


def test_attend_gradients_through_the_sparse_read():
    """gradcheck (float64, finite differences) through the top-k gather and its custom
    backward, with padding slots and a replay start in play."""
    from ced.attention import Selection
    q, positions, keys, source, sink = _random_sources(2, 9, 2)
    scores = torch.randn(2, 9, source.n_entries, dtype=torch.float64)
    index, valid = select_entries(scores, visible_entries(positions, 2), 2)
    lower = window_lower_bound(positions, 3, as_replay_starts(4, 2, "s"))

    def run(q, wk, wv, gk, gv):
        window = WindowKV(wk, wv, positions)
        src = SourceKV(gk, gv, None, source.pending_tokens, source.pending_gates, 2)
        return attend(q, positions, lower, window, src, Selection(index, valid, None), sink,
                      block=4)[0]

    inputs = [t.clone().requires_grad_() for t in (q, keys.k, keys.v, source.k, source.v)]
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 48), topk=st.integers(1, 7),
       window=st.integers(1, 6), ratio=st.integers(1, 3), block=st.sampled_from([1, 5, 128]),
       sink=st.booleans(), starts=st.lists(st.integers(0, 50), min_size=1, max_size=2))
def test_masked_and_gathered_topk_reads_agree(seed, length, topk, window, ratio, block, sink,
                                              starts):
    """The three executions of a top-k read (ModelConfig.global_read: gathered, masked over
    every visible entry, masked over the union of a block's picks, where it is small enough
    and in every block) are one semantics: logits, the indexer KL and every gradient agree in
    float64 to TOL, with replay starts, padding slots (fewer visible entries than k), blocks
    and compression ratios that do not divide T."""
    from conftest import make_model
    window = max(window, ratio)
    results = []
    for mode, union_share in (("gather", None), ("masked", None), ("union", None),
                              ("union", 1.0)):
        cfg = tiny_config("ced", topk=topk, window=window, encoder_compress_ratio=ratio,
                          decoder_compress_ratio=ratio, attention_block=block,
                          attention_sink=sink, decoder_reindex_every=1, global_read=mode)
        model = make_model(cfg, seed % 97)
        ids = torch.randint(0, cfg.vocab_size, (2, length),
                            generator=torch.Generator().manual_seed(seed))
        with mock.patch.object(attention, "UNION_READ_MAX_SHARE",
                               union_share or attention.UNION_READ_MAX_SHARE):
            logits, aux = model(ids, decoder_replay_start=torch.tensor([starts[0], starts[-1]]),
                                return_aux=True)
            (logits.square().mean() + aux["indexer_kl"]).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logits, aux["indexer_kl"], grads))
    la, ka, ga = results[0]
    for lb, kb, gb in results[1:]:
        assert torch.allclose(la, lb, rtol=0, atol=TOL)
        assert torch.allclose(ka, kb, rtol=0, atol=TOL)
        assert len(ga) == len(gb)
        for a, b in zip(ga, gb):
            assert torch.allclose(a, b, rtol=0, atol=TOL)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 40), topk=st.integers(1, 7),
       ratio=st.integers(1, 3), block=st.sampled_from([1, 5, 128]),
       starts=st.lists(st.integers(0, 45), min_size=1, max_size=2))
def test_indexer_kl_from_picked_scores_equals_gathering_every_score(seed, length, topk, ratio,
                                                                     block, starts):
    """The indexer's KL reads its scores at the chosen entries only (`picked_scores`, from each
    query's k gathered keys) instead of scoring every entry with autograd and gathering: the
    same KL and the same gradient of every parameter, in float64 to TOL, with padding slots,
    replay starts and blocks."""
    from conftest import make_model
    from ced.model import IndexerQuery

    def gathered_from_all(self, x, keys, index):     # the definition: score all, then gather
        scores = self.scores(x, keys)
        if scores.shape[-1] < index.shape[-1]:
            scores = torch.nn.functional.pad(scores, (0, index.shape[-1] - scores.shape[-1]))
        return scores.gather(-1, index)

    results = []
    for picked in (IndexerQuery.picked_scores, gathered_from_all):
        cfg = tiny_config("ced", topk=topk, window=max(4, ratio), encoder_compress_ratio=ratio,
                          decoder_compress_ratio=ratio, attention_block=block,
                          decoder_reindex_every=1)
        model = make_model(cfg, seed % 97)
        ids = torch.randint(0, cfg.vocab_size, (2, length),
                            generator=torch.Generator().manual_seed(seed))
        original = IndexerQuery.picked_scores
        IndexerQuery.picked_scores = picked
        try:
            _, aux = model(ids, decoder_replay_start=torch.tensor([starts[0], starts[-1]]),
                           return_aux=True)
        finally:
            IndexerQuery.picked_scores = original
        aux["indexer_kl"].backward()
        results.append((aux["indexer_kl"].detach(), [
            p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]))
    (ka, ga), (kb, gb) = results
    assert torch.allclose(ka, kb, rtol=0, atol=TOL)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=0, atol=TOL)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 2), queries=st.integers(1, 9),
       entries=st.integers(0, 40), chunk=st.integers(1, 16),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_selection_scores_in_chunks_are_the_scores(seed, batch, queries, entries, chunk, dtype):
    """The indexer scores entries a chunk at a time (`IndexerQuery.scores`): every score is the
    one computed in one piece, to the last bits (a narrow chunk may be served by another matmul
    kernel, as a block of another width always could: `round_scores` makes such near-ties exact
    ties), and so is the gradient through them (the dense warm-up trains on these scores).
    Tolerance on the scores: 1e-6 relative in float32, 1e-14 in float64; on the gradients, sums
    over every score in another order: 1e-4 relative (1e-5 absolute) in float32, 1e-12 in
    float64."""
    from unittest import mock

    from ced.model import IndexerQuery
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    indexer = IndexerQuery(tiny_config("ced", topk=2)).to(dtype)
    x = torch.randn(batch, queries, indexer.q.in_features, generator=g, dtype=dtype)
    keys = torch.randn(batch, entries, indexer.dim, generator=g, dtype=dtype)
    weights = torch.randn(batch, queries, entries, generator=g, dtype=dtype)
    results = []
    for size in (max(entries, 1), chunk):
        indexer.zero_grad()
        with mock.patch("ced.model.SCORE_CHUNK", size):
            scores = indexer.scores(x, keys)
        (scores * weights).sum().backward()
        results.append((scores.detach(), [p.grad.clone() for p in indexer.parameters()]))
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    (whole, whole_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, whole, rtol=tol, atol=tol)
    grad_rtol, grad_atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-12, 1e-12)
    for got, want in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=grad_rtol, atol=grad_atol)


def test_global_read_choice_follows_cost():
    """auto: masked while the visible entries are few relative to the slots, gathered for a
    single query (decode) or long caches; explicit modes are obeyed."""
    from ced.config import MASKED_READ_MAX_RATIO, global_read_is_masked
    assert global_read_is_masked("auto", 128, 512, 64)
    assert global_read_is_masked("auto", 128, MASKED_READ_MAX_RATIO * 64, 64)
    assert not global_read_is_masked("auto", 128, MASKED_READ_MAX_RATIO * 64 + 1, 64)
    assert not global_read_is_masked("auto", 1, 16, 8)
    # fewer K/V heads than query heads: the gather is cheaper, the masked range shorter
    assert global_read_is_masked("auto", 128, MASKED_READ_MAX_RATIO * 64 // 4, 64, 4)
    assert not global_read_is_masked("auto", 128, MASKED_READ_MAX_RATIO * 64 // 4 + 1, 64, 4)
    assert not global_read_is_masked("auto", 128, MASKED_READ_MAX_RATIO * 64 // 2 + 1, 64, 2)
    assert global_read_is_masked("masked", 1, 10_000, 1)
    assert not global_read_is_masked("gather", 128, 8, 8)
    with pytest.raises(ValueError, match="ModelConfig.global_read"):
        tiny_config("ced", topk=2, global_read="fast")
