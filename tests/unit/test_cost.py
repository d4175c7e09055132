"""The analytic cost model (ced/cost): the paper's numbers on the paper-scale config
(docs/semantics.md section 7), the CLI, storage formats, closed-form sums against brute force,
and parameter counts against the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ced import CEDModel
from ced.config import ModelConfig
from ced.cost import (
    _sum_min,
    _sum_visible,
    _sum_visible_capped,
    active_params,
    decode_flops,
    engine_cache_bytes,
    kv_bytes_per_token,
    layer_costs,
    model_params,
    prefill_flops,
    prefill_flops_ratio,
)
from ced.cost.report import report
from ced.storage import parse_storage
from ced.train_config import model_conf
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def load(name: str) -> ModelConfig:
    return ModelConfig.from_dict(model_conf(name))


@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return load("deepseek_v41_flash")


@pytest.fixture(scope="module")
def flash_report(flash) -> dict:
    return report(flash, seq_len=131072)


# ---- 1. the paper's numbers (docs/semantics.md section 7) ----------------------------------

PER_LAYER = 374e6
EMBEDDING = 0.66e9


def test_flash_active_params_per_layer(flash):
    layers = layer_costs(flash)
    for part in ("encoder", "decoder"):
        active = [lc.active for lc in layers if lc.part == part]
        assert len(active) == 20
        assert sum(active) / 20 == pytest.approx(PER_LAYER, rel=0.01), part
    # Full / Reindex layers carry an indexer and sources: "about" 374M, not exactly.
    assert all(lc.active == pytest.approx(PER_LAYER, rel=0.05) for lc in layers)
    # Total (every expert) is far above active: the model is a MoE.
    assert all(lc.total > 10 * lc.active for lc in layers)


def test_flash_active_params_prefill_and_decode(flash):
    act = active_params(flash)
    assert act["embedding"] == pytest.approx(EMBEDDING, rel=0.01)
    assert act["lm_head"] == act["embedding"]
    # Spec: prefill 20 x 374M + 0.66B ~ 8B; decode 40 x 374M + 1.32B ~ 16B.
    assert act["early_exited_token"] == pytest.approx(20 * PER_LAYER + EMBEDDING, rel=0.01)
    assert act["decode_token"] == pytest.approx(40 * PER_LAYER + 2 * EMBEDDING, rel=0.01)
    assert round(act["early_exited_token"] / 1e9) == 8
    assert round(act["decode_token"] / 1e9) == 16
    # A replayed prefill token runs every layer but computes no logits.
    assert act["replayed_token"] == act["decode_token"] - act["lm_head"]


def test_flash_replay_lengths(flash_report):
    assert flash_report["exact_replay_length"] == 2541
    assert flash_report["paper_replay_length"] == 2560
    assert flash_report["bounded_replay_length"] == 128


def test_flash_global_kv_bytes(flash):
    kv = kv_bytes_per_token(flash)
    assert kv["entry_bytes"] == {"main": 288, "indexer_key": 68, "total": 356}
    assert kv["global_entries_per_token"] == 2.5
    assert [(s["part"], s["compress_ratio"]) for s in kv["sources"]] == \
        [("encoder", 2)] * 3 + [("decoder", 1)]
    assert kv["global_kv_bytes_per_token"] == 890
    assert isinstance(kv["global_kv_bytes_per_token"], int)


def test_flash_prefill_ratio_approaches_half(flash, flash_report):
    """Early exit with replay = W over full prefill. Every term linear in T (projections,
    window and top-k reads) gives a ratio that approaches 0.5 as T grows (the decoder's 20
    global reads against the encoder's 18 put the limit a hair under 0.5). The lightning
    indexer's scoring is quadratic in T and the decoder has 5 indexing layers on an
    uncompressed source against the encoder's 3 on ratio-2 sources, so the all-in ratio keeps
    falling below 0.5 at long T, towards 0.75 / (0.75 + 2.5) = 0.23."""
    curve = {row["T"]: row for row in flash_report["prefill_flops_ratio_vs_T"]}
    linear = [curve[t]["ratio_window_excluding_indexer"] for t in sorted(curve)]
    assert linear == sorted(linear, reverse=True)              # falls as T grows ...
    assert linear[0] > 0.51                                    # ... from above 0.5 ...
    assert all(abs(curve[t]["ratio_window_excluding_indexer"] - 0.5) < 0.005
               for t in curve if t >= 65536)                # ... to about 0.5
    ratio = flash_report["prefill_flops_ratio"]
    assert flash_report["seq_len"] == 131072
    assert 0.40 < ratio < 0.5
    assert ratio < flash_report["prefill_flops_ratio_excluding_indexer"]
    # The quadratic-indexer limit.
    assert prefill_flops_ratio(flash, 2 ** 28) == pytest.approx(0.75 / 3.25, abs=0.002)
    # Exact replay costs more than bounded replay, and the gap closes as T grows.
    assert all(curve[t]["ratio_exact"] > curve[t]["ratio_window"] for t in curve)


def test_flash_decode_flops_are_about_twice_active_params(flash):
    """Decode FLOPs = 2 x active matmul parameters + attention terms; at short context the
    parameter term dominates."""
    flops = decode_flops(flash, 1024)
    act = active_params(flash)
    assert flops.linear + flops.head == pytest.approx(2 * act["decode_token"]
                                                      - 2 * act["embedding"], rel=0.01)


# ---- 2. the CLI ---------------------------------------------------------------------------

def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ced.cost", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=True, timeout=120)


def test_cli_json(tmp_path):
    out = run_cli("model=deepseek_v41_flash", "--json", cwd=tmp_path)
    data = json.loads(out.stdout)
    for key in ("params_per_layer", "active_params_prefill", "active_params_decode",
                "exact_replay_length", "paper_replay_length", "global_kv_bytes_per_token",
                "prefill_flops_ratio"):
        assert key in data, key
    assert len(data["params_per_layer"]) == 40
    assert data["exact_replay_length"] == 2541 and data["paper_replay_length"] == 2560
    assert data["global_kv_bytes_per_token"] == 890
    assert data["seq_len"] == 131072
    assert 0.40 < data["prefill_flops_ratio"] < 0.5
    assert round(data["active_params_prefill"]["early_exited_token"] / 1e9) == 8
    assert round(data["active_params_decode"] / 1e9) == 16
    assert list(tmp_path.iterdir()) == []            # Hydra wrote no output dir or log


def test_cli_table_and_hydra_overrides(tmp_path, monkeypatch, capsys):
    """In-process (Hydra is re-entrant): the table, a Hydra override, json=true."""
    from ced.cli.cost import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ced.cost"])
    main(["model=ced", "seq_len=4096"])
    table = capsys.readouterr().out
    assert "R_exact = L_d * (W - 1) + 1 = 249" in table
    assert "T = 4096" in table and "890" not in table
    main(["model=ced", "json=true", "counting=executed"])
    data = json.loads(capsys.readouterr().out)
    assert data["counting"] == "executed" and data["config"]["d_model"] == 128
    assert list(tmp_path.iterdir()) == []


GOLDEN_TABLES = Path(__file__).with_name("golden_cost_tables.json")


@pytest.mark.parametrize("name", ["tiny", "deepseek_v41_flash", "dense", "swa", "yoco"])
def test_rendered_table_matches_the_golden_text(name):
    """The whole table, byte for byte, as it was when render/report were split into per-section
    helpers (tests/unit/golden_cost_tables.json): with and without a decoder, paper scale and
    tiny. Regenerate the file deliberately when the table is meant to change."""
    from ced.cost.report import render
    seq_len = 131072 if name == "deepseek_v41_flash" else 4096
    expected = json.loads(GOLDEN_TABLES.read_text())[name]
    assert render(report(load(name), seq_len=seq_len)) == expected


# ---- 3. storage formats -------------------------------------------------------------------

@pytest.mark.parametrize("name, values, expected", [
    ("fp4_block16", 512, 256 + 32),        # V4.1 main KV entry
    ("fp4_block32", 128, 64 + 4),          # V4.1 indexer key
    ("fp8", 512, 512),
    ("fp8_e4m3_block128", 512, 512 + 4),
    ("bf16", 512, 1024),
    ("fp32", 3, 12),
    ("float64", 3, 24),
    ("fp4", 3, 2),                         # padded to whole bytes
    ("fp4_block16", 17, 9 + 2),            # and whole blocks
])
def test_storage_bytes(name, values, expected):
    assert parse_storage(name).vector_bytes(values) == expected


@pytest.mark.parametrize("name", ["fp3", "fp4_block0", "fp4_blockx", "", "int8"])
def test_storage_rejects(name):
    with pytest.raises(ValueError, match="storage format"):
        parse_storage(name)


# ---- 4. the new config fields -------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(global_kv_dtype="fp5"), r"ModelConfig\.global_kv_dtype"),
    (dict(window_kv_dtype=16), r"ModelConfig\.window_kv_dtype"),
    (dict(unmodelled={"experts": 8}), r"ModelConfig\.unmodelled: unknown key"),
    (dict(unmodelled={"moe_ff_dim": 64}), r"ModelConfig\.unmodelled\.moe_routed_experts"),
    (dict(unmodelled={"moe_routed_experts": 4, "moe_active_experts": 5, "moe_ff_dim": 8}),
     r"ModelConfig\.unmodelled\.moe_active_experts"),
    (dict(unmodelled={"kv_latent_dim": 0}), r"ModelConfig\.unmodelled\.kv_latent_dim"),
    (dict(unmodelled={"hc_streams": True}), r"ModelConfig\.unmodelled\.hc_streams"),
    (dict(unmodelled={"engram_layers": [99], "engram_table_rows": 8, "engram_dim": 8,
                      "engram_lookups": 2}), r"ModelConfig\.unmodelled\.engram_layers"),
    (dict(unmodelled={"engram_layers": [1], "engram_table_rows": 8, "engram_dim": 9,
                      "engram_lookups": 2}), r"ModelConfig\.unmodelled\.engram_lookups"),
    (dict(unmodelled={"engram_dim": 8}), r"ModelConfig\.unmodelled\.engram_dim"),
])
def test_new_fields_validated(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        tiny_config("ced", **overrides)


def test_flash_config_round_trips(flash):
    assert ModelConfig.from_dict(flash.to_dict()) == flash
    hash(flash)
    assert flash.describes_unmodelled_parts and not tiny_config().describes_unmodelled_parts


# ---- 5. parameters: the real model, and hand-computed paper-style parts ---------------------

@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
@pytest.mark.parametrize("topk, tie, shift, kv_heads", [(None, False, 0, None), (2, True, 2, None),
                                                        (None, False, 3, None), (2, False, 0, 1),
                                                        (None, True, 0, 1)])
def test_params_match_the_model(variant, topk, tie, shift, kv_heads):
    cfg = tiny_config(variant, topk=topk, tie_embeddings=tie, decoder_reindex_every=1,
                      encoder_compress_ratio=3, window=4, shift_tokens=shift,
                      global_kv_heads=kv_heads)
    model = CEDModel(cfg)
    assert model_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    dec_src = model.plan.decoder_source
    for lc, block in zip(layer_costs(cfg), model.blocks):
        expected = sum(p.numel() for p in block.parameters())
        fed = model.source_fed_by.get(lc.index)
        if fed is not None:
            expected += sum(p.numel() for p in model.sources[fed].parameters())
        if dec_src is not None and lc.index == cfg.n_encoder_layers:   # decoder KV source
            expected += sum(p.numel() for p in model.sources[dec_src.index].parameters())
            expected += sum(p.numel() for p in model.encoder_output_norm.parameters())
        assert lc.total == lc.active == expected, lc.index


def test_unmodelled_parts_priced_by_hand():
    d, h, lat, r_q, r_o, v = 32, 4, 16, 8, 12, 50
    cfg = tiny_config("ced", d_model=d, n_heads=h, vocab_size=v, topk=3, indexer_heads=2,
                      indexer_dim=4, n_encoder_layers=3, n_decoder_layers=2,
                      global_from_layer=1, encoder_kv_groups=1, encoder_compress_ratio=2,
                      unmodelled=dict(kv_latent_dim=lat, q_lora_rank=r_q, o_lora_rank=r_o,
                                      moe_routed_experts=6, moe_active_experts=2,
                                      moe_shared_experts=1, moe_ff_dim=5, hc_streams=2,
                                      engram_layers=[0], engram_table_rows=10, engram_dim=6,
                                      engram_lookups=3, engram_conv_kernel=4))
    layers = layer_costs(cfg)
    attention = (d * r_q + r_q + r_q * h * lat) + d * lat + (h * lat * r_o + r_o * d) + h
    expert = 3 * d * 5
    hc = 2 * (2 * d * 8 + 8 + 3)
    engram_active = 6 + 6 * d * 3 + d * 4          # 6 looked-up values, W_V + 2 W_K, conv
    engram_total = 10 * 2 + 6 * d * 3 + d * 4
    c0 = layers[0].components
    assert c0["attention"].active == attention
    assert c0["ffn"].total == d * 6 + 7 * expert and c0["ffn"].active == d * 6 + 3 * expert
    assert c0["hc"].active == hc
    assert (c0["engram"].total, c0["engram"].active) == (engram_total, engram_active)
    assert "engram" not in layers[1].components
    # Layer 1 leads the encoder group (Full): indexer from the query latent, and the source.
    c1 = layers[1].components
    assert c1["indexer"].active == r_q * 2 * 4 + d * 2
    assert c1["global_source"].active == d * lat + (d * lat + 2 * lat) + lat * 4
    # The decoder source on layer 3 (ratio 1: no gate) with its RMSNorm(H_Le).
    assert layers[3].components["global_source"].active == d * lat + lat * 4 + d
    # Active per token: the embedding, encoder layers and the decoder source; decode adds the
    # decoder layers and the head.
    act = active_params(cfg)
    enc = sum(lc.active for lc in layers[:3])
    assert act["early_exited_token"] == v * d + enc + d * lat + lat * 4 + d
    assert act["decode_token"] == (act["early_exited_token"] + sum(lc.active for lc in layers[3:])
                                   - (d * lat + lat * 4 + d) + d + v * d)
    # FLOPs per token of the token-linear parts: 2 per multiply-add of every matmul weight
    # (norms, sinks, biases and looked-up Engram rows are not multiplied), plus mHC's stream
    # mixes and Engram's gating dots. Full layers (with an indexer): 1 (encoder) and 3.
    attn_w = d * r_q + r_q * h * lat + d * lat + h * lat * r_o + r_o * d
    ffn_w = d * 6 + 3 * expert
    index_w = r_q * 2 * 4 + d * 2
    hc_f = 2 * (2 * (2 * d) * 8 + 2 * (2 * d) + 2 * (2 * d) + 2 * 4 * d)
    engram_f = 2 * (6 * d * 3) + 2 * (d * 4) + 2 * d * 2
    f = prefill_flops(cfg, 1, None, "causal")
    assert f.linear == 5 * (2 * (attn_w + ffn_w) + hc_f) + 2 * 2 * index_w + engram_f
    assert f.head == 2 * d * v


# ---- 6. FLOP counting: closed forms against brute force --------------------------------------

def test_closed_form_sums():
    for m in (1, 2, 3, 5):
        for a in range(0, 12):
            for b in range(a, 30):
                assert _sum_visible(a, b, m) == sum((i + 1) // m for i in range(a, b))
                for k in (1, 2, 4, 7):
                    assert _sum_visible_capped(a, b, m, k) == sum(
                        min(k, (i + 1) // m) for i in range(a, b))
    for c0 in range(1, 10):
        for c1 in range(c0 - 1, 25):
            for cap in (None, 1, 3, 8):
                assert _sum_min(c0, c1, cap) == sum(c if cap is None else min(cap, c)
                                                    for c in range(c0, c1 + 1))


def brute_causal_attention_keys(cfg: ModelConfig, seq_len: int, n_replay: int) -> dict:
    """Per-query counts summed, straight from the rules of docs/semantics.md (no blocks)."""
    from ced.config import build_plan
    plan = build_plan(cfg)
    window = read = scored = 0
    for spec in plan.layers:
        start = seq_len - n_replay if spec.part == "decoder" else 0
        for i in range(start, seq_len):
            if spec.full_causal:
                window += i + 1
            elif spec.window is not None:
                window += min(spec.window, i - start + 1)
            if spec.global_source is not None:
                vis = (i + 1) // plan.sources[spec.global_source].compress_ratio
                read += vis if cfg.topk is None else min(cfg.topk, vis)
                if cfg.topk is not None and spec.global_mode in ("full", "reindex"):
                    scored += vis
    return {"window": window, "read": read, "scored": scored}


@pytest.mark.parametrize("variant, topk", [("ced", None), ("ced", 3), ("yoco", 2),
                                           ("dense", None), ("swa", None)])
@pytest.mark.parametrize("seq_len", [1, 9, 30])
def test_causal_counting_matches_per_query_sums(variant, topk, seq_len):
    cfg = tiny_config(variant, topk=topk, decoder_reindex_every=1, window=5,
                      encoder_compress_ratio=3)
    replays = [None, 4, "exact"] if cfg.has_decoder else [None]
    for replay in replays:
        n = seq_len if replay is None else min(seq_len, 4 if replay == 4 else
                                               (cfg.n_decoder_layers * 4 + 1
                                                if variant == "ced" else 1))
        brute = brute_causal_attention_keys(cfg, seq_len, n)
        f = prefill_flops(cfg, seq_len, replay, "causal")
        per_key = 4 * cfg.n_heads * cfg.head_dim
        per_entry = 2 * cfg.indexer_heads * cfg.indexer_dim + 2 * cfg.indexer_heads
        assert f.window_attention == brute["window"] * per_key
        assert f.global_attention == brute["read"] * per_key
        assert f.indexer == brute["scored"] * per_entry
        # The executed blockwise count never does less work than the ideal one.
        assert prefill_flops(cfg, seq_len, replay, "executed").total >= f.total


def test_decode_counting_agrees():
    cfg = tiny_config("ced", topk=3, decoder_reindex_every=1)
    for context in (1, 5, 40):
        assert decode_flops(cfg, context, "causal").total == \
            decode_flops(cfg, context, "executed").total


def test_replay_errors():
    cfg = tiny_config("ced")
    with pytest.raises(ValueError, match="replay"):
        prefill_flops(cfg, 10, 0)
    with pytest.raises(ValueError, match="no decoder"):
        prefill_flops(tiny_config("dense"), 10, 3)
    with pytest.raises(ValueError, match="counting"):
        prefill_flops(cfg, 10, None, "ideal")
    with pytest.raises(ValueError, match="seq_len"):
        engine_cache_bytes(cfg, 0)


# ---- 7. KV bytes: per-token figure and the engine's accounting agree ---------------------------

@pytest.mark.parametrize("variant", ["yoco", "ced"])
def test_per_token_global_bytes_match_engine_accounting(variant):
    cfg = tiny_config(variant, topk=2, encoder_compress_ratio=3)
    length = 36                                  # a multiple of every ratio: no pending block
    engine = engine_cache_bytes(cfg, length, dtype="fp64")
    per_token = kv_bytes_per_token(cfg, dtype="fp64")["global_kv_bytes_per_token"]
    assert engine["global_kv"] + engine["indexer_keys"] == length * per_token
    windowed = replace(cfg, global_kv_dtype="fp4_block16", indexer_key_dtype="fp8")
    kv = kv_bytes_per_token(windowed, dtype="fp64")
    entry = (2 * cfg.d_model) // 2 + (2 * cfg.d_model) // 16 + cfg.indexer_dim
    assert kv["entry_bytes"]["total"] == entry
