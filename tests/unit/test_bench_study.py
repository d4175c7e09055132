"""`make bench-study` (benchmarks/study.py) times the shapes the studies train: its shapes
compose from the studies' own configs, and a tiny run returns a positive rate for every
variant. Nothing here is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import study  # noqa: E402
from experiments.study import load_study  # noqa: E402


def study_value(name: str, key: str) -> str:
    """The value a study's shared `train` overrides give `key` (e.g. model.window)."""
    found = [o.split("=", 1)[1] for o in load_study(name).train if o.startswith(f"{key}=")]
    assert found, f"{name} sets no {key}"
    return found[-1]


def test_the_shapes_compose_from_the_study_configs():
    deep = study.compose("depth_L20", "ced").model
    assert (deep.n_encoder_layers, deep.n_decoder_layers) == (2, 20)
    assert deep.window == int(study_value("depth", "model.window"))
    assert deep.d_model == int(study_value("depth", "model.d_model"))
    assert deep.topk == 16 and deep.attention_block == int(study_value("depth",
                                                                       "model.attention_block"))
    both = study.compose("depth_Le20_L20", "ced").model
    assert (both.n_encoder_layers, both.n_decoder_layers) == (20, 20)
    text = study.compose("real_text_L8", "ced")
    assert text.model.n_decoder_layers == 8 and text.data.kind == "stdlib"
    assert text.train.seq_len == int(study_value("real_text", "train.seq_len"))
    dense = study.compose("depth_L20", "dense").model
    assert dense.variant == "dense" and dense.n_layers == deep.n_layers
    assert dense.d_model == deep.d_model


def test_a_tiny_run_gives_every_variant_a_rate(tmp_path, monkeypatch):
    """The depth study at L_d = 1, 2 rows a step and 8 suite documents: one round, no
    warm-up; and the profile and tables of the same shape."""
    monkeypatch.setitem(study.SHAPES, "tiny", ("depth", ["model.n_decoder_layers=1",
                                                         "train.batch_size=2"]))
    monkeypatch.setattr(study, "SUITE_BATCH", 8)
    result = study.bench_shape("tiny", list(study.VARIANTS), rounds=1, warmup=0,
                               run_dir=tmp_path)
    assert result["geometry"]["eval"] == "suite full mode"
    for variant in study.VARIANTS:
        row = result["variants"][variant]
        assert row["step"]["rate"] > 0 and row["eval"]["rate"] > 0
        assert row["step"]["ratio_to_dense"] > 0 and row["eval"]["ratio_to_dense"] > 0
    assert result["variants"]["dense"]["step"]["ratio_to_dense"] == pytest.approx(1.0)
    prof = study.profile_shape("tiny", 1, tmp_path)
    assert prof["ced"]["groups"]["matmul"]["self_ms"] > 0
    assert prof["ced"]["flops"]["executed"]["indexer"] > 0
    meta = {"threads": 1, "rounds": 1, "warmup": 0, "torch": "x", "commit": "x", "set": []}
    assert "| tiny (L_e 2, L_d 1) | 2 x 256 | fp32 | ced |" in study.markdown({"tiny": result}, meta)
    assert "ced's top" in study.markdown_profile(prof, "tiny")


@pytest.mark.parametrize("name, group", [("aten::mm", "matmul"), ("aten::addmm", "matmul"),
                                         ("aten::topk", "topk / sort"),
                                         ("aten::_fused_adamw_", "optimizer"),
                                         ("aten::index_add_", "index / gather / scatter / mask"),
                                         ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                          "attention kernel"),
                                         ("aten::t", "views"),
                                         ("_FlashReadBackward", "autograd / python")])
def test_profiled_ops_fall_in_their_group(name, group):
    assert study.op_group(name) == group


def test_job_shapes_are_composed_from_their_study_files_job():
    """A shape named after a study's job carries that job's overrides as the study file writes
    them (so it cannot drift from the study) and composes in the study's own precision."""
    from experiments.study import load_study
    for name, (study_name, job) in study.JOB_SHAPES.items():
        written = next(j for j in load_study(study_name, "full").jobs if j.name == job)
        assert study.SHAPES[name] == (study_name, written.overrides), name
    cfg = study.compose("encoder_w_E8_L8", "ced")
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) == (8, 8)
    assert cfg.train.mixed_precision == "bf16"


def test_the_ab_of_a_lever_times_both_arms_on_the_same_weights(tmp_path, monkeypatch):
    """benchmarks/ab.py at the depth study with L_d = 1 and 2 rows: one round of each arm
    (arm B under --set), both loaded with one saved model's weights, and the printed ratio."""
    import ab
    from ced.checkpoint import save_model
    monkeypatch.setitem(study.SHAPES, "tiny", ("depth", ["model.n_decoder_layers=1",
                                                         "train.batch_size=2"]))
    cfg = study.compose("tiny", "ced")
    run = study.make_run(cfg, tmp_path / "source")
    model = run.accelerator.unwrap_model(run.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_model(model, tmp_path / "final")
    times = ab.ab_times("tiny", ("model.global_read=union",), rounds=1, warmup=0,
                        weights=tmp_path / "final", run_dir=tmp_path / "ab")
    assert set(times) == {("A", "step"), ("A", "eval"), ("B", "step"), ("B", "eval")}
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    monkeypatch.setattr(ab, "ab_times", lambda *a: times)
    assert ab.main(["tiny", "--set", "model.global_read=union", "--rounds", "1"]) == 0
