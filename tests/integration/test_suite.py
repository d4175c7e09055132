"""The edge-case suite: its generators are ced.data's (one copy) swept where replay should hurt,
its runner scores every family x point x mode on the engine path end to end (CLI included), exact
modes reproduce the full forward, and its statistics flag a real drop and only a real drop."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from ced import exact_replay_length
from ced.checkpoint import save_model
from ced.data import ByteTokenizer, make_example
from conftest import make_model, tiny_config
from evals.modes import exact_logits
from evals.suites import (FAMILIES, SuiteSettings, build_documents, load_checkpoint,
                          mcnemar_exact, paired_tests, prompt_ids, read_jsonl, target_ids,
                          wilson_interval)
from evals.suites.__main__ import main as suite_main
from evals.suites.families import min_distance
from evals.suites.stats import binomial_two_sided, holm

REPLAYS = (5, 10)


def suite_config():
    """Byte vocabulary, W=6, 2 decoder layers: R_exact = 11, top-k 3."""
    return tiny_config(vocab_size=259, n_encoder_layers=2, n_decoder_layers=2, window=6,
                       topk=3, global_from_layer=1, encoder_kv_groups=1, max_seq_len=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_model(make_model(suite_config(), 0), tmp_path_factory.mktemp("ckpt") / "final")


@pytest.fixture(scope="module")
def settings() -> SuiteSettings:
    return SuiteSettings.from_config(suite_config(), REPLAYS)


def test_documents_are_ced_data_examples_at_the_requested_points(settings):
    cfg = suite_config()
    r = exact_replay_length(cfg)
    assert (settings.r_exact, settings.window, settings.turns) == (11, 6, (2,))
    docs = build_documents(settings, examples=2)
    assert {d["family"] for d in docs} == set(FAMILIES)
    for doc in docs:
        ex = make_example(doc["task"], doc["seed"], **doc["params"])
        assert (doc["context"], doc["target"]) == (ex.context, ex.target)   # reuse, no copy
        assert prompt_ids(doc) == ex.prompt_ids and target_ids(doc) + [257] == ex.answer_ids
        assert doc["length"] == len(ex.prompt_ids) <= cfg.max_seq_len - 8
        if doc["x_name"] == "distance" and FAMILIES[doc["family"]].task != "running_state":
            assert doc["x"] == doc["distance"] == ex.meta["distance"]
    by = {}
    for doc in docs:
        by.setdefault(doc["family"], set()).add(doc["x"])
    # distances 1, N-1, N, N+1, W, R-1, R, R+1, 2R, clamped up to what the task allows
    low = min_distance("kv_recall", {"n_pairs": 4})
    want = {max(low, d) for d in [1, 4, 5, 6, 9, 10, 11, 6, r - 1, r, r + 1, 2 * r]}
    assert by["recall"] == by["multiturn"] == want
    assert max(by["copy"]) == 2 * r and {10, 11, 12} <= by["copy"]
    # running state: `|` at M + 2 in {N-1, N, N+1}
    assert {4, 5, 6, 9, 10, 11} <= by["running_count"]
    # multiturn_count: the running-count sweep, saying whether `|` lies in the cached prefix
    assert by["multiturn_count"] == by["running_count"]
    for d in (d for d in docs if d["family"] == "multiturn_count"):
        assert d["meta"]["fact_in_cached_prefix"] == [d["x"] > t for t in settings.turns]
        assert d["context"][-d["x"]] == "|"           # prompt_ids[-x] is `|`, the window start
    # multihop: the chain's statements on both sides of the replay start, and all beyond it
    # (N=5 is shorter than the last statement plus the query: every statement lies beyond)
    outside = {sum(c > 10 for c in d["meta"]["chain_distances"])
               for d in docs if d["family"] == "multihop"}
    assert outside == {2, 3}
    needle = [d for d in docs if d["family"] == "needle"]
    assert all(d["params"]["n_distractors"] > cfg.topk for d in needle)
    assert all(d["x"] <= max(REPLAYS) and d["length"] == d["x"]
               for d in docs if d["family"] == "short")
    for d in (d for d in docs if d["family"] == "boundary"):
        assert d["x"] == d["length"] > max(REPLAYS) and d["length"] % cfg.window in (5, 0, 1)
    # one seed, same facts at every distance (paired across x)
    recall = [d for d in docs if d["family"] == "recall" and d["seed"] == 0]
    assert len({d["target"] for d in recall}) == 1
    assert build_documents(settings, 2) == docs                              # deterministic


def test_suite_says_each_replay_form_with_its_n_and_caps_it_at_r_exact(checkpoint, tmp_path,
                                                                        capsys):
    """W = 6, R_exact = 11: W/3 is 2 (floor), 3W is 18, read as 11 with a warning naming
    R_exact; both printed and recorded in summary.json."""
    out = tmp_path / "run"
    assert suite_main(["--checkpoint", str(checkpoint), "--replay", "W/3", "3W", "--out",
                       str(out), "--examples", "1", "--families", "recall", "--no-plot",
                       "--no-wandb"]) == 0
    err = capsys.readouterr().err
    assert "replays: W/3 -> 2, 3W -> 11 (R_exact; 3W is 18)" in err
    assert ("warning: --replay: 3W is 18 positions on this model, above R_exact = 11 (from "
            "which replay is exact); using N = 11") in err
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run["replays"] == {"W/3": 2, "3W": 11}
    assert "replay=2" in run["modes"] and "replay=18" not in run["modes"]
    # the documents are placed around the forms' own lengths (N - 1, N, N + 1 of 18), as on a
    # model whose R_exact is longer, so that every model of a study reads the same documents
    xs = {d["x"] for d in read_jsonl(out / "data" / "recall.jsonl")}
    assert {17, 18, 19} <= xs


def test_suite_cli_end_to_end(checkpoint, tmp_path):
    out = tmp_path / "run"
    argv = ["--checkpoint", str(checkpoint), "--replay", *map(str, REPLAYS), "--out", str(out),
            "--examples", "3", "--dtype", "float64", "--quiet"]
    assert suite_main(argv) == 0
    for name in ["results.csv", "summary.csv", "summary.json", "paired_tests.csv",
                 "capability_drop.csv", "accuracy.png"]:
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(out / "results.csv")))
    docs = [d for f in FAMILIES for d in read_jsonl(out / "data" / f"{f}.jsonl")]
    base = ["full", "replay=5", "replay=10", "replay=exact"]
    turn = [f"turn=2,policy={p},replay={r}" for p in
            ("keep_decoder_swa", "suffix_only", "cached_hidden", "encoder_replay")
            for r in (5, 10, "exact")]
    turn_families = {"multiturn", "multiturn_count"}
    assert {f for f in FAMILIES if FAMILIES[f].turn_modes} == turn_families
    n_turn = sum(d["family"] in turn_families for d in docs)
    assert len(rows) == len(docs) * len(base) + n_turn * len(turn)
    modes = {(r["family"], r["mode"]) for r in rows}
    assert all((f, m) in modes for f in FAMILIES for m in base)
    assert all((f, m) in modes for f in turn_families for m in turn)
    summary = json.loads((out / "summary.json").read_text())
    assert {s["family"] for s in summary["summary"]} == set(FAMILIES)
    assert summary["run"]["settings"]["r_exact"] == 11

    diff, kl = {}, {}
    for r in rows:
        diff.setdefault((r["family"], r["mode"], int(r["length"])), []).append(
            float(r["logit_diff"]))
        kl.setdefault((r["family"], r["mode"], int(r["length"])), []).append(
            float(r["kl_answer"]))
    # KL(full || mode) at the answer is >= 0, exactly 0 for full, at round-off where the mode is
    # exact, and clearly positive somewhere for bounded replay of long prompts
    assert all(v >= 0 for d in kl.values() for v in d)
    assert all(v == 0 for (f, m, t), d in kl.items() if m == "full" for v in d)
    assert max(max(d) for (f, m, t), d in kl.items() if m == "replay=5" and t > 11) > 1e-6
    # exact modes reproduce full; T <= N: bounded replay covers the prompt, so it is exact too
    for (family, mode, length), d in diff.items():
        exact = mode in ("full", "replay=exact") or (mode.startswith("replay=") and
                                                     mode != "replay=exact"
                                                     and length <= int(mode[7:]))
        exact |= mode.startswith("turn=") and mode.endswith("cached_hidden,replay=exact")
        if exact:
            assert max(d) < 1e-9, (family, mode, length)
            assert max(kl[(family, mode, length)]) < 1e-12, (family, mode, length)
    # ... and bounded replay on long prompts is not silently exact
    assert max(max(d) for (f, m, t), d in diff.items() if m == "replay=5" and t > 11) > 1e-3
    assert max(max(d) for (f, m, t), d in diff.items()
               if m == "turn=2,policy=suffix_only,replay=exact") > 1e-3
    tests = list(csv.DictReader(open(out / "paired_tests.csv")))
    assert {t["mode"] for t in tests} == set(base[1:]) | set(turn)
    drops = list(csv.DictReader(open(out / "capability_drop.csv")))
    assert all(t["significant"] == "1" for t in drops)


def test_runner_scores_match_the_full_forward(checkpoint, tmp_path):
    """nll and exact match of mode `full` equal the parallel forward's on the same documents."""
    from evals.suites import SuiteConfig, run_suite

    result = run_suite(SuiteConfig(checkpoint, REPLAYS, tmp_path, examples=2,
                                   families=["recall", "needle"], dtype="float64", plot=False,
                                   wandb=False, quiet=True))
    model = load_checkpoint(checkpoint, dtype="float64")
    docs = {d["id"]: d for f in ("recall", "needle")
            for d in read_jsonl(tmp_path / "data" / f"{f}.jsonl")}
    rows = [r for r in result["rows"] if r["mode"] in ("full", "replay=exact")]
    assert len(rows) == 2 * len(docs)
    for r in rows:
        doc = docs[r["id"]]
        ctx, tgt = torch.tensor([prompt_ids(doc)]), torch.tensor([target_ids(doc)])
        logits = exact_logits(model, ctx, tgt).double()
        nll = -torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).sum()
        assert abs(r["nll"] - float(nll)) < 1e-8
        assert r["correct"] == int(logits.argmax(-1).eq(tgt).all())
        assert r["prediction"] == ByteTokenizer().decode(logits.argmax(-1)[0])


def test_kv_override_reads_the_checkpoint_back_in_the_storage_format(checkpoint, tmp_path):
    """--kv rebuilds the trained model with other storage formats: the same weights, the
    formats in the run's config, the exact modes still exact (engine and forward quantise
    alike), and the outputs moved by the quantisation."""
    from evals.suites import SuiteConfig, run_suite

    spec = "window:fp8,global:fp4_block16,indexer:fp4_block32"
    model = load_checkpoint(checkpoint, dtype="float64", kv=spec)
    plain = load_checkpoint(checkpoint, dtype="float64")
    assert (model.cfg.window_kv_dtype, model.cfg.global_kv_dtype,
            model.cfg.indexer_key_dtype) == ("fp8", "fp4_block16", "fp4_block32")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                   plain.state_dict().values()))
    ids = torch.tensor([make_example("kv_recall", 0, length=40).prompt_ids])
    assert (model(ids) - plain(ids)).abs().max() > 1e-6
    result = run_suite(SuiteConfig(checkpoint, REPLAYS, tmp_path, examples=2,
                                   families=["recall"], dtype="float64", plot=False,
                                   wandb=False, quiet=True, kv=spec))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["config"]["global_kv_dtype"] == "fp4_block16"
    exact = [r for r in result["rows"] if r["mode"] == "replay=exact"]
    assert exact and max(r["logit_diff"] for r in exact) < 1e-9
    with pytest.raises(ValueError, match="POINT:FORMAT"):
        load_checkpoint(checkpoint, kv="glob:fp8")


def test_teacher_forced_exact_match_equals_greedy_generation(checkpoint):
    """The runner's score (argmax at every target position, teacher-forced) equals greedy
    generation of len(target) tokens on the engine: checked on a model that knows the answer
    for some examples (its own greedy output as the target)."""
    from ced import InferenceEngine
    from evals.modes import mode_logits, parse_mode

    model = load_checkpoint(checkpoint, dtype="float64")
    engine = InferenceEngine(model)
    docs = build_documents(SuiteSettings.from_config(model.cfg, REPLAYS), 4, ["recall"])[:8]
    ctx = torch.tensor([prompt_ids(d) for d in docs])
    for mode in ("replay=5", "full"):
        greedy = engine.generate(ctx, 3, replay=parse_mode(mode).replay)
        targets = greedy.clone()
        targets[::2, 1] = (targets[::2, 1] + 1) % 256        # half the rows: a wrong target
        logits = mode_logits(engine, ctx, targets, parse_mode(mode))
        correct = logits.argmax(-1).eq(targets).all(-1)
        assert correct.tolist() == [i % 2 == 1 for i in range(len(docs))]


def test_statistics():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    lo, hi = wilson_interval(30, 50)
    assert lo < 0.6 < hi and (lo, hi) == pytest.approx((0.4618, 0.7239), abs=1e-4)
    assert binomial_two_sided(0, 6) == pytest.approx(2 / 64)
    assert binomial_two_sided(0, 5) == pytest.approx(2 / 32)
    assert binomial_two_sided(3, 6) == 1.0
    assert mcnemar_exact([True] * 6 + [False], [False] * 6 + [True]) == {
        "b": 6, "c": 1, "p_value": pytest.approx(16 / 128)}
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def _rows(mode: str, outcomes: list[int], x: int = 8) -> list[dict]:
    return [{"id": f"f/{x}/{i}", "family": "recall", "x_name": "distance", "x": x, "mode": mode,
             "correct": c} for i, c in enumerate(outcomes)]


def test_capability_drop_needs_a_significant_paired_loss():
    full = [1] * 12 + [0] * 8
    lost = [0] * 8 + [1] * 4 + [0] * 8            # 8 pairs lost, none won: p = 2/256
    mixed = [0] * 4 + [1] * 8 + [1] * 4 + [0] * 4  # 4 lost, 4 won: no evidence
    better = [1] * 20                              # above full: never a drop
    rows = _rows("full", full) + _rows("replay=4", lost) + _rows("replay=8", mixed) + \
        _rows("replay=exact", better)
    tests = {(t["mode"], t["x"]): t for t in paired_tests(rows)}
    assert tests[("replay=4", 8)]["significant"] == 1
    assert tests[("replay=4", 8)]["p_value"] == pytest.approx(2 / 256)
    assert (tests[("replay=4", 8)]["full_only"], tests[("replay=4", 8)]["mode_only"]) == (8, 0)
    assert tests[("replay=8", 8)]["significant"] == 0
    assert tests[("replay=exact", 8)]["significant"] == 0
    assert tests[("replay=4", "all")]["significant"] == 1
