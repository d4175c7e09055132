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
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from ced import InferenceEngine
from ced.config import ModelConfig, parse_replay_form, replay_length, state_replay
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


def format_mode(mode: Mode) -> str:
    """The mode's text in the grammar's order: the inverse of `parse_mode` (as a name)."""
    if mode.replay is None and mode.turn is None:
        return "full"
    if mode.turn is None:
        return f"replay={mode.replay}"
    parts = [f"turn={mode.turn}", f"policy={mode.policy}"]
    if mode.replay is not None:
        parts.append(f"replay={mode.replay}")
    if not mode.prefix_cache:
        parts.append("prefix_cache=0")
    elif mode.encoder_replay is not None:
        parts.append(f"encoder_replay={mode.encoder_replay}")
    return ",".join(parts)


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
    if mode.turn is None or mode.policy in ("keep_decoder_swa", "cached_hidden"):
        return mode.turn is None or mode.encoder_replay in (None, "exact")
    if mode.policy == "encoder_replay":
        return mode.encoder_replay == "exact"
    return n <= mode.turn          # suffix_only: exact only if the replay is inside the turn


def mode_order(mode: str) -> tuple:
    """A sort key for mode strings: full, then replay=N by N, then replay=exact, then the rest
    by name."""
    match = re.fullmatch(r"replay=(\d+)", mode)
    if mode == "full":
        return (0, 0, "")
    if match:
        return (1, int(match.group(1)), "")
    return (2, 0, "") if mode == "replay=exact" else (3, 0, mode)


def replay_of(mode: str, r_exact: int | None) -> float:
    """N of a single-turn replay mode string (`replay=exact`: R_exact); NaN for `full`,
    multi-turn and anything else."""
    try:
        parsed = parse_mode(mode)
    except ValueError:
        return math.nan
    if parsed.turn is not None or parsed.replay is None:
        return math.nan
    if parsed.replay == "exact":
        return float(r_exact) if r_exact else math.nan
    return float(parsed.replay)


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
