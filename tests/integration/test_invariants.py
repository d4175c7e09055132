"""The invariants of docs/semantics.md section 6, on random weights and inputs across many
seeds, shapes and schedules; the prompts are full of repeated tokens and substrings (conftest's
random_ids), the inputs that produce top-k near-ties. Equalities hold to TOL = 1e-10 in float64
(the two sides differ only in summation order); inequalities require a difference of at least
1e-6."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ced import InferenceEngine, exact_encoder_replay_length, exact_replay_length
from conftest import TOL, configs, engine_logits, make_model, random_ids, tiny_config

SETTINGS = settings(max_examples=150, deadline=None)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- 1. incremental prefill(full) + decode == parallel forward, every variant ---------------

@SETTINGS
@given(cfg=configs(), seed=st.integers(0, 10_000), prompt_len=st.integers(1, 30),
       extra=st.integers(0, 5), batch=st.integers(1, 2))
def test_incremental_equals_parallel(cfg, seed, prompt_len, extra, batch):
    model = make_model(cfg, seed)
    ids = random_ids(batch, prompt_len + extra, seed)
    parallel = model(ids)[:, prompt_len - 1:]
    assert max_diff(engine_logits(model, ids, prompt_len), parallel) < TOL


# ---- 2. yoco: early exit with any N >= 1 is exact -----------------------------------------

@SETTINGS
@given(cfg=configs(variants=("yoco",)), seed=st.integers(0, 10_000),
       prompt_len=st.integers(1, 30), extra=st.integers(0, 4), replay=st.integers(1, 35))
def test_yoco_early_exit_is_exact(cfg, seed, prompt_len, extra, replay):
    model = make_model(cfg, seed)
    ids = random_ids(2, prompt_len + extra, seed)
    parallel = model(ids)[:, prompt_len - 1:]
    assert exact_replay_length(cfg) == 1
    assert max_diff(engine_logits(model, ids, prompt_len, replay=replay), parallel) < TOL


# ---- 3. ced with N >= R_exact is exact -------------------------------------------------------

@SETTINGS
@given(cfg=configs(variants=("ced",)), seed=st.integers(0, 10_000),
       prompt_len=st.integers(1, 40), extra=st.integers(0, 4), surplus=st.integers(0, 3))
def test_ced_exact_replay_is_exact(cfg, seed, prompt_len, extra, surplus):
    model = make_model(cfg, seed)
    ids = random_ids(2, prompt_len + extra, seed)
    parallel = model(ids)[:, prompt_len - 1:]
    n_exact = exact_replay_length(cfg) + surplus
    for replay in ("exact", n_exact):
        assert max_diff(engine_logits(model, ids, prompt_len, replay=replay), parallel) < TOL


# ---- 4. ced with any N == parallel forward with decoder windows truncated at T - N ----------

@SETTINGS
@given(cfg=configs(variants=("ced", "yoco")), seed=st.integers(0, 10_000),
       prompt_len=st.integers(1, 40), extra=st.integers(0, 5), replay=st.integers(1, 45),
       batch=st.integers(1, 2))
def test_bounded_replay_equals_truncated_parallel(cfg, seed, prompt_len, extra, replay, batch):
    model = make_model(cfg, seed)
    ids = random_ids(batch, prompt_len + extra, seed)
    start = max(prompt_len - replay, 0)        # N > T is clipped to T
    parallel = model(ids, decoder_replay_start=start)[:, prompt_len - 1:]
    assert max_diff(engine_logits(model, ids, prompt_len, replay=replay), parallel) < TOL


@pytest.mark.parametrize("prompt_len,replay,window,ratio", [
    (1, 1, 3, 1),    # T = 1
    (5, 9, 3, 2),    # T < N: clipped, must equal the full forward
    (17, 4, 1, 1),   # W = 1: the window is the query alone
    (23, 6, 4, 3),   # m does not divide T
    (24, 5, 4, 3),   # m divides T
])
def test_bounded_replay_edge_cases(prompt_len, replay, window, ratio):
    cfg = tiny_config(window=window, encoder_compress_ratio=ratio,
                      decoder_compress_ratio=min(ratio, window), topk=2)
    for seed in range(5):
        model = make_model(cfg, seed)
        ids = random_ids(2, prompt_len + 3, seed)
        start = max(prompt_len - replay, 0)
        parallel = model(ids, decoder_replay_start=start)[:, prompt_len - 1:]
        assert max_diff(engine_logits(model, ids, prompt_len, replay=replay), parallel) < TOL
        if replay >= prompt_len or window == 1 and replay >= 1:
            # Nothing was cut: T <= N, or W = 1 windows never reach back.
            full = model(ids)[:, prompt_len - 1:]
            assert max_diff(parallel, full) < TOL


def test_replay_start_per_row_and_batch_independence():
    """Row b of a batch with per-row starts equals that row run alone (engine and parallel)."""
    cfg = tiny_config(topk=3)
    model = make_model(cfg, 3)
    ids = random_ids(3, 30, 3)
    starts = torch.tensor([0, 11, 25])
    batched = model(ids, decoder_replay_start=starts)
    for row in range(3):
        alone = model(ids[row:row + 1], decoder_replay_start=int(starts[row]))
        assert max_diff(batched[row:row + 1], alone) < TOL
    engine_batched = engine_logits(model, ids, 26, replay=7)
    for row in range(3):
        assert max_diff(engine_batched[row:row + 1],
                        engine_logits(model, ids[row:row + 1], 26, replay=7)) < TOL


# ---- 5. top-k covering every visible entry == dense read; smaller k changes the output ------

def _with_topk(cfg, topk, dense_model):
    """The dense model's weights in a model with `topk` (plus its own random indexer)."""
    from dataclasses import replace
    sparse = make_model(replace(cfg, topk=topk), 1234)
    missing, unexpected = sparse.load_state_dict(dense_model.state_dict(), strict=False)
    assert not unexpected and all("index" in name for name in missing)
    return sparse


@SETTINGS
@given(cfg=configs(variants=("ced", "yoco")), seed=st.integers(0, 10_000),
       length=st.integers(1, 30))
def test_topk_covering_all_entries_equals_dense_read(cfg, seed, length):
    from dataclasses import replace
    dense_cfg = replace(cfg, topk=None)
    dense = make_model(dense_cfg, seed)
    ids = random_ids(2, length, seed)
    sparse = _with_topk(dense_cfg, length, dense)   # k >= any visible count
    assert max_diff(sparse(ids), dense(ids)) < TOL
    start = max(length - 3, 0)
    assert max_diff(engine_logits(sparse, ids, length, replay=3),
                    dense(ids, decoder_replay_start=start)[:, length - 1:]) < TOL


@pytest.mark.parametrize("variant", ["ced", "yoco"])
def test_smaller_topk_changes_the_output(variant):
    cfg = tiny_config(variant, decoder_compress_ratio=1)
    for seed in range(5):
        dense = make_model(cfg, seed)
        ids = random_ids(2, 40, seed)
        sparse = _with_topk(cfg, 2, dense)
        reference = dense(ids)
        # Queries that see at most k entries read everything either way; later ones must differ.
        assert max_diff(sparse(ids)[:, :1], reference[:, :1]) < TOL
        assert max_diff(sparse(ids)[:, 20:], reference[:, 20:]) > 1e-6


def test_topk_one_and_ties_match_between_engine_and_parallel():
    """topk = 1, and an indexer whose scores are all exactly 0 (every entry ties): the lower
    index must win identically in both paths, so the read is the first visible entry."""
    cfg = tiny_config(topk=1, decoder_reindex_every=1)
    for seed in range(5):
        model = make_model(cfg, seed)
        ids = random_ids(2, 25, seed)
        for replay in (3, None):
            start = 0 if replay is None else 20 - replay
            parallel = model(ids, decoder_replay_start=start)[:, 19:]
            assert max_diff(engine_logits(model, ids, 20, replay=replay), parallel) < TOL
        with torch.no_grad():
            for block in model.blocks:
                if block.attn.indexer is not None:
                    block.attn.indexer.q.weight.zero_()
        parallel = model(ids, decoder_replay_start=14)[:, 19:]
        assert max_diff(engine_logits(model, ids, 20, replay=6), parallel) < TOL


# ---- 6. bounded replay with N < R_exact is not the full forward on long prompts -------------

@pytest.mark.parametrize("seed", range(8))
def test_bounded_replay_is_not_silently_exact(seed):
    cfg = tiny_config(window=3, n_decoder_layers=2, topk=4)
    r_exact = exact_replay_length(cfg)                      # 2 * (3 - 1) + 1 = 5
    model = make_model(cfg, seed)
    ids = random_ids(2, 30, seed)
    full = model(ids)[:, 24:]
    for replay in range(1, r_exact):
        approx = engine_logits(model, ids, 25, replay=replay)
        assert max_diff(approx[:, 0], full[:, 0]) > 1e-6, f"replay={replay} was exact"
    assert max_diff(engine_logits(model, ids, 25, replay=r_exact), full) < TOL


# ---- 7. encoder replay at a prefix-cache hit, and the multi-turn policies -------------------

def _conversation(cfg, seed, prefix_len=26, suffix_len=3, batch=2):
    model = make_model(cfg, seed)
    ids = random_ids(batch, prefix_len + suffix_len + 3, seed)
    return model, ids, prefix_len, suffix_len


@pytest.mark.parametrize("seed", range(3))
def test_exact_encoder_replay_at_prefix_hit_is_exact(seed):
    """Invariant 7: N_e >= L_e (W - 1) + 1 makes the suffix's encoder exact; with
    cached_hidden (exact stored H_{L_e}) and N >= R_exact the whole step is exact."""
    cfg = tiny_config(topk=3, encoder_compress_ratio=3, window=4)
    model, ids, p, m = _conversation(cfg, seed)
    engine = InferenceEngine(model)
    prefix = engine.prefill(ids[:, :p], replay=5).cache.as_prefix_cache()
    logits = [engine.extend(ids[:, p:p + m], prefix, policy="cached_hidden", replay="exact",
                            encoder_replay="exact")]
    logits += [engine.decode(ids[:, t], prefix) for t in range(p + m, ids.shape[1])]
    full = model(ids)[:, p + m - 1:]
    assert exact_encoder_replay_length(cfg) == 3 * 3 + 1
    assert max_diff(torch.stack(logits, 1), full) < TOL


@pytest.mark.parametrize("seed", range(3))
def test_encoder_replay_policy_needs_the_decoder_segment_covered(seed):
    """The encoder_replay policy feeds the decoder H_{L_e} of prefix positions from the encoder
    replay itself, so exactness needs N_e >= L_e (W - 1) + (N - m), not just L_e (W - 1) + 1:
    exact at that bound, not exact one below it."""
    cfg = tiny_config(topk=3, encoder_compress_ratio=3, window=4)
    model, ids, p, m = _conversation(cfg, seed)
    engine = InferenceEngine(model)
    n_replay = exact_replay_length(cfg)
    needed = cfg.n_encoder_layers * (cfg.window - 1) + n_replay - m
    full = model(ids)[:, p + m - 1]
    for n_enc, exact in ((needed, True), (needed - 1, False)):
        prefix = engine.prefill(ids[:, :p]).cache.as_prefix_cache()
        got = engine.extend(ids[:, p:p + m], prefix, policy="encoder_replay", replay=n_replay,
                            encoder_replay=n_enc)
        assert (max_diff(got, full) < TOL) == exact, n_enc


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_replay", ["exact", 3, 9])
def test_exact_encoder_replay_under_the_encoder_replay_policy_is_exact(seed, n_replay):
    """encoder_replay='exact' promises an exact step under every policy: under
    `encoder_replay`, whose decoder reads the encoder replay's own outputs at N - m prefix
    positions, that is L_e (W - 1) + max(N - m, 1), not the encoder's L_e (W - 1) + 1 (with
    which the suite's `policy=encoder_replay,replay=exact` once changed answers)."""
    cfg = tiny_config(topk=3, encoder_compress_ratio=2, window=4)
    model, ids, p, m = _conversation(cfg, seed)
    engine = InferenceEngine(model)
    n = exact_replay_length(cfg) if n_replay == "exact" else n_replay
    want = model(ids[:, :p + m], decoder_replay_start=p + m - n)[:, -1]
    prefix = engine.prefill(ids[:, :p]).cache.as_prefix_cache()
    got = engine.extend(ids[:, p:p + m], prefix, policy="encoder_replay", replay=n_replay,
                        encoder_replay="exact")
    assert max_diff(got, want) < TOL
    if n > m + 1:      # the encoder's own bound is too short here: not exact
        prefix = engine.prefill(ids[:, :p]).cache.as_prefix_cache()
        short = engine.extend(ids[:, p:p + m], prefix, policy="encoder_replay",
                              replay=n_replay, encoder_replay=exact_encoder_replay_length(cfg))
        assert max_diff(short, want) > 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_bounded_encoder_replay_is_not_silently_exact(seed):
    cfg = tiny_config(topk=3, encoder_compress_ratio=2, window=4)
    model, ids, p, m = _conversation(cfg, seed)
    engine = InferenceEngine(model)
    prefix = engine.prefill(ids[:, :p]).cache.as_prefix_cache()
    approx = engine.extend(ids[:, p:p + m], prefix, policy="encoder_replay", replay="exact",
                           encoder_replay=4)
    assert max_diff(approx, model(ids)[:, p + m - 1]) > 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_policies_equal_their_truncated_parallel_forward(seed):
    """With an encoder replay long enough to make every H_{L_e} the decoder reads exact, each
    policy's decoder is a bounded replay whose start the parallel forward can express: suffix_only truncates at the prefix end; cached_hidden and
    encoder_replay at end - N; keep_decoder_swa continues the previous turn's truncation."""
    cfg = tiny_config(topk=3, window=4, n_decoder_layers=2)
    model, ids, p, m = _conversation(cfg, seed, prefix_len=20, suffix_len=3)
    end, n_replay, first_replay = p + m, 6, 5
    n_encoder_replay = cfg.n_encoder_layers * (cfg.window - 1) + n_replay
    engine = InferenceEngine(model)

    def prefix_cache(keep_decoder=False):
        cache = engine.prefill(ids[:, :p], replay=first_replay).cache
        return cache.as_prefix_cache(keep_decoder_windows=keep_decoder)

    expected = {
        "suffix_only": torch.tensor([[p]] * 2),
        "cached_hidden": torch.tensor([[end - n_replay]] * 2),
        "encoder_replay": torch.tensor([[end - n_replay]] * 2),
        # two starts: the first turn's, then none (the decoder windows carried on)
        "keep_decoder_swa": torch.tensor([[p - first_replay]] * 2),
    }
    for policy, starts in expected.items():
        cache = prefix_cache(keep_decoder=policy == "keep_decoder_swa")
        got = engine.extend(ids[:, p:end], cache, policy=policy, replay=n_replay,
                            encoder_replay=n_encoder_replay)
        want = model(ids[:, :end], decoder_replay_start=starts)[:, -1]
        assert max_diff(got, want) < TOL, policy


def test_live_multi_turn_with_two_replay_starts():
    """prefill with replay N0, then a long new turn with bounded replay N1 < m: the parallel
    forward with two starts per row (docs/semantics.md 4.4: truncate at the latest start
    <= i) must agree."""
    cfg = tiny_config(topk=2, window=3)
    for seed in range(4):
        model = make_model(cfg, seed)
        ids = random_ids(2, 40, seed)
        engine = InferenceEngine(model)
        cache = engine.prefill(ids[:, :18], replay=4).cache
        got = [engine.extend(ids[:, 18:30], cache, policy="keep_decoder_swa", replay=5)]
        got += [engine.decode(ids[:, t], cache) for t in range(30, 40)]
        starts = torch.tensor([[14, 25]] * 2)
        want = model(ids, decoder_replay_start=starts)[:, 29:]
        assert max_diff(torch.stack(got, 1), want) < TOL


def test_live_cache_extend_without_replay_equals_full_forward():
    for variant in ("dense", "swa", "yoco", "ced"):
        cfg = tiny_config(variant, topk=3)
        model = make_model(cfg, 0)
        ids = random_ids(2, 30, 0)
        engine = InferenceEngine(model)
        cache = engine.prefill(ids[:, :10]).cache
        first = engine.extend(ids[:, 10:17], cache)
        second = engine.extend(ids[:, 17:30], cache)
        full = model(ids)
        assert max_diff(first, full[:, 16]) < TOL and max_diff(second, full[:, 29]) < TOL
