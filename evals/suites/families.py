"""Edge-case task families: where bounded replay should hurt, built on `ced.data`'s generators.

Every family is a thin *sweep* over one `ced.data` generator (`make_example(task, seed,
**params)`, the single copy of the task logic): it picks the parameters (distance, length,
window, distractor count, ...) from the model under test (window W, compression block m,
top-k, R_exact = `ced.exact_replay_length(cfg)`) and the replay lengths N being tested.

    settings = SuiteSettings.from_config(cfg, replays=(8, 16))
    docs = build_documents(settings, examples=50)            # list of JSON-able dicts
    write_jsonl(docs, "out/data")                            # out/data/<family>.jsonl

A document: {"id", "family", "task", "seed", "x_name", "x", "distance", "length", "params",
"meta", "context", "target", ...}. `x` is the swept quantity the family is plotted against
(`x_name`: "distance" in tokens from the prompt's end, or "length" = prompt length T, BOS
included). The model's prompt is [BOS] + context bytes and the answer is target's bytes, as in
`ced.data.Example`. Example `seed` i uses the same seed at every x, and `ced.data` draws the
content before the layout, so the facts at different distances are the same facts moved:
comparisons across x are paired too.

Families (docs/semantics.md section 4; see each `points_*` function):
  recall           kv_recall, fact at distance d in {1, N-1, N, N+1, W, R_exact-1, R_exact,
                   R_exact+1, 2 R_exact} (clamped to the smallest distance the task allows)
  copy             copy a span that begins d tokens from the end (before the replay start
                   iff d > N)
  running_count / running_parity / running_bracket
                   running state over the last M symbols, `|` at distance M + 2 around N
  multihop         variable tracking, 2 hops `spread` tokens apart, the literal placed so that
                   0 .. hops+1 chain statements lie before each replay start
  needle           a needle line among more same-template distractors than top-k
  short            prompts with T <= N (bounded replay must be exact); x = T
  boundary         T at block (m) and window (W) boundaries, T mod m, T mod W in {-1, 0, 1}
  multiturn        recall whose last `turn` tokens are a new turn on a cached prefix; the only
                   family evaluated with the multi-turn policies of docs/semantics.md 4.3
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ced import ModelConfig, exact_replay_length
from ced.data import ByteTokenizer, TaskParamError, chance_accuracy, make_example

_TOK = ByteTokenizer()
SLACK = 16           # filler tokens before the farthest fact, so it never sits at the BOS
ANSWER_ROOM = 8      # positions kept free under max_seq_len for teacher-forced targets


@dataclass(frozen=True)
class SuiteSettings:
    """What the sweeps depend on: the model's geometry and the replay lengths under test."""

    replays: tuple[int, ...]
    window: int
    block: int                      # encoder compression ratio m (a block boundary)
    decoder_block: int
    r_exact: int | None             # None: no decoder (dense, swa)
    topk: int | None
    max_seq_len: int
    variant: str = "ced"
    turns: tuple[int, ...] = ()
    extra_distances: tuple[int, ...] = ()
    max_length: int | None = None   # cap on prompt length (default max_seq_len - ANSWER_ROOM)
    needle_distractors: int | None = None
    multihop_spread: int = 4

    @classmethod
    def from_config(cls, cfg: ModelConfig, replays: Iterable[int], turns: Iterable[int] = (),
                    **kw: Any) -> "SuiteSettings":
        replays = tuple(sorted({int(n) for n in replays}))
        if not replays or replays[0] < 1:
            raise ValueError(f"replays: need at least one N >= 1; got {replays}")
        r_exact = exact_replay_length(cfg) if cfg.has_decoder else None
        turns = tuple(sorted({int(t) for t in turns})) or (max(1, replays[0] // 2),)
        return cls(replays=replays, window=cfg.window, block=cfg.encoder_compress_ratio,
                   decoder_block=cfg.decoder_compress_ratio, r_exact=r_exact, topk=cfg.topk,
                   max_seq_len=cfg.max_seq_len, variant=cfg.variant, turns=turns, **kw)

    @property
    def length_cap(self) -> int:
        cap = self.max_seq_len - ANSWER_ROOM
        return min(cap, self.max_length) if self.max_length else cap

    def distances(self) -> list[int]:
        """The distance sweep: 1, N-1, N, N+1 for each N, W, and R_exact-1, R_exact,
        R_exact+1, 2 R_exact (answerable only through the global KV beyond R_exact)."""
        d = {1, self.window, *self.extra_distances}
        for n in self.replays:
            d |= {n - 1, n, n + 1}
        if self.r_exact is not None:
            r = self.r_exact
            d |= {r - 1, r, r + 1, 2 * r}
        return sorted(x for x in d if x >= 1)

    def marks(self) -> dict[str, list[int]]:
        """Reference lines for plots."""
        out = {"N": list(self.replays), "W": [self.window]}
        if self.r_exact is not None:
            out["R_exact"] = [self.r_exact]
        return out


@dataclass(frozen=True)
class Point:
    """One x value of a family: the generator parameters of its examples."""

    x: int
    params: dict
    extra: dict = field(default_factory=dict)     # copied into every document


@dataclass(frozen=True)
class Family:
    name: str
    task: str                         # the ced.data generator
    x_name: str                       # "distance" or "length"
    points: Callable[[SuiteSettings], list[Point]]
    description: str
    turn_modes: bool = False          # evaluated with the multi-turn policies too


# ---- probing the generators (they are the single source of truth for what fits) ------------

def _fits(task: str, **params: Any) -> bool:
    try:
        make_example(task, 0, **params)
        return True
    except TaskParamError:
        return False


def min_distance(task: str, params: dict) -> int:
    """Smallest `distance` the generator accepts with these params."""
    d = 1
    while not _fits(task, **{**params, "distance": d, "length": None}):
        d += 1
        if d > 100_000:
            raise ValueError(f"{task}: no feasible distance for {params}")
    return d


def min_length(task: str, params: dict) -> int:
    """Smallest `length` the generator accepts with these params (binary search)."""
    lo, hi = 1, 64
    while not _fits(task, **{**params, "length": hi}):
        lo, hi = hi + 1, hi * 2
        if hi > 1 << 22:
            raise ValueError(f"{task}: no feasible length for {params}")
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(task, **{**params, "length": mid}):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _distance_points(s: SuiteSettings, task: str, params: dict, distances: Iterable[int],
                     extra: Callable[[int], dict] | None = None) -> list[Point]:
    """Points at the given distances (clamped up to the task's minimum), all with one prompt
    length T: the smallest that holds the farthest kept fact plus SLACK tokens of filler.
    Distances that cannot fit under the length cap are dropped."""
    low = min_distance(task, params)
    wanted = sorted({max(low, d) for d in distances})
    while wanted:
        far = wanted[-1]
        need = max(min_length(task, {**params, "distance": d}) for d in wanted)
        length = max(need, far + 1 + SLACK)
        if length <= s.length_cap:
            break
        wanted.pop()
    else:
        return []
    return [Point(d, {**params, "distance": d, "length": length},
                  extra(d) if extra else {}) for d in wanted]


# ---- the families ---------------------------------------------------------------------------

def points_recall(s: SuiteSettings) -> list[Point]:
    return _distance_points(s, "kv_recall", {"n_pairs": 4}, s.distances())


def points_copy(s: SuiteSettings) -> list[Point]:
    return _distance_points(s, "copy", {"span_len": 4}, s.distances())


def _running(kind: str) -> Callable[[SuiteSettings], list[Point]]:
    def points(s: SuiteSettings) -> list[Point]:
        # `|` lies at distance M + 2: M + 2 in {N-1, N, N+1} puts the start of the counted
        # window just inside / at / just outside the replay.
        targets = {s.window + 2}
        for n in s.replays:
            targets |= {n - 1, n, n + 1}
        windows = sorted({d - 2 for d in targets if d - 2 >= 1})
        windows = [m for m in windows if m + 3 + SLACK <= s.length_cap]
        if not windows:
            return []
        length = max(windows) + 3 + SLACK
        return [Point(m + 2, {"kind": kind, "window_len": m, "length": length})
                for m in windows]
    points.__name__ = f"points_running_{kind}"
    return points


def points_multihop(s: SuiteSettings) -> list[Point]:
    hops, spread = 2, s.multihop_spread
    step = 4 + spread                  # statement k lies at distance d - k * step
    params = {"hops": hops, "n_distractor_chains": 1, "spread": spread}
    wanted = set()
    for n in s.replays:
        # j chain statements (literal first) beyond the replay start, j = 0 .. hops + 1
        wanted |= {n + j * step for j in range(hops + 2)}
    if s.r_exact is not None:
        wanted |= {s.r_exact, s.r_exact + 1, 2 * s.r_exact}
    wanted |= {s.window, *s.extra_distances}

    def extra(d: int) -> dict:
        return {"chain_distances": [d - k * step for k in range(hops + 1)]}
    return _distance_points(s, "variable_tracking", params, wanted, extra)


def needle_distractors(s: SuiteSettings) -> int:
    if s.needle_distractors is not None:
        return s.needle_distractors
    return s.topk + 1 if s.topk is not None else 8


def points_needle(s: SuiteSettings) -> list[Point]:
    """More distractor lines than the top-k has slots (each line is 17 tokens, so the top-k
    cannot even read one token of every line). If they do not fit under the length cap,
    as many as fit are used (the document's params say how many)."""
    n = needle_distractors(s)
    params = {"n_distractors": n, "id_digits": 3, "code_digits": 4}
    while n >= 0:
        params["n_distractors"] = n
        pts = _distance_points(s, "needle", params, s.distances())
        if pts:
            return pts
        n -= 1
    return []


def _kv_at_length(length: int, max_pairs: int = 4) -> dict | None:
    """kv_recall params at an exact prompt length: as many pairs (<= max_pairs) as fit."""
    for n_pairs in range(max_pairs, 0, -1):
        params = {"n_pairs": n_pairs, "length": length}
        if _fits("kv_recall", **params):
            return params
    return None


def points_short(s: SuiteSettings) -> list[Point]:
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


def points_boundary(s: SuiteSettings) -> list[Point]:
    """T = k*W + {-1,0,1} for the two smallest k with k*W - 1 > max N (so every replay is
    bounded), and k*m + {-1,0,1} for the smallest block multiple above max N that is not a
    window multiple (when m > 2: with m <= 2 every T is already at a block boundary)."""
    top = max(s.replays)
    centres = set()
    k = top // s.window + 1
    while k * s.window - 1 <= top:
        k += 1
    centres |= {k * s.window, (k + 1) * s.window}
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


def points_multiturn(s: SuiteSettings) -> list[Point]:
    def extra(d: int) -> dict:
        return {"turns": list(s.turns), "fact_in_cached_prefix": [d > t for t in s.turns]}
    return _distance_points(s, "kv_recall", {"n_pairs": 4}, s.distances(), extra)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("recall", "kv_recall", "distance", points_recall,
           "a key's value at distance d from the prompt's end"),
    Family("copy", "copy", "distance", points_copy,
           "copy a span that begins d tokens before the end"),
    Family("running_count", "running_state", "distance", _running("count"),
           "count of `a` over the last M symbols (`|` at distance M + 2)"),
    Family("running_parity", "running_state", "distance", _running("parity"),
           "parity of `1` over the last M symbols"),
    Family("running_bracket", "running_state", "distance", _running("bracket"),
           "bracket depth over the last M symbols"),
    Family("multihop", "variable_tracking", "distance", points_multihop,
           "2-hop variable tracking, hops on both sides of the replay start"),
    Family("needle", "needle", "distance", points_needle,
           "needle line among more same-template distractors than top-k"),
    Family("short", "kv_recall", "length", points_short,
           "prompts with T <= N (replay must be exact)"),
    Family("boundary", "kv_recall", "length", points_boundary,
           "T at block and window boundaries (T mod m, T mod W in {-1, 0, 1})"),
    Family("multiturn", "kv_recall", "distance", points_multiturn,
           "a cached prefix then a short new turn (< N tokens), every multi-turn policy (docs/semantics.md 4.3)",
           turn_modes=True),
]}


# ---- documents ------------------------------------------------------------------------------

def family_points(settings: SuiteSettings, family: str) -> list[Point]:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family].points(settings)


def build_documents(settings: SuiteSettings, examples: int, families: Iterable[str] | None = None,
                    seed_offset: int = 0) -> list[dict]:
    """`examples` documents per (family, x), deterministic in (settings, seeds)."""
    if examples < 1:
        raise ValueError(f"examples: must be >= 1; got {examples}")
    docs = []
    requested = families is not None
    for name in families or FAMILIES:
        fam = FAMILIES.get(name)
        if fam is None:
            raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
        points = fam.points(settings)
        if not points:
            # A family asked for by name that evaluates nothing would let a study report an
            # empty result as if it had been measured.
            message = (f"family {name}: no points for these settings (replays "
                       f"{list(settings.replays)}, W={settings.window}, prompt length cap "
                       f"{settings.length_cap})" + _no_points_hint(name))
            if requested:
                raise ValueError(message)
            print(f"warning: {message}; skipped", file=sys.stderr)
        for point in points:
            chance = chance_accuracy(fam.task, **{k: v for k, v in point.params.items()
                                                  if k not in ("distance", "length")})
            for i in range(examples):
                seed = seed_offset + i
                ex = make_example(fam.task, seed, **point.params)
                if fam.x_name == "distance" and ex.meta["distance"] != point.x:
                    raise AssertionError(f"{name}: asked distance {point.x}, generator laid "
                                         f"out {ex.meta['distance']}")
                docs.append({
                    "id": f"{name}/{fam.x_name}={point.x}/{seed}",
                    "family": name, "task": fam.task, "seed": seed,
                    "x_name": fam.x_name, "x": point.x,
                    "distance": ex.meta.get("distance"), "length": ex.meta["length"],
                    "chance": chance,
                    "params": ex.params, "meta": {**ex.meta, **point.extra},
                    "context": ex.context, "target": ex.target,
                })
    return docs


def _no_points_hint(name: str) -> str:
    if name != "short":
        return ""
    shortest = next((t for t in range(1, 4096) if _kv_at_length(t) is not None), None)
    return (f"; short needs a replay N >= {shortest} (its shortest prompt)" if shortest
            else "")


def prompt_ids(doc: dict) -> list[int]:
    """[BOS] + context bytes (== ced.data.Example.prompt_ids)."""
    return [_TOK.bos] + _TOK.encode(doc["context"])


def target_ids(doc: dict) -> list[int]:
    """Target bytes (EOS is not scored)."""
    return _TOK.encode(doc["target"])


def write_jsonl(docs: list[dict], directory: str | Path) -> dict[str, Path]:
    """One <family>.jsonl per family under `directory`; returns {family: path}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_family: dict[str, list[dict]] = {}
    for doc in docs:
        by_family.setdefault(doc["family"], []).append(doc)
    paths = {}
    for name, rows in by_family.items():
        path = directory / f"{name}.jsonl"
        with open(path, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row, sort_keys=True) + "\n")
        paths[name] = path
    return paths


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def describe(settings: SuiteSettings) -> str:
    """A few lines on what each family will sweep, for logs."""
    lines = [f"N={list(settings.replays)} W={settings.window} m={settings.block} "
             f"R_exact={settings.r_exact} topk={settings.topk} turns={list(settings.turns)}"]
    for name, fam in FAMILIES.items():
        pts = fam.points(settings)
        xs = [p.x for p in pts]
        t = sorted({p.params.get("length") for p in pts} - {None})
        lines.append(f"  {name:16s} {fam.x_name}={xs} T={t if len(t) > 1 else (t or ['-'])[0]}")
    return "\n".join(lines)


__all__ = ["SuiteSettings", "Point", "Family", "FAMILIES", "build_documents", "write_jsonl",
           "read_jsonl", "prompt_ids", "target_ids", "family_points", "describe",
           "min_distance", "min_length"]
