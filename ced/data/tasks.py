"""The synthetic tasks: one registry entry each (ced/data/registry.py), holding the generator
of (context, target) text pairs, its defaults, its chance level and its suite sweeps.

    task            suite families (evals.suites)
    kv_recall       recall, short, boundary, multiturn
    copy            copy
    variable_tracking  multihop
    running_state   running_count, running_parity, running_bracket, multiturn_count
    needle          needle

Every task is a function `generator(rng: random.Random, **params) -> Example`, registered in
`TASKS` under its name; `make_example(task, seed, **params)` seeds the rng for you. Contexts
are ASCII, so one character is one byte is one token of `ByteTokenizer`, and
`prompt_ids = [BOS] + context bytes`, `answer_ids = target bytes + [EOS]`.

Shared layout parameters (kv_recall, copy, variable_tracking, needle):
  distance  the fact's first token lies exactly `distance` tokens from the end of the prompt,
            counting itself and the last prompt token: prompt_ids[-distance] is the fact's first
            byte. A replay of the last N prompt tokens therefore covers the whole fact iff
            N >= distance. None: the fact lies anywhere.
  length    exact prompt length in tokens, BOS included (len(prompt_ids) == length); filler
            pads the free space. None: natural length plus `filler`.
  filler    when length is None, a random number of filler tokens in [0, filler] is spread over
            the free gaps.
Filler is lowercase pseudo-words, each followed by one space ("ko lusa be "): no digits,
capitals or punctuation, so it is never confusable with a fact or a query.

The content (keys, values, spans, chains) is drawn before the layout, so one seed with
different `distance`/`length`/`filler` gives the same facts and query, only moved: paired
comparisons across distances come for free. `Example.meta["distance"]` is the measured
distance of the fact (for variable_tracking also `meta["chain_distances"]`, one per statement
of the queried chain); `meta["length"]` is len(prompt_ids).
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

from .layout import (DIGITS, UPPER, check_alphabet, check_int, check_layout, check_min_distance,
                     composition, distinct_strings, filler_text, layout)
from .registry import (SLACK, TASKS, Example, Point, Sweep, TaskParamError, chance_accuracy,
                       distance_points, fits, make_example, task)

__all__ = ["TASKS", "Example", "TaskParamError", "make_example", "chance_accuracy",
           "filler_text", "RUNNING_KINDS"]


def _pick_one_of(n: int, space: int) -> float:
    """Chance of guessing one of n candidates shown in the context, each drawn from an answer
    space of `space` values: right when the pick is the asked one, or by luck otherwise."""
    return 1.0 / n + (1.0 - 1.0 / n) / space


def check_sep(family: str, sep: Any) -> str:
    """`sep` (the separator between a key and its value) if it is at most 3 ASCII punctuation
    characters other than '?', ";" and space, else a TaskParamError."""
    if not (isinstance(sep, str) and len(sep) <= 3
            and all(c.isascii() and c.isprintable() and not c.isalnum() and c not in " ?;"
                    for c in sep)):
        raise TaskParamError(family, "sep", f"must be a string of at most 3 ASCII punctuation "
                             f"characters other than '?', ';' and space (\"\" for none), "
                             f"got {sep!r}")
    return sep


# ---- kv_recall: families recall, short, boundary, multiturn ----------------------------------
def chance_kv_recall(p: dict) -> float:
    """A random value among the n_pairs in the context (the key ignored)."""
    return _pick_one_of(p["n_pairs"], len(p["value_alphabet"]) ** p["value_len"])


def points_recall(s: Any) -> list[Point]:
    """The fact at the suite's distance sweep (1, N-1, N, N+1, W, R_exact-1 .. 2 R_exact)."""
    return distance_points(s, "kv_recall", {"n_pairs": 4}, s.distances())


def _kv_at_length(length: int, max_pairs: int = 4) -> Optional[dict]:
    """kv_recall params at an exact prompt length: as many pairs (<= max_pairs) as fit."""
    for n_pairs in range(max_pairs, 0, -1):
        params = {"n_pairs": n_pairs, "length": length}
        if fits("kv_recall", **params):
            return params
    return None


def points_short(s: Any) -> list[Point]:
    """T <= N: the replay covers the whole prompt, so replay=N must equal the exact model."""
    lengths = set()
    for n in s.replays:
        lengths |= {n // 2, n - 1, n}
    out = []
    for t in sorted(lengths):
        params = _kv_at_length(t) if 1 <= t <= s.length_cap else None
        if params is not None:
            out.append(Point(t, params, {"covered_by": [n for n in s.replays if n >= t]}))
    return out


def short_needs() -> str:
    """What `short` needs when it has no points: a replay at least its shortest prompt."""
    shortest = next((t for t in range(1, 4096) if _kv_at_length(t) is not None), None)
    return f"short needs a replay N >= {shortest} (its shortest prompt)" if shortest else ""


def points_boundary(s: Any) -> list[Point]:
    """T = k*W + {-1,0,1} for the two smallest k with k*W - 1 > max N (so every replay is
    bounded), and k*m + {-1,0,1} for the smallest block multiple above max N that is not a
    window multiple (when m > 2: with m <= 2 every T is already at a block boundary)."""
    top = max(s.replays)
    k = top // s.window + 1
    while k * s.window - 1 <= top:
        k += 1
    centres = {k * s.window, (k + 1) * s.window}
    for m in {s.block, s.decoder_block}:
        if m > 2:
            j = top // m + 1
            while j * m - 1 <= top or (j * m) % s.window == 0:
                j += 1
            centres.add(j * m)
    out = []
    for t in sorted({c + delta for c in centres for delta in (-1, 0, 1)}):
        params = _kv_at_length(t) if t <= s.length_cap else None
        if params is not None:
            out.append(Point(t, params, {"T_mod_W": t % s.window, "T_mod_m": t % s.block}))
    return out


def points_multiturn(s: Any) -> list[Point]:
    """The recall sweep, each document also saying whether the fact lies in the cached prefix."""
    def extra(d: int) -> dict:
        return {"turns": list(s.turns), "fact_in_cached_prefix": [d > t for t in s.turns]}
    return distance_points(s, "kv_recall", {"n_pairs": 4}, s.distances(), extra)


KV_RECALL_SWEEPS = (
    Sweep("recall", "distance", points_recall, "a key's value at distance d from the prompt's end"),
    Sweep("short", "length", points_short, "prompts with T <= N (replay must be exact)",
          needs=short_needs),
    Sweep("boundary", "length", points_boundary,
          "T at block and window boundaries (T mod m, T mod W in {-1, 0, 1})"),
    Sweep("multiturn", "distance", points_multiturn,
          "a cached prefix then a short new turn (< N tokens), every multi-turn policy "
          "(docs/semantics.md 4.3)", turn_modes=True),
)


@task("kv_recall", chance=chance_kv_recall, sweeps=KV_RECALL_SWEEPS)
def kv_recall(rng: random.Random, n_pairs: int = 4, key_len: int = 1, value_len: int = 1,
              key_alphabet: str = UPPER, value_alphabet: str = DIGITS,
              distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32,
              queries: int = 1, sep: str = ""):
    """Associative recall (zoology's MQAR): can the model look up a key's value?

    context: `K7 ` pairs (key, then value), the queried one among them, filler around, then
    `?K`; target `7`. E.g. "Q3 ba K7 X1 kolu T0 ?K" -> "7". Keys distinct; the queried pair has
    width key_len + len(sep) + value_len + 1 and `distance` counts from its key's first byte.
    The value follows its key directly and the query ends with the key, as in zoology's MQAR: the
    answer is then "the token after the earlier occurrence of what I just read", which small
    models learn (with ModelConfig.shift_tokens) in a few hundred steps. `sep` puts a separator
    between key and value and after the queried key (sep="=" is this task's earlier format
    "K=7 ", "?K="); FINDINGS.md measures how much slower that is to learn.
    queries > 1 (a training option, as in MQAR): `queries - 1` other keys are asked and
    answered first, "... ?X1 ?T0 ?K" -> "7"; their values are marked as answers too
    (meta["answer_spans"]), so one example supervises `queries` look-ups.
    """
    f = "kv_recall"
    n_pairs = check_int(f, "n_pairs", n_pairs, 1)
    check_int(f, "key_len", key_len, 1)
    check_int(f, "value_len", value_len, 1)
    check_alphabet(f, "key_alphabet", key_alphabet)
    check_alphabet(f, "value_alphabet", value_alphabet)
    check_layout(f, distance, length, filler)
    check_sep(f, sep)
    if n_pairs > len(key_alphabet) ** key_len:
        raise TaskParamError(f, "n_pairs", f"must be <= {len(key_alphabet) ** key_len} (distinct "
                             f"keys of key_len {key_len} from key_alphabet), got {n_pairs}")
    keys = distinct_strings(rng, key_alphabet, key_len, n_pairs)
    values = ["".join(rng.choice(value_alphabet) for _ in range(value_len)) for _ in keys]
    pairs = [f"{k}{sep}{v} " for k, v in zip(keys, values)]
    queries = check_int(f, "queries", queries, 1)
    if queries > n_pairs:
        raise TaskParamError(f, "queries", f"must be <= n_pairs ({n_pairs}), got {queries}")
    q = rng.randrange(n_pairs)
    others = pairs[:q] + pairs[q + 1:]
    rng.shuffle(others)
    # Drawn only when asked for, so that queries=1 keeps the single-query examples as they were.
    asked = ([i for i in rng.sample(range(n_pairs), n_pairs) if i != q][:queries - 1]
             if queries > 1 else [])
    query = "".join(f"?{keys[i]}{sep}{values[i]} " for i in asked) + f"?{keys[q]}{sep}"
    check_min_distance(f, distance, len(pairs[q]) + len(query))
    gap = None if distance is None else distance - len(pairs[q]) - len(query)
    context, (offset,) = layout(rng, f, [pairs[q]], others, query, [gap], length, filler)
    spans, at = [], len(context) - len(query)
    for i in asked:
        at += 1 + len(keys[i]) + len(sep)
        spans.append((at, len(values[i])))
        at += len(values[i]) + 1
    meta = {"distance": len(context) - offset}
    if spans:
        meta["answer_spans"] = spans
    return context, values[q], meta


# ---- copy: family copy ----------------------------------------------------------------------
def chance_copy(p: dict) -> float:
    """A uniform random span: 1 / |alphabet| ** span_len."""
    return 1.0 / len(p["alphabet"]) ** p["span_len"]


def points_copy(s: Any) -> list[Point]:
    """A span beginning d tokens from the end (before the replay start iff d > N)."""
    return distance_points(s, "copy", {"span_len": 4}, s.distances())


COPY_SWEEPS = (Sweep("copy", "distance", points_copy,
                     "copy a span that begins d tokens before the end"),)


@task("copy", chance=chance_copy, sweeps=COPY_SWEEPS)
def copy_span(rng: random.Random, span_len: int = 4, alphabet: str = UPPER + DIGITS,
              distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32):
    """Long-range copy: can the model reproduce a span it saw `distance` tokens ago?

    context: filler, `<SPAN> `, filler, then `?<`; target SPAN. E.g. "bo <QX7B> kalu ?<" -> "QX7B".
    `distance` counts from the `<` (minimum span_len + 5).
    """
    f = "copy"
    check_int(f, "span_len", span_len, 1)
    check_alphabet(f, "alphabet", alphabet)
    check_layout(f, distance, length, filler)
    span = "".join(rng.choice(alphabet) for _ in range(span_len))
    fact, query = f"<{span}> ", "?<"
    check_min_distance(f, distance, len(fact) + len(query))
    gap = None if distance is None else distance - len(fact) - len(query)
    context, (offset,) = layout(rng, f, [fact], [], query, [gap], length, filler)
    return context, span, {"distance": len(context) - offset}


# ---- variable_tracking: family multihop -----------------------------------------------------
def _statement_width(sep: str) -> int:
    """Tokens of one variable_tracking statement: variable, sep, value, `;`."""
    return 3 + len(sep)


def chance_variable_tracking(p: dict) -> float:
    """A random literal among the chains' literals (n_distractor_chains + 1 of them)."""
    return _pick_one_of(p["n_distractor_chains"] + 1, len(p["values"]))


def points_multihop(s: Any) -> list[Point]:
    """2 hops `spread` tokens apart, the literal placed so that 0 .. hops+1 chain statements
    lie before each replay start; also R_exact, R_exact + 1, 2 R_exact and W."""
    hops, spread = 2, s.multihop_spread
    params = {"hops": hops, "n_distractor_chains": 1, "spread": spread}
    sep = TASKS["variable_tracking"].defaults["sep"]     # the suite writes the default format
    step = _statement_width(sep) + spread    # statement k lies at distance d - k * step
    wanted = set()
    for n in s.point_replays:
        # j chain statements (literal first) beyond the replay start, j = 0 .. hops + 1
        wanted |= {n + j * step for j in range(hops + 2)}
    if s.r_exact is not None:
        wanted |= {s.r_exact, s.r_exact + 1, 2 * s.r_exact}
    wanted |= {s.window, *s.extra_distances}

    def extra(d: int) -> dict:
        return {"chain_distances": [d - k * step for k in range(hops + 1)]}
    return distance_points(s, "variable_tracking", params, wanted, extra)


VARIABLE_TRACKING_SWEEPS = (
    Sweep("multihop", "distance", points_multihop,
          "2-hop variable tracking, hops on both sides of the replay start"),)


@task("variable_tracking", chance=chance_variable_tracking,
      sweeps=VARIABLE_TRACKING_SWEEPS)
def variable_tracking(rng: random.Random, hops: int = 2, n_distractor_chains: int = 1,
                      names: str = UPPER, values: str = DIGITS, distance: Optional[int] = None,
                      spread: Optional[int] = None, length: Optional[int] = None, filler: int = 32,
                      sep: str = ""):
    """Multi-hop variable binding (RULER's variable tracking): can the model follow `XY` links
    (X takes Y's value) back to a literal?

    context: the statements of the queried chain `A5;` `BA;` `CB;` and of
    `n_distractor_chains` other chains of the same shape, interleaved (each chain in order)
    with filler, then `?C`; target `5`. E.g. "A5;D2;BA;ko ED;CB;FE;?C" -> "5".
    The value follows its variable directly and the query ends with the variable, as in
    kv_recall: each hop is then "the token after the earlier statement of what I just read".
    `sep` goes between a variable and its value (sep="=" is this task's earlier format
    "A=5;", "?C="; findings/HISTORY.md 0.6 has what was measured with each).
    hops: links from the literal to the queried variable (0: plain lookup `?A`).
    Names are single characters of `names`, all distinct; every statement is 3 + len(sep)
    tokens.
    distance: distance of the chain's literal statement `A5;`.
    spread: tokens between consecutive statements of the queried chain (end of one to start of
      the next; filled with distractor statements and filler); None: random. With both set,
      statement k of the chain lies at distance exactly
      `distance - k * (3 + len(sep) + spread)`, so an
      evaluator can put any number of hops before or after a replay start.
    meta["chain_distances"]: measured distances of the chain's statements, literal first.
    """
    f = "variable_tracking"
    hops = check_int(f, "hops", hops, 0)
    n_chains = check_int(f, "n_distractor_chains", n_distractor_chains, 0) + 1
    check_alphabet(f, "names", names)
    check_alphabet(f, "values", values)
    check_int(f, "spread", spread, 0, optional=True)
    check_layout(f, distance, length, filler)
    check_sep(f, sep)
    if n_chains * (hops + 1) > len(names):
        raise TaskParamError(f, "n_distractor_chains", f"needs (n_distractor_chains + 1) * "
                             f"(hops + 1) <= {len(names)} distinct names, got {n_distractor_chains}")
    variables = rng.sample(names, n_chains * (hops + 1))
    chains = []
    for c in range(n_chains):
        chain = variables[c * (hops + 1):(c + 1) * (hops + 1)]
        chains.append([f"{chain[0]}{sep}{rng.choice(values)};"]
                      + [f"{b}{sep}{a};" for a, b in zip(chain, chain[1:])])
    order = [c for c in range(1, n_chains) for _ in range(hops + 1)]
    rng.shuffle(order)                        # a random merge that keeps each chain in order
    others = [chains[c].pop(0) for c in order]
    main, width = chains[0], _statement_width(sep)
    query = f"?{main[-1][0]}{sep}"

    min_distance = (hops + 1) * width + hops * (spread or 0) + len(query)
    check_min_distance(f, distance, min_distance)
    gaps: list[Optional[int]] = [spread] * hops + [None]
    if distance is not None and spread is not None:
        gaps[-1] = distance - min_distance
    elif distance is not None:
        gaps = composition(rng, distance - min_distance, hops + 1)
    context, offsets = layout(rng, f, main, others, query, gaps, length, filler)
    chain_distances = [len(context) - o for o in offsets]
    literal = main[0][1 + len(sep)]
    return context, literal, {"distance": chain_distances[0], "chain_distances": chain_distances}


RUNNING_KINDS = ("count", "parity", "bracket")


# ---- running_state: families running_count, running_parity, running_bracket, multiturn_count
def _bracket_depths(window_len: int) -> list[float]:
    """Distribution of the final depth of running_state's bracket windows (exact, by DP)."""
    probs = [1.0] + [0.0] * window_len
    for _ in range(window_len):
        nxt = [0.0] * (window_len + 1)
        for depth, p in enumerate(probs):
            if p == 0.0:
                continue
            if depth == 0:
                nxt[1] += p
            else:
                nxt[depth + 1] += p / 2
                nxt[depth - 1] += p / 2
        probs = nxt
    return probs


def chance_running_state(p: dict) -> float:
    """The most likely answer, max_a P(target = a): count: the binomial mode, parity: 1/2,
    bracket: the mode of the depth distribution."""
    m = p["window_len"]
    if p["kind"] == "parity":
        return 0.5
    if p["kind"] == "count":
        return math.comb(m, m // 2) / 2 ** m
    return max(_bracket_depths(m))


def _running(kind: str) -> Callable[[Any], list[Point]]:
    """The sweep of one running_state kind: `|` at distance M + 2 around each N and at W + 2,
    or at each of the settings' `span_starts` when set; one prompt length for every point, or
    with `state_filler` set, training's layout (a random prefix of 0..state_filler symbols)."""
    def points(s: Any) -> list[Point]:
        # `|` lies at distance M + 2: M + 2 in {N-1, N, N+1} puts the start of the counted
        # window just inside / at / just outside the replay; a grid of span starts
        # (`span_starts`, e.g. the uncensored one) replaces those points.
        if getattr(s, "span_starts", None):
            targets = set(s.span_starts)
        else:
            targets = {s.window + 2}
            for n in s.point_replays:
                targets |= {n - 1, n, n + 1}
        windows = sorted({d - 2 for d in targets if d - 2 >= 1})
        filler = getattr(s, "state_filler", None)
        if filler is not None:
            # training's layout: each example draws its own prefix of 0..filler symbols, so a
            # short span is read after a short prefix, as the model met it in training
            return [Point(m + 2, {"kind": kind, "window_len": m, "filler": filler})
                    for m in windows if m + 3 + filler <= s.length_cap]
        windows = [m for m in windows if m + 3 + SLACK <= s.length_cap]
        if not windows:
            return []
        # a longer random prefix before `|` when asked (state_length): a prompt longer than the
        # decoder's reach R_exact, so that a bounded replay leaves window state outside it
        length = min(max(max(windows) + 3 + SLACK, s.state_length or 0), s.length_cap)
        return [Point(m + 2, {"kind": kind, "window_len": m, "length": length})
                for m in windows]
    points.__name__ = f"points_running_{kind}"
    return points


def points_multiturn_count(s: Any) -> list[Point]:
    """The running-count sweep, each document also saying whether `|` (the start of the counted
    window) lies in the cached prefix: the answer then depends on decoder window state built
    before the new turn, which is what the multi-turn policies keep or lose."""
    return [Point(p.x, p.params, {"turns": list(s.turns),
                                  "fact_in_cached_prefix": [p.x > t for t in s.turns]})
            for p in _running("count")(s)]


RUNNING_STATE_SWEEPS = (
    Sweep("running_count", "distance", _running("count"),
          "count of `a` over the last M symbols (`|` at distance M + 2)"),
    Sweep("running_parity", "distance", _running("parity"), "parity of `1` over the last M symbols"),
    Sweep("running_bracket", "distance", _running("bracket"), "bracket depth over the last M symbols"),
    Sweep("multiturn_count", "distance", points_multiturn_count,
          "the running count after a cached prefix and a short new turn: window state across "
          "the turn, every multi-turn policy (docs/semantics.md 4.3)", turn_modes=True),
)


@task("running_state", chance=chance_running_state, sweeps=RUNNING_STATE_SWEEPS)
def running_state(rng: random.Random, kind: str = "count", window_len: int = 8,
                  length: Optional[int] = None, filler: int = 16,
                  min_window_len: Optional[int] = None):
    """State over a window: can the model keep a running count / parity / bracket depth over the
    last `window_len` symbols, ignoring the symbols before?

    min_window_len (a training option): when set, each example's window length is drawn
    uniformly in [min_window_len, window_len], so that a model trained on it meets every window
    the suite sweeps (the suite fixes window_len per point and leaves this unset).

    context: a prefix of random symbols, `|`, window_len symbols, `?`; the target depends only
    on the window (the `|` marks where it starts, so this probes state accumulation over M
    tokens, not position counting). E.g. count: "abba|aabab?" -> "3".
      count:   symbols a/b; target = number of `a` in the window, in decimal
      parity:  symbols 0/1; target = number of `1` mod 2
      bracket: symbols ( ); the window is a valid bracket prefix (depth never below 0);
               target = its final depth, in decimal
    length fixes len(prompt_ids) (>= window_len + 3) via the prefix; else the prefix has a random
    [0, filler] symbols. meta["distance"] = window_len + 2, the distance of `|`.
    """
    f = "running_state"
    if kind not in RUNNING_KINDS:
        raise TaskParamError(f, "kind", f"must be one of {', '.join(RUNNING_KINDS)}, got {kind!r}")
    window_len = check_int(f, "window_len", window_len, 1)
    check_layout(f, None, length, filler)
    if min_window_len is not None:
        min_window_len = check_int(f, "min_window_len", min_window_len, 1)
        if min_window_len > window_len:
            raise TaskParamError(f, "min_window_len", f"must be <= window_len ({window_len}), "
                                 f"got {min_window_len}")
        window_len = rng.randint(min_window_len, window_len)
    symbols = {"count": "ab", "parity": "01", "bracket": "()"}[kind]
    if kind == "bracket":
        window, depth = [], 0
        for _ in range(window_len):
            window.append("(" if depth == 0 else rng.choice(symbols))
            depth += 1 if window[-1] == "(" else -1
        target = depth
    else:
        window = [rng.choice(symbols) for _ in range(window_len)]
        target = window.count(symbols[0] if kind == "count" else "1")
        target = target % 2 if kind == "parity" else target
    if length is not None and length < window_len + 3:
        raise TaskParamError(f, "length", f"must be >= window_len + 3 = {window_len + 3}, got {length}")
    n_prefix = rng.randint(0, filler) if length is None else length - window_len - 3
    prefix = "".join(rng.choice(symbols) for _ in range(n_prefix))
    return f"{prefix}|{''.join(window)}?", str(target), {"distance": window_len + 2}


# ---- needle: family needle ------------------------------------------------------------------
def chance_needle(p: dict) -> float:
    """A random code among the n_distractors + 1 lines in the context."""
    return _pick_one_of(p["n_distractors"] + 1, 10 ** p["code_digits"])


def points_needle(s: Any) -> list[Point]:
    """More distractor lines than the top-k has slots (each line is 12 tokens in the default
    format, so the top-k cannot even read one token of every line):
    `settings.needle_distractors`, else top-k + 1, else 8. If they do not fit under the length
    cap, as many as fit are used (the document's params say how many)."""
    n = s.needle_distractors
    if n is None:
        n = s.topk + 1 if s.topk is not None else 8
    params = {"n_distractors": n, "id_digits": 3, "code_digits": 4}
    while n >= 0:
        params["n_distractors"] = n
        pts = distance_points(s, "needle", params, s.distances())
        if pts:
            return pts
        n -= 1
    return []


NEEDLE_SWEEPS = (Sweep("needle", "distance", points_needle,
                       "needle line among more same-template distractors than top-k"),)


@task("needle", chance=chance_needle, sweeps=NEEDLE_SWEEPS)
def needle(rng: random.Random, n_distractors: int = 3, id_digits: int = 3, code_digits: int = 4,
           distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32,
           sep: str = ":", near_misses: int = 0):
    """Needle in a haystack with same-template distractors: can the model find the one line
    whose multi-token id matches and copy its multi-token code?

    context: lines `id 123:4567\\n` (the needle among `n_distractors` others with distinct
    ids) in filler, then `?id 123:`; target `4567`. Ids and codes are zero-padded decimals; a
    line has 4 + len(sep) + id_digits + code_digits tokens; `distance` counts from its `i`.
    sep: the text between id and code. The default ":" ends the query with a token that only
    ever precedes a code, as kv_recall's query ends with its key; sep=" code " is this task's
    earlier format (`id 123 code 4567`).
    near_misses: how many of the distractors get an id one digit away from the needle's (the
    digit's position uniform), the others stay uniform. With uniform ids a model that matches
    only the id's last digits (the query `:` sees the last two through shift_tokens 2) is
    rarely caught; near misses make every digit of the id count (FINDINGS.md "Needle").
    """
    f = "needle"
    n = check_int(f, "n_distractors", n_distractors, 0)
    check_int(f, "id_digits", id_digits, 1)
    check_int(f, "code_digits", code_digits, 1)
    check_layout(f, distance, length, filler)
    if not (isinstance(sep, str) and 1 <= len(sep) <= 8 and sep[-1] not in DIGITS
            and all(c.isascii() and c.isprintable() and c not in "?" + DIGITS for c in sep)):
        raise TaskParamError(f, "sep", f"must be 1 to 8 printable ASCII characters without "
                             f"digits or '?', got {sep!r}")
    if n + 1 > 10 ** id_digits:
        raise TaskParamError(f, "n_distractors", f"must be < {10 ** id_digits} (distinct ids of "
                             f"id_digits {id_digits}), got {n}")
    near = check_int(f, "near_misses", near_misses, 0)
    if near > min(n, 9 * id_digits):
        raise TaskParamError(f, "near_misses", f"must be <= n_distractors ({n}) and <= 9 * "
                             f"id_digits ({9 * id_digits}, the ids one digit away), got {near}")
    if near == 0:     # the original draw, kept so that earlier data stays the same bit for bit
        ids = [f"{i:0{id_digits}d}" for i in rng.sample(range(10 ** id_digits), n + 1)]
    else:
        ids = [f"{rng.randrange(10 ** id_digits):0{id_digits}d}"]
        ids += rng.sample([ids[0][:k] + d + ids[0][k + 1:] for k in range(id_digits)
                           for d in DIGITS if d != ids[0][k]], near)
        while len(ids) < n + 1:
            candidate = f"{rng.randrange(10 ** id_digits):0{id_digits}d}"
            if candidate not in ids:
                ids.append(candidate)
        others = ids[1:]
        rng.shuffle(others)             # near misses anywhere among the lines
        ids = ids[:1] + others
    codes = [f"{rng.randrange(10 ** code_digits):0{code_digits}d}" for _ in ids]
    lines = [f"id {i}{sep}{c}\n" for i, c in zip(ids, codes)]
    others = lines[1:]                          # ids are already in random order
    query = f"?id {ids[0]}{sep}"
    check_min_distance(f, distance, len(lines[0]) + len(query))
    gap = None if distance is None else distance - len(lines[0]) - len(query)
    context, (offset,) = layout(rng, f, [lines[0]], others, query, [gap], length, filler)
    return context, codes[0], {"distance": len(context) - offset}
