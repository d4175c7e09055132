"""The divergence runner on a tiny checkpoint trained inside the test: exact modes report
KL at float64 round-off (<= 1e-12), bounded replay with N < R_exact on prompts longer than
R_exact clearly more, and the run writes its table, summary and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "WANDB_SILENT": "true"}


def train_tiny(run: Path, *overrides: str, steps: int) -> Path:
    """Train a tiny model (2+2 layers, W=8) on the stdlib corpus; returns its final/."""
    done = subprocess.run(
        [sys.executable, "-m", "ced.train", *overrides, "model.d_model=32", "model.n_heads=2",
         "model.n_encoder_layers=2", "model.n_decoder_layers=2", "model.window=8",
         "model.max_seq_len=128", "train.seq_len=64", "train.batch_size=4",
         f"train.steps={steps}", f"train.eval_every={steps}", "train.threads=1",
         "train.progress=false", "logging=none", "data=stdlib", f"hydra.run.dir={run}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run / "final"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny ced model trained for a few steps (R_exact = 2*7+1 = 15)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"), "model=ced", "model.topk=8",
                      "model.global_from_layer=1", "model.encoder_kv_groups=1", steps=15)


def test_divergence_run_separates_exact_from_bounded_modes(checkpoint, tmp_path):
    out = tmp_path / "div"
    done = subprocess.run(
        [sys.executable, "-m", "evals.divergence", f"checkpoints=[{checkpoint}]",
         "replays=[1,4,W/3,3W]", "lengths=[48]", "steps=3", "greedy_steps=4", "prompts.count=4",
         "turn_tokens=3", "encoder_replays=[4,exact]", "bootstrap=100", "wandb.mode=offline",
         f"hydra.run.dir={out}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("divergence.csv", "divergence.parquet", "summary.json", "kl_vs_replay.png",
                 "top1_agree_vs_replay.png", "layer_error_by_offset.png"):
        assert (out / name).exists(), name
    assert list((out / "wandb").glob("offline-run-*"))

    summary = json.loads((out / "summary.json").read_text())
    kl = {s["mode"]: s["mean"] for s in summary if s["metric"] == "kl" and s["step"] == 0}
    exact_modes = ["replay=exact", "turn=3,policy=cached_hidden,replay=exact,encoder_replay=15"]
    bounded = ["replay=1", "replay=4", "turn=3,policy=suffix_only,replay=8",
               "turn=3,policy=cached_hidden,replay=exact,encoder_replay=4"]
    # float64 throughout: exact modes sit at round-off (about 1e-17); a 15-step model drifts
    # little under bounded replay (replay=4 measured 9.7e-7 on CI), but far above round-off.
    for mode in exact_modes:
        assert kl[mode] <= 1e-12, (mode, kl[mode])
    for mode in bounded:
        assert kl[mode] > 1e-10, (mode, kl[mode])

    table = pd.read_parquet(out / "divergence.parquet")
    assert {"checkpoint", "T", "prompt", "mode", "N", "metric", "step", "value"} <= set(table)
    assert set(table["metric"]) >= {"kl", "tv", "top1_agree", "delta_logp",
                                    "greedy_agree_tokens", "hidden_rel_l2", "kv_rel_l2"}
    layers = table[(table["metric"] == "hidden_rel_l2") & (table["mode"] == "replay=4")]
    assert sorted(layers["offset"].unique()) == [0, 1, 2, 3]
    # the first decoder layer at the replay start has lost the most context: nonzero error
    assert layers[layers["offset"] == 0]["value"].max() > 1e-6

    # replay forms said with their N (W = 8, R_exact = 15): W/3 is floor(8/3) = 2; 3W is 24,
    # above R_exact, so it is read as 15 (a longer replay is exact too) with a warning naming
    # R_exact; printed, and recorded in replays.json
    label = checkpoint.parent.name
    assert (f"[divergence] {label}: W = 8, R_exact = 15; replays 1, 4, W/3 -> 2, 3W -> 15 "
            f"(R_exact; 3W is 24); encoder_replays 4, exact -> 15") in done.stdout
    assert (f"[divergence] {label}: warning: replays: 3W is 24 positions on this model, above "
            f"R_exact = 15 (from which replay is exact); using N = 15") in done.stdout
    recorded = json.loads((out / "replays.json").read_text())[str(checkpoint)]
    assert recorded["replays"] == {"1": 1, "4": 4, "W/3": 2, "3W": 15}
    assert recorded["R_exact"] == 15
    assert {"replay=2", "replay=15"} <= set(table["mode"]) and "replay=24" not in set(table["mode"])
    # progress lines name the run (job/seed in a study), not the checkpoint folder `final`
    progress = [line for line in done.stdout.splitlines() if " T=48 prompts " in line]
    assert progress and all(line.startswith(f"[divergence] {label} T=48") for line in progress)


def test_yoco_early_exit_has_no_divergence_and_every_policy_runs(tmp_path):
    """yoco: any decoder replay is exact (KL <= 1e-6); the cached_hidden policy at N = W needs
    N - m stored H_{L_e} positions, which the runner must keep (R_exact alone is 1)."""
    final = train_tiny(tmp_path / "yoco", "model=yoco", steps=5)
    from evals.divergence import DivergenceConfig, PromptConfig, WandbConfig
    from evals.divergence import run as run_divergence
    config = DivergenceConfig(checkpoints=[str(final)], replays=[1, 4], lengths=[40],
                              steps=2, greedy_steps=3, turn_tokens=2, encoder_replays=["exact"],
                              bootstrap=10, prompts=PromptConfig(count=2),
                              wandb=WandbConfig(enabled=False))
    rows = run_divergence(config, tmp_path / "out")
    kl = {r["mode"]: r["value"] for r in rows if r["metric"] == "kl" and r["step"] == 0}
    assert "turn=2,policy=cached_hidden,replay=8" in kl
    # yoco's R_exact is 1: replays=[1,4] reads 4 as 1 (ced.config.state_replay)
    assert "replay=4" not in kl
    for mode in ("replay=1", "replay=exact", "yoco_early_exit",
                 "turn=2,policy=cached_hidden,replay=8", "turn=2,policy=suffix_only,replay=8"):
        assert kl[mode] <= 1e-6, (mode, kl[mode])
