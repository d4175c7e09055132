"""The path ablation of docs/semantics.md 4.6 (invariant 8 of section 6): a ced model read
without its decoder's global read (`decoder_global_read = False`, the evaluation override
`decoder_global=off`). On random float64 models across many seeds and shapes: the engine and
the parallel forward agree under it (invariants 1, 3 and 4 hold, TOL = 1e-10); the output no
longer depends on the decoder source's weights (TOL) but still depends on the encoder's global
reads and differs from the model as trained (each by at least 1e-6, so the tests would fail if
the override did nothing or removed too much)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ced import CEDModel, exact_replay_length
from ced.checkpoint import evaluation_overrides, load_model, save_model
from conftest import TOL, configs, engine_logits, make_model, random_ids, tiny_config

SETTINGS = settings(max_examples=60, deadline=None)
DIFFERENT = 1e-6


def ablated(model: CEDModel) -> CEDModel:
    """The same weights, read without the decoder's global read."""
    cfg = dataclasses.replace(model.cfg, decoder_global_read=False)
    out = CEDModel(cfg).double().eval()
    out.load_state_dict(model.state_dict())
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def perturb(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


@SETTINGS
@given(cfg=configs(variants=("ced",)), seed=st.integers(0, 10_000),
       prompt_len=st.integers(1, 40), extra=st.integers(0, 4), replay=st.integers(1, 45))
def test_engine_equals_parallel_forward_without_the_decoder_global_read(
        cfg, seed, prompt_len, extra, replay):
    """Invariants 1, 3 and 4 under the ablation: full prefill, exact and bounded replay."""
    model = ablated(make_model(cfg, seed))
    ids = random_ids(2, prompt_len + extra, seed)
    full = model(ids)[:, prompt_len - 1:]
    assert max_diff(engine_logits(model, ids, prompt_len), full) < TOL
    assert max_diff(engine_logits(model, ids, prompt_len, replay="exact"), full) < TOL
    truncated = model(ids, decoder_replay_start=max(prompt_len - replay, 0))[:, prompt_len - 1:]
    assert max_diff(engine_logits(model, ids, prompt_len, replay=replay), truncated) < TOL


@SETTINGS
@given(cfg=configs(variants=("ced",)), seed=st.integers(0, 10_000),
       length=st.integers(1, 40), replay=st.integers(1, 45))
def test_the_decoder_source_is_read_by_nobody(cfg, seed, length, replay):
    """Perturbing the decoder source's projections changes nothing under the ablation, with
    or without a bounded replay."""
    model = ablated(make_model(cfg, seed))
    ids = random_ids(2, length, seed)
    start = max(length - replay, 0)
    before = (model(ids), model(ids, decoder_replay_start=start))
    perturb(model.sources[model.plan.decoder_source.index], seed)
    after = (model(ids), model(ids, decoder_replay_start=start))
    assert max(max_diff(a, b) for a, b in zip(before, after)) < TOL


@pytest.mark.parametrize("topk", [None, 2])
def test_the_ablation_removes_the_decoder_read_only(topk):
    """As trained, the decoder source matters; ablated, the encoder's global reads still do,
    and the output differs from the model as trained (on every seed tried)."""
    cfg = tiny_config(topk=topk, window=3, n_encoder_layers=3, global_from_layer=1,
                      encoder_kv_groups=1, n_decoder_layers=2)
    for seed in range(5):
        trained = make_model(cfg, seed)
        ids = random_ids(2, 30, seed)
        cut = ablated(trained)
        assert max_diff(trained(ids), cut(ids)) > DIFFERENT
        encoder_source = next(s.index for s in cut.plan.sources if s.part == "encoder")
        before = cut(ids)
        perturb(cut.sources[encoder_source], seed)
        assert max_diff(before, cut(ids)) > DIFFERENT
        before = trained(ids)
        perturb(trained.sources[trained.plan.decoder_source.index], seed)
        assert max_diff(before, trained(ids)) > DIFFERENT


def test_bounded_replay_still_cuts_the_window_chain_under_the_ablation():
    """Without the global read, a bounded replay below R_exact loses what only the cut chain
    carried (invariant 6 under the ablation): it must differ from the full ablated read."""
    cfg = tiny_config(window=3, n_decoder_layers=3)
    for seed in range(4):
        model = ablated(make_model(cfg, seed))
        ids = random_ids(2, 40, seed)
        n = exact_replay_length(cfg) - 2
        assert max_diff(model(ids)[:, -1], model(ids, decoder_replay_start=40 - n)[:, -1]) \
            > DIFFERENT


def test_the_override_loads_a_checkpoint_without_the_read(tmp_path):
    cfg = tiny_config(topk=2)
    model = make_model(cfg, 0)
    directory = save_model(model, tmp_path / "final")
    ids = random_ids(2, 24, 0)
    off = load_model(directory, decoder_global="off").double()
    assert off.cfg.decoder_global_read is False
    as_saved = load_model(directory).double()       # the weights as the file holds them
    assert max_diff(off(ids), ablated(as_saved)(ids)) < TOL
    for as_trained in (None, "", "on", "ON", "none"):
        assert load_model(directory, decoder_global=as_trained).cfg.decoder_global_read


def test_bad_values_name_the_key():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="decoder_global: one of"):
        evaluation_overrides(cfg, decoder_global="of")
    for variant in ("yoco", "dense", "swa"):
        with pytest.raises(ValueError, match=f"decoder_global=off: only for variant 'ced'.*"
                                             f"'{variant}'"):
            evaluation_overrides(tiny_config(variant), decoder_global="off")
        with pytest.raises(ValueError, match="ModelConfig.decoder_global_read"):
            tiny_config(variant, decoder_global_read=False)
    with pytest.raises(ValueError, match="ModelConfig.decoder_global_read"):
        tiny_config(decoder_global_read="off")


# ---- the global cut (CEDModel.forward(decoder_global_start=s)), the complement of a replay ---

def noisy_decoder_source_inputs(model: CEDModel, before: int, seed: int, start: int = 0):
    """A hook that adds noise to RMSNorm(H_{L_e}) at positions start .. before - 1: what feeds
    the decoder's global entries there, and nothing else."""
    gen = torch.Generator().manual_seed(seed + 7)

    def hook(module, args, output):
        noise = torch.randn(output.shape, generator=gen, dtype=output.dtype)
        noise[:, before:] = 0
        noise[:, :start] = 0
        return output + noise
    return model.encoder_output_norm.register_forward_hook(hook)


@SETTINGS
@given(cfg=configs(variants=("ced", "yoco")), seed=st.integers(0, 10_000),
       length=st.integers(2, 40), cut=st.integers(1, 45), replay=st.booleans())
def test_the_global_cut_removes_the_entries_before_it_and_nothing_else(
        cfg, seed, length, cut, replay):
    """With the cut at s: positions before s are as in the full forward; after it, nothing
    fed into the decoder's global entries before s matters where the window chain cannot
    carry it either (a replay cut at the same s, or W = 1: then only the encoder carries what
    lies before s; with the chain whole, the decoder states before s read those entries and
    pass them on, which is the path the cut keeps)."""
    model = make_model(cfg, seed)
    ids = random_ids(2, length, seed)
    s = min(cut, length - 1)
    replay_start = s if replay else None
    cut_out = model(ids, decoder_replay_start=replay_start, decoder_global_start=s)
    full = model(ids, decoder_replay_start=replay_start)
    assert max_diff(cut_out[:, :s], full[:, :s]) < TOL
    if not (replay or cfg.window == 1):
        return
    handle = noisy_decoder_source_inputs(model, s, seed)
    try:
        noisy = model(ids, decoder_replay_start=replay_start, decoder_global_start=s)
    finally:
        handle.remove()
    assert max_diff(noisy[:, s:], cut_out[:, s:]) < TOL


@pytest.mark.parametrize("variant,topk", [("ced", None), ("ced", 2), ("yoco", None)])
def test_the_global_cut_does_cut(variant, topk):
    """Without the cut the same noise reaches the positions after s (the test above would
    pass on a cut that removed nothing otherwise); the cut at 0 is no cut."""
    cfg = tiny_config(variant, topk=topk, window=3)
    for seed in range(4):
        model = make_model(cfg, seed)
        ids = random_ids(2, 30, seed)
        full = model(ids)
        assert max_diff(model(ids, decoder_global_start=0), full) < TOL
        assert max_diff(model(ids, decoder_global_start=12), full) > DIFFERENT
        both = model(ids, decoder_replay_start=12, decoder_global_start=12)
        global_cut = model(ids, decoder_global_start=12)
        handle = noisy_decoder_source_inputs(model, 12, seed)
        try:
            assert max_diff(model(ids)[:, 12:], full[:, 12:]) > DIFFERENT
            if variant == "ced":   # the chain carries the noise past the global cut
                assert max_diff(model(ids, decoder_global_start=12)[:, 12:],
                                global_cut[:, 12:]) > DIFFERENT
            assert max_diff(model(ids, decoder_replay_start=12, decoder_global_start=12)[:, 12:],
                            both[:, 12:]) < TOL
        finally:
            handle.remove()


@pytest.mark.parametrize("ratio,cut", [(1, 11), (2, 11), (2, 12), (3, 10), (3, 13)])
@pytest.mark.parametrize("variant", ["ced", "yoco"])
def test_the_global_cut_keeps_the_entries_from_it_on(variant, ratio, cut):
    """The first entry that begins at or after s, ceil(s / m), stays readable (with the
    replay cut at the same s, nothing else carries its tokens): noise on its m positions
    alone changes every later output; noise on the entry that straddles s changes none."""
    cfg = tiny_config(variant, window=max(3, ratio), decoder_compress_ratio=ratio
                      if variant == "ced" else 1)
    ratio = cfg.decoder_compress_ratio
    first = -(-cut // ratio) * ratio                   # where the first kept entry begins
    for seed in range(3):
        model = make_model(cfg, seed)
        ids = random_ids(2, 30, seed)
        both = model(ids, decoder_replay_start=cut, decoder_global_start=cut)
        handle = noisy_decoder_source_inputs(model, first + ratio, seed, start=first)
        try:
            noisy = model(ids, decoder_replay_start=cut, decoder_global_start=cut)
        finally:
            handle.remove()
        complete = first + ratio - 1                   # the first query the entry is complete for
        assert max_diff(noisy[:, complete:], both[:, complete:]) > DIFFERENT
        assert max_diff(noisy[:, :complete], both[:, :complete]) < TOL
        if first > cut:                                # an entry straddles s: removed whole
            handle = noisy_decoder_source_inputs(model, first, seed, start=first - ratio)
            try:
                straddling = model(ids, decoder_replay_start=cut, decoder_global_start=cut)
            finally:
                handle.remove()
            assert max_diff(straddling[:, cut:], both[:, cut:]) < TOL


def test_the_global_cut_needs_a_decoder():
    with pytest.raises(ValueError, match=r"decoder_global_start: variant 'dense' has no decoder"):
        make_model(tiny_config("dense"), 0)(random_ids(1, 8, 0), decoder_global_start=3)


def test_the_ablated_decoder_trains_its_encoders_indexer_only():
    """With the read removed the decoder's indexer picks nothing; the indexer KL (aux output,
    as training asks for it) covers the encoder's reads and stays finite."""
    cfg = tiny_config(topk=2, decoder_global_read=False)
    model = make_model(cfg, 0)
    logits, aux = model(random_ids(2, 24, 0), return_aux=True)
    assert torch.isfinite(aux["indexer_kl"]) and torch.isfinite(logits).all()
