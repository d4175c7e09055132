"""ced.data: tokenizer, synthetic tasks (checked by independent reference solvers), token sources
(determinism, labels, splits, mixtures) and config validation."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from ced.data import (TASKS, ByteTokenizer, DataConfig, SequenceSource, answer_accuracy,
                      build_source, chance_accuracy, make_example)
from ced.data import corpora

TOK = ByteTokenizer()
CONF = Path(__file__).resolve().parents[2] / "conf" / "data"
FAMILIES = ["kv_recall", "copy", "variable_tracking", "running_state", "needle"]


# ---- reference solvers: parse the context, compute the answer -----------------------------
def kv_pair_list(text: str, sep: str = "") -> list[tuple[str, str]]:
    """The `KEY<sep>VALUE ` pairs of a kv_recall context in order (default alphabets: keys A-Z,
    values 0-9; filler is lowercase), queries included when they carry a value."""
    return re.findall(rf"(?<![A-Za-z0-9])([A-Z]+){re.escape(sep)}([0-9]+) ", text)


def kv_pairs(text: str, sep: str = "") -> dict[str, str]:
    return dict(kv_pair_list(text, sep))


def solve_kv_recall(ctx: str, sep: str = "") -> str:
    body, key = re.fullmatch(rf"(.*)\?([A-Z]+){re.escape(sep)}", ctx, re.S).groups()
    values = [v for k, v in kv_pair_list(body, sep) if k == key]
    assert len(values) == 1, (ctx, key)
    return values[0]


def solve_copy(ctx: str) -> str:
    assert ctx.endswith("?<")
    (span,) = re.findall(r"<(\w+)> ", ctx)
    return span


def solve_variable_tracking(ctx: str, sep: str = "") -> str:
    body, var = re.fullmatch(rf"(.*)\?(\w){re.escape(sep)}", ctx, re.S).groups()
    env = {}
    for name, value in re.findall(rf"(\w){re.escape(sep)}(\w);", body):
        assert name not in env
        env[name] = value
    while not var.isdigit():
        var = env[var]
    return var


def solve_running_state(ctx: str) -> str:
    window = re.fullmatch(r"[ab01()]*\|([ab01()]+)\?", ctx).group(1)
    if set(window) <= set("ab"):
        return str(window.count("a"))
    if set(window) <= set("01"):
        return str(window.count("1") % 2)
    depth = 0
    for ch in window:
        depth += 1 if ch == "(" else -1
        assert depth >= 0
    return str(depth)


def solve_needle(ctx: str, sep: str = ":") -> str:
    body, ident = re.fullmatch(rf"(.*)\?id (\d+){re.escape(sep)}", ctx, re.S).groups()
    codes = [c for i, c in re.findall(rf"id (\d+){re.escape(sep)}(\d+)\n", body) if i == ident]
    assert len(codes) == 1
    return codes[0]


SOLVERS = {f: globals()[f"solve_{f}"] for f in FAMILIES}


def distance_of(ex, fact: str) -> int:
    """Measured distance of the unique match of regex `fact` in the context: prompt tokens from
    its first byte to the end of the prompt, inclusive."""
    starts = [m.start() for m in re.finditer(fact, ex.context)]
    assert len(starts) == 1, (fact, ex.context)
    return len(ex.prompt_ids) - (starts[0] + 1)


# ---- tokenizer -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.decode([TOK.bos] + ids + [TOK.eos, TOK.pad]) == text
    assert TOK.decode(torch.tensor(ids, dtype=torch.long)) == text


def test_tokenizer_ids():
    assert (TOK.vocab_size, TOK.bos, TOK.eos, TOK.pad) == (259, 256, 257, 258)
    assert TOK.encode("hé") == [104, 195, 169]


# ---- synthetic tasks -----------------------------------------------------------------------
def test_registry():
    assert list(TASKS) == FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_generator_deterministic_and_varied(family):
    a, b = make_example(family, 7), make_example(family, 7)
    assert a == b and a.prompt_ids == b.prompt_ids
    assert a.prompt_ids == [TOK.bos] + list(a.context.encode()) and a.prompt_ids[0] == TOK.bos
    assert a.answer_ids == list(a.target.encode()) + [TOK.eos]
    assert 1 <= len(a.target) <= 6
    contexts = {make_example(family, s).context for s in range(20)}
    assert len(contexts) >= 18
    assert make_example(family, 7, **a.params) == a          # defaults recorded in params


PARAM_GRID = {
    "kv_recall": [{}, {"n_pairs": 8, "key_len": 2, "value_len": 3}, {"distance": 40, "length": 120}],
    "copy": [{}, {"span_len": 6}, {"distance": 60, "length": 100}],
    "variable_tracking": [{}, {"hops": 0}, {"hops": 4, "n_distractor_chains": 3},
                          {"distance": 90, "spread": 10, "length": 150}],
    "running_state": [{"kind": k, "window_len": m} for k in ("count", "parity", "bracket")
                      for m in (1, 8, 13)] + [{"kind": "bracket", "length": 40}],
    "needle": [{}, {"n_distractors": 10, "id_digits": 2, "code_digits": 6},
               {"distance": 100, "length": 300}],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_recoverable_from_context(family):
    for params in PARAM_GRID[family]:
        for seed in range(60):
            ex = make_example(family, seed, **params)
            assert SOLVERS[family](ex.context) == ex.target, (params, ex)
            assert ex.context.isascii() and ex.meta["length"] == len(ex.prompt_ids)


def fact_of(ex) -> str:
    """A regex for the fact whose distance the generator controls."""
    if ex.family == "kv_recall":
        key = ex.context.rsplit("?", 1)[1]
        return rf"(?<![A-Za-z0-9]){key}{ex.target} "
    if ex.family == "copy":
        return f"<{ex.target}> "
    ident = re.search(r"\?id (\d+):$", ex.context).group(1)
    return f"id {ident}:{ex.target}\n"


@pytest.mark.parametrize("family", ["kv_recall", "copy", "needle"])
def test_distance_and_length_honoured(family):
    minimum = {"kv_recall": 5, "copy": 11, "needle": 20}[family]
    for distance in (minimum, minimum + 1, 50, 257):
        for length in (None, 300, 600):
            for seed in range(8):
                ex = make_example(family, seed, distance=distance, length=length)
                measured = distance_of(ex, fact_of(ex))
                assert measured == distance == ex.meta["distance"], (distance, ex)
                assert length is None or len(ex.prompt_ids) == length
                assert SOLVERS[family](ex.context) == ex.target
    # random placement: meta reports the measured distance
    for seed in range(30):
        ex = make_example(family, seed)
        assert distance_of(ex, fact_of(ex)) == ex.meta["distance"]


@pytest.mark.parametrize("sep", ["", "="])
def test_variable_tracking_hops_at_controlled_distances(sep):
    width = 3 + len(sep)                               # variable, sep, value, `;`
    for distance, spread, hops in [(120, 30, 2), (60, 0, 3), (300, 97, 2), (43, None, 4)]:
        for seed in range(10):
            ex = make_example("variable_tracking", seed, hops=hops, distance=distance,
                              spread=spread, length=400, n_distractor_chains=2, sep=sep)
            assert len(ex.prompt_ids) == 400
            assert solve_variable_tracking(ex.context, sep) == ex.target
            assert ex.context.endswith(f"?{ex.context[-1 - len(sep)]}{sep}")
            # walk the queried chain back from the query, measuring each statement
            var, measured = ex.context[-1 - len(sep)], []
            for _ in range(hops + 1):
                (stmt,) = re.findall(rf"(?<![A-Z]){var}{re.escape(sep)}\w;", ex.context)
                measured.append(distance_of(ex, re.escape(stmt)))
                var = stmt[1 + len(sep)]
            measured.reverse()                         # literal first
            assert measured == ex.meta["chain_distances"] and measured[0] == distance
            assert var.isdigit() and var == ex.target
            if spread is not None:
                assert measured == [distance - k * (width + spread) for k in range(hops + 1)]


@pytest.mark.parametrize("sep", [" code ", ":", "=>"])
def test_needle_sep_sets_the_text_between_id_and_code(sep):
    for seed in range(20):
        ex = make_example("needle", seed, n_distractors=5, sep=sep, distance=60, length=150)
        assert ex.context.endswith(sep) and solve_needle(ex.context, sep) == ex.target
        assert len(re.findall(rf"id \d{{3}}{re.escape(sep)}\d{{4}}\n", ex.context)) == 6
        ident = re.search(r"\?id (\d+)", ex.context).group(1)
        assert distance_of(ex, rf"id {ident}{re.escape(sep)}{ex.target}") == 60
    for bad in ("", "1", "a?", 5):
        with pytest.raises(ValueError, match="sep"):
            make_example("needle", 0, sep=bad)


@pytest.mark.parametrize("id_digits", [2, 3, 4])
def test_needle_near_misses_differ_from_the_needle_id_in_one_digit(id_digits):
    """near_misses distractor ids sit one digit from the needle's, the rest stay uniform, ids
    stay distinct, the answer stays unique, and the near misses' digit positions vary."""
    positions = set()
    for seed in range(40):
        ex = make_example("needle", seed, n_distractors=8, id_digits=id_digits, near_misses=4)
        assert solve_needle(ex.context) == ex.target
        ident = re.search(r"\?id (\d+):$", ex.context).group(1)
        ids = [i for i, _ in re.findall(rf"id (\d{{{id_digits}}}):(\d{{4}})\n", ex.context)]
        assert len(ids) == 9 and len(set(ids)) == 9 and ident in ids
        dist = [sum(a != b for a, b in zip(i, ident)) for i in ids if i != ident]
        assert dist.count(1) >= 4 and 0 not in dist
        positions |= {k for i in ids for k in range(id_digits)
                      if sum(a != b for a, b in zip(i, ident)) == 1 and i[k] != ident[k]}
    assert positions == set(range(id_digits))


def test_needle_near_misses_default_keeps_the_data_and_bad_values_name_the_key():
    for seed in range(20):
        a, b = make_example("needle", seed, near_misses=0), make_example("needle", seed)
        assert (a.context, a.target) == (b.context, b.target)
    for bad in (-1, 4, 1.5):
        with pytest.raises(ValueError, match="near_misses"):
            make_example("needle", 0, n_distractors=3, near_misses=bad)
    with pytest.raises(ValueError, match=r"near_misses.*9 \* id_digits"):
        make_example("needle", 0, n_distractors=12, id_digits=2, near_misses=19)


def test_running_state_window_and_length():
    for seed in range(20):
        ex = make_example("running_state", seed, kind="parity", window_len=5, length=30)
        assert len(ex.prompt_ids) == 30 and ex.context.index("|") == 30 - 1 - 7
        assert distance_of(ex, r"\|") == ex.meta["distance"] == 7


def test_layout_moves_content_only():
    """One seed, different layouts: same facts, same query, same answer."""
    a = make_example("kv_recall", 3, n_pairs=6)
    b = make_example("kv_recall", 3, n_pairs=6, distance=100, length=400)
    pairs = lambda ex: sorted(kv_pairs(ex.context).items())   # noqa: E731
    assert pairs(a) == pairs(b) and a.target == b.target
    assert a.context.rsplit("?", 1)[1] == b.context.rsplit("?", 1)[1]


def test_chance_accuracy():
    assert chance_accuracy("kv_recall") == pytest.approx(1 / 4 + 3 / 4 / 10)
    assert chance_accuracy("copy", span_len=2, alphabet="AB") == 0.25
    assert chance_accuracy("needle") == pytest.approx(1 / 4 + 3 / 4 * 1e-4)
    assert chance_accuracy("variable_tracking") == pytest.approx(0.5 + 0.5 / 10)
    assert chance_accuracy("running_state", kind="parity") == 0.5
    # running_state: the most frequent target's empirical frequency matches
    for kind in ("count", "bracket"):
        counts = Counter(make_example("running_state", s, kind=kind, window_len=6).target
                         for s in range(3000))
        assert max(counts.values()) / 3000 == pytest.approx(
            chance_accuracy("running_state", kind=kind, window_len=6), abs=0.035)


@pytest.mark.parametrize("family, params, key", [
    ("kv_recall", {"n_pair": 3}, "data.tasks.kv_recall.n_pair"),
    ("kv_recall", {"n_pairs": 27}, "data.tasks.kv_recall.n_pairs"),
    ("kv_recall", {"distance": 4}, "data.tasks.kv_recall.distance"),
    ("kv_recall", {"value_alphabet": "1=2"}, "data.tasks.kv_recall.value_alphabet"),
    ("copy", {"span_len": 0}, "data.tasks.copy.span_len"),
    ("needle", {"distance": 50, "length": 60}, "data.tasks.needle.length"),
    ("variable_tracking", {"hops": 9, "n_distractor_chains": 2}, "data.tasks.variable_tracking.n_distractor_chains"),
    ("variable_tracking", {"distance": 30, "spread": 20}, "data.tasks.variable_tracking.distance"),
    ("running_state", {"kind": "xor"}, "data.tasks.running_state.kind"),
    ("running_state", {"length": 5}, "data.tasks.running_state.length"),
])
def test_generator_errors_name_the_key(family, params, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        make_example(family, 0, **params)
    with pytest.raises(ValueError, match="unknown task 'kv_recal'"):
        make_example("kv_recal", 0)


# ---- sources -------------------------------------------------------------------------------
def check_rows(batch, count, seq_len):
    assert set(batch) == {"input_ids", "labels", "answer_mask", "family_ids"}
    for name, dtype in [("input_ids", torch.long), ("labels", torch.long),
                        ("answer_mask", torch.bool), ("family_ids", torch.long)]:
        assert batch[name].shape == (count, seq_len) and batch[name].dtype == dtype
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.min() >= 0 and ids.max() < TOK.vocab_size
    nxt = ids[:, 1:]
    expect = nxt.masked_fill((nxt == TOK.bos) | (nxt == TOK.pad), -100)
    assert torch.equal(labels[:, :-1], expect)
    assert not (batch["answer_mask"] & (labels == -100)).any()
    assert torch.equal(batch["family_ids"] >= 0, batch["answer_mask"])


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cat_rows(*batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def test_synthetic_rows_answers_are_correct():
    source = build_source(DataConfig(), "train")
    assert isinstance(source, SequenceSource) and source.families == FAMILIES
    batch = source.rows(0, 48, 256)
    check_rows(batch, 48, 256)
    seen = Counter()
    for row in range(48):
        ids, mask = batch["input_ids"][row].tolist(), batch["answer_mask"][row]
        labels, fams = batch["labels"][row].tolist(), batch["family_ids"][row].tolist()
        positions = mask.nonzero().flatten().tolist()
        runs = [[positions[0]]]
        for p in positions[1:]:
            runs[-1].append(p) if p == runs[-1][-1] + 1 else runs.append([p])
        for run in runs:
            family = source.families[fams[run[0]]]
            assert {fams[p] for p in run} == {fams[run[0]]}
            start = max(i for i in range(run[0] + 1) if ids[i] == TOK.bos)
            context = TOK.decode(ids[start + 1:run[0] + 1])
            answer = [labels[p] for p in run]
            assert answer[-1] == TOK.eos and TOK.decode(answer) == SOLVERS[family](context)
            assert ids[run[0] + 1:run[-1] + 2] == answer        # labels are the next tokens
            seen[family] += 1
    assert set(seen) == set(FAMILIES)


@pytest.mark.parametrize("cfg", [
    {"kind": "synthetic", "seed": 3},
    {"kind": "stdlib"},
    {"kind": "mixture", "mixture": [{"kind": "synthetic", "weight": 1}, {"kind": "stdlib", "weight": 1}]},
], ids=["synthetic", "stdlib", "mixture"])
def test_rows_deterministic_and_split_independent(cfg):
    source = build_source(cfg, "train")
    whole = source.rows(0, 8, 200)
    check_rows(whole, 8, 200)
    assert_same(whole, cat_rows(source.rows(0, 3, 200), source.rows(3, 5, 200)))
    assert_same(whole, build_source(cfg, "train").rows(0, 8, 200))        # a fresh source
    assert_same(whole, pickle.loads(pickle.dumps(source)).rows(0, 8, 200))  # DataLoader workers
    assert_same(source.rows(5, 1, 200), {k: v[5:6] for k, v in whole.items()})
    assert not torch.equal(whole["input_ids"], build_source(cfg, "validation").rows(0, 8, 200)["input_ids"])
    assert not torch.equal(whole["input_ids"], build_source({**cfg, "seed": 1}, "train").rows(0, 8, 200)["input_ids"])
    assert source.rows(0, 0, 200)["input_ids"].shape == (0, 200)


def docs_of(stream: torch.Tensor) -> list[bytes]:
    """Invert the packing BOS doc EOS BOS doc EOS ..."""
    bos = (stream == TOK.bos).nonzero().flatten().tolist()
    eos = (stream == TOK.eos).nonzero().flatten().tolist()
    assert len(bos) == len(eos) and bos[0] == 0 and eos[-1] == len(stream) - 1
    return [bytes(stream[b + 1:e].to(torch.uint8).tolist()) for b, e in zip(bos, eos)]


def stable_in_validation(identity: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "big")
    return h / 2 ** 64 < fraction


def test_stdlib_split_disjoint_and_stable():
    paths = corpora.stdlib_paths()
    rels = [r for r, _ in paths]
    assert corpora.stdlib_paths() == paths                          # deterministic listing
    assert len(rels) > 300 and not any("site-packages" in r or "/test/" in f"/{r}" for r in rels)
    val = [r for r in rels if stable_in_validation(r, 0.05)]
    assert 0.02 < len(val) / len(rels) < 0.09
    streams = corpora.stdlib_streams(0.05)
    expected = [Path(p).read_bytes() for r, p in paths if r in set(val)]
    assert docs_of(streams["validation"]) == expected
    train_sizes = sum(len(Path(p).read_bytes()) + 2 for r, p in paths if r not in set(val))
    assert len(streams["train"]) == train_sizes
    assert corpora.in_validation("json/decoder.py", 0.5) is stable_in_validation("json/decoder.py", 0.5)
    source = build_source({"kind": "stdlib"}, "validation")
    batch = source.rows(0, 4, 128)
    check_rows(batch, 4, 128)
    assert not batch["answer_mask"].any() and source.families == []


def write_jsonl(path: Path, n: int) -> list[str]:
    texts = [f"document {i}: " + "lorem ipsum é " * (i % 7 + 1) for i in range(n)]
    path.write_text("".join(json.dumps({"text": t, "other": i}) + "\n" for i, t in enumerate(texts)))
    return texts


def test_hf_local_jsonl(tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    texts = write_jsonl(tmp_path / "docs.jsonl", 300)
    monkeypatch.chdir(tmp_path)                            # relative paths: from the cwd
    cfg = {"kind": "hf", "name": "json", "files": ["docs.jsonl"], "validation_fraction": 0.2}
    train, val = build_source(cfg, "train"), build_source(cfg, "validation")
    got_train = [d.decode() for d in docs_of(train.stream)]
    got_val = [d.decode() for d in docs_of(val.stream)]
    assert set(got_train).isdisjoint(got_val) and sorted(got_train + got_val) == sorted(texts)
    assert got_val == [t for t in texts if stable_in_validation(t, 0.2)]
    batch = train.rows(0, 6, 64)
    check_rows(batch, 6, 64)
    assert_same(batch, cat_rows(train.rows(0, 2, 64), train.rows(2, 4, 64)))
    # builder inferred from the extension
    inferred = build_source({"kind": "hf", "files": [str(tmp_path / "docs.jsonl")],
                             "validation_fraction": 0.2}, "train")
    assert torch.equal(inferred.stream, train.stream)
    with pytest.raises(ValueError, match=r"data\.text_field='body'"):
        build_source({**cfg, "text_field": "body"}, "train").rows(0, 1, 8)


def test_hf_streaming_and_max_documents_read_the_first_documents(tmp_path, monkeypatch):
    """data.streaming reads documents as they come (here from a local file, offline) and
    stops at data.max_documents; the same cap without streaming gives the same documents."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    texts = write_jsonl(tmp_path / "docs.jsonl", 300)
    base = {"kind": "hf", "name": "json", "files": [str(tmp_path / "docs.jsonl")],
            "validation_fraction": 0.2, "max_documents": 50}
    streamed = build_source({**base, "streaming": True}, "train")
    capped = build_source(base, "train")
    got = [d.decode() for d in docs_of(streamed.stream)]
    assert got == [t for t in texts[:50] if not stable_in_validation(t, 0.2)]
    assert torch.equal(streamed.stream, capped.stream)
    with pytest.raises(ValueError, match=r"data\.max_documents: required with data\.streaming"):
        build_source({**base, "streaming": True, "max_documents": None}, "train").rows(0, 1, 8)


def test_hf_subset_and_revision_reach_load_dataset(monkeypatch):
    import datasets

    from ced.data import corpora
    seen = {}

    def fake_load_dataset(path, **kwargs):
        seen.update(path=path, **kwargs)
        return datasets.Dataset.from_dict({"text": ["a b c", "d e f"] * 20})

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(corpora, "offline", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = build_source({"kind": "hf", "name": "someone/corpus", "subset": "en",
                           "revision": "v1.0", "hf_split": "train"}, "train")
    source.rows(0, 1, 8)
    assert seen == {"path": "someone/corpus", "split": "train", "name": "en", "revision": "v1.0"}
    with pytest.raises(ValueError, match=r"data\.subset must be null or a non-empty string"):
        build_source({"kind": "hf", "name": "someone/corpus", "subset": ""}, "train")


def test_hf_hub_name_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"data\.name='someone/corpus'.*offline.*"
                                         r"data\.name=json data\.files=\["):
        build_source({"kind": "hf", "name": "someone/corpus"}, "train")
    assert time.perf_counter() - t0 < 0.5


def test_mixture_weights_and_family_ids():
    cfg = {"kind": "mixture", "seed": 5, "mixture": [
        {"kind": "synthetic", "weight": 0.25, "only": ["copy"]},
        {"kind": "synthetic", "weight": 0.5, "seed": 9,
         "tasks": {"kv_recall": {"weight": 1}, "copy": {"span_len": 2}},
         "only": ["kv_recall", "copy"]},
        {"kind": "stdlib", "weight": 0.25}]}
    source = build_source(cfg, "train")
    assert source.families == ["copy", "kv_recall"]
    n, seq_len = 400, 96
    batch = source.rows(0, n, seq_len)
    check_rows(batch, n, seq_len)
    comps = [build_source({**c, "seed": c.get("seed", 5)}, "train").rows(0, n, seq_len)
             for c in ({k: v for k, v in c.items() if k != "weight"} for c in cfg["mixture"])]
    picks = []
    for r in range(n):
        match = [i for i, c in enumerate(comps) if torch.equal(c["input_ids"][r], batch["input_ids"][r])]
        assert len(match) == 1
        picks.append(match[0])
        fam = comps[match[0]]["family_ids"][r]
        names = ([["copy"], ["kv_recall", "copy"], []][match[0]])
        expect = torch.tensor([source.families.index(names[f]) if f >= 0 else -1 for f in fam.tolist()])
        assert torch.equal(batch["family_ids"][r], expect)
    shares = [picks.count(i) / n for i in range(3)]
    assert shares == pytest.approx([0.25, 0.5, 0.25], abs=0.08)


def test_answer_accuracy():
    source = build_source({"only": ["copy", "kv_recall"]}, "train")
    batch = source.rows(0, 4, 128)
    perfect = answer_accuracy(batch["labels"], batch, source.families)
    assert all(v["token_acc"] == 1.0 and v["exact_match"] == 1.0 for v in perfect.values())
    pred = batch["labels"].clone()
    first = batch["answer_mask"].nonzero()[0]
    fam = source.families[int(batch["family_ids"][first[0], first[1]])]
    pred[first[0], first[1]] = 0
    hurt = answer_accuracy(pred, batch, source.families)[fam]
    assert hurt["exact_match"] == pytest.approx(1 - 1 / hurt["examples"])


# ---- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key", [
    ({"kind": "corpus"}, "data.kind"),
    ({"foo": 1}, "data.foo"),
    ({"seed": -1}, "data.seed"),
    ({"tasks": {"kv_recal": {}}}, "data.tasks.kv_recal"),
    ({"tasks": {"kv_recall": {"n_pair": 2}}}, "data.tasks.kv_recall.n_pair"),
    ({"tasks": {"kv_recall": {"n_pairs": 0}}}, "data.tasks.kv_recall.n_pairs"),
    ({"tasks": {"copy": {"weight": 0}}}, "data.tasks.copy.weight"),
    ({"tasks": {"par": {"family": "running_state", "kind": "xor"}}}, "data.tasks.par.kind"),
    ({"tasks": {"par": {"family": "parity"}}}, "data.tasks.par.family"),
    ({"tasks": {name: None for name in FAMILIES}}, "data.tasks"),
    ({"kind": "stdlib", "validation_fraction": 1.0}, "data.validation_fraction"),
    ({"kind": "hf", "name": "json"}, "data.files"),
    ({"kind": "hf", "name": "json", "files": ["/nonexistent/x.jsonl"]}, "data.files[0]"),
    ({"kind": "hf", "files": ["/etc/hostname"]}, "data.name"),
    ({"kind": "mixture"}, "data.mixture"),
    ({"kind": "mixture", "mixture": [{"kind": "stdlib", "weight": -1}]}, "data.mixture[0].weight"),
    ({"kind": "mixture", "mixture": [{"kind": "stdlib"}, {"kind": "mixture"}]}, "data.mixture[1].kind"),
    ({"kind": "mixture", "mixture": [{"kind": "synthetic", "tasks": {"copy": {"spanlen": 1}}}]},
     "data.mixture[0].tasks.copy.spanlen"),
])
def test_config_errors_name_the_key(cfg, key):
    with pytest.raises(ValueError, match=re.escape(key)) as info:
        build_source(cfg, "train")
    assert "\n" not in str(info.value)


def test_errors_at_rows_time():
    with pytest.raises(ValueError, match=r"data\.tasks\.needle: .*seq_len=64"):
        build_source({}, "train").rows(0, 1, 64)
    with pytest.raises(ValueError, match=r"data\.validation_fraction=0"):
        build_source({"kind": "stdlib", "validation_fraction": 0}, "validation")
    with pytest.raises(ValueError, match="split"):
        build_source({}, "test")


def test_conf_files_and_hydra_schema():
    schema = OmegaConf.structured(DataConfig)
    cfgs = {n: OmegaConf.merge(schema, OmegaConf.load(CONF / f"{n}.yaml"))
            for n in ("synthetic", "stdlib", "hf", "mixture")}
    synthetic = build_source(cfgs["synthetic"], "train")
    assert synthetic.families == FAMILIES
    default = build_source(DataConfig(), "train")      # tasks: {} = all five with defaults
    assert_same(synthetic.rows(0, 4, 256), default.rows(0, 4, 256))
    assert build_source(cfgs["stdlib"], "train").families == []
    assert build_source(cfgs["mixture"], "validation").families == FAMILIES
    with pytest.raises(ValueError, match=r"data\.files is required"):
        build_source(cfgs["hf"], "train")
    OmegaConf.update(cfgs["synthetic"], "tasks.needle", None, merge=True)   # data.tasks.needle=null
    assert build_source(cfgs["synthetic"], "train").families == FAMILIES[:4]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("queries", [2, 4, 6])
@pytest.mark.parametrize("sep", ["", "="])
def test_kv_recall_queries_mark_every_answer(seed, queries, sep):
    """Multi-query kv_recall (training option): every marked context span is the value of the
    key asked just before it, the keys asked are distinct, and the final query is the target."""
    ex = make_example("kv_recall", seed, n_pairs=6, queries=queries, filler=8, sep=sep)
    pairs = kv_pairs(ex.context.split("?")[0], sep)
    assert len(pairs) == 6
    spans = ex.meta["answer_spans"]
    assert len(spans) == queries - 1
    asked = []
    for start, size in spans:
        key = ex.context[start - 1 - len(sep)]
        assert ex.context[start - 2 - len(sep):start] == f"?{key}{sep}"
        assert ex.context[start:start + size] == pairs[key]
        asked.append(key)
    final = ex.context[-1 - len(sep)]
    assert ex.context.endswith(f"?{final}{sep}") and ex.target == pairs[final]
    assert len(set(asked + [final])) == queries


@pytest.mark.parametrize("seed", range(8))
def test_kv_recall_value_follows_its_key(seed):
    """The default format is zoology's: `K7 ` pairs and a query ending with the key, so the
    answer is the token after the key's earlier occurrence; sep="=" restores `K=7 ` / `?K=`."""
    plain = make_example("kv_recall", seed, filler=0)
    marked = make_example("kv_recall", seed, filler=0, sep="=")
    assert plain.context.endswith("?" + plain.context[-1]) and "=" not in plain.context
    assert marked.context.endswith("=") and marked.target == plain.target
    assert solve_kv_recall(plain.context) == solve_kv_recall(marked.context, "=") == plain.target
    assert marked.context.replace("=", "") == plain.context
    # the separator widens the fact, every later pair and the query by one token each
    d = marked.meta["distance"]
    assert d == plain.meta["distance"] + marked.context[-(d - 1):].count("=")


@pytest.mark.parametrize("sep", ["?", " ", "a", "1", "====", 3])
def test_kv_recall_sep_must_be_punctuation(sep):
    with pytest.raises(ValueError, match="data.tasks.kv_recall.sep"):
        make_example("kv_recall", 0, sep=sep)


def test_kv_recall_single_query_examples_unchanged_by_the_option():
    """queries=1 draws nothing extra: the examples the suites and golden files use stay put."""
    for seed in range(20):
        a = make_example("kv_recall", seed)
        b = make_example("kv_recall", seed, queries=1)
        assert (a.context, a.target, a.meta) == (b.context, b.target, b.meta)
        assert "answer_spans" not in a.meta
    with pytest.raises(ValueError, match="data.tasks.kv_recall.queries"):
        make_example("kv_recall", 0, n_pairs=3, queries=4)


def test_rows_mark_context_answers_for_multi_query_examples():
    source = build_source({"kind": "synthetic", "tasks": {
        "kv_recall": {"weight": 1.0, "n_pairs": 5, "queries": 5, "filler": 4}},
        "only": ["kv_recall"]}, "train")
    batch = source.rows(0, 6, 128)
    for row in range(6):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        marked = batch["answer_mask"][row].nonzero().flatten().tolist()
        values = [p for p in marked if labels[p] != TOK.eos]
        assert values
        for p in values:     # each marked value follows "?K" and equals K's value in context
            assert TOK.decode(ids[p - 1:p + 1])[0] == "?"
            start = max(i for i in range(p + 1) if ids[i] == TOK.bos)
            text = TOK.decode(ids[start + 1:p + 1])
            key = text[-1]
            assert kv_pairs(text.split("?")[0])[key] == TOK.decode([labels[p]])


def test_curriculum_ramps_filler_on_training_rows_only():
    """data.curriculum_rows: early training rows pack more, shorter examples (filler scaled
    towards 0), later rows and every validation row have the configured spread, and rows stay a
    pure function of their index."""
    tasks = {"kv_recall": {"weight": 1.0, "filler": 64}, "copy": {"weight": 1.0}}
    narrowed = {"kind": "synthetic", "tasks": tasks, "only": list(tasks)}
    ramped = build_source({**narrowed, "curriculum_rows": 400}, "train")
    plain_train = build_source(narrowed, "train")

    def examples_per_row(source, start):
        batch = source.rows(start, 40, 256)
        return (batch["input_ids"] == TOK.bos).sum().item() / 40

    assert examples_per_row(ramped, 0) > 1.5 * examples_per_row(plain_train, 0)
    late = ramped.rows(400, 8, 256)
    assert torch.equal(late["input_ids"], plain_train.rows(400, 8, 256)["input_ids"])
    assert torch.equal(ramped.rows(3, 5, 256)["input_ids"], ramped.rows(3, 5, 256)["input_ids"])
    val_ramped = build_source({**narrowed, "curriculum_rows": 400}, "validation")
    val_plain = build_source(narrowed, "validation")
    assert torch.equal(val_ramped.rows(0, 8, 256)["input_ids"],
                       val_plain.rows(0, 8, 256)["input_ids"])
    with pytest.raises(ValueError, match="data.curriculum_rows"):
        build_source({"kind": "synthetic", "curriculum_rows": -1}, "train")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("start", [1, 37, 200])
def test_from_row_stages_a_task_into_training_rows(seed, start):
    """data.tasks.<name>.from_row: training rows before `start` draw none of that task, rows
    from it on draw it with its weight (row for row the rows of the unstaged source);
    validation rows draw every task from row 0; rows before `start` are those of a source
    whose late task has a vanishing weight (the same random draws: a stage does not reshuffle
    the early curriculum). Rows without from_row stay as they were: test_registry's golden
    row hashes."""
    early = {"kv_recall": {"filler": 8}, "copy": {"filler": 8}}
    staged_tasks = {**early, "copy": {"filler": 8, "from_row": start}}
    cfg = {"kind": "synthetic", "seed": seed, "only": ["kv_recall", "copy"]}
    staged = build_source({**cfg, "tasks": staged_tasks}, "train")
    both = build_source({**cfg, "tasks": early}, "train")
    copy_id = staged.families.index("copy")

    before = staged.rows(0, start, 128)["family_ids"]
    assert not (before == copy_id).any()
    after = staged.rows(start, 200, 128)["family_ids"]
    copies = (after == copy_id).any(dim=1).float().mean().item()
    assert 0.6 < copies <= 1.0        # equal weights, several examples a row: most rows hold one
    # From `start` on, the staged source is the unstaged one row for row.
    assert torch.equal(after, both.rows(start, 200, 128)["family_ids"])
    val = build_source({**cfg, "tasks": staged_tasks}, "validation").rows(0, 20, 128)
    assert torch.equal(val["input_ids"],
                       build_source({**cfg, "tasks": early}, "validation").rows(0, 20, 128)[
                           "input_ids"])
    # Before `start`, the rows are those of kv_recall alone: a zero weight draws nothing.
    alone = build_source({**cfg, "only": ["kv_recall", "copy"],
                          "tasks": {**early, "copy": {"filler": 8, "weight": 1e-300}}}, "train")
    assert torch.equal(before, alone.rows(0, start, 128)["family_ids"])


def test_from_row_errors_name_the_key():
    """A bad from_row names data.tasks.<name>.from_row; a schedule whose row 0 has no task is
    refused (validation alone would accept it, so the training split says why)."""
    with pytest.raises(ValueError, match=r"data\.tasks\.copy\.from_row must be an integer >= 0"):
        build_source({"kind": "synthetic", "tasks": {"copy": {"from_row": -3}}}, "train")
    with pytest.raises(ValueError, match=r"data\.tasks\.copy\.from_row"):
        build_source({"kind": "synthetic", "tasks": {"copy": {"from_row": 1.5}}}, "train")
    with pytest.raises(ValueError, match="every task has from_row > 0"):
        build_source({"kind": "synthetic", "only": ["copy"],
                      "tasks": {"copy": {"from_row": 4}}}, "train")
    build_source({"kind": "synthetic", "only": ["copy"],
                  "tasks": {"copy": {"from_row": 4}}}, "validation")


@pytest.mark.parametrize("per_row", [1, 2])
def test_examples_per_row_caps_the_packing(per_row):
    """data.examples_per_row: at most that many examples (BOS tokens) per row, the rest padding;
    the default packs as many as fit, and a bad value names the key."""
    tasks = {"kv_recall": {"weight": 1.0, "filler": 0}, "copy": {"weight": 1.0, "filler": 0}}
    packed = build_source({"tasks": tasks, "only": list(tasks)}, "train").rows(0, 16, 128)
    capped = build_source({"tasks": tasks, "only": list(tasks), "examples_per_row": per_row},
                          "train").rows(0, 16, 128)
    assert ((packed["input_ids"] == TOK.bos).sum(1) > per_row).all()
    assert ((capped["input_ids"] == TOK.bos).sum(1) == per_row).all()
    # the first example of each row is the same draw either way
    first = (capped["input_ids"] == TOK.pad).int().argmax(1) if per_row == 1 else None
    if first is not None:
        for row in range(16):
            n = int(first[row])
            assert torch.equal(capped["input_ids"][row, :n], packed["input_ids"][row, :n])
    with pytest.raises(ValueError, match="data.examples_per_row"):
        build_source({"tasks": tasks, "only": list(tasks), "examples_per_row": 0}, "train")


def test_running_state_min_window_len_draws_every_window_and_leaves_fixed_ones_alone():
    lengths = {make_example("running_state", s, min_window_len=2, window_len=6).meta["distance"] - 2
               for s in range(200)}
    assert lengths == {2, 3, 4, 5, 6}
    for s in range(20):    # unset: the suite's fixed-window examples are what they were
        fixed = make_example("running_state", s, window_len=5)
        assert fixed.meta["distance"] == 7
        same = make_example("running_state", s, window_len=5, min_window_len=None)
        assert same.prompt_ids == fixed.prompt_ids and same.answer_ids == fixed.answer_ids
    ex = make_example("running_state", 3, min_window_len=4, window_len=9)
    window = bytes(ex.prompt_ids[1:]).decode().split("|")[1].rstrip("?")
    assert bytes(ex.answer_ids[:-1]).decode() == str(window.count("a"))
    for bad in ({"min_window_len": 0}, {"min_window_len": 9, "window_len": 8},
                {"min_window_len": 1.5}):
        with pytest.raises(ValueError, match=r"data\.tasks\.running_state\.min_window_len"):
            make_example("running_state", 0, **bad)
