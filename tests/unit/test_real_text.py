"""The real-text evaluation (evals.real_text, evals.code_tokens): its one-forward read of every
replay equals the engine's, the token classes on a hand-checked file, the rows score every byte
once, the cluster bootstrap against hand-computed cases, the n-gram baselines against direct
counts; and the CLI end to end on a model saved with a data=stdlib config."""

from __future__ import annotations

import codecs
import json
import math
import shutil
import time

import numpy as np
import pytest
import torch

from ced import InferenceEngine, exact_replay_length
from ced.checkpoint import save_model
from evals import lm_eval_outcomes, real_text
from evals.code_tokens import CLASSES, annotate, classify, group_of
from evals.modes import Mode, mode_logits
from tests.conftest import make_model, tiny_config

SOURCE = b'''import os

def f(alpha, beta):
    x = (alpha +
         beta)
    if x:
        return [x,
                os.sep]
    y = x
    return y

class C:
    def g(self):
        return f(1, 2)
z = alpha = f
'''


def _at(text: bytes, needle: bytes, occurrence: int = 0) -> int:
    index = -1
    for _ in range(occurrence + 1):
        index = text.index(needle, index + 1)
    return index


def test_annotation_of_a_hand_checked_file():
    ann = annotate(SOURCE)
    # a name's bytes carry the gap to its latest earlier occurrence; keywords are no names
    second_alpha = _at(SOURCE, b"alpha", 1)
    assert (ann.name_gap[second_alpha:second_alpha + 5] == second_alpha - _at(SOURCE, b"alpha")).all()
    assert ann.name_gap[_at(SOURCE, b"alpha")] == -1                 # first occurrence
    assert ann.name_gap[_at(SOURCE, b"def")] == -2                   # keyword
    last_alpha = _at(SOURCE, b"alpha", 2)
    assert ann.name_gap[last_alpha] == last_alpha - second_alpha
    # brackets pair with their openers
    close = _at(SOURCE, b"beta)\n") + 4
    assert ann.closer_kind[close] == 1 and ann.opener[close] == _at(SOURCE, b"(alpha +")
    square = _at(SOURCE, b"sep]") + 3
    assert ann.opener[square] == _at(SOURCE, b"[x,")
    # a dedent marks the dedented line's first byte; its opener is the header of the
    # outermost block it closes (the line whose indentation it takes)
    y = _at(SOURCE, b"y = x")
    assert ann.closer_kind[y] == 2 and ann.opener[y] == _at(SOURCE, b"if x:")
    z = _at(SOURCE, b"z = ")
    assert ann.closer_kind[z] == 2 and ann.opener[z] == _at(SOURCE, b"class C")
    assert ann.closer_kind[_at(SOURCE, b"class C")] == 2           # closes def f
    assert ann.opener[_at(SOURCE, b"class C")] == _at(SOURCE, b"def f")
    assert annotate(b"def f(:\n  )\n x = (") is None                 # tokenize refuses it


def test_classes_follow_the_window_the_replay_start_and_the_row():
    ann = annotate(SOURCE)
    first, second = _at(SOURCE, b"alpha"), _at(SOURCE, b"alpha", 1)
    gap = second - first
    close = _at(SOURCE, b"beta)\n") + 4
    opener = int(ann.opener[close])

    def one(position, start, window=4, visible=0):
        return classify(ann, np.array([position]), start, window, visible)[0]
    assert one(second, start=0, window=gap) == "identifier_near"          # not beyond W
    assert one(second, start=0, window=gap - 1) == "identifier_far_in_replay"
    assert one(second, start=first + 1, window=gap - 1) == "identifier_far"
    assert one(second, start=first + 1, window=gap - 1, visible=first + 1) == \
        "evidence_outside_row"                                             # never shown
    assert one(close, start=opener) == "closer_in_replay"
    assert one(close, start=opener + 1) == "closer_before_replay"
    assert one(close, start=opener + 1, visible=opener + 1) == "evidence_outside_row"
    assert one(0, start=0) == "other"
    # per-position arrays broadcast
    got = classify(ann, np.array([second, close]), np.array([first + 1, opener]), gap - 1,
                   np.array([0, 0]))
    assert list(got) == ["identifier_far", "closer_in_replay"]
    assert {group_of(c) for c in CLASSES} == {"identifier_far", "closer_before_replay", "other"}
    assert [c for c in CLASSES if group_of(c) != "other"] == ["identifier_far",
                                                             "closer_before_replay"]
    with pytest.raises(ValueError, match="not one of"):
        group_of("bracket")


def test_names_in_comments_and_strings_count_as_occurrences_and_a_bom_shifts_line_one():
    src = b"import os\n# gamma here\nx = 'delta'\ngamma = delta = 1\n"
    ann = annotate(src)
    gamma, delta = src.index(b"gamma ="), src.index(b"delta =")
    assert gamma - ann.name_gap[gamma] == src.index(b"gamma here")        # the comment
    assert delta - ann.name_gap[delta] == src.index(b"delta'")            # the string
    bom = codecs.BOM_UTF8 + b"if a:\n    b = a\n"
    ann = annotate(bom)
    assert ann.name_start[bom.index(b"a:")] == bom.index(b"a:")
    assert ann.name_gap[bom.index(b"a\n", 9)] == bom.index(b"a\n", 9) - bom.index(b"a:")


@pytest.mark.parametrize("row_len,context", [(16, 3), (9, 0), (32, 30)])
def test_rows_score_every_byte_once(row_len, context):
    files = [bytes(range(65, 65 + n)) for n in (1, 5, 17, 40, 100)]
    rows = real_text.build_rows(files, row_len, context)
    seen = {}
    for r in range(rows.ids.shape[0]):
        f, offset = int(rows.file[r]), int(rows.offset[r])
        for i in rows.scored[r].nonzero()[:, 0].tolist():
            byte = offset + i                        # stream offset i + 1 -> file byte
            assert i >= context
            assert int(rows.ids[r, i + 1]) == files[f][byte] if i + 1 < row_len else True
            assert (f, byte) not in seen
            seen[(f, byte)] = True
    want = {(f, b) for f, data in enumerate(files) for b in range(context, len(data))}
    assert set(seen) == want


def test_distances_from_the_latest_start():
    starts = real_text.replay_starts(12, 5, 2)
    assert starts.tolist() == [2, 7]
    # position i predicts byte i + 1; distance from the latest start s <= i
    assert real_text.distances(12, starts).tolist() == [0, 0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_forward_reads_every_replay_as_the_engine_does(seed):
    """Each scored byte's KL and NLLs equal those of the engine's prefill with replay
    N = distance - g, followed by g teacher-forced decode steps (float64, 1e-9)."""
    cfg = tiny_config(n_decoder_layers=2, window=4, topk=4, max_seq_len=64, vocab_size=259)
    model = make_model(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    files = [bytes(torch.randint(97, 123, (n,), generator=gen).tolist()) for n in (50, 70)]
    rows = real_text.build_rows(files, 40, 8)
    period = exact_replay_length(cfg) + 3
    scores = real_text.score(model, rows, period, passes=2, batch_size=3)
    engine = InferenceEngine(model)
    picks = np.random.default_rng(seed).choice(len(scores["kl"]), 12, replace=False)
    for k in picks:
        r, i, d = int(scores["row"][k]), int(scores["position"][k]), int(scores["distance"][k])
        ids = rows.ids[r:r + 1]
        for g in {0, d - 1}:                        # replay N = d - g, then g decode steps
            n, t = d - g, i + 1 - g                 # the prompt ends at position t - 1
            context, continuation = ids[:, :t], ids[:, t:i + 2]
            exact = mode_logits(engine, context, continuation, Mode("full"))[:, g]
            approx = mode_logits(engine, context, continuation,
                                 Mode(f"replay={n}", replay=n))[:, g]
            lp_e, lp_a = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
            kl = float((lp_e.exp() * (lp_e - lp_a)).sum())
            target = int(ids[0, i + 1])
            assert abs(kl - scores["kl"][k]) < 1e-9
            assert abs(-float(lp_e[0, target]) - scores["nll_exact"][k]) < 1e-9
            assert abs(-float(lp_a[0, target]) - scores["nll_replay"][k]) < 1e-9
    # beyond R_exact a replay is exact
    far = scores["distance"] >= exact_replay_length(cfg)
    assert far.any() and np.abs(scores["kl"][far]).max() < 1e-12


def test_cluster_bootstrap_hand_cases():
    # one model, every file the same mean: no spread
    low, high = real_text.cluster_bootstrap([[[2.0, 4], [1.0, 2], [3.0, 6]]], resamples=200)
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    # one model, two one-token files 0 and 1: replicates are 0, 1/2, 1 with 1/4, 1/2, 1/4
    assert real_text.cluster_bootstrap([[[0.0, 1], [1.0, 1]]], resamples=4000,
                                       confidence=0.4) == (0.5, 0.5)
    # two models whose files agree within a model: the interval spans the two model means
    low, high = real_text.cluster_bootstrap([[[0.0, 2], [0.0, 3]], [[4.0, 2], [2.0, 1]]],
                                            resamples=4000)
    assert low == pytest.approx(0.0) and high == pytest.approx(2.0)
    assert all(math.isnan(v) for v in real_text.cluster_bootstrap([[[0.0, 0]]]))


def test_models_reading_the_same_files_do_not_narrow_the_file_spread():
    """Files and models are crossed: three identical models give about the interval of one
    (resampling files per model would shrink it by about sqrt(3))."""
    rng = np.random.default_rng(0)
    counts = rng.integers(2000, 20000, 38).astype(float)
    one = np.stack([rng.gamma(1.0, 1.0, 38) * 1e-2 * counts, counts], -1)
    width = np.diff(real_text.cluster_bootstrap([one], resamples=3000))[0]
    width3 = np.diff(real_text.cluster_bootstrap([one, one, one], resamples=3000))[0]
    assert 0.85 < width3 / width < 1.15


def test_ngram_baselines_against_direct_counts():
    train = np.array([1, 2, 1, 2, 1, 3, 1, 2], dtype=np.int64)
    targets, previous = np.array([2, 3]), np.array([1, 1])
    got = real_text.ngram_nll(train, targets, previous, ks=(1.0,))
    vocab = real_text._TOK.vocab_size
    p2, p3 = (3 + 1) / (8 + vocab), (1 + 1) / (8 + vocab)     # 2 thrice, 3 once in 8
    assert got["unigram_nll"] == pytest.approx(-(math.log(p2) + math.log(p3)) / 2)
    # after 1: 2 three times, 3 once, out of 4
    b2, b3 = (3 + 1) / (4 + vocab), (1 + 1) / (4 + vocab)
    assert got["bigram_nll"] == pytest.approx(-(math.log(b2) + math.log(b3)) / 2)
    best = real_text.ngram_nll(train, targets, previous)
    assert best["bigram_nll"] <= got["bigram_nll"]


def test_xz_anchor_prices_structure_and_the_context():
    """xz9_nll is `xz -9` of the files as one stream; xz9_scored_nll prices only the bytes after
    each file's context: random bytes cost about 8 bits a byte (within 3%), a file that repeats
    its own context costs far less after it than the random file, and a context no file exceeds
    is refused."""
    import lzma
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
    block = rng.integers(0, 256, 500, dtype=np.uint8).tobytes()
    repeated = block * 40
    got = real_text.xz_nll([noise, repeated], context=500)
    stream = lzma.compress(noise + repeated, preset=9)
    assert got["xz9_nll"] == pytest.approx(8 * math.log(2) * len(stream) / 40000, rel=1e-12)
    eight_bits = 8 * math.log(2)
    alone = real_text.xz_nll([noise], context=500)["xz9_scored_nll"]
    assert abs(alone / eight_bits - 1) < 0.03, alone
    only_repeats = real_text.xz_nll([repeated], context=500)["xz9_scored_nll"]
    assert only_repeats < 0.02 * eight_bits, only_repeats
    # the pooled scored cost is the byte-weighted mix of the two files' (sizes add per file)
    assert only_repeats < got["xz9_scored_nll"] < alone
    with pytest.raises(ValueError, match="context 30000"):
        real_text.xz_nll([noise, repeated], context=30000)


def test_cli_end_to_end(tmp_path, capsys, monkeypatch):
    """A model saved with a data=stdlib run config: every table and plot is written (and
    logged to an offline wandb run), replay R_exact reads zero KL, and a model trained on
    other data is refused naming the flag."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(n_decoder_layers=2, window=4, topk=4, max_seq_len=64, vocab_size=259)
    run = tmp_path / "runs" / "job" / "seed0"
    save_model(make_model(cfg, 0).float(), run / "final")
    (run / "config.yaml").write_text("data:\n  kind: stdlib\n  validation_fraction: 0.05\n")
    dense = tmp_path / "runs" / "dense" / "seed0"
    save_model(make_model(tiny_config("dense", max_seq_len=64, vocab_size=259), 0).float(),
               dense / "final")
    (dense / "config.yaml").write_text((run / "config.yaml").read_text())
    out = tmp_path / "out"
    code = real_text.main(["--checkpoint", str(run / "final"), str(dense / "final"),
                           "--out", str(out),
                           "--max-files", "2", "--row-len", "64", "--context", "16",
                           "--bootstrap", "50", "--dtype", "float64"])
    err = capsys.readouterr().err
    assert code == 0, err
    # a reading of minutes per model says where it is (one line per model, in order)
    progress = [line for line in err.splitlines() if line.startswith("[real_text] ")]
    assert [line.split()[1] for line in progress] == ["1/2", "2/2"], progress
    assert "min left" in progress[0] and str(dense / "final") in progress[1]
    for name in ("tokens.parquet", "kl_by_position.csv", "kl_by_class.csv", "baselines.csv",
                 "kl_by_position.png", "kl_by_class.png", "settings.json"):
        assert (out / name).exists(), name
    import pandas as pd
    classes = pd.read_csv(out / "kl_by_class.csv")
    exact = classes[(classes["replay"] == "R_exact") & (classes["group"] == "all")]
    assert len(exact) == 2 and (exact["kl_max"] < 1e-12).all()      # the model and pooled row
    n1 = classes[(classes["replay"] == "1") & (classes["group"] == "all")]
    assert (n1["kl_mean"] > 1e-6).all()                               # a random model drifts
    assert set(classes["level"]) == {"model", "seeds"}
    base = pd.read_csv(out / "baselines.csv")
    assert list(base["job"]) == ["job", "dense"]          # the dense model is read here only
    assert (base["bigram_nll"] < base["unigram_nll"]).all()
    assert (base["unigram_nll"] < math.log(259)).all() and (base["nll_exact"] > 0).all()
    # xz reads real source: well under 8 bits a byte, one number for every model
    assert (base["xz9_nll"] < 4 * math.log(2)).all() and base["xz9_scored_nll"].nunique() == 1
    assert base["bytes"].nunique() == 1                   # the same bytes for every model
    assert json.loads((out / "settings.json").read_text())["max_files"] == 2
    from ced.tracking import read_offline_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    deadline = time.time() + 30       # the service may append the last records after finish()
    while True:
        summary = read_offline_run(runs[0])["summary"]
        if "nll/bigram" in summary or time.time() > deadline:
            break
        time.sleep(0.5)
    assert summary["nll/bigram"] == pytest.approx(base["bigram_nll"].iloc[0])
    assert summary["kl/job/R_exact/all"] < 1e-12 and summary["kl/job/1/all"] > 1e-6
    # a malformed replay form is one line naming the flag, before any model is read
    capsys.readouterr()                  # (wandb's own messages of the run above)
    assert real_text.main(["--checkpoint", str(run / "final"), "--out", str(tmp_path / "y"),
                           "--replays", "W", "W/0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("wandb")]
    assert len(err) == 1 and "--replays: expected" in err[0] and "'W/0'" in err[0]
    (run / "config.yaml").write_text("data:\n  kind: synthetic\n")
    assert real_text.main(["--checkpoint", str(run / "final"), "--out", str(tmp_path / "x")]) == 2
    assert "data kind 'synthetic'" in capsys.readouterr().err
    # a context shorter than R_exact + G (7 + 4 here) is refused, naming the flag
    (run / "config.yaml").write_text((dense / "config.yaml").read_text())
    assert real_text.main(["--checkpoint", str(run / "final"), "--out", str(tmp_path / "z"),
                           "--context", "10"]) == 2
    assert "--context: 10 is shorter than R_exact + G = 7 + 4" in capsys.readouterr().err


def _stdlib_run(root, job: str, cfg, seed: int):
    """A model saved as a data=stdlib training run's final/ (its config.yaml beside it)."""
    run = root / "runs" / job / f"seed{seed}"
    save_model(make_model(cfg, seed).float(), run / "final")
    (run / "config.yaml").write_text("data:\n  kind: stdlib\n  validation_fraction: 0.05\n")
    return str(run / "final")


def test_readings_of_one_model_each_merge_into_the_reading_of_all(tmp_path):
    """Every model read alone, then merged (`merge_readings`), writes the same tables as one
    reading of every model: per model rows, the per job rows pooled over its seeds (the same
    bootstrap draws), the positions and the baselines, for two seeds of one ced job, another
    ced geometry and a dense model read for its NLL only. Readings of other settings, or of
    models other than those named, are refused."""
    import pandas as pd
    ced = tiny_config(n_decoder_layers=2, window=4, topk=4, max_seq_len=128, vocab_size=259)
    wide = tiny_config(n_decoder_layers=1, window=6, topk=4, max_seq_len=128, vocab_size=259)
    models = [_stdlib_run(tmp_path, "ced", ced, 0), _stdlib_run(tmp_path, "ced", ced, 1),
              _stdlib_run(tmp_path, "wide", wide, 0),
              _stdlib_run(tmp_path, "dense", tiny_config("dense", max_seq_len=128,
                                                         vocab_size=259), 0)]
    # one pass over one file in rows of 128, float32 (merging is exact in any dtype and for
    # any number of passes): seconds a model
    settings = dict(replays=["1", "W", "R_exact"], max_files=1, row_len=128, context=16,
                    passes=1, bootstrap=20, dtype="float32", wandb=False)
    real_text.run(real_text.RealTextConfig(checkpoint=models, out=str(tmp_path / "all"),
                                           **settings))
    # readings of one model or of several, in any order
    parts = [[models[3], models[1]], [models[0]], [models[2]]]
    alone = [str(tmp_path / f"part{i}") for i in range(len(parts))]
    for part, out in zip(parts, alone):
        real_text.run(real_text.RealTextConfig(checkpoint=part, out=out, **settings))
    merged = tmp_path / "merged"
    real_text.merge_readings(real_text.RealTextConfig(checkpoint=models, out=str(merged),
                                                      **settings), alone)
    for name in ("kl_by_class.csv", "kl_by_position.csv", "baselines.csv"):
        expected = pd.read_csv(tmp_path / "all" / name)
        pd.testing.assert_frame_equal(pd.read_csv(merged / name), expected, check_exact=True)
    assert set(pd.read_csv(merged / "kl_by_class.csv")["level"]) == {"model", "seeds"}
    assert (merged / "kl_by_position.png").exists()
    with pytest.raises(ValueError, match="not each of --checkpoint"):
        real_text.merge_readings(real_text.RealTextConfig(
            checkpoint=models[:2], out=str(tmp_path / "m2"), **settings), alone)
    # a reading made with other replays
    shutil.copytree(alone[2], tmp_path / "other")
    other = json.loads((tmp_path / "other" / "settings.json").read_text())
    assert len(other["held_out"]) == 16 and other["validation_fraction"] == 0.05
    (tmp_path / "other" / "settings.json").write_text(json.dumps({**other, "replays": ["W"]}))
    with pytest.raises(ValueError, match="their replays differ"):
        real_text.merge_readings(real_text.RealTextConfig(
            checkpoint=models, out=str(tmp_path / "m3"), **settings),
            [*alone[:2], str(tmp_path / "other")])
    # readings of other held-out files (another stdlib), of no recorded forms, or that lost
    # the per-byte rows of a model whose replay they read are refused too
    for change, error in (({"held_out": "0" * 16}, "their held_out differ"),
                          ({"forms": None}, "no forms in settings.json")):
        edited = {key: value for key, value in {**other, **change}.items() if value is not None}
        (tmp_path / "other" / "settings.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=error):
            real_text.merge_readings(real_text.RealTextConfig(
                checkpoint=models, out=str(tmp_path / "m4"), **settings),
                [*alone[:2], str(tmp_path / "other")])
    (tmp_path / "other" / "settings.json").write_text(json.dumps(other))
    (tmp_path / "other" / "tokens.parquet").unlink()
    with pytest.raises(ValueError, match="no tokens.parquet rows of"):
        real_text.merge_readings(real_text.RealTextConfig(
            checkpoint=models, out=str(tmp_path / "m5"), **settings),
            [*alone[:2], str(tmp_path / "other")])


# ---- the lm-eval code tasks (evals.lmeval.code_tasks) ---------------------------------------

def test_code_task_points_on_a_hand_checked_file():
    from evals.lmeval.code_tasks import (close_points, dedent_choices, documents,
                                         identifier_points, name_runs)
    ann = annotate(SOURCE)
    runs = name_runs(ann)
    assert (_at(SOURCE, b"alpha"), _at(SOURCE, b"alpha") + 5) in runs
    assert all(SOURCE[b:e].decode().isidentifier() for b, e in runs)
    # 'alpha' again at 40, 23 bytes after the first: the cut two bytes in lies 25 back
    second = _at(SOURCE, b"alpha", 1)
    got = {p["cut"]: p for p in identifier_points(SOURCE, ann, context=30, min_distance=24)}
    assert got[second + 2] == {"cut": second + 2, "end": second + 5, "distance": 25}
    assert second + 2 not in {p["cut"] for p in identifier_points(SOURCE, ann, 30, 25)}
    # the earlier occurrence must lie inside the context
    assert second + 2 not in {p["cut"] for p in identifier_points(SOURCE, ann, 24, 20)}
    close = _at(SOURCE, b"beta)\n") + 4
    brackets = {p["at"]: p for p in close_points(SOURCE, ann, 30, 5, kind=1)}
    assert brackets[close]["distance"] == close - _at(SOURCE, b"(alpha +")
    y = _at(SOURCE, b"y = x")
    dedents = {p["at"]: p for p in close_points(SOURCE, ann, 60, 5, kind=2)}
    assert dedents[y]["cut"] == y - 4 and dedents[y]["distance"] == y - 4 - _at(SOURCE, b"if x:")
    # the line after 'os.sep]' (a continuation line indented 16; the block is at 8) returns
    # to 4: the choices are the open blocks' levels 0, 4, 8 (+ 'y'), not the continuation's
    assert ann.levels[y] == (0, 4, 8)
    assert dedent_choices(SOURCE, ann, y) == (["y", "    y", "        y"], 1)
    assert dedent_choices(SOURCE, ann, _at(SOURCE, b"return [x")) is None   # not a dedent
    z = _at(SOURCE, b"z = ")
    assert dedent_choices(SOURCE, ann, z) == (["z", "    z", "        z"], 0)
    docs = documents([("f.py", SOURCE)], "code_dedent", context=60, min_distance=5,
                     examples=10)
    assert docs and all(d["target"] == d["choices"][d["answer"]] for d in docs)
    for d in docs:
        assert SOURCE[:d["byte"]].decode().endswith(d["context"])


def test_code_tasks_are_written_as_an_lm_eval_group(tmp_path):
    from evals.lmeval.code_tasks import write_code_tasks
    files = [(f"f{i}.py", SOURCE * 3) for i in range(3)]
    written = write_code_tasks(tmp_path, files, context=60, min_distance=8, examples=5)
    assert set(written) == {"ced_code", "ced_code_identifier", "ced_code_close",
                            "ced_code_dedent", "ced_code_turn"}
    group = written["ced_code"].read_text()
    assert '"task": ["ced_code_identifier", "ced_code_close", "ced_code_dedent"]' in group \
        or 'task: ["ced_code_identifier", "ced_code_close", "ced_code_dedent"]' in group
    assert 'output_type: "multiple_choice"' in written["ced_code_dedent"].read_text()
    rows = [json.loads(line) for line in
            (tmp_path / "data" / "code_identifier.jsonl").read_text().splitlines()]
    turn = [json.loads(line) for line in
            (tmp_path / "data" / "code_turn.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(r["distance"] > 8 for r in rows)
    # the turn task reads other points than the identifier task
    assert not {(r["file"], r["byte"]) for r in rows} & {(r["file"], r["byte"]) for r in turn}
    with pytest.raises(ValueError, match="no point qualifies"):
        write_code_tasks(tmp_path / "none", files, context=60, min_distance=500, examples=5)


def test_dedent_documents_skip_a_comment_that_gives_the_level_away():
    from evals.lmeval.code_tasks import dedent_choices
    src = b"def f():\n    if x:\n        y = 1\n    # back at 4\n    z = 2\n"
    ann = annotate(src)
    z = src.index(b"z = 2")
    assert ann.closer_kind[z] == 2 and ann.levels[z] == (0, 4, 8)
    assert dedent_choices(src, ann, z) is None
    plain = src.replace(b"    # back at 4\n", b"")
    ann = annotate(plain)
    assert dedent_choices(plain, ann, plain.index(b"z = 2")) == (["z", "    z", "        z"], 1)


def test_lm_eval_runs_and_read_lm_eval_walk_the_same_finished_runs(tmp_path):
    """read_lm_eval and publish find runs through one walk (lm_eval_runs): job, seed and mode
    come from the path and mode.txt; a run without mode.txt (killed before it ended) is not a
    run, and `runs=` keeps only the listed ones."""
    doc = {"family": "code_close", "x": 16, "file": "a.py", "byte": 7, "distance": 20}
    for job, seed, mode, acc in [("ced_L2", 0, "full", 1), ("ced_L2", 0, "replay=W", 0),
                                 ("dense", 2, "full", 1)]:
        run_dir = tmp_path / job / f"seed{seed}" / "ced_code" / mode.replace("=", "_")
        (run_dir / "model").mkdir(parents=True)
        (run_dir / "mode.txt").write_text(mode + "\n")
        (run_dir / "model" / "samples_ced_code_close.jsonl").write_text(
            json.dumps({"doc": doc, "acc": acc}) + "\n")
    unfinished = tmp_path / "ced_L8" / "seed1" / "ced_code" / "full" / "model"
    unfinished.mkdir(parents=True)
    (unfinished / "samples_ced_code_close.jsonl").write_text(json.dumps({"doc": doc, "acc": 1}))
    found = [(job, seed, mode) for _, job, seed, mode in lm_eval_outcomes.lm_eval_runs(tmp_path)]
    assert found == [("ced_L2", 0, "full"), ("ced_L2", 0, "replay=W"), ("dense", 2, "full")]
    table = lm_eval_outcomes.read_lm_eval(tmp_path)
    assert sorted(zip(table["run"], table["mode"], table["correct"])) == [
        ("ced_L2/seed0", "full", True), ("ced_L2/seed0", "replay=W", False),
        ("dense/seed2", "full", True)]
    assert set(table["train_seed"]) == {0, 2} and set(table["id"]) == {"a.py:7"}
    only = lm_eval_outcomes.read_lm_eval(tmp_path, runs=[tmp_path / "dense/seed2/ced_code/full"])
    assert list(only["run"]) == ["dense/seed2"]
    with pytest.raises(FileNotFoundError, match="no <job>/seed<k>"):
        lm_eval_outcomes.read_lm_eval(tmp_path / "ced_L8")
