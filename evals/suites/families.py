"""Edge-case task families: where bounded replay should hurt, built on `ced.data`'s generators.

A family (suite sweep) is registered with its task in the task registry (ced/data/tasks.py,
`@task(name, chance=..., sweeps=[Sweep(...)])`), the one place that says which task each
family sweeps (kv_recall: recall, short, boundary, multiturn; copy: copy; variable_tracking:
multihop; running_state: running_count/_parity/_bracket; needle: needle). `FAMILIES` here is a
live view of those sweeps, in task registration order. Every family picks the parameters of
its task's generator (distance, length, window, distractor count, ...) from the model under
test (window W, compression block m, top-k, R_exact = `ced.exact_replay_length(cfg)`) and the
replay lengths N being tested, through `SuiteSettings`.

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
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ced import ModelConfig, exact_replay_length
from ced.data import ByteTokenizer, Point, Sweep, chance_accuracy, families, make_example
from ced.data.registry import SLACK, min_distance, min_length  # noqa: F401  (re-exported)

_TOK = ByteTokenizer()
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
    # the replay lengths around which the distance and window sweeps place their points
    # (N-1, N, N+1); None: every replay under test. A long grid of modes (e.g. W ... R_exact
    # for N*) then reads one fixed set of documents instead of adding points at every N.
    sweep_replays: tuple[int, ...] | None = None
    # running_count/_parity/_bracket prompts of at least this many tokens (a longer random
    # prefix before `|`); None: as short as the windows allow (window + 3 + SLACK)
    state_length: int | None = None
    # running_count/_parity/_bracket prompts laid out as training lays them out: a random
    # prefix of 0..F symbols before `|`, drawn per example (the task's `filler`), instead of one
    # prompt length for every point; None: one length (`state_length` or the longest span's)
    state_filler: int | None = None
    # the running families' span starts (distance of `|`), replacing the points around each N:
    # set from `span_grid` ("uncensored": `uncensored_span_starts`), with `extra_distances`
    span_starts: tuple[int, ...] | None = None

    @property
    def point_replays(self) -> tuple[int, ...]:
        """The replay lengths the sweeps place points around (`sweep_replays` or `replays`)."""
        return self.replays if self.sweep_replays is None else self.sweep_replays
    multihop_spread: int = 4

    @classmethod
    def from_config(cls, cfg: ModelConfig, replays: Iterable[int], turns: Iterable[int] = (),
                    span_grid: str | None = None, **kw: Any) -> "SuiteSettings":
        """Settings for a model of config `cfg`; `span_grid` names a grid of span starts for
        the running families (None: around each N; "uncensored": `uncensored_span_starts` of
        the model's W and R_exact, plus `extra_distances`)."""
        replays = tuple(sorted({int(n) for n in replays}))
        if not replays or replays[0] < 1:
            raise ValueError(f"replays: need at least one N >= 1; got {replays}")
        r_exact = exact_replay_length(cfg) if cfg.has_decoder else None
        turns = tuple(sorted({int(t) for t in turns})) or (max(1, replays[0] // 2),)
        if kw.get("sweep_replays") is not None:
            sweep = tuple(sorted({int(n) for n in kw["sweep_replays"]}))
            if not sweep or sweep[0] < 1:
                raise ValueError(f"sweep_replays: need at least one N >= 1; got {sweep}")
            kw["sweep_replays"] = sweep
        filler = kw.get("state_filler")
        if filler is not None:
            if isinstance(filler, bool) or not isinstance(filler, int) or filler < 0:
                raise ValueError(f"state_filler: an int >= 0 (the most prefix symbols before "
                                 f"`|`); got {filler!r}")
            if kw.get("state_length") is not None:
                raise ValueError("state_filler and state_length: set one (a random prefix of "
                                 "0..state_filler symbols, or one prompt length)")
        if span_grid is not None:
            if span_grid not in SPAN_GRIDS:
                raise ValueError(f"span_grid: one of {', '.join(SPAN_GRIDS)}; got {span_grid!r}")
            if r_exact is None:
                raise ValueError(f"span_grid: {span_grid!r} is placed against R_exact, which "
                                 f"variant {cfg.variant!r} (no decoder) does not have")
            kw["span_starts"] = tuple(sorted(set(SPAN_GRIDS[span_grid](cfg.window, r_exact))
                                             | {int(d) for d in kw.get("extra_distances", ())}))
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
        for n in self.point_replays:
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


def uncensored_span_starts(window: int, r_exact: int) -> list[int]:
    """Span starts (distances of the evidence before the answer) that reach past the decoder's
    whole receptive field, so that no replay length below R_exact is judged only on evidence
    inside it: W/2, W, W + 1 (the first start a replay of N = W cuts), 3W/2, 2W, then 3W, 4W,
    6W, 8W, 12W, ... (each multiple twice the one two before) while below R_exact, then
    R_exact and floor(3 R_exact / 2). Starts under 3 (no counted span fits) are dropped.
    E.g. W = 8, R_exact = 15: [4, 8, 9, 12, 15, 22]."""
    if window < 1 or r_exact < 1:
        raise ValueError(f"uncensored_span_starts: window and r_exact must be >= 1; got "
                         f"{window}, {r_exact}")
    starts = {window // 2, window, window + 1, 3 * window // 2, 2 * window}
    multiple, following = 3, 4
    while multiple * window < r_exact:
        starts.add(multiple * window)
        multiple, following = following, 2 * multiple
    starts = {d for d in starts if d < r_exact} | {r_exact, 3 * r_exact // 2}
    return sorted(d for d in starts if d >= 3)


# named span-start grids of the running families (`SuiteConfig.span_grid`)
SPAN_GRIDS = {"uncensored": uncensored_span_starts}


# ---- the families: each task's sweeps, read live from the task registry ---------------------
# A family (suite sweep) is registered with its task in ced/data (`@task(..., sweeps=...)`); this
# view lists them, so a task registered later (a notebook, a test) is swept without edits here.
Family = Sweep


class _Families(Mapping):
    """Read-only mapping family name -> `Sweep` over every registered task's sweeps."""

    def __getitem__(self, name: str) -> Sweep:
        return families()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(families())

    def __len__(self) -> int:
        return len(families())

    def __repr__(self) -> str:
        return f"FAMILIES({', '.join(families())})"


FAMILIES: Mapping[str, Sweep] = _Families()


# ---- documents ------------------------------------------------------------------------------

def family_points(settings: SuiteSettings, family: str) -> list[Point]:
    """The points of one family for these settings."""
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
                       f"{settings.length_cap})"
                       + (f"; {fam.needs()}" if fam.needs and fam.needs() else ""))
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
    """The documents of one <family>.jsonl."""
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


__all__ = ["SuiteSettings", "SPAN_GRIDS", "uncensored_span_starts", "Point", "Family", "FAMILIES", "build_documents", "write_jsonl",
           "read_jsonl", "prompt_ids", "target_ids", "family_points", "describe",
           "min_distance", "min_length"]
