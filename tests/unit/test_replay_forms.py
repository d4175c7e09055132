"""One resolver for every written form of a replay length (`ced.config.replay_length` /
`resolve_replay`, docs/semantics.md 4.1 and 4.2), and the helpers that share its rules:
`keep_from` (what a window layer keeps) and `default_hidden_tail`. Every caller (engine, cost
model, suite runner, divergence, report, study driver) must give the same number for the same
form."""

from __future__ import annotations

import pytest
import torch

from ced import InferenceEngine
from ced.config import (default_hidden_tail, exact_encoder_replay_length, exact_replay_length,
                        is_window_form, keep_from, replay_length, resolve_replay)
from ced.cost import engine_cache_bytes, prefill_flops
from conftest import make_model, random_ids, tiny_config

# window 8, 2 decoder layers, 3 encoder layers: R_exact = 15, exact N_e = 22.
CED = tiny_config(window=8)
YOCO = tiny_config("yoco", window=8)
FORMS = [1, 5, "exact", "R_exact", "W", "W/4", "W/2", "2W", "3W/2", " W / 2 "]


def expected(cfg, form, part: str) -> int:
    """The documented meaning of each form, written out independently of the resolver."""
    exact = exact_replay_length(cfg) if part == "decoder" else exact_encoder_replay_length(cfg)
    w = cfg.window
    return {"exact": exact, "R_exact": exact, "W": w, "W/4": w // 4, "W/2": w // 2,
            "2W": 2 * w, "3W/2": 3 * w // 2, " W / 2 ": w // 2}.get(form, form)


@pytest.mark.parametrize("cfg", [CED, YOCO], ids=["ced", "yoco"])
@pytest.mark.parametrize("part", ["decoder", "encoder"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_resolves_alike(cfg, part, form):
    want = expected(cfg, form, part)
    name = "replay" if part == "decoder" else "encoder_replay"
    assert replay_length(cfg, form, part, name) == want
    for available in (1, want, want + 3, 100):
        assert resolve_replay(cfg, form, available, name, part) == min(want, available)


def test_exact_lengths_differ_by_part():
    assert replay_length(CED, "exact") == 2 * 7 + 1
    assert replay_length(CED, "exact", "encoder") == 3 * 7 + 1
    assert replay_length(YOCO, "R_exact") == 1


def test_none_means_every_position():
    assert replay_length(CED, None) is None
    assert resolve_replay(CED, None, 37) == 37
    assert resolve_replay(tiny_config("dense"), None, 37) == 37


def test_is_window_form_accepts_exactly_what_replay_length_resolves_as_w():
    """A study checks `suite.distances` with is_window_form before any config exists: it must
    accept the W forms replay_length resolves and nothing else."""
    for form in ["W", "W/4", "2W", "3W/2", " W / 2 ", "10W/3"]:
        assert is_window_form(form)
        assert replay_length(CED, form) >= 1
    for form in ["", "4", "R_exact", "exact", "W/0", "0W", "Wx", "W/", "/2", "w", "W*2", "2.5W"]:
        assert not is_window_form(form), form


def test_window_forms_are_at_least_one():
    assert replay_length(tiny_config(window=2, encoder_compress_ratio=1), "W/4") == 1


@pytest.mark.parametrize("part, name", [("decoder", "replay"), ("encoder", "encoder_replay")])
@pytest.mark.parametrize("bad, message", [
    (0, r"must be >= 1"), (-3, r"must be >= 1"), ("all", r"expected .*'exact' or an int >= 1"),
    ("4", r"expected"), ("W/0", r"expected"), ("0W", r"expected"), ("Wx", r"expected"),
    (True, r"expected"), (2.0, r"expected"), ([4], r"expected"),
])
def test_bad_forms_name_the_argument(part, name, bad, message):
    with pytest.raises(ValueError, match=rf"^{name}: {message}"):
        replay_length(CED, bad, part, name)
    with pytest.raises(ValueError, match=rf"^{name}: {message}"):
        resolve_replay(CED, bad, 50, name, part)


def test_encoder_message_does_not_offer_none():
    with pytest.raises(ValueError, match=r"^encoder_replay: expected 'exact' or an int"):
        replay_length(CED, "bogus", "encoder", "encoder_replay")


@pytest.mark.parametrize("variant", ["dense", "swa"])
def test_no_decoder_no_replay(variant):
    cfg = tiny_config(variant)
    with pytest.raises(ValueError, match=rf"^replay: variant '{variant}' has no decoder"):
        resolve_replay(cfg, "W", 10)
    with pytest.raises(ValueError, match=rf"^n: variant '{variant}' has no decoder"):
        replay_length(cfg, "exact", name="n")
    # A window multiple is still a number for any config (a study resolves it from whichever
    # checkpoint it has).
    assert replay_length(cfg, "2W") == 2 * cfg.window


def test_bad_part():
    with pytest.raises(ValueError, match=r"part must be 'decoder' or 'encoder'"):
        replay_length(CED, 4, "middle")


# ---- the callers ---------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_engine_prefill_accepts_every_form(form):
    model = make_model(CED, 0)
    engine = InferenceEngine(model)
    ids = random_ids(2, 20, 3)
    n = resolve_replay(CED, form, 20)
    out = engine.prefill(ids, replay=form)
    assert out.replay == n
    assert torch.equal(out.logits, engine.prefill(ids, replay=n).logits)


@pytest.mark.parametrize("form", ["exact", "R_exact", "W", "2W", 9])
def test_engine_encoder_replay_accepts_every_form(form):
    model = make_model(CED, 1)
    engine = InferenceEngine(model)
    ids = random_ids(2, 30, 4)
    prefix = engine.prefill(ids[:, :26]).cache.as_prefix_cache()
    n_e = resolve_replay(CED, form, 26, "encoder_replay", "encoder")
    a = engine.extend(ids[:, 26:], prefix.as_prefix_cache(), "suffix_only", encoder_replay=form)
    b = engine.extend(ids[:, 26:], prefix.as_prefix_cache(), "suffix_only", encoder_replay=n_e)
    assert torch.equal(a, b)


def test_engine_errors_name_the_argument():
    engine = InferenceEngine(make_model(CED, 2))
    ids = random_ids(2, 30, 5)
    with pytest.raises(ValueError, match=r"^replay: expected None, 'exact' or an int"):
        engine.prefill(ids, replay="W/0")
    prefix = engine.prefill(ids[:, :26]).cache.as_prefix_cache()
    with pytest.raises(ValueError, match=r"^encoder_replay: expected 'exact' or an int"):
        engine.extend(ids[:, 26:], prefix, "suffix_only", encoder_replay="whole")
    with pytest.raises(ValueError, match=r"^encoder_replay: must be >= 1"):
        engine.extend(ids[:, 26:], prefix, "suffix_only", encoder_replay=0)


@pytest.mark.parametrize("form", FORMS)
def test_cost_model_accepts_every_form(form):
    n = resolve_replay(CED, form, 40)
    assert prefill_flops(CED, 40, form).total == prefill_flops(CED, 40, n).total
    assert engine_cache_bytes(CED, 40, form, 2) == engine_cache_bytes(CED, 40, n, 2)


def test_study_lengths_use_the_resolver():
    from experiments.sections import resolve_lengths
    forms = [f for f in FORMS if f != "exact"]
    assert resolve_lengths(forms + ["exact"], CED) == \
        list(dict.fromkeys(replay_length(CED, f) for f in forms)) + ["exact"]
    # R_exact has no meaning without a decoder and is dropped; window multiples remain.
    dense = tiny_config("dense")
    assert resolve_lengths(["R_exact", "W", "7", 3], dense) == [dense.window, 7, 3]


def test_divergence_encoder_replays_take_every_form():
    """evals.divergence used to int() anything but 'exact', so a study's `W` crashed."""
    from evals.divergence import DivergenceConfig, modes_for
    c = DivergenceConfig(replays=[2], policies=[], encoder_replays=[3, "W", "exact"])
    got = [m.encoder_replay for m, _ in modes_for(CED, c) if m.encoder_replay is not None]
    assert got == [3, CED.window, exact_encoder_replay_length(CED)]


def test_divergence_replays_resolve_per_model():
    """One divergence run over models of different windows (the scaling study) reads each at
    its own N = W: the forms reach evals.divergence unresolved and resolve per checkpoint."""
    from evals.divergence import DivergenceConfig, modes_for
    c = DivergenceConfig(replays=["W/2", "W", 3, "R_exact", "exact"], policies=[],
                         encoder_replays=[])
    for window in (4, 8, 16):
        cfg = tiny_config(window=window)
        r = exact_replay_length(cfg)
        plain = [m.name for m, _ in modes_for(cfg, c) if m.turn is None]
        assert plain == [f"replay={n}" for n in sorted({window // 2, window, 3, r})] + \
            ["replay=exact"]
    with pytest.raises(ValueError, match="^replays: expected"):
        modes_for(CED, DivergenceConfig(replays=["Wx"], policies=[], encoder_replays=[]))


def test_report_mode_replay_parses_with_evals_modes():
    from evals.modes import parse_mode
    from analysis.report import mode_replay
    from evals.suites.runner import suite_modes
    base, turn = suite_modes(CED, [2, 4], [3])
    for mode in base:
        assert mode_replay(mode) == parse_mode(mode).replay
    assert all(mode_replay(m) is False for m in turn)
    assert mode_replay("yoco_early_exit") is False
    assert mode_replay("replay=0") is False


# ---- what a window keeps, and the H_(L_e) tail -----------------------------------------------

@pytest.mark.parametrize("window", [None, 1, 2, 5])
@pytest.mark.parametrize("end", [0, 1, 3, 4, 5, 9])
def test_keep_from_is_what_later_queries_can_see(window, end):
    """Brute force: keep position p < end iff some query q >= end has p in its window."""
    first = keep_from(end, window)
    for p in range(end):
        seen = window is None or any(q - window + 1 <= p for q in range(end, end + 20))
        assert (p >= first) == seen
    if window is not None and end >= window - 1:
        assert end - first == window - 1


@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
def test_engine_windows_hold_what_keep_from_says(variant):
    cfg = tiny_config(variant, window=5)
    model = make_model(cfg, 3)
    out = InferenceEngine(model).prefill(random_ids(1, 17, 6), replay=None)
    for spec in model.plan.layers:
        kept = out.cache.state.windows[spec.index]
        if kept is None:
            continue
        first = max(0, keep_from(17, spec.window))
        assert kept.positions.tolist() == list(range(first, 17))


@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
def test_default_hidden_tail_is_shared(variant):
    from evals.suites.runner import make_engine
    cfg = tiny_config(variant, window=8, max_seq_len=64)
    model = make_model(cfg, 0)
    want = min(exact_replay_length(cfg), 64) if cfg.has_decoder else 0
    assert default_hidden_tail(cfg) == InferenceEngine(model).hidden_tail == want
    assert make_engine(model, [40, 90]).hidden_tail == (64 if cfg.has_decoder else 0)
    assert default_hidden_tail(cfg, [40]) == (40 if cfg.has_decoder else 0)
    # The cost model's default is the engine's.
    assert engine_cache_bytes(cfg, 30) == engine_cache_bytes(cfg, 30,
                                                             hidden_tail=default_hidden_tail(cfg))


@pytest.mark.parametrize("form", FORMS)
def test_parse_replay_form_keeps_every_form_for_the_resolver(form):
    """What a command line or config accepts is exactly what replay_length resolves."""
    from ced.config import parse_replay_form
    parsed = parse_replay_form(form if isinstance(form, int) else str(form))
    assert replay_length(CED, parsed) == expected(CED, form, "decoder")


@pytest.mark.parametrize("bad", ["W/0", "2W+", "0", "-1", "", "1.5", "W2", True, 0, None])
def test_parse_replay_form_refuses_the_rest_in_one_line(bad):
    from ced.config import parse_replay_form
    with pytest.raises(ValueError, match=r"^--x: expected N \(an int >= 1\), W, W/k, kW, kW/d, "
                                         r"R_exact or exact; got "):
        parse_replay_form(bad, "--x")


def test_the_suite_resolves_forms_against_its_checkpoint(tmp_path):
    from ced.checkpoint import save_model
    from evals.suites.runner import SuiteConfig, run_suite
    path = save_model(make_model(tiny_config(window=8, vocab_size=259), 0).float(),
                      tmp_path / "model")
    result = run_suite(SuiteConfig(str(path), ["W/2", "W"], str(tmp_path / "out"), examples=1,
                                   families=["running_count"], plot=False, wandb=False,
                                   quiet=True))
    assert sorted({r["mode"] for r in result["rows"]}) == ["full", "replay=4", "replay=8",
                                                            "replay=exact"]


# ---- the mode grammar and the training simulation take the same forms ------------------------

@pytest.mark.parametrize("text,replay,resolved_name", [
    ("replay=W", "W", "replay=16"),
    ("replay=W/2", "W/2", "replay=8"),
    ("replay=3W/2", "3W/2", "replay=24"),
    ("replay=R_exact", "exact", "replay=R_exact"),     # 'exact' needs no resolving
    ("replay=12", 12, "replay=12"),
    ("turn=4,policy=encoder_replay,replay=W,encoder_replay=2W",
     "W", "turn=4,policy=encoder_replay,replay=16,encoder_replay=32"),
])
def test_modes_take_every_form_and_resolve_per_model(text, replay, resolved_name):
    from evals.modes import parse_mode, resolve_mode
    cfg = tiny_config(window=16, topk=4, max_seq_len=256)
    mode = parse_mode(text)
    assert mode.replay == replay
    resolved = resolve_mode(mode, cfg)
    assert resolved.name == resolved_name
    if isinstance(replay, str) and replay != "exact":
        assert resolved.replay == replay_length(cfg, replay)
        assert parse_mode(resolved.name) == resolved      # the name parses back to the mode
    else:
        assert resolved is mode


@pytest.mark.parametrize("bad", ["W/0", "2W+", "0", "-3", "Wx", "exactly"])
def test_modes_refuse_a_malformed_form_in_one_line(bad):
    from evals.modes import parse_mode
    with pytest.raises(ValueError) as caught:
        parse_mode(f"replay={bad}")
    assert str(caught.value) == (f"mode 'replay={bad}': replay: expected N (an int >= 1), W, "
                                 f"W/k, kW, kW/d, R_exact or exact; got '{bad}'")


def test_an_unresolved_window_form_is_not_judged_exact_or_inexact():
    from evals.modes import parse_mode, promises_exact
    with pytest.raises(ValueError, match="resolve_mode"):
        promises_exact(parse_mode("replay=W"), 15)


def _train_config(*overrides):
    from ced.cli.train import compose_config
    return compose_config(["model=tiny", "train.replay.probability=0.5", *overrides])


def test_train_replay_length_takes_a_window_form():
    import torch
    from ced.train import sample_replay_starts
    form = _train_config("train.replay.length=W/2")
    window = form.model.window
    number = _train_config(f"train.replay.length={window // 2}")
    assert form.train.replay.length == "W/2"                # kept as written, in config.yaml
    assert form.train.replay.resolved_length(form.model) == window // 2
    rows = torch.arange(64)
    # the same draws as the number it stands for
    assert torch.equal(sample_replay_starts(form.train.replay, rows, 128, 3, form.model),
                       sample_replay_starts(number.train.replay, rows, 128, 3))


@pytest.mark.parametrize("overrides,message", [
    (["train.replay.length=W/0"], "train.replay.length: expected N (an int >= 1), W, W/k, "
                                  "kW, kW/d, R_exact or exact; got 'W/0'"),
    (["train.replay.length=W/2", "train.replay.distribution=uniform",
      "train.replay.min_length=10000"], "train.replay.min_length: must lie in [1, length="),
])
def test_train_replay_length_errors_name_the_key(overrides, message):
    from ced.train_config import ConfigError
    with pytest.raises(ConfigError) as caught:
        _train_config(*overrides)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
