"""evals.erf, the effective receptive field of the decoder windows, on tiny float64 models with
non-degenerate random weights: the gradient view is exactly zero beyond each decoder layer's
theoretical reach and not before it, the replay view is exact at R_exact, ablating a copy of
the cache leaves the prompt's cache alone, the share summaries are what their definitions
say, and the command line writes its outputs and refuses models without decoder windows."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from ced import InferenceEngine, exact_replay_length
from ced.checkpoint import save_model
from conftest import make_model, tiny_config
from evals.erf import (_copy, cache_drop, decoder_input_gradients, main, measure,
                       replay_drop, residual_distance, share_beyond,
                       share_distance, summarize)

T = 30
VOCAB = 259          # the byte tokenizer's, so the CLI's task prompts fit


def model_for(seed: int, **overrides):
    return make_model(tiny_config("ced", vocab_size=VOCAB, **overrides), seed)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,layers,topk", [(4, 2, None), (3, 3, 2), (5, 1, 3)])
def test_gradient_reaches_exactly_the_theoretical_bound_per_layer(seed, window, layers, topk):
    model = model_for(seed, window=window, n_decoder_layers=layers, topk=topk)
    ids = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(seed))
    grads = decoder_input_gradients(model, ids)              # [L_d, B, T]
    assert grads.shape == (layers, 3, T)
    for depth in range(layers):
        reach = (layers - depth) * (window - 1)             # farthest d layer `depth` reaches
        by_distance = grads[depth].flip(-1)                  # [B, d]
        assert torch.all(by_distance[:, reach + 1:] == 0), (depth, reach)
        assert torch.all(by_distance[:, reach] > 0), (depth, reach)
    assert exact_replay_length(model.cfg) == layers * (window - 1) + 1


@pytest.mark.parametrize("seed", range(3))
def test_replay_view_vanishes_at_r_exact_and_not_before(seed):
    model = model_for(seed, window=4, topk=3)
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        rows = replay_drop(model, ids)
    kl = {(r["distance"], r["prompt"]): r["value"] for r in rows if r["metric"] == "kl"}
    r_exact = exact_replay_length(model.cfg)
    assert max(d for d, _ in kl) == r_exact
    assert all(kl[(r_exact, p)] <= 1e-12 for p in range(4))   # float64 round-off
    assert all(kl[(1, p)] > 1e-8 for p in range(4))


def test_ablating_a_copy_leaves_the_prompt_cache_alone():
    model = model_for(0, window=4, topk=3)
    engine = InferenceEngine(model)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prompt = engine.prefill(ids[:, :-1]).cache
        first = engine.decode(ids[:, -1], _copy(prompt))
        again = engine.decode(ids[:, -1], _copy(prompt))
        direct = model(ids)[:, -1]
        rows = cache_drop(model, ids)
    assert torch.equal(first, again) and prompt.length == T - 1
    assert torch.allclose(first, direct, atol=1e-10, rtol=0)
    kl = [r for r in rows if r["metric"] == "kl"]
    assert {r["distance"] for r in kl} == {1, 2, 3}                  # d < W
    assert {r["layer"] for r in kl} == {"0", "1", "all"}
    assert all(r["value"] >= 0 for r in kl) and max(r["value"] for r in kl) > 1e-8


def test_share_and_residual_distances_follow_their_definitions():
    # influence 0.5 at d=1, 0.4 at d=2, 0.099 at d=3, 0.001 at d=4 (d=0 ignored)
    profile = np.array([100.0, 0.5, 0.4, 0.099, 0.001])
    assert share_distance(profile, 0.9) == 2
    assert share_distance(profile, 0.99) == 3
    assert share_distance(profile, 0.999) == 3       # 0.999 reached exactly at d=3
    assert share_distance(profile, 0.9995) == 4
    assert share_distance(np.zeros(5), 0.99) == 0
    kl = np.array([np.nan, 1.0, 0.5, 0.011, 0.0005, 0.0])
    assert residual_distance(kl, 0.99) == 4          # first N with KL <= 0.01 * KL(1)
    assert residual_distance(kl, 0.999) == 4
    assert residual_distance(np.array([np.nan, 1.0, 0.9]), 0.99) == 3   # not reached: past end


def test_share_beyond_w_reads_the_same_mean_profile_as_d99():
    """A prompt with almost no influence must not weigh like one with much: the share at
    d >= W and d99 both read the mean profile, so d99 < W implies a share below 1%."""
    assert share_beyond(np.array([9.0, 0.5, 0.3, 0.2]), 2) == pytest.approx(0.5)
    assert share_beyond(np.zeros(4), 2) == 0.0
    window, rows = 3, []
    # prompt 0: large influence, all at d = 1; prompt 1: tiny influence, all at d = 4 >= W
    for prompt, (d, value) in enumerate([(1, 1.0), (4, 1e-6)]):
        for distance in range(6):
            rows.append({"checkpoint": "c", "prompt": prompt, "view": "gradient",
                         "layer": "total", "metric": "norm", "distance": distance,
                         "value": value if distance == d else 0.0})
            rows.append({"checkpoint": "c", "prompt": prompt, "view": "replay", "layer": "all",
                         "metric": "kl", "distance": distance, "value": 1.0 / (1 + distance)})
    out = summarize(pd.DataFrame(rows), window=window, reach=6, bootstrap=20)
    assert out["gradient_d99"] == 1
    assert out["gradient_share_beyond_W"] == pytest.approx(1e-6 / (1 + 1e-6))   # not 0.5


def test_measure_has_every_view_and_layer():
    model = model_for(1, window=4, n_decoder_layers=2)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    table = measure(model, ids)
    assert set(table["view"]) == {"gradient", "cache_drop", "replay"}
    assert set(table.loc[table["view"] == "gradient", "layer"]) == {"total", "1"}
    assert table.loc[table["view"] == "gradient", "distance"].max() == T - 1


def test_cli_writes_outputs_and_a_verdict_per_job(tmp_path):
    for seed in (0, 1):
        save_model(model_for(seed, window=4, topk=3).float(),
                   tmp_path / "runs" / "ced" / f"seed{seed}" / "final")
    out = tmp_path / "erf"
    argv = ["--checkpoint", *(str(tmp_path / "runs" / "ced" / f"seed{s}" / "final")
                              for s in (0, 1)),
            "--out", str(out), "--tasks", "running_state", "copy", "--examples", "2",
            "--length", "40", "--bootstrap", "50"]
    assert main(argv) == 0
    for name in ("erf.csv", "summary.json", "erf.md", "erf.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    job = summary["jobs"]["ced"]
    assert job["units"] == 2 * 2 * 2                      # seeds x tasks x examples
    assert 1 <= job["gradient_d99"] <= job["gradient_d99.9"] <= summary["geometry"]["ced"][
        "R_exact"] - 1
    assert job["gradient_d99.9_ci"][0] <= job["gradient_d99.9_ci"][1]
    assert "N = W is" in job["verdict"] and job["verdict"] in (out / "erf.md").read_text()
    # --from summarises the saved table again, without the checkpoints, to the same summary
    again = tmp_path / "again"
    assert main(["--from", str(out), "--out", str(again), "--bootstrap", "50"]) == 0
    # (erf.csv keeps 6 significant digits: the same distances, KLs within 1e-4 relative)
    redone = json.loads((again / "summary.json").read_text())["jobs"]["ced"]
    assert redone.keys() == job.keys()
    for key, value in job.items():
        if key == "verdict" or isinstance(value, int):
            assert redone[key] == value, key
        else:
            assert redone[key] == pytest.approx(value, rel=1e-4, abs=1e-12), key
    assert (again / "erf.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["--from", str(out), *argv])                # --from and --checkpoint: one of them
    assert main(["--from", str(tmp_path / "runs"), "--out", str(again)]) == 2


def test_cli_refuses_a_model_without_decoder_windows(tmp_path, capsys):
    save_model(make_model(tiny_config("yoco", vocab_size=VOCAB), 0).float(), tmp_path / "yoco")
    code = main(["--checkpoint", str(tmp_path / "yoco"), "--out", str(tmp_path / "o"),
                 "--examples", "1", "--length", "40"])
    assert code == 2 and "no decoder windows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path / "yoco"), "--out", str(tmp_path / "o"),
              "--params", "[1]"])


def test_divergence_reference_reads_single_turn_numeric_replays_only(tmp_path):
    """The KL-against-N reference an erf run draws beside its curve: per job, the step-0 KL of
    every single-turn replay of a given length; replay=exact, full, the multi-turn modes and
    the other metrics and steps stay out (they have no N of that kind)."""
    from evals.erf import _divergence_curve
    rng = np.random.default_rng(0)
    modes = ["replay=1", "replay=4", "replay=15", "replay=exact", "full",
             "turn=4,policy=suffix_only,replay=8",
             "turn=4,policy=cached_hidden,replay=exact,encoder_replay=8"]
    rows = [{"checkpoint": f"/s/runs/{job}/seed{seed}/final", "mode": mode, "metric": metric,
             "step": step, "value": float(rng.random())}
            for job, seed in (("a", 0), ("a", 1), ("b", 0)) for mode in modes
            for metric in ("kl", "top1") for step in (0, 1)]
    path = tmp_path / "divergence.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    curve = _divergence_curve(path)
    assert sorted(curve["job"].unique()) == ["a", "b"]
    assert sorted(curve["N"].unique()) == [1, 4, 15]
    table = pd.DataFrame(rows)
    expect = table[(table["metric"] == "kl") & (table["step"] == 0)
                   & (table["mode"] == "replay=4")
                   & table["checkpoint"].str.contains("/a/")]["value"].mean()
    got = curve[(curve["job"] == "a") & (curve["N"] == 4)]["value"].item()
    assert got == pytest.approx(expect, abs=1e-12)       # the mean over a's two seeds
