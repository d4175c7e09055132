"""Inference modes: the ways a context can be run through the engine, each compared against the
exact full forward. Shared by the divergence runner, the edge-case suite and the lm-eval adapter,
so every number in a report comes from the same engine path.

A mode is written as a short string:

    full                          every token through every layer (the exact oracle, on the engine)
    replay=32 | replay=exact      early-exit prefill with bounded / exact decoder replay; a
                                  replay takes every form of `ced.config.parse_replay_form`
                                  (32, W, W/2, 2W, R_exact, exact), and `resolve_mode` turns
                                  a form into its length for one model (replay=W -> replay=16
                                  at W = 16; at most R_exact: `ced.config.state_replay`)
                                  before the mode is run or recorded
    turn=8,policy=suffix_only,replay=32[,encoder_replay=64|exact][,prefix_cache=0]
                                  the context's last 8 tokens are a new turn appended to a
                                  cached prefix (docs/semantics.md 4.3); a prefix cache
                                  (windows evicted, its 4.2) unless prefix_cache=0; the
                                  encoder replay defaults to 'exact' (the bound that makes
                                  the step exact under the policy)

`yoco` models accept the same modes; for them any replay is exact.

Downstream a mode is data, not text: `mode_columns` writes a Mode as typed columns beside its
label (MODE_COLUMNS: the replay as given and the N it runs, turn, policy, encoder replay,
prefix cache, and the run's top-k and KV overrides), `with_mode_columns` adds them to a table
(from its `mode` labels where a CSV predates them), and `mode_sort_keys`, `replay_lengths` and
`mode_from_columns` read them. The text above is parsed here and nowhere else; `format_mode`
writes the human-facing label.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ced import InferenceEngine
from ced.config import (ModelConfig, parse_replay_form, replay_length, state_replay,
                        window_form_length)
from ced.inference import POLICIES


@dataclass(frozen=True)
class Mode:
    name: str
    replay: int | str | None = None
    turn: int | None = None               # tokens of the context that form a new turn
    policy: str | None = None
    encoder_replay: int | str | None = None
    prefix_cache: bool = True


def _int_value(text: str, key: str, mode: str) -> int:
    """An int >= 1, else a one-line ValueError naming the key."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"mode {mode!r}: {key} must be an int >= 1; got {text!r}")
    return value


def _replay_value(text: str, key: str = "replay", mode: str = "") -> int | str:
    """A replay form, kept as written ('R_exact' as 'exact'): an int, 'exact' or 'W/2'."""
    try:
        value = parse_replay_form(text, key)
    except ValueError as exc:
        raise ValueError(f"mode {mode or f'{key}={text}'!r}: {exc}") from None
    return "exact" if value == "R_exact" else value


def format_mode(mode: Mode, short: bool = False) -> str:
    """The mode's text in the grammar's order: the inverse of `parse_mode` (as a name). With
    `short`, a prefix cache's encoder replay is left out where it is parse_mode's default
    ('exact'), as the suite's labels write it."""
    if mode.replay is None and mode.turn is None:
        return "full"
    if mode.turn is None:
        return f"replay={mode.replay}"
    parts = [f"turn={mode.turn}", f"policy={mode.policy}"]
    if mode.replay is not None:
        parts.append(f"replay={mode.replay}")
    if not mode.prefix_cache:
        parts.append("prefix_cache=0")
    elif mode.encoder_replay is not None and not (short and mode.encoder_replay == "exact"):
        parts.append(f"encoder_replay={mode.encoder_replay}")
    return ",".join(parts)


def named_mode(replay: int | str | None = None, turn: int | None = None,
               policy: str | None = None, encoder_replay: int | str | None = None,
               prefix_cache: bool = True, short: bool = False) -> Mode:
    """A Mode from its fields with parse_mode's defaults (a new turn: policy
    keep_decoder_swa and, under a prefix cache, encoder replay 'exact'), named by
    `format_mode(mode, short)`: what parse_mode returns for that name."""
    if turn is None and (policy or encoder_replay or not prefix_cache):
        raise ValueError("mode: policy, encoder_replay and prefix_cache need a turn")
    if turn is not None:
        policy = policy or "keep_decoder_swa"
        encoder_replay = (encoder_replay or "exact") if prefix_cache else None
    mode = Mode("", replay=replay, turn=turn, policy=policy, encoder_replay=encoder_replay,
                prefix_cache=prefix_cache)
    return dataclasses.replace(mode, name=format_mode(mode, short))


def resolve_mode(mode: Mode, cfg: ModelConfig) -> Mode:
    """`mode` for one model: a window form of its replay or encoder replay becomes that model's
    length, and the name is rewritten to say so (replay=W -> replay=16), so results name the
    length that ran. A single-turn replay above R_exact is read as R_exact
    (`ced.config.state_replay`: it computes the same); a multi-turn mode keeps its lengths,
    since its encoder replay's exact bound grows with N (docs/semantics.md 4.3). 'exact'
    stays as it is; a mode whose lengths do not change is returned unchanged, name
    included."""
    def length(value, part: str, key: str):
        if value is None or value == "exact":
            return value
        name = f"mode {mode.name!r}: {key}"
        if part == "decoder" and mode.turn is None and cfg.has_decoder:
            return state_replay(cfg, value, name=name).n
        return value if isinstance(value, int) else replay_length(cfg, value, part, name)
    replay = length(mode.replay, "decoder", "replay")
    encoder = length(mode.encoder_replay, "encoder", "encoder_replay")
    if (replay, encoder) == (mode.replay, mode.encoder_replay):
        return mode
    resolved = dataclasses.replace(mode, replay=replay, encoder_replay=encoder)
    return dataclasses.replace(resolved, name=format_mode(resolved))


def parse_mode(text: str) -> Mode:
    """'replay=32' -> Mode(...); see the module docstring for the grammar. Anything else is a
    one-line ValueError naming the mode and the part that is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"mode: expected a string such as 'full' or 'replay=32'; got {text!r}")
    text = text.strip()
    if text == "full":
        return Mode("full")
    fields = {}
    for part in text.split(","):
        if "=" not in part:
            raise ValueError(f"mode {text!r}: expected key=value parts, got {part!r}")
        key, value = part.split("=", 1)
        fields[key.strip()] = value.strip()
    allowed = ["encoder_replay", "policy", "prefix_cache", "replay", "turn"]
    unknown = set(fields) - set(allowed)
    if unknown:
        raise ValueError(f"mode {text!r}: unknown key(s) {sorted(unknown)}; allowed: 'full' or "
                         f"{allowed}")
    replay = _replay_value(fields["replay"], "replay", text) if "replay" in fields else None
    if "turn" not in fields:
        if set(fields) != {"replay"}:
            raise ValueError(f"mode {text!r}: policy/encoder_replay need turn=<tokens>")
        return Mode(text, replay=replay)
    policy = fields.get("policy", "keep_decoder_swa")
    if policy not in POLICIES:
        raise ValueError(f"mode {text!r}: policy must be one of {POLICIES}; got {policy!r}")
    encoder_replay = (_replay_value(fields["encoder_replay"], "encoder_replay", text)
                      if "encoder_replay" in fields else None)
    flag = fields.get("prefix_cache", "1").lower()
    if flag not in ("0", "1", "false", "true"):
        raise ValueError(f"mode {text!r}: prefix_cache must be 0, 1, false or true; got "
                         f"{fields['prefix_cache']!r}")
    prefix_cache = flag in ("1", "true")
    turn = _int_value(fields["turn"], "turn", text)
    if prefix_cache and encoder_replay is None:
        encoder_replay = "exact"
    return Mode(text, replay=replay, turn=turn, policy=policy,
                encoder_replay=encoder_replay if prefix_cache else None,
                prefix_cache=prefix_cache)


# When a new turn under each multi-turn policy (ced.inference.POLICIES) is exact, given the mode
# and its decoder replay n >= R_exact (docs/semantics.md 4.3): a policy that rebuilds every
# prefix H_{L_e} its decoder reads is exact when its encoder replay is; suffix_only only when
# the replay lies inside the turn. One rule per policy: tests/unit/test_mode_columns.py fails
# while a policy in POLICIES has none, rather than letting it borrow another's.
POLICY_EXACT: dict[str, Callable[[Mode, int], bool]] = {
    "keep_decoder_swa": lambda mode, n: mode.encoder_replay in (None, "exact"),
    "cached_hidden": lambda mode, n: mode.encoder_replay in (None, "exact"),
    "encoder_replay": lambda mode, n: mode.encoder_replay == "exact",
    "suffix_only": lambda mode, n: n <= mode.turn,
}


def promises_exact(mode: Mode, r_exact: int) -> bool:
    """Whether the contract (docs/semantics.md 4.1-4.3) makes `mode` equal to `full` for a
    model with exact replay length `r_exact` (1 for yoco, whose early exit is exact): a
    decoder replay of N >= R_exact ('exact', or none at all), and for a new turn a policy
    that rebuilds every prefix H_{L_e} the decoder reads exactly (`cached_hidden`,
    `encoder_replay` with encoder_replay 'exact', `keep_decoder_swa`; `suffix_only` only when
    the replay lies within the turn). An exact mode that changes an answer is a bug, or
    float32 round-off at a near-tie (`analysis.findings` flags it)."""
    if isinstance(mode.replay, str) and mode.replay != "exact":
        raise ValueError(f"mode {mode.name!r}: resolve its window form for a model first "
                         "(evals.modes.resolve_mode)")
    if mode.replay is None:
        n = math.inf
    else:
        n = r_exact if mode.replay == "exact" else int(mode.replay)
    if n < r_exact:
        return False
    if mode.turn is None:
        return True
    if mode.policy not in POLICY_EXACT:
        raise ValueError(f"mode {mode.name!r}: policy {mode.policy!r} has no exactness rule; "
                         f"add it to evals.modes.POLICY_EXACT (rules for {sorted(POLICY_EXACT)})")
    return POLICY_EXACT[mode.policy](mode, n)


# ---- a mode as typed columns -----------------------------------------------------------------

# The columns a results row carries beside its `mode` label; "" (in a CSV row) or NaN (in a
# DataFrame) where a field is not set:
#   replay_given    the decoder replay as the mode gives it: '8', 'exact', 'W/2'; empty: none
#   replay_n        the N it runs on the model: the number (one turn's at most R_exact, as
#                   resolve_mode reads it), R_exact for 'exact', a window form at W; empty
#                   without a replay or where the model's geometry it needs is not known
#   turn            tokens of the new turn; empty: one turn
#   policy          the new turn's policy (docs/semantics.md 4.3); empty: one turn
#   encoder_replay  the new turn's encoder replay as given ('exact', '64', '2W'); empty: none
#   prefix_cache    1 / 0 for a new turn (0: the prefix's windows kept); empty: one turn
#   topk_read       the run's evaluation-time top-k ('2', 'all'); empty: as trained
#   kv              the run's evaluation-time KV storage formats; empty: as trained
#   decoder_global  'off': read without the decoder's global read (docs/semantics.md 4.6);
#                   empty: as trained
MODE_COLUMNS = ("replay_given", "replay_n", "turn", "policy", "encoder_replay", "prefix_cache",
                "topk_read", "kv", "decoder_global")
_NUMBER_COLUMNS = ("replay_n", "turn", "prefix_cache")
FULL = "full"


def _text(value) -> str:
    return "" if value is None else str(value)


def _replay_n(mode: Mode, r_exact: int | None, window: int | None) -> int | None:
    """The decoder replay length `mode` runs on a model with this R_exact and W; None where
    it has no replay or the geometry it needs is not known."""
    if mode.replay is None:
        return None
    if mode.replay in ("exact", "R_exact"):
        return r_exact
    n = mode.replay if isinstance(mode.replay, int) else (
        window_form_length(mode.replay, window) if window else None)
    if n is None or mode.turn is not None or not r_exact:
        return n
    return min(n, r_exact)          # one turn: a longer replay computes what R_exact does


def mode_columns(mode: Mode, r_exact: int | None = None, window: int | None = None, *,
                 topk_read: int | str | None = None, kv: str | None = None,
                 decoder_global: str | None = None) -> dict[str, Any]:
    """`mode` as MODE_COLUMNS (described above) for a CSV row: numbers as ints, forms as text,
    "" where a field is not set. `r_exact` and `window` are the model's R_exact and W, which
    resolve 'exact' and window forms into replay_n; `topk_read`, `kv` and `decoder_global` are
    the run's evaluation-time overrides (`ced.checkpoint.evaluation_overrides`), None where the
    model reads as trained."""
    turn = mode.turn is not None
    n = _replay_n(mode, r_exact, window)
    return {"replay_given": _text(mode.replay), "replay_n": "" if n is None else int(n),
            "turn": mode.turn if turn else "", "policy": (mode.policy or "") if turn else "",
            "encoder_replay": _text(mode.encoder_replay) if turn else "",
            "prefix_cache": int(mode.prefix_cache) if turn else "",
            "topk_read": _text(topk_read), "kv": _text(kv),
            "decoder_global": _text(decoder_global)}


def label_columns(label: str, r_exact: int | None = None,
                  window: int | None = None) -> dict[str, Any] | None:
    """`mode_columns` of a mode label as `format_mode` or a user wrote it (a CSV written before
    the columns existed, a record that keeps only the label); None where the label is not a
    mode (e.g. divergence's yoco_early_exit)."""
    try:
        mode = parse_mode(label)
    except ValueError:
        return None
    return mode_columns(mode, r_exact, window)


def _unset(value) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _form_text(value):
    """A form column's cell as text ('8', 'exact'); NaN where unset. A CSV of numbers only
    reads back as floats (8.0), hence the int."""
    if _unset(value):
        return np.nan
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _typed(column: pd.Series, name: str) -> pd.Series:
    """A mode column as a DataFrame holds it: float (NaN unset) or text (NaN unset)."""
    if name in _NUMBER_COLUMNS:
        return pd.to_numeric(column.map(lambda v: np.nan if _unset(v) else v),
                             errors="coerce").astype(float)
    return column.map(_form_text).astype(object)


def _per_row(value, rows: int) -> np.ndarray:
    """A geometry argument (None, a number, or one value per row) as floats, NaN unknown."""
    if value is None or np.isscalar(value):
        value = [value] * rows
    return pd.to_numeric(pd.Series(list(value), dtype=object).map(
        lambda v: np.nan if _unset(v) else v), errors="coerce").to_numpy(dtype=float)


def _known(value: float) -> int | None:
    return None if math.isnan(value) else int(value)


def with_mode_columns(frame: pd.DataFrame, r_exact=None, window=None) -> pd.DataFrame:
    """A copy of `frame` (with a `mode` label column) with MODE_COLUMNS, typed: numbers as
    floats, forms as text, NaN where unset. Where the frame has a column its values stand;
    where a row lacks one (a CSV or archive written before the columns existed, a table
    aggregated over labels), it is recovered from the label (`label_columns`): the one
    place that reads an old label. `r_exact`, `window`: the model's R_exact and W, each None,
    one number, or one value per row (e.g. each row's job looked up)."""
    rows = len(frame)
    keys = pd.DataFrame({"mode": frame["mode"].to_numpy(), "r_exact": _per_row(r_exact, rows),
                         "window": _per_row(window, rows)})
    unique = keys.drop_duplicates(ignore_index=True)
    derived = pd.DataFrame([label_columns(str(m), _known(r), _known(w)) or {}
                            for m, r, w in unique.itertuples(index=False)],
                           columns=list(MODE_COLUMNS), index=unique.index)
    filled = keys.merge(pd.concat([unique, derived], axis=1), how="left",
                        on=["mode", "r_exact", "window"])
    out = frame.copy()
    for name in MODE_COLUMNS:
        value = _typed(filled[name], name).set_axis(frame.index)
        if name in frame:
            present = _typed(frame[name], name)
            value = present.where(present.notna(), value)
        out[name] = value
    return out


def replay_lengths(frame: pd.DataFrame, r_exact=None, window=None) -> pd.Series:
    """Per row of `frame` (see `with_mode_columns`), N of its single-turn replay mode
    (replay=exact: R_exact); NaN for `full`, a new turn, and a label that is not a mode."""
    columns = with_mode_columns(frame, r_exact, window)
    return columns["replay_n"].where(columns["turn"].isna())


def mode_sort_keys(frame: pd.DataFrame) -> pd.Series:
    """A sort key per row of `frame` (see `with_mode_columns`): `full`, then single-turn
    replays by N, then replay=exact, then the rest by label."""
    columns = with_mode_columns(frame)

    def key(label, given, n, turn) -> tuple:
        if label == FULL:
            return (0, 0, "")
        if math.isnan(turn) and given == "exact":
            return (2, 0, "")
        if math.isnan(turn) and not math.isnan(n):
            return (1, int(n), "")
        return (3, 0, label)
    return pd.Series([key(*row) for row in zip(columns["mode"], columns["replay_given"],
                                               columns["replay_n"], columns["turn"])],
                     index=frame.index, dtype=object)


def _given(value) -> int | str | None:
    """A form column's cell back as the Mode field: an int, a form ('exact', 'W/2'), None."""
    text = _form_text(value)
    if not isinstance(text, str):
        return None
    return int(text) if text.isdigit() else text


def mode_from_columns(columns: Mapping[str, Any], name: str = "") -> Mode | None:
    """The Mode whose `mode_columns` these are (a CSV row, or a row of `with_mode_columns`),
    named `name` (default: `format_mode`'s). None where every column is unset but the name
    is not `full`: a label that is not a mode."""
    fields = {key: columns.get(key) for key in MODE_COLUMNS[:6]}
    if all(_unset(v) for v in fields.values()) and name not in ("", FULL):
        return None
    turn = None if _unset(fields["turn"]) else int(fields["turn"])
    mode = Mode(name, replay=_given(fields["replay_given"]), turn=turn,
                policy=None if _unset(fields["policy"]) else str(fields["policy"]),
                encoder_replay=_given(fields["encoder_replay"]),
                prefix_cache=_unset(fields["prefix_cache"]) or bool(int(fields["prefix_cache"])))
    return mode if name else dataclasses.replace(mode, name=format_mode(mode))


def start_mode(engine: InferenceEngine, context: Tensor, mode: Mode):
    """Run `mode` over the context [B, T]: (logits [B, V] at position T - 1, the cache)."""
    if mode.turn is None:
        out = engine.prefill(context, replay=mode.replay)
        return out.logits, out.cache
    if not 1 <= mode.turn < context.shape[1]:
        raise ValueError(f"mode {mode.name!r}: turn must lie in [1, T-1] for T="
                         f"{context.shape[1]}")
    split = context.shape[1] - mode.turn
    cache = engine.prefill(context[:, :split], replay=mode.replay).cache
    if mode.prefix_cache:
        cache = cache.as_prefix_cache(keep_decoder_windows=mode.policy == "keep_decoder_swa")
    logits = engine.extend(context[:, split:], cache, policy=mode.policy, replay=mode.replay,
                           encoder_replay=mode.encoder_replay)
    return logits, cache


@torch.no_grad()
def mode_logits(engine: InferenceEngine, context: Tensor, continuation: Tensor | None,
                mode: Mode) -> Tensor:
    """Logits [B, G, V] predicting each of the G continuation tokens [B, G]: the first from the
    context's last position, the others after feeding the continuation teacher-forced through
    decode steps. With continuation None, [B, 1, V] at the last context position."""
    first, cache = start_mode(engine, context, mode)
    logits = [first]
    if continuation is not None:
        for g in range(continuation.shape[1] - 1):
            logits.append(engine.decode(continuation[:, g], cache))
    return torch.stack(logits, dim=1)


@torch.no_grad()
def mode_generate(engine: InferenceEngine, context: Tensor, steps: int, mode: Mode) -> Tensor:
    """Greedy continuation LongTensor[B, steps] under `mode`."""
    logits, cache = start_mode(engine, context, mode)
    tokens = []
    for step in range(steps):
        tokens.append(logits.argmax(-1))
        if step + 1 < steps:
            logits = engine.decode(tokens[-1], cache)
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def exact_logits(model, context: Tensor, continuation: Tensor | None) -> Tensor:
    """The reference: the parallel full forward's logits at the same positions as `mode_logits`."""
    ids = context if continuation is None else torch.cat((context, continuation[:, :-1]), 1)
    return model(ids)[:, context.shape[1] - 1:]
