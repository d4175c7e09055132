"""The benchmark scripts stay runnable: the peer comparison at a toy shape, and the GPU
check's exactness routine on the CPU (the same code runs on CUDA in `make gpu-check`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import learning  # noqa: E402
import peer  # noqa: E402


def test_gpu_check_exactness_routine_holds_on_cpu():
    result = gpu_check.exactness(torch.device("cpu"))
    assert set(result) == set(gpu_check.VARIANTS)
    for variant, row in result.items():
        assert row["ok"], (variant, row)
    assert set(result["ced"]["max_abs_diff"]) == {"None", "exact", "3"}


def test_peer_benchmark_writes_its_table(tmp_path):
    assert peer.main(["--shapes", "1x32", "--steps", "1", "--warmup", "0", "--variants",
                      "ced,swa", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "peer.json").read_text())
    row = data["results"]["1x32"]
    assert set(row) == {"gpt", "ced", "swa"} and row["gpt"]["ratio_to_gpt"] == 1.0
    assert abs(row["ced"]["params"] / row["gpt"]["params"] - 1) < 0.05   # about equal size
    assert "| 1 x 32 |" in (tmp_path / "peer.md").read_text()


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
