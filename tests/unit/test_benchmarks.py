"""The benchmark scripts stay runnable: the peer comparison at a toy shape, and the GPU
check's exactness routine on the CPU (the same code runs on CUDA in `make gpu-check`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import learning  # noqa: E402
import peer  # noqa: E402
import window_read  # noqa: E402


def test_gpu_check_exactness_routine_holds_on_cpu():
    result = gpu_check.exactness(torch.device("cpu"))
    assert set(result) == set(gpu_check.VARIANTS)
    for variant, row in result.items():
        assert row["ok"], (variant, row)
    assert set(result["ced"]["max_abs_diff"]) == {"None", "exact", "3"}


def test_gpu_check_runs_every_section_at_toy_size_on_cpu(tmp_path):
    """Every cell of the GPU check runs (none errors or is skipped), the ratios to the GPT
    are computed, and the JSON and table are written: the script is known to run before a
    GPU is lent."""
    assert gpu_check.main(["--device", "cpu", "--tiny", "--warmup", "0", "--iters", "1",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(row["ok"] for row in result["exactness"].values())
    for section, shapes in (("short", ["2x64"]), ("long", ["1x128"])):
        assert sorted(result[section]) == shapes
        for kinds in result[section].values():
            for kind, rows in kinds.items():
                names = {n.split(":")[0] for n in rows}
                assert names == set(gpu_check.MODELS), (section, kind)
                for name, row in rows.items():
                    assert "median_s" in row, (section, kind, name, row)
                    ratio = row.get("ratio_to_gpt", row.get("ratio_to_gpt_forward"))
                    assert ratio and ratio > 0, (section, kind, name)
    prefill = result["long"]["1x128"]["prefill_bf16"]
    assert set(prefill) == {"gpt:full", "dense:full", "swa:full", "yoco:full", "yoco:W",
                            "ced:full", "ced:W"}
    assert "| ced |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_records_a_failing_cell_and_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of luck")
    monkeypatch.setattr(gpu_check, "make_step", broken)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--sections", "short", "--warmup", "0",
                           "--iters", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["short"]["2x64"]["train_fp32"]
    assert rows["ced"] == {"error": "RuntimeError: out of luck"}


def test_peer_benchmark_writes_its_table(tmp_path):
    assert peer.main(["--tables", "short", "--shapes", "1x32", "--steps", "1", "--warmup", "0",
                      "--variants", "ced,swa", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "peer.json").read_text())
    row = data["results"]["1x32"]
    assert set(row) == {"gpt", "ced", "swa"} and row["gpt"]["ratio_to_gpt"] == 1.0
    assert abs(row["ced"]["params"] / row["gpt"]["params"] - 1) < 0.05   # about equal size
    assert "| 1 x 32 |" in (tmp_path / "peer.md").read_text()
    for name in ("ced", "swa"):
        r = row[name]
        assert r["flops_ideal"] <= r["flops_executed"]
        assert r["flop_ratio_executed"] == row["gpt"]["flops_executed"] / r["flops_executed"]
        assert r["rate_vs_gpt"] == r["ratio_to_gpt"] / r["flop_ratio_executed"]
    assert "ideal / executed / rate" in (tmp_path / "peer.md").read_text()


def test_peer_long_context_table(tmp_path, monkeypatch):
    """The long-context table at a toy shape: a step and a prefill per model against the
    GPT's (its own ratio 1), the peak memory of a model's phase from a fresh process (one
    child here: the table takes one per model and phase, 3 s of start-up each), ced's executed
    FLOPs by kind summing to its total and its early exit doing less than its forward, the
    layers a half as asked, and a target missed is reported."""
    monkeypatch.setitem(peer.LONG_STEP_TARGETS, 64, {"ced": 1e6})
    children = []
    monkeypatch.setattr(peer, "peak_memory", lambda *args: children.append(args) or 1.0)
    assert peer.main(["--tables", "long", "--long-shapes", "1x64:1", "--steps", "1",
                      "--warmup", "0", "--variants", "ced,dense", "--set", "window=16",
                      "--out", str(tmp_path)]) == 0
    assert {(a[0], a[4]) for a in children} == {(n, ph) for n in ("gpt", "ced", "dense")
                                                for ph in ("step", "prefill")}
    monkeypatch.undo()
    assert peer.peak_memory("ced", 1, 64, 1, "step", "fp32", {"window": 16}) >= 0  # it runs
    data = json.loads((tmp_path / "peer.json").read_text())
    assert data["results"] == {} and set(data["long"]) == {"1x64"}
    row = data["long"]["1x64"]
    assert set(row) == {"gpt", "ced", "dense"}
    for phase in ("step", "prefill"):
        assert row["gpt"][phase]["ratio_to_gpt"] == 1.0
        for name in row:
            assert row[name][phase]["peak_mb"] == 1.0 and row[name][phase]["tokens_per_s"] > 0
    ced = row["ced"]
    assert sum(ced["forward_by_kind"][k] for k in ("linear", "sources", "window_attention",
                                                   "global_attention", "indexer", "head")) \
        == ced["forward_executed"]
    assert ced["prefill_executed"] < ced["forward_executed"]          # early exit at W = 16
    dense = row["dense"]       # no early exit: the forward, less the LM head on T - 1 tokens
    assert dense["prefill_executed"] == \
        dense["forward_executed"] - dense["forward_by_kind"]["head"] * 63 // 64
    assert data["long_missed"] == [f"ced step at 1x64: {ced['step']['ratio_to_gpt']:.2f}x "
                                   "< 1000000.0x"]
    table = (tmp_path / "peer.md").read_text()
    assert "| 1 x 64 (1) | step |" in table and "| 1 x 64 (1) | prefill |" in table
    built = peer.build("ced", {}, layers=1, max_len=64)
    assert (built.cfg.n_encoder_layers, built.cfg.n_decoder_layers) == (1, 1)
    assert len(peer.build("gpt", {}, layers=1, max_len=64).blocks) == 2
    with pytest.raises(SystemExit):
        peer.main(["--tables", "long", "--long-shapes", "1x8192"])          # no :L
    with pytest.raises(SystemExit):
        peer.main(["--flops-only", "--long-shapes", "1x8192:1,1x8192:2"])   # one row a shape


def test_peer_flops_only_prints_the_long_breakdown_without_timing(capsys, monkeypatch):
    monkeypatch.setattr(peer, "bench_long_shape", None)       # nothing may be timed
    assert peer.main(["--flops-only", "--long-shapes", "1x256:1", "--variants", "ced,swa",
                      "--set", "window=16"]) == 0
    out = capsys.readouterr().out
    assert "| 1 x 256 | ced |" in out and "| 1 x 256 | swa |" in out and "| gpt |" not in out


def test_peer_variants_configs():
    """ced_mq is the benchmark's ced with one K/V head per global entry, and --set wins."""
    ced, mq = peer.model_config("ced"), peer.model_config("ced_mq")
    assert mq.variant == "ced" and mq.n_global_kv_heads == 1 and ced.n_global_kv_heads == 4
    assert mq.to_dict() == {**ced.to_dict(), "global_kv_heads": 1}
    assert peer.model_config("ced_mq", global_kv_heads=2).n_global_kv_heads == 2
    assert peer.model_config("yoco", global_kv_heads=1).n_global_kv_heads == 1


def test_gpt_flop_count_matches_torch_counter_and_dense_does_the_gpts_work():
    """The GPT's analytic FLOPs equal FlopCounterMode's on a forward through SDPA's math
    backend (which multiplies the whole T x T rectangle), and ced's dense variant of the
    benchmark does the GPT's matmul work within 0.1% (its SwiGLU width 683 matches the GELU
    MLP's parameters), so a gap between the two is a rate, not work."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from ced.cost import forward_flops
    from gpt import GPT, GPTConfig
    for d, layers, t in ((32, 2, 48), (64, 3, 17)):
        model = GPT(GPTConfig(d_model=d, n_heads=2, n_layers=layers, max_seq_len=64))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 259, (1, t)))
        assert counter.get_total_flops() == model.forward_flops(t, counting="rectangle")
        causal_pairs, square = t * (t + 1) // 2, t * t
        assert (model.forward_flops(t, "rectangle") - model.forward_flops(t)
                == layers * 4 * d * (square - causal_pairs))
    gpt = peer.build("gpt", {})
    for t in (512, 2048):
        dense = forward_flops(peer.model_config("dense"), t, counting="causal").total
        assert abs(dense / gpt.forward_flops(t) - 1) < 1e-3


def test_learning_probe_trains_every_model_on_the_same_rows(tmp_path):
    assert learning.main(["--models", "gpt,gpt-rotary,yoco", "--steps", "2", "--eval-every", "1",
                          "--batch", "2", "--seq-len", "64", "--d-model", "16", "--heads", "2",
                          "--valid-rows", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "learning.json").read_text())
    assert set(data["results"]) == {"gpt", "gpt-rotary", "yoco"}
    for row in data["results"].values():
        assert [step for step, _ in row["curve"]] == [1, 2]
        assert set(row["curve"][-1][1]) == {"kv_recall"}
    # rotary replaces the position table: fewer parameters, everything else equal
    assert data["results"]["gpt"]["params"] - data["results"]["gpt-rotary"]["params"] == 64 * 16
    assert "| gpt-rotary |" in (tmp_path / "learning.md").read_text()
    assert (tmp_path / "learning.png").stat().st_size > 0


def test_peer_compile_modes_compile_the_modules_they_name():
    """--compile pointwise marks every MLP and norm of a ced-family model for torch.compile
    and nothing else (attention keeps its data-dependent masks in eager mode); `all` also
    the GPT's blocks. Marking is lazy: nothing compiles until a forward runs."""
    from ced.model import MLP, RMSNorm

    def compiled(module):
        return getattr(module, "_compiled_call_impl", None) is not None

    for mode in ("none", "pointwise", "all"):
        model = peer.build("dense", {}, mode)
        pointwise = [m for m in model.modules() if isinstance(m, (MLP, RMSNorm))]
        assert sum(isinstance(m, MLP) for m in pointwise) == 16          # one per layer
        assert sum(isinstance(m, RMSNorm) for m in pointwise) >= 2 * 16     # two per layer
        assert all(compiled(m) == (mode != "none") for m in pointwise)
        assert not any(compiled(m) for m in model.modules()
                       if not isinstance(m, (MLP, RMSNorm)))
        gpt = peer.build("gpt", {}, mode)
        assert all(compiled(block) == (mode == "all") for block in gpt.blocks)
    with pytest.raises(SystemExit):      # the compiling step would be timed
        peer.main(["--compile", "pointwise", "--warmup", "0", "--shapes", "1x8"])


@pytest.mark.parametrize("window,block", [(1, 4), (3, 4), (8, 8), (5, 16), (20, 8)])
def test_window_read_forms_compute_attends_window_read(window, block):
    """The banded reads the window benchmark times against `attend`'s rectangle give its output
    in float64 (tolerance 1e-10), windows shorter than, equal to and longer than a block, over
    seeds: the timing compares the same computation."""
    for seed in range(3):
        assert window_read.check_agree(window, block, seed) < 1e-10


def test_window_read_benchmark_prints_every_form(capsys):
    assert window_read.main(["--batch", "1", "--length", "32", "--heads", "2", "--head-dim", "4",
                             "--block", "8", "--rounds", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    for name in window_read.READS:
        assert f"rectangle / {name}" in out
