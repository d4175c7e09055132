"""The bf16 probe (`ced.train.precision`): a CPU that emulates bf16 is named before a run spends
hours on it, and the probe leaves the run's random state alone."""

from __future__ import annotations

import math

import pytest
import torch

from ced.train.precision import EMULATED_SLOWDOWN, bf16_cpu_warning, bf16_matmul_slowdown


def test_the_probe_measures_a_finite_positive_ratio_and_draws_no_global_random_numbers():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    slowdown = bf16_matmul_slowdown(size=64, reps=2)
    assert math.isfinite(slowdown) and slowdown > 0
    assert torch.equal(torch.rand(5), expected)    # a run's init and data order are unchanged


@pytest.mark.parametrize("slowdown", [0.5, 1.0, 1.5, EMULATED_SLOWDOWN])
def test_no_warning_where_bf16_is_about_as_fast_as_fp32(slowdown):
    assert bf16_cpu_warning(slowdown) is None


@pytest.mark.parametrize("slowdown", [EMULATED_SLOWDOWN + 0.01, 10.0, 27.0])
def test_an_emulating_cpu_is_named_with_its_slowdown_and_the_key_that_changes_it(slowdown):
    warning = bf16_cpu_warning(slowdown)
    assert warning is not None
    assert f"{slowdown:.0f}x slower" in warning
    assert "train.mixed_precision=no" in warning and "different recipe" in warning
