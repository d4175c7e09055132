"""Synthetic tasks: small deterministic generators of (context, target) text pairs.

Each family is a function `generator(rng: random.Random, **params) -> Example`, registered in
`TASKS` under its name; `make_example(family, seed, **params)` seeds the rng for you. Contexts
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

import functools
import inspect
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"


@dataclass
class Example:
    """One synthetic example: the model must produce `target` right after `context`."""

    family: str
    params: dict          # every generator parameter, defaults filled in
    context: str
    target: str
    meta: dict = field(default_factory=dict)   # measured layout facts (see module docstring)

    @property
    def prompt_ids(self) -> list[int]:
        """[BOS] + UTF-8 bytes of context; length len(context) + 1."""
        return [_TOK.bos] + _TOK.encode(self.context)

    @property
    def answer_ids(self) -> list[int]:
        """UTF-8 bytes of target + [EOS]."""
        return _TOK.encode(self.target) + [_TOK.eos]


class TaskParamError(ValueError):
    """A bad generator parameter; the message names the config key data.tasks.<family>.<param>."""

    def __init__(self, family: str, param: str, message: str):
        self.family, self.param, self.message = family, param, message
        super().__init__(f"data.tasks.{family}.{param} {message}")


TASKS: dict[str, Callable[..., Example]] = {}


def task(name: str):
    """Register `fn(rng, **params) -> (context, target, meta)` as family `name`. The registered
    generator rejects unknown params, fills in defaults and returns an Example."""

    def register(fn):
        defaults = {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[1:]}

        @functools.wraps(fn)
        def generate(rng: random.Random, **params: Any) -> Example:
            for key in params:
                if key not in defaults:
                    raise TaskParamError(name, key, f"is not a parameter of {name}; "
                                         f"allowed: {', '.join(defaults)}")
            full = {**defaults, **params}
            context, target, meta = fn(rng, **full)
            assert context.isascii() and target.isascii()
            return Example(name, full, context, target, {**meta, "length": len(context) + 1})

        generate.defaults = defaults
        TASKS[name] = generate
        return generate

    return register


def make_example(family: str, seed: int, **params: Any) -> Example:
    """The example of `family` for `seed`; deterministic in (family, seed, params)."""
    if family not in TASKS:
        raise ValueError(f"data.tasks: unknown task family {family!r}; allowed: {', '.join(TASKS)}")
    return TASKS[family](random.Random(f"ced.data/{family}/{seed}"), **params)


# ---- parameter checks ---------------------------------------------------------------------
def _int(family: str, name: str, value: Any, low: int, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        allowed = f"{'null or ' if optional else ''}an integer >= {low}"
        raise TaskParamError(family, name, f"must be {allowed}, got {value!r}")
    return value


def _alphabet(family: str, name: str, value: Any) -> str:
    if not (isinstance(value, str) and value and len(set(value)) == len(value)
            and all(c.isascii() and c.isalnum() for c in value)):
        raise TaskParamError(family, name, f"must be a non-empty string of distinct ASCII "
                             f"letters/digits, got {value!r}")
    return value


def _layout_params(family: str, distance: Any, length: Any, filler: Any) -> None:
    _int(family, "distance", distance, 1, optional=True)
    _int(family, "length", length, 1, optional=True)
    _int(family, "filler", filler, 0)


def _min_distance(family: str, distance: Optional[int], minimum: int) -> None:
    if distance is not None and distance < minimum:
        raise TaskParamError(family, "distance", f"must be >= {minimum} for these params (the "
                             f"fact and everything that must follow it), got {distance}")


# ---- filler and layout --------------------------------------------------------------------
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def filler_text(rng: random.Random, n: int) -> str:
    """Exactly n characters of neutral text: lowercase pseudo-words, each followed by a space."""
    words, size = [], 0
    while size < n:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS)
                       for _ in range(rng.randint(1, 3)))
        words.append(word + " ")
        size += len(word) + 1
    return "".join(words)[: n - 1] + " " if n > 0 else ""


def _composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` split into `parts` non-negative integers at random cut points."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _layout(rng: random.Random, family: str, facts: list[str], others: list[str], query: str,
            gaps: list[Optional[int]], length: Optional[int], filler_max: int) -> tuple[str, list[int]]:
    """Lay out `facts` (in order), `others` (equal widths, kept in order) and filler, then `query`.

    Region 0 lies before facts[0]; region j >= 1 between facts[j-1] and facts[j] (or the query).
    gaps[j-1] fixes region j's size in tokens (its others plus filler); None leaves it free.
    Free regions share what `length` leaves, or a random [0, filler_max] filler when length is
    None. Others are spread over regions as a uniform random merge, then moved only as far as
    the region sizes require. Returns (context, offset of each fact in context).
    """
    m, n = len(facts), len(others)
    width = len(others[0]) if others else 1
    assert all(len(o) == width for o in others)
    sizes: list[Optional[int]] = [None] + list(gaps)
    fixed = [j for j in range(m + 1) if sizes[j] is not None]
    free = [j for j in range(m + 1) if sizes[j] is None]
    cap = {j: sizes[j] // width for j in fixed}
    core = 1 + sum(map(len, facts)) + len(query) + sum(sizes[j] for j in fixed)  # BOS included
    if length is None:
        free_cap = n
    else:
        need = core + max(0, n - sum(cap.values())) * width
        if length < need:
            raise TaskParamError(family, "length", f"must be >= {need} for these params, got {length}")
        free_cap = (length - core) // width

    bars = sorted(rng.sample(range(n + m), m))
    counts = [b - a - 1 for a, b in zip([-1] + bars, bars + [n + m])]
    spill = 0
    for j in fixed:
        spill += max(0, counts[j] - cap[j])
        counts[j] = min(counts[j], cap[j])
    while sum(counts[j] for j in free) > free_cap:
        j = max(free, key=lambda j: counts[j])
        counts[j] -= 1
        spill += 1
    for _ in range(spill):
        room = [j for j in fixed if counts[j] < cap[j]]
        if sum(counts[j] for j in free) < free_cap:
            room += free
        counts[rng.choice(room)] += 1

    free_items = sum(counts[j] for j in free)
    free_fill = rng.randint(0, filler_max) if length is None else length - core - free_items * width
    free_parts = iter(_composition(rng, free_fill, free_items + len(free)))
    out: list[str] = []
    offsets: list[int] = []
    items = iter(others)
    for j in range(m + 1):
        if sizes[j] is None:
            parts = [next(free_parts) for _ in range(counts[j] + 1)]
        else:
            parts = _composition(rng, sizes[j] - counts[j] * width, counts[j] + 1)
        for k, size in enumerate(parts):
            out.append(filler_text(rng, size))
            if k < counts[j]:
                out.append(next(items))
        if j < m:
            offsets.append(sum(map(len, out)))
            out.append(facts[j])
    out.append(query)
    return "".join(out), offsets


def _distinct_strings(rng: random.Random, alphabet: str, size: int, count: int) -> list[str]:
    """`count` distinct random strings of `size` characters from `alphabet`."""
    base = len(alphabet)
    out = []
    for code in rng.sample(range(base ** size), count):
        chars = []
        for _ in range(size):
            code, digit = divmod(code, base)
            chars.append(alphabet[digit])
        out.append("".join(chars))
    return out


# ---- the five families --------------------------------------------------------------------
@task("kv_recall")
def kv_recall(rng: random.Random, n_pairs: int = 4, key_len: int = 1, value_len: int = 1,
              key_alphabet: str = UPPER, value_alphabet: str = DIGITS,
              distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32,
              queries: int = 1):
    """Associative recall (zoology's MQAR): can the model look up a key's value?

    context: `K=7 ` pairs, the queried one among them, filler around, then `?K=`; target `7`.
    E.g. "Q=3 ba K=7 X=1 kolu T=0 ?K=" -> "7". Keys distinct; the queried pair has width
    key_len + value_len + 2 and `distance` counts from its key's first byte.
    queries > 1 (a training option, as in MQAR): `queries - 1` other keys are asked and
    answered first, "... ?X=1 ?T=0 ?K=" -> "7"; their values are marked as answers too
    (meta["answer_spans"]), so one example supervises `queries` look-ups.
    """
    f = "kv_recall"
    n_pairs = _int(f, "n_pairs", n_pairs, 1)
    _int(f, "key_len", key_len, 1)
    _int(f, "value_len", value_len, 1)
    _alphabet(f, "key_alphabet", key_alphabet)
    _alphabet(f, "value_alphabet", value_alphabet)
    _layout_params(f, distance, length, filler)
    if n_pairs > len(key_alphabet) ** key_len:
        raise TaskParamError(f, "n_pairs", f"must be <= {len(key_alphabet) ** key_len} (distinct "
                             f"keys of key_len {key_len} from key_alphabet), got {n_pairs}")
    keys = _distinct_strings(rng, key_alphabet, key_len, n_pairs)
    values = ["".join(rng.choice(value_alphabet) for _ in range(value_len)) for _ in keys]
    pairs = [f"{k}={v} " for k, v in zip(keys, values)]
    queries = _int(f, "queries", queries, 1)
    if queries > n_pairs:
        raise TaskParamError(f, "queries", f"must be <= n_pairs ({n_pairs}), got {queries}")
    q = rng.randrange(n_pairs)
    others = pairs[:q] + pairs[q + 1:]
    rng.shuffle(others)
    # Drawn only when asked for, so that queries=1 keeps the single-query examples as they were.
    asked = ([i for i in rng.sample(range(n_pairs), n_pairs) if i != q][:queries - 1]
             if queries > 1 else [])
    query = "".join(f"?{keys[i]}={values[i]} " for i in asked) + f"?{keys[q]}="
    _min_distance(f, distance, len(pairs[q]) + len(query))
    gap = None if distance is None else distance - len(pairs[q]) - len(query)
    context, (offset,) = _layout(rng, f, [pairs[q]], others, query, [gap], length, filler)
    spans, at = [], len(context) - len(query)
    for i in asked:
        at += len(keys[i]) + 2
        spans.append((at, len(values[i])))
        at += len(values[i]) + 1
    meta = {"distance": len(context) - offset}
    if spans:
        meta["answer_spans"] = spans
    return context, values[q], meta


@task("copy")
def copy_span(rng: random.Random, span_len: int = 4, alphabet: str = UPPER + DIGITS,
              distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32):
    """Long-range copy: can the model reproduce a span it saw `distance` tokens ago?

    context: filler, `<SPAN> `, filler, then `?<`; target SPAN. E.g. "bo <QX7B> kalu ?<" -> "QX7B".
    `distance` counts from the `<` (minimum span_len + 5).
    """
    f = "copy"
    _int(f, "span_len", span_len, 1)
    _alphabet(f, "alphabet", alphabet)
    _layout_params(f, distance, length, filler)
    span = "".join(rng.choice(alphabet) for _ in range(span_len))
    fact, query = f"<{span}> ", "?<"
    _min_distance(f, distance, len(fact) + len(query))
    gap = None if distance is None else distance - len(fact) - len(query)
    context, (offset,) = _layout(rng, f, [fact], [], query, [gap], length, filler)
    return context, span, {"distance": len(context) - offset}


@task("variable_tracking")
def variable_tracking(rng: random.Random, hops: int = 2, n_distractor_chains: int = 1,
                      names: str = UPPER, values: str = DIGITS, distance: Optional[int] = None,
                      spread: Optional[int] = None, length: Optional[int] = None, filler: int = 32):
    """Multi-hop variable binding (RULER's variable tracking): can the model follow `X=Y` links
    back to a literal?

    context: the statements of the queried chain `A=5;` `B=A;` `C=B;` and of
    `n_distractor_chains` other chains of the same shape, interleaved (each chain in order)
    with filler, then `?C=`; target `5`. E.g. "A=5;D=2;B=A;ko E=D;C=B;F=E;?C=" -> "5".
    hops: `X=Y;` links from the literal to the queried variable (0: plain lookup `?A=`).
    Names are single characters of `names`, all distinct; every statement is 4 tokens.
    distance: distance of the chain's literal statement `A=5;`.
    spread: tokens between consecutive statements of the queried chain (end of one to start of
      the next; filled with distractor statements and filler); None: random. With both set,
      statement k of the chain lies at distance exactly `distance - k * (4 + spread)`, so an
      evaluator can put any number of hops before or after a replay start.
    meta["chain_distances"]: measured distances of the chain's statements, literal first.
    """
    f = "variable_tracking"
    hops = _int(f, "hops", hops, 0)
    n_chains = _int(f, "n_distractor_chains", n_distractor_chains, 0) + 1
    _alphabet(f, "names", names)
    _alphabet(f, "values", values)
    _int(f, "spread", spread, 0, optional=True)
    _layout_params(f, distance, length, filler)
    if n_chains * (hops + 1) > len(names):
        raise TaskParamError(f, "n_distractor_chains", f"needs (n_distractor_chains + 1) * "
                             f"(hops + 1) <= {len(names)} distinct names, got {n_distractor_chains}")
    variables = rng.sample(names, n_chains * (hops + 1))
    chains = []
    for c in range(n_chains):
        chain = variables[c * (hops + 1):(c + 1) * (hops + 1)]
        chains.append([f"{chain[0]}={rng.choice(values)};"]
                      + [f"{b}={a};" for a, b in zip(chain, chain[1:])])
    order = [c for c in range(1, n_chains) for _ in range(hops + 1)]
    rng.shuffle(order)                        # a random merge that keeps each chain in order
    others = [chains[c].pop(0) for c in order]
    main, width = chains[0], 4
    query = f"?{main[-1][0]}="

    min_distance = (hops + 1) * width + hops * (spread or 0) + len(query)
    _min_distance(f, distance, min_distance)
    gaps: list[Optional[int]] = [spread] * hops + [None]
    if distance is not None and spread is not None:
        gaps[-1] = distance - min_distance
    elif distance is not None:
        gaps = _composition(rng, distance - min_distance, hops + 1)
    context, offsets = _layout(rng, f, main, others, query, gaps, length, filler)
    chain_distances = [len(context) - o for o in offsets]
    return context, main[0][2], {"distance": chain_distances[0], "chain_distances": chain_distances}


RUNNING_KINDS = ("count", "parity", "bracket")


@task("running_state")
def running_state(rng: random.Random, kind: str = "count", window_len: int = 8,
                  length: Optional[int] = None, filler: int = 16):
    """State over a window: can the model keep a running count / parity / bracket depth over the
    last `window_len` symbols, ignoring the symbols before?

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
    window_len = _int(f, "window_len", window_len, 1)
    _layout_params(f, None, length, filler)
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


@task("needle")
def needle(rng: random.Random, n_distractors: int = 3, id_digits: int = 3, code_digits: int = 4,
           distance: Optional[int] = None, length: Optional[int] = None, filler: int = 32):
    """Needle in a haystack with same-template distractors: can the model find the one line
    whose multi-token id matches and copy its multi-token code?

    context: lines `id 123 code 4567\\n` (the needle among `n_distractors` others with distinct
    ids) in filler, then `?id 123 code `; target `4567`. Ids and codes are zero-padded
    decimals; a line has 10 + id_digits + code_digits tokens; `distance` counts from its `i`.
    """
    f = "needle"
    n = _int(f, "n_distractors", n_distractors, 0)
    _int(f, "id_digits", id_digits, 1)
    _int(f, "code_digits", code_digits, 1)
    _layout_params(f, distance, length, filler)
    if n + 1 > 10 ** id_digits:
        raise TaskParamError(f, "n_distractors", f"must be < {10 ** id_digits} (distinct ids of "
                             f"id_digits {id_digits}), got {n}")
    ids = [f"{i:0{id_digits}d}" for i in rng.sample(range(10 ** id_digits), n + 1)]
    codes = [f"{rng.randrange(10 ** code_digits):0{code_digits}d}" for _ in ids]
    lines = [f"id {i} code {c}\n" for i, c in zip(ids, codes)]
    others = lines[1:]                          # ids are already in random order
    query = f"?id {ids[0]} code "
    _min_distance(f, distance, len(lines[0]) + len(query))
    gap = None if distance is None else distance - len(lines[0]) - len(query)
    context, (offset,) = _layout(rng, f, [lines[0]], others, query, [gap], length, filler)
    return context, codes[0], {"distance": len(context) - offset}


FAMILIES: tuple[str, ...] = tuple(TASKS)
DEFAULT_PARAMS: dict[str, dict[str, Any]] = {name: dict(fn.defaults) for name, fn in TASKS.items()}


# ---- chance levels ------------------------------------------------------------------------
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


def chance_accuracy(family: str, **params: Any) -> float:
    """Exact-match accuracy of a guesser blind to what the task probes (exact, not sampled):

    kv_recall, needle: a random value/code among the n candidates in the context (the key is
      ignored): 1/n + (1 - 1/n) / |answer space|.
    variable_tracking: a random literal among the chains' literals, likewise with
      n = n_distractor_chains + 1.
    copy: a uniform random span, 1 / |alphabet| ** span_len.
    running_state: the most likely answer, max_a P(target = a) (count: binomial mode,
      parity: 1/2, bracket: mode of the depth distribution).
    """
    p = make_example(family, 0, **params).params          # validates, fills defaults
    if family == "kv_recall":
        n, space = p["n_pairs"], len(p["value_alphabet"]) ** p["value_len"]
    elif family == "needle":
        n, space = p["n_distractors"] + 1, 10 ** p["code_digits"]
    elif family == "variable_tracking":
        n, space = p["n_distractor_chains"] + 1, len(p["values"])
    elif family == "copy":
        return 1.0 / len(p["alphabet"]) ** p["span_len"]
    else:
        m = p["window_len"]
        if p["kind"] == "parity":
            return 0.5
        if p["kind"] == "count":
            return math.comb(m, m // 2) / 2 ** m
        return max(_bracket_depths(m))
    return 1.0 / n + (1.0 - 1.0 / n) / space
