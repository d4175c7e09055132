"""The task registry: one entry per synthetic task, holding everything the project knows about it.

A **task** is a generator of (context, target) examples, registered with

    @task("my_task", chance=lambda p: 1 / 10, sweeps=[Sweep("my_sweep", "distance", points)])
    def my_task(rng, distance=None, length=None, filler=32): ... -> (context, target, meta)

and its entry (`TASKS["my_task"]`, a `Task`) holds the generator, its defaults (the
signature's), its training weight in `data=synthetic`, its chance level (a function of the
full params) and its suite sweeps. Training (`ced.data.build_source`, `data=synthetic`) uses
every registered task unless narrowed (`data.only`); the edge-case suite
(`evals.suites.families.FAMILIES`) is the union of every task's sweeps. `sweeps=()` states
that a task has no suite sweep: it is trained, not swept.

A **family** (suite sweep) is one `Sweep`: a name (`recall`, `multihop`, ...), the axis it is
plotted against (`distance` or `length`) and `points(settings)`, the generator params at each x,
chosen from the model and the replay lengths under test (`settings` is an
`evals.suites.families.SuiteSettings`). A task may own several families (kv_recall owns
recall, short, boundary and multiturn); each family belongs to exactly one task, and the
registry is the one place that says which (`family_task`).

The probing helpers below (`fits`, `min_distance`, `min_length`, `distance_points`) let a
sweep ask its generator what fits instead of restating the generator's layout rules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from .tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
SLACK = 16           # filler tokens before a sweep's farthest fact, so it never sits at the BOS


@dataclass
class Example:
    """One synthetic example: the model must produce `target` right after `context`.
    `family` is the name of the task that generated it."""

    family: str
    params: dict          # every generator parameter, defaults filled in
    context: str
    target: str
    meta: dict = field(default_factory=dict)   # measured layout facts (see ced/data/tasks.py)

    @property
    def prompt_ids(self) -> list[int]:
        """[BOS] + UTF-8 bytes of context; length len(context) + 1."""
        return [_TOK.bos] + _TOK.encode(self.context)

    @property
    def answer_ids(self) -> list[int]:
        """UTF-8 bytes of target + [EOS]."""
        return _TOK.encode(self.target) + [_TOK.eos]


class TaskParamError(ValueError):
    """A bad generator parameter; the message names the config key data.tasks.<task>.<param>."""

    def __init__(self, family: str, param: str, message: str):
        self.family, self.param, self.message = family, param, message
        super().__init__(f"data.tasks.{family}.{param} {message}")


@dataclass(frozen=True)
class Point:
    """One x value of a suite family: the generator parameters of its examples."""

    x: int
    params: dict
    extra: dict = field(default_factory=dict)     # copied into every document


@dataclass(frozen=True)
class Sweep:
    """A suite family: how the edge-case suite sweeps one task (see the module docstring).
    `task` is filled in when the sweep is registered with its task."""

    name: str
    x_name: str                       # "distance" or "length"
    points: Callable[[Any], list[Point]]
    description: str = ""
    turn_modes: bool = False          # evaluated with the multi-turn policies too
    needs: Optional[Callable[[], str]] = None   # what it needs, said when it has no points
    task: str = ""


@dataclass(frozen=True)
class Task:
    """A registry entry. Calling it generates: `TASKS[name](rng, **params) -> Example`."""

    name: str
    generate: Callable[..., Example]
    defaults: dict
    chance: Callable[[dict], float]   # exact-match accuracy of a blind guesser, from full params
    sweeps: tuple[Sweep, ...]
    weight: float = 1.0               # its weight in data=synthetic
    description: str = ""

    def __call__(self, rng: random.Random, **params: Any) -> Example:
        return self.generate(rng, **params)


TASKS: dict[str, Task] = {}


def _wrap(name: str, fn: Callable, defaults: dict) -> Callable[..., Example]:
    """`fn(rng, **params) -> (context, target, meta)` as a checked generator of Examples."""

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

    return generate


def task(name: str, *, chance: Callable[[dict], float], sweeps: Sequence[Sweep],
         weight: float = 1.0):
    """Register `fn(rng, **params) -> (context, target, meta)` as task `name`, with its chance
    level `chance(full_params) -> float` and its suite sweeps (`()`: none). The defaults are
    `fn`'s keyword defaults. Returns `fn`'s entry (a callable `Task`). A name or sweep name
    already taken is an error: one name per idea."""

    def register(fn: Callable) -> Task:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        if not callable(chance):
            raise ValueError(f"task {name}: chance must be a function of the params")
        taken = families()
        if name in taken:
            raise ValueError(f"task {name!r}: already the name of a family of {taken[name].task}")
        names = [s.name for s in sweeps]
        for sweep in sweeps:
            # A family may share its own task's name (copy, needle), not another's.
            if sweep.name in taken or sweep.name in TASKS or names.count(sweep.name) > 1:
                raise ValueError(f"task {name}: sweep name {sweep.name!r} is already taken")
            if sweep.x_name not in ("distance", "length"):
                raise ValueError(f"task {name}: sweep {sweep.name}.x_name must be 'distance' "
                                 f"or 'length', got {sweep.x_name!r}")
        defaults = {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[1:]}
        entry = Task(name, _wrap(name, fn, defaults), defaults, chance,
                     tuple(dataclasses.replace(s, task=name) for s in sweeps), float(weight),
                     inspect.getdoc(fn) or "")
        TASKS[name] = entry
        return entry

    return register


def unregister(name: str) -> None:
    """Remove task `name` (for tests and notebooks that register a task of their own)."""
    TASKS.pop(name, None)


def make_example(task: str, seed: int, **params: Any) -> Example:
    """The example of `task` for `seed`; deterministic in (task, seed, params)."""
    if task not in TASKS:
        raise ValueError(f"data.tasks: unknown task {task!r}; allowed: {', '.join(TASKS)}")
    # The seed string keeps its old wording ("ced.data/<task>/<seed>"): examples stay the same.
    return TASKS[task](random.Random(f"ced.data/{task}/{seed}"), **params)


def chance_accuracy(task: str, **params: Any) -> float:
    """Exact-match accuracy of a guesser blind to what `task` probes, at these params (the
    task's registered `chance`, given the params with defaults filled in and validated)."""
    full = make_example(task, 0, **params).params
    return float(TASKS[task].chance(full))


def families() -> dict[str, Sweep]:
    """Every registered suite family, by name: each task's sweeps, in registration order."""
    return {s.name: s for entry in TASKS.values() for s in entry.sweeps}


def family_task(family: str) -> str:
    """The task a suite family sweeps (the one explicit family -> task mapping)."""
    found = families().get(family)
    if found is None:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(families())}")
    return found.task


# ---- probing the generators (they are the single source of truth for what fits) ------------
def fits(task: str, **params: Any) -> bool:
    """Whether `task` accepts these params."""
    try:
        make_example(task, 0, **params)
        return True
    except TaskParamError:
        return False


def min_distance(task: str, params: dict) -> int:
    """Smallest `distance` the generator accepts with these params."""
    d = 1
    while not fits(task, **{**params, "distance": d, "length": None}):
        d += 1
        if d > 100_000:
            raise ValueError(f"{task}: no feasible distance for {params}")
    return d


def min_length(task: str, params: dict) -> int:
    """Smallest `length` the generator accepts with these params (binary search)."""
    lo, hi = 1, 64
    while not fits(task, **{**params, "length": hi}):
        lo, hi = hi + 1, hi * 2
        if hi > 1 << 22:
            raise ValueError(f"{task}: no feasible length for {params}")
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(task, **{**params, "length": mid}):
            hi = mid
        else:
            lo = mid + 1
    return lo


def distance_points(settings: Any, task: str, params: dict, distances: Iterable[int],
                    extra: Optional[Callable[[int], dict]] = None) -> list[Point]:
    """Points at the given distances (clamped up to the task's minimum), all with one prompt
    length T: the smallest that holds the farthest kept fact plus SLACK tokens of filler.
    Distances that cannot fit under `settings.length_cap` are dropped."""
    low = min_distance(task, params)
    wanted = sorted({max(low, d) for d in distances})
    while wanted:
        far = wanted[-1]
        need = max(min_length(task, {**params, "distance": d}) for d in wanted)
        length = max(need, far + 1 + SLACK)
        if length <= settings.length_cap:
            break
        wanted.pop()
    else:
        return []
    return [Point(d, {**params, "distance": d, "length": length},
                  extra(d) if extra else {}) for d in wanted]
