"""lm-eval integration: `--model ced` scores on the inference-engine path (its log-likelihoods are
mode_logits', and with replay=exact the full forward's), every edge-case family runs through
lm-eval offline from generated task YAMLs, agreeing document by document with the suite runner,
and the shell entry point works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from ced import InferenceEngine  # noqa: E402
from ced.checkpoint import save_model  # noqa: E402
from ced.data import ByteTokenizer  # noqa: E402
from conftest import make_model, tiny_config  # noqa: E402
from evals.lmeval import CEDLM, build_mode  # noqa: E402
from evals.lmeval.model import ModelArgsError  # noqa: E402
from evals.lmeval.tasks import write_tasks  # noqa: E402
from evals.modes import exact_logits, mode_logits, parse_mode  # noqa: E402
from evals.suites import (FAMILIES, SuiteSettings, build_documents, evaluate_documents,  # noqa: E402
                          load_checkpoint, make_engine)

ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
TOL = 1e-6          # float64 model: the two sides differ by summation order only


def lm_config(**kw):
    base = dict(vocab_size=259, n_encoder_layers=2, n_decoder_layers=2, window=6, topk=3,
                global_from_layer=1, encoder_kv_groups=1, max_seq_len=256)
    return tiny_config(**{**base, **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_model(make_model(lm_config(), 1), tmp_path_factory.mktemp("ckpt") / "final")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_checkpoint(checkpoint, dtype="float64")


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


# Prompts full of repeats among them: identical windows give global entries equal in exact
# arithmetic, which the engine and the parallel forward compute with different kernels; the
# indexer's scores are rounded before the top-k (docs/api.md, "Ties in the top-k"), so such
# near-ties break alike on both paths and the exact comparison with the full forward holds on
# them too.
PAIRS = [("ko lusa K=7 be Q=3 du ma X=1 zo pe N=4 tavi ?K=", "7"),
         ("vu 4 ka 9 mi 2 lo 8 nefa duri ?ka ", "9 "),
         ("", "abc"),                                   # empty context: BOS alone
         ("ze F=7 ze mala sama sepi pubege kore W=5 var U=7 veru ?W=", "5 "),
         ("id 012 code id 012 code id 012 code id 7 code ?id ", "012"),
         ("abababababababababababababab aaaaaaaaaaaa ab", "ab"),
         ("the cat sat on the mat. " * 4 + "the cat sat on the ", "mat")]


def engine_ll(model, context: str, continuation: str, mode: str) -> tuple[float, bool]:
    ctx = torch.tensor([[TOK.bos] + TOK.encode(context)])
    cont = torch.tensor([TOK.encode(continuation)])
    engine = make_engine(model, [5])
    logits = mode_logits(engine, ctx, cont, parse_mode(mode)).double()
    return (float(torch.log_softmax(logits, -1).gather(-1, cont[..., None]).sum()),
            bool(logits.argmax(-1).eq(cont).all()))


@pytest.mark.parametrize("args,mode", [
    ({"replay": 5}, "replay=5"),
    ({"replay": "exact"}, "replay=exact"),
    ({}, "full"),
    ({"turn": 3, "policy": "suffix_only", "replay": 5}, "turn=3,policy=suffix_only,replay=5"),
    ({"mode": "turn=3;policy=cached_hidden;replay=exact"},
     "turn=3,policy=cached_hidden,replay=exact"),
    # window forms resolve against the checkpoint's own W (6 here), and the name says so
    ({"replay": "W/2"}, "replay=3"),
    ({"turn": 3, "policy": "suffix_only", "replay": "W"},
     "turn=3,policy=suffix_only,replay=6,encoder_replay=exact"),
])
def test_loglikelihood_is_the_engines(checkpoint, model, args, mode):
    lm = CEDLM(checkpoint=str(checkpoint), dtype="float64", batch_size=2, **args)
    assert lm.mode_name == mode
    pairs = PAIRS if "turn" not in mode else PAIRS[:2] + PAIRS[3:]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = engine_ll(model, context, continuation, mode)
        assert abs(ll - want_ll) < TOL and greedy == want_greedy


def test_bos_false_scores_the_context_as_it_stands(checkpoint, model):
    """model_args bos=false: a context that starts mid-document gets no BOS (the engine on
    the bare bytes), an empty one still does; a bad value is one line naming the key."""
    lm = CEDLM(checkpoint=str(checkpoint), dtype="float64", replay=5, bos="false")
    got = lm.loglikelihood(requests("loglikelihood", PAIRS))
    engine = make_engine(model, [5])
    for (context, continuation), (ll, _) in zip(PAIRS, got):
        ids = TOK.encode(context) or [TOK.bos]
        cont = torch.tensor([TOK.encode(continuation)])
        logits = mode_logits(engine, torch.tensor([ids]), cont, parse_mode("replay=5")).double()
        want = float(torch.log_softmax(logits, -1).gather(-1, cont[..., None]).sum())
        assert abs(ll - want) < TOL
    with_bos = CEDLM(checkpoint=str(checkpoint), dtype="float64", replay=5)
    assert with_bos.loglikelihood(requests("loglikelihood", PAIRS[:1]))[0][0] != got[0][0]
    with pytest.raises(ModelArgsError, match=r"^ced: model_args bos must be true or false"):
        CEDLM(checkpoint=str(checkpoint), bos="maybe")


def test_exact_replay_loglikelihood_is_the_full_forward_and_bounded_is_not(checkpoint, model):
    exact = CEDLM(checkpoint=str(checkpoint), dtype="float64", replay="exact")
    bounded = CEDLM(checkpoint=str(checkpoint), dtype="float64", replay=5)
    reqs = requests("loglikelihood", PAIRS)
    differs = False
    for (context, continuation), (ll, _), (ll_b, _) in zip(PAIRS, exact.loglikelihood(reqs),
                                                           bounded.loglikelihood(reqs)):
        ctx = torch.tensor([[TOK.bos] + TOK.encode(context)])
        cont = torch.tensor([TOK.encode(continuation)])
        logits = exact_logits(model, ctx, cont).double()
        want = float(torch.log_softmax(logits, -1).gather(-1, cont[..., None]).sum())
        assert abs(ll - want) < TOL
        differs |= abs(ll_b - want) > 1e-4
    assert differs                       # bounded replay on long contexts is not silently exact


def test_rolling_and_generation_on_the_engine(tmp_path):
    # a short max_seq_len, so the rolling windows and context truncation are exercised
    small = make_model(lm_config(max_seq_len=32), 2)
    lm = CEDLM(model=small, replay=5, batch_size=3)
    text = "the quick brown fox jumps over the lazy dog, " * 2
    (rolling,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    want = 0.0
    for window in get_rolling_token_windows(TOK.encode(text), TOK.bos, 32, 1):
        ctx, cont = make_disjoint_window(window)
        ctx_t, cont_t = torch.tensor([ctx]), torch.tensor([cont])
        logits = mode_logits(InferenceEngine(small), ctx_t, cont_t, parse_mode("replay=5"))
        want += float(torch.log_softmax(logits.double(), -1).gather(-1, cont_t[..., None]).sum())
    assert len(TOK.encode(text)) > 32 and abs(rolling - want) < TOL

    contexts = ["ko lusa K=7 be ?K=", "ab" * 40]          # the second is truncated to fit
    gen = lm.generate_until(requests("generate_until",
                                     [(c, {"until": ["\n"], "max_gen_toks": 4}) for c in contexts]))
    for context, text_out in zip(contexts, gen):
        ids = [TOK.bos] + TOK.encode(context)
        ids = ids if len(ids) <= 29 else [TOK.bos] + ids[len(ids) - 28:]
        tokens = InferenceEngine(small).generate(torch.tensor([ids]), 4, replay=5,
                                                 eos_id=TOK.eos)[0].tolist()
        tokens = tokens[:tokens.index(TOK.eos)] if TOK.eos in tokens else tokens
        assert text_out == TOK.decode(tokens).split("\n")[0]

    turn = CEDLM(model=small, turn=2, policy="cached_hidden", replay="exact")
    (out,) = turn.generate_until(requests("generate_until", [(contexts[0], {"max_gen_toks": 3})]))
    full = CEDLM(model=small)
    assert out == full.generate_until(requests("generate_until",
                                               [(contexts[0], {"max_gen_toks": 3})]))[0]


def test_model_args():
    assert build_mode() == "full" and build_mode(replay="none") == "full"
    assert build_mode(replay=8) == "replay=8"
    assert build_mode(replay=8, turn=4) == "turn=4,policy=keep_decoder_swa,replay=8"
    assert build_mode(turn=4, policy="encoder_replay", replay=8, encoder_replay=16,
                      prefix_cache="true") == \
        "turn=4,policy=encoder_replay,replay=8,encoder_replay=16,prefix_cache=1"
    with pytest.raises(ValueError, match="turn"):
        build_mode(policy="suffix_only")
    with pytest.raises(ValueError, match="mode"):
        build_mode(replay=3, mode="replay=4")
    with pytest.raises(ValueError, match="checkpoint"):
        CEDLM()
    with pytest.raises(ValueError, match=r"^ced: model_args: mode 'replay=W/0': replay: "
                                         r"expected N .* got 'W/0'$"):
        CEDLM(replay="W/0")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, model):
    """The suite's documents for this model, as lm-eval tasks (2 per family x point)."""
    settings = SuiteSettings.from_config(model.cfg, (5, 10))
    docs = build_documents(settings, examples=2)
    out = tmp_path_factory.mktemp("tasks")
    return out, docs, write_tasks(out, settings, docs=docs, per_point=True)


def run_lm_eval(checkpoint, task_dir, task_names, limit=None, **model_args):
    args = ",".join(f"{k}={v}" for k, v in {"checkpoint": checkpoint, "dtype": "float64",
                                            **model_args}.items())
    return simple_evaluate(model="ced", model_args=args, tasks=task_names,
                           task_manager=TaskManager(include_path=str(task_dir),
                                                    include_defaults=False),
                           log_samples=True, batch_size=8, device="cpu", verbosity="ERROR",
                           limit=limit)


def test_every_family_through_lm_eval_agrees_with_the_suite_runner(checkpoint, model, tasks):
    task_dir, docs, written = tasks
    assert not any("/" in n for n in written) and all(p.exists() for p in written.values())
    names = [f"ced_{f}" for f in FAMILIES] + [f"ced_{f}_gen" for f in FAMILIES]
    res = run_lm_eval(checkpoint, task_dir, names, replay=5)
    assert set(names) <= set(res["results"])
    rows, _ = evaluate_documents(model, docs, [parse_mode("full"), parse_mode("replay=5")], [],
                                 batch_size=8)
    runner = {(r["family"], r["x"], r["seed"]): r for r in rows if r["mode"] == "replay=5"}
    for family in FAMILIES:
        samples = res["samples"][f"ced_{family}"]
        assert len(samples) == sum(d["family"] == family for d in docs)
        for s in samples:
            ll, greedy = s["resps"][0][0]
            r = runner[(family, s["doc"]["x"], s["doc"]["seed"])]
            assert abs(ll + r["nll"]) < TOL and int(greedy) == r["correct"] == s["acc"]
        acc = res["results"][f"ced_{family}"]["acc,none"]
        assert acc == pytest.approx(sum(s["acc"] for s in samples) / len(samples))
        for s in res["samples"][f"ced_{family}_gen"]:
            assert s["exact_match"] == float(s["resps"][0][0] == s["doc"]["target"])


def test_lm_eval_output_carries_the_resolved_replay(checkpoint, tasks, capfd):
    """W = 6, R_exact = 11: replay=3W is 18, read as 11 with a warning naming R_exact; the
    results' config says the form and its N, and so does stderr."""
    task_dir, _, _ = tasks
    res = run_lm_eval(checkpoint, task_dir, ["ced_recall"], limit=1, replay="3W")
    assert res["config"]["ced_replay"] == "3W -> 11 (R_exact; 3W is 18)"
    assert res["config"]["ced_mode"] == "replay=11"
    err = capfd.readouterr().err
    assert "ced: replay 3W -> 11 (R_exact; 3W is 18)" in err
    assert "ced: warning: replay: 3W is 18 positions on this model, above R_exact = 11" in err
    res = run_lm_eval(checkpoint, task_dir, ["ced_recall"], limit=1, replay="W/4")
    assert res["config"]["ced_replay"] == "W/4 -> 1" and res["config"]["ced_mode"] == "replay=1"
    # write-tasks reads the forms as the suite does, and says so
    from evals.lmeval.tasks import main as write_tasks_main
    out = task_dir.parent / "forms"
    assert write_tasks_main(["--checkpoint", str(checkpoint), "--replay", "W/4", "3W", "--out",
                             str(out), "--examples", "1", "--families", "recall",
                             "--no-generate"]) == 0
    shown = capfd.readouterr()
    assert "replays: W/4 -> 1, 3W -> 11 (R_exact; 3W is 18)" in shown.out
    assert "warning: --replay: 3W is 18 positions on this model" in shown.err


def test_multiturn_policy_through_lm_eval(checkpoint, model, tasks):
    task_dir, docs, _ = tasks
    mode = "turn=2,policy=encoder_replay,replay=5"
    res = run_lm_eval(checkpoint, task_dir, ["ced_multiturn_points"], turn=2,
                      policy="encoder_replay", replay=5)
    turn_docs = [d for d in docs if d["family"] == "multiturn"]
    rows, _ = evaluate_documents(model, turn_docs, [parse_mode("full")], [parse_mode(mode)],
                                 batch_size=8)
    runner = {(r["x"], r["seed"]): r for r in rows if r["mode"] == mode}
    seen = 0
    for name, samples in res["samples"].items():
        for s in samples:
            ll, greedy = s["resps"][0][0]
            assert abs(ll + runner[(s["doc"]["x"], s["doc"]["seed"])]["nll"]) < TOL
            seen += 1
    assert seen == len(turn_docs)


def test_lm_eval_shell_entry_point(checkpoint, tasks):
    """`python -m evals.lmeval` is lm_eval's CLI with --model ced registered."""
    task_dir, _, _ = tasks
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "evals.lmeval", "--model", "ced", "--model_args",
         f"checkpoint={checkpoint},replay=5", "--include_path", str(task_dir), "--tasks",
         "ced_recall", "ced_short_gen", "--limit", "2", "--device", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ced_recall" in done.stdout and "ced_short_gen" in done.stdout


def test_the_entry_point_indexes_only_the_include_path_when_it_has_every_task(tasks,
                                                                             monkeypatch):
    """Indexing lm-eval's own task files is most of a small run's time: when every --tasks name
    is in --include_path the wrapper's task manager reads that path alone (and still finds the
    tasks); a task from anywhere else keeps lm-eval's full index."""
    import lm_eval.tasks

    from evals.lmeval.__main__ import _index_included_tasks_only
    task_dir, _, _ = tasks
    shipped = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", shipped)
    _index_included_tasks_only(["--model", "ced", "--include_path", str(task_dir),
                                "--tasks", "ced_recall,ced_suite", "--limit", "2"])
    narrowed = lm_eval.tasks.TaskManager
    assert narrowed is not shipped
    manager = narrowed(include_path=str(task_dir))
    assert {"ced_recall", "ced_suite"} <= set(manager.all_tasks)
    assert "hellaswag" not in manager.all_tasks         # lm-eval's own tasks are not indexed
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", shipped)
    for argv in (["--include_path", str(task_dir), "--tasks", "ced_recall", "hellaswag"],
                 ["--tasks", "ced_recall"]):
        _index_included_tasks_only(argv)
        assert lm_eval.tasks.TaskManager is shipped, argv


def test_group_with_aggregate_and_limit_samples_every_distance(checkpoint, tasks):
    """`--tasks ced_suite` is a group whose score aggregates its families; with `--limit`, a
    family's first documents cover its distances rather than repeating the first one."""
    task_dir, docs, written = tasks
    assert {"ced_suite", "ced_suite_gen"} <= set(written)
    first = [json.loads(line) for line in
             (task_dir / "data" / "recall.jsonl").read_text().splitlines()]
    distances = list(dict.fromkeys(d["x"] for d in docs if d["family"] == "recall"))
    assert len(distances) > 2
    assert [d["x"] for d in first[:len(distances)]] == distances
    res = run_lm_eval(checkpoint, task_dir, ["ced_suite"], replay=5, limit=3)
    group = res["results"]["ced_suite"]
    members = [f"ced_{f}" for f in FAMILIES if f"ced_{f}" in res["results"]]
    assert len(members) == len(FAMILIES)
    sizes = {m: len(res["samples"][m]) for m in members}
    assert sizes == {m: min(3, sum(d["family"] == m[4:] for d in docs)) for m in members}
    mean = sum(res["results"][m]["acc,none"] * sizes[m] for m in members) / sum(sizes.values())
    assert group["acc,none"] == pytest.approx(mean)
    recall_x = [s["doc"]["x"] for s in res["samples"]["ced_recall"]]
    assert recall_x == distances[:3]


def test_help_shows_write_tasks():
    done = subprocess.run([sys.executable, "-m", "evals.lmeval", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "python -m evals.lmeval write-tasks --checkpoint DIR" in done.stdout
    assert "lm-eval" in done.stdout                    # lm-eval's own help follows
