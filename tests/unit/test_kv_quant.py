"""KV precision: the fake quantisers of ced/quant.py against references built from
each format's bit fields, the storage points in the model (engine == parallel forward with
the same stored values), unsupported formats, and the straight-through estimator.
docs/semantics.md section 3.6."""

from __future__ import annotations

import itertools

import pytest
import torch

from ced import InferenceEngine, ModelConfig
from ced.quant import (E2M1, E4M3, KVStorage, quantise_scaled, round_to_grid,
                       storage_quantiser)
from ced.storage import parse_storage
from conftest import TOL, engine_logits, make_model, random_ids, tiny_config

FORMATS = ["bf16", "fp16", "fp32", "fp8", "fp8_e4m3_block8", "fp4_block16", "fp4_block32", "fp4"]


# ---- references written from the bit fields -------------------------------------------------

def decode_fields(exponent_bits: int, mantissa_bits: int, bias: int, nan_codes=()):
    """Every finite number of a sign/exponent/mantissa format, as (value, mantissa field),
    from its definition: exponent field 0 is subnormal, (m / 2^M) * 2^(1 - bias); otherwise
    (1 + m / 2^M) * 2^(e - bias). Codes listed in nan_codes ((e, m) pairs) are not numbers."""
    codes = []
    for sign, e, m in itertools.product((1.0, -1.0), range(2 ** exponent_bits),
                                        range(2 ** mantissa_bits)):
        if (e, m) in nan_codes:
            continue
        fraction = m / 2 ** mantissa_bits
        value = fraction * 2.0 ** (1 - bias) if e == 0 else (1 + fraction) * 2.0 ** (e - bias)
        codes.append((sign * value, m))
    return codes


# E4M3 (OCP "fn"): bias 7, no infinities, S.1111.111 is NaN, so the largest number is 448.
E4M3_CODES = decode_fields(4, 3, 7, nan_codes={(15, 7)})
E2M1_CODES = decode_fields(2, 1, 1)
REFERENCES = {"e4m3": (E4M3, E4M3_CODES), "e2m1": (E2M1, E2M1_CODES)}


def reference_round(x: torch.Tensor, codes) -> torch.Tensor:
    """Nearest code point by brute force; a tie goes to the even mantissa field; beyond the
    largest magnitude, the largest (saturation)."""
    values = torch.tensor([v for v, _ in codes], dtype=torch.float64)
    odd = torch.tensor([m % 2 for _, m in codes], dtype=torch.float64)
    top = values.abs().max()
    clipped = x.clamp(-top, top)
    distance = (clipped[:, None] - values[None, :]).abs()
    best = distance.min(-1, keepdim=True).values
    # Among the nearest, prefer an even mantissa field, then (for +-0) the sign of x.
    rank = torch.where(distance == best, odd[None, :], torch.inf)
    return values[rank.argmin(-1)].abs().copysign(x)


def test_code_point_tables_match_the_formats():
    magnitudes = sorted({abs(v) for v, _ in E2M1_CODES})
    assert magnitudes == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e4m3 = sorted({abs(v) for v, _ in E4M3_CODES})
    assert len(e4m3) == 127 and e4m3[1] == 2.0 ** -9 and e4m3[-1] == 448.0


@pytest.mark.parametrize("name", ["e4m3", "e2m1"])
def test_every_code_point_times_a_power_of_two_round_trips(name):
    grid, codes = REFERENCES[name]
    values = torch.tensor([v for v, _ in codes], dtype=torch.float64)
    assert torch.equal(round_to_grid(values, grid), values)
    assert torch.equal(round_to_grid(values, grid, up=True), values)
    # In a row whose amax is the format's maximum times 2^k, the scale is exactly 2^k.
    for power in (-9, -3, 0, 5, 8):
        row = torch.cat((values, values.new_tensor([grid.max_value]))) * 2.0 ** power
        assert torch.equal(quantise_scaled(row, grid, None), row), power
        blocks = row[:(len(row) // 16) * 16].view(-1, 16)
        blocks = torch.cat((blocks, blocks.new_full((blocks.shape[0], 1),
                                                    grid.max_value * 2.0 ** power)), -1)
        assert torch.equal(quantise_scaled(blocks, grid, 17), blocks), power


@pytest.mark.parametrize("name", ["e4m3", "e2m1"])
def test_random_values_round_to_the_nearest_code_point(name):
    grid, codes = REFERENCES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-12, 10, (20_000,), generator=gen).double())
    assert torch.equal(round_to_grid(x, grid), reference_round(x, codes))


@pytest.mark.parametrize("name", ["e4m3", "e2m1"])
def test_ties_go_to_the_even_mantissa(name):
    grid, codes = REFERENCES[name]
    values = sorted({v for v, _ in codes})
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(values, values[1:])],
                             dtype=torch.float64)
    expected = reference_round(midpoints, codes)
    assert torch.equal(round_to_grid(midpoints, grid), expected)
    # Spot checks written out: 2.5 lies between 2 (m=0) and 3 (m=1); 1.75 between 1.5 and 2.
    if name == "e2m1":
        got = round_to_grid(torch.tensor([2.5, 1.75, 5.0, 0.25, -0.75]), grid)
        assert got.tolist() == [2.0, 2.0, 4.0, 0.0, -1.0]


@pytest.mark.parametrize("name", ["e4m3", "e2m1"])
def test_saturation_and_signed_zero(name):
    grid, _ = REFERENCES[name]
    big = torch.tensor([grid.max_value * 1.01, 1e30, -1e30, grid.max_value * 1.5])
    assert round_to_grid(big, grid).abs().eq(grid.max_value).all()
    assert round_to_grid(big, grid, up=True).abs().eq(grid.max_value).all()
    zero = round_to_grid(torch.tensor([0.0, -0.0]), grid)
    assert zero.eq(0).all() and not zero.isnan().any()


def test_e4m3_agrees_with_torch_float8_where_in_range():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch has no float8_e4m3fn")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 50
    assert torch.equal(round_to_grid(x, E4M3), x.to(torch.float8_e4m3fn).float())


def test_block_scale_is_e4m3_rounded_up_so_nothing_overflows():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=gen, dtype=torch.float64) * 3
    got = quantise_scaled(x, E2M1, 16)
    scales = x.view(64, 2, 16).abs().amax(-1) / 6
    e4m3 = torch.tensor(sorted({abs(v) for v, _ in E4M3_CODES}), dtype=torch.float64)
    ref_scale = e4m3[torch.searchsorted(e4m3, scales)]            # smallest code >= amax / 6
    ref = reference_round((x.view(64, 2, 16) / ref_scale[..., None]).flatten(), E2M1_CODES)
    ref = ref.view(64, 2, 16) * ref_scale[..., None]
    assert torch.equal(got, ref.view(64, 32))
    assert (got.view(64, 2, 16).abs() <= 6 * ref_scale[..., None]).all()


def test_zero_rows_and_blocks_stay_zero_and_finite():
    x = torch.zeros(3, 2, 32, dtype=torch.float64)
    x[1, 0, 16:] = torch.linspace(-1, 1, 16)       # one block of a row zero, the other not
    for name in FORMATS:
        got = storage_quantiser(name, "window_kv_dtype")(x)
        assert got.isfinite().all(), name
        assert got[0].eq(0).all() and got[1, 0, :16].eq(0).all() and got[2].eq(0).all(), name


def test_partial_last_block_and_casts():
    x = torch.randn(5, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q = storage_quantiser("fp4_block16", "global_kv_dtype")(x)
    assert torch.equal(q[:, 16:], quantise_scaled(x[:, 16:], E2M1, 16))
    assert torch.equal(storage_quantiser("bf16", "k")(x), x.to(torch.bfloat16).double())
    x32 = x.float()
    assert storage_quantiser("fp32", "k")(x32) is x32       # the format holds it: no op
    assert storage_quantiser("fp64", "k")(x32) is x32
    assert storage_quantiser(None, "k") is None


# ---- the storage points: engine and parallel forward read the same stored values ------------

def quantised_config(variant: str, fmt: str, **overrides) -> ModelConfig:
    return tiny_config(variant, window_kv_dtype=fmt, global_kv_dtype=fmt,
                       indexer_key_dtype=fmt, **overrides)


@pytest.mark.parametrize("variant", ["yoco", "ced"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_equals_parallel_forward_with_quantised_storage(variant, fmt):
    cfg = quantised_config(variant, fmt, topk=2, decoder_reindex_every=1)
    model = make_model(cfg, 5)
    ids = random_ids(2, 24, 5)
    parallel = model(ids)[:, 11:]
    assert (engine_logits(model, ids, 12) - parallel).abs().max() < TOL
    assert (engine_logits(model, ids, 12, replay="exact") - parallel).abs().max() < TOL
    truncated = model(ids, decoder_replay_start=12 - 3)[:, 11:]
    assert (engine_logits(model, ids, 12, replay=3) - truncated).abs().max() < TOL


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4_block16"])
def test_each_storage_point_changes_the_output(fmt):
    """Each main-KV key alone moves the logits (the storage point is wired); None stays
    exactly the unquantised model. (Indexer keys only move the selection: see the next test.)"""
    ids = random_ids(2, 16, 6)
    plain = make_model(tiny_config("ced", topk=2), 6)(ids)
    for key in ("window_kv_dtype", "global_kv_dtype"):
        got = make_model(tiny_config("ced", topk=2, **{key: fmt}), 6)(ids)
        assert (got - plain).abs().max() > 1e-6, key
    model = make_model(tiny_config("ced", topk=2), 6)
    keys = model.sources[0].storage.index_keys
    assert keys is None and torch.equal(model(ids), plain)


def test_indexer_keys_are_stored_quantised():
    cfg = tiny_config("ced", topk=2, indexer_key_dtype="fp4_block32", indexer_dim=8)
    model = make_model(cfg, 7)
    engine = InferenceEngine(model)
    cache = engine.prefill(random_ids(1, 20, 7)).cache
    grid = cache.state.sources[0].index_keys
    assert torch.equal(model.sources[0].storage.index_keys(grid), grid)   # already on the grid
    scales = grid.abs().amax(-1, keepdim=True) / 6
    assert torch.equal(round_to_grid(scales, E4M3), scales)   # amax is 6 x an E4M3 scale


# ---- formats the model cannot store; the cost model still prices them ------------------------

@pytest.mark.parametrize("key", ["window_kv_dtype", "global_kv_dtype", "indexer_key_dtype"])
@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_e5m2_block32", "bf16_block16"])
def test_unsupported_format_is_a_value_error_naming_the_key(key, fmt):
    cfg = tiny_config("ced", topk=2, **{key: fmt})     # the cost model accepts it
    parse_storage(fmt)
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{key}: CEDModel does not implement "
                                         rf"storage format '{fmt}'"):
        make_model(cfg, 0)


def test_unknown_format_and_bad_flag_fail_at_the_config():
    with pytest.raises(ValueError, match=r"^ModelConfig\.window_kv_dtype: "):
        tiny_config(window_kv_dtype="fp5")
    with pytest.raises(ValueError, match=r"^ModelConfig\.kv_quant_aware: must be true or false"):
        tiny_config(kv_quant_aware="yes")
    with pytest.raises(ValueError, match=r"^ModelConfig\.global_kv_dtype: "):
        storage_quantiser("fp5", "global_kv_dtype")


# ---- gradients: straight-through with kv_quant_aware, torch's own without ---------------------

@pytest.mark.parametrize("fmt", ["fp8", "fp4_block16", "bf16"])
def test_straight_through_gradient_is_the_identity(fmt):
    x = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    weight = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ste = storage_quantiser(fmt, "window_kv_dtype", straight_through=True)
    plain = storage_quantiser(fmt, "window_kv_dtype")
    leaf = x.clone().requires_grad_()
    out = ste(leaf)
    assert torch.equal(out.detach(), plain(x))               # forward: the stored values
    (out * weight).sum().backward()
    assert torch.equal(leaf.grad, weight)                    # backward: identity
    if fmt != "bf16":   # without STE, rounding has zero gradient: only the amax elements get any
        leaf = x.clone().requires_grad_()
        (plain(leaf) * weight).sum().backward()
        assert (leaf.grad != 0).sum() <= x.numel() // 16 * 2


def test_quant_aware_model_has_the_same_forward_and_trains():
    ids = random_ids(2, 16, 10)
    plain = make_model(quantised_config("ced", "fp4_block16", topk=2), 10).train()
    aware = make_model(quantised_config("ced", "fp4_block16", topk=2, kv_quant_aware=True),
                       10).train()
    assert torch.equal(plain(ids), aware(ids))
    aware(ids).logsumexp(-1).mean().backward()
    grad = aware.blocks[0].attn.qkv.weight.grad
    assert grad is not None and grad.isfinite().all() and grad.abs().max() > 0
    assert all(p.grad is None or p.grad.isfinite().all() for p in aware.parameters())
    assert KVStorage.from_config(aware.cfg).window.straight_through


def test_kv_override_names_fields_and_rejects_bad_parts_by_name():
    from ced.quant import parse_kv_override
    assert parse_kv_override("window:fp8, global:fp4_block16,indexer:fp4_block32") == {
        "window_kv_dtype": "fp8", "global_kv_dtype": "fp4_block16",
        "indexer_key_dtype": "fp4_block32"}
    assert parse_kv_override("global:bf16") == {"global_kv_dtype": "bf16"}
    for bad, fragment in (("globl:fp8", "POINT:FORMAT"), ("window", "POINT:FORMAT"),
                          ("window:", "POINT:FORMAT"), ("", "empty"),
                          ("global:fp8_e5m2", "global_kv_dtype"), ("window:fp5", "window_kv")):
        with pytest.raises(ValueError, match=fragment):
            parse_kv_override(bad)
