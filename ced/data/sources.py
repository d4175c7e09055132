"""Token sources for training: infinite, deterministic, resumable by row index, shardable.

Row r of a source depends only on (seed, split, r), so the trainer takes batch i of global batch
size B as rows [i*B, (i+1)*B) and each rank its slice; resuming needs only the step counter.

Every row is a dict of four [count, seq_len] tensors:
  input_ids    LongTensor  token ids (ByteTokenizer: bytes, BOS=256, EOS=257, PAD=258)
  labels       LongTensor  next-token targets: labels[t] = input_ids[t+1]; -100 where there is
                           no loss: padding and the position whose next token is BOS (or PAD)
  answer_mask  BoolTensor  True where labels[t] is an answer token of a synthetic example
                           (target bytes and its EOS); all False for text corpora
  family_ids   LongTensor  index into `source.families` where answer_mask, else -1

synthetic: a row packs whole examples BOS context target EOS, then PAD. The example count and
  kinds come from random.Random(seed, split, r): family by weight (among the tasks whose
  `from_row` <= r in the training split; every task in validation), then an example seed. An
  example that does not fit the rest of the row ends the row; one that does not fit an empty
  row is skipped (the first call for each seq_len checks that every task's examples fit).
stdlib, hf: a window of seq_len + 1 tokens of the split's packed stream at an offset drawn from
  (seed, split, r): input_ids = window[:-1], labels = window[1:].
mixture: row r picks component c with probability proportional to its weight, from (seed,
  split, r), and is row r of component c (family_ids remapped to the mixture's `families`).
"""

from __future__ import annotations

import functools
import random
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from . import corpora
from .config import (KINDS, SPLITS, as_dict, check_fraction, check_int, check_str, check_weight,
                     plain)
from .tasks import TASKS, TaskParamError, make_example
from .tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
IGNORE = -100
Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@runtime_checkable
class SequenceSource(Protocol):
    families: list[str]

    def rows(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        """Rows start..start+count-1; see the module docstring."""
        ...


def _next_token_labels(ids: torch.Tensor, following: int) -> torch.Tensor:
    """labels[t] = ids[t+1] (ids[-1]'s successor is `following`), -100 where that is BOS/PAD."""
    nxt = torch.cat([ids[1:], ids.new_tensor([following])])
    return nxt.masked_fill((nxt == _TOK.bos) | (nxt == _TOK.pad), IGNORE)


class _RowSource:
    """rows() = stack of row(r); subclasses define row(r, seq_len) -> Row."""

    families: list[str]

    def row(self, r: int, seq_len: int) -> Row:
        raise NotImplementedError

    def rows(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        check_int("rows(start)", start, 0)
        check_int("rows(count)", count, 0)
        check_int("rows(seq_len)", seq_len, 1)
        built = [self.row(r, seq_len) for r in range(start, start + count)]
        if not built:
            empty = torch.empty(0, seq_len, dtype=torch.long)
            return {"input_ids": empty, "labels": empty.clone(),
                    "answer_mask": torch.zeros(0, seq_len, dtype=torch.bool),
                    "family_ids": empty.clone()}
        ids, labels, mask, fams = (torch.stack(t) for t in zip(*built))
        return {"input_ids": ids, "labels": labels, "answer_mask": mask, "family_ids": fams}


class SyntheticSource(_RowSource):
    """Rows of packed synthetic examples. tasks: name -> (family, weight, params); from_rows:
    name -> the first training row that draws the task (a curriculum of stages: a task absent
    from it, or at 0, takes part from the start; validation rows draw every task)."""

    def __init__(self, tasks: dict[str, tuple[str, float, dict]], seed: int, split: str,
                 key: str = "data", curriculum_rows: int = 0,
                 examples_per_row: Optional[int] = None,
                 from_rows: Optional[dict[str, int]] = None):
        self.families = list(tasks)
        self.examples_per_row = examples_per_row
        self.tasks, self.seed, self.split, self.key = tasks, seed, split, key
        self.curriculum_rows = curriculum_rows if split == "train" else 0
        self._weights = [w for _, w, _ in tasks.values()]
        starts = from_rows or {}
        self._from_rows = [starts.get(n, 0) if split == "train" else 0 for n in self.families]
        if min(self._from_rows) > 0:
            raise ValueError(f"{key}.tasks: every task has from_row > 0, so row 0 has no task "
                             f"to draw; let at least one start at row 0")
        self._fits: set[int] = set()

    def _weights_at(self, r: int) -> list[float]:
        """The draw weights of row r: a task before its from_row weighs 0."""
        if not any(self._from_rows):
            return self._weights
        return [w if r >= start else 0.0 for w, start in zip(self._weights, self._from_rows)]

    def _check_fits(self, seq_len: int) -> None:
        for name, (family, _, params) in self.tasks.items():
            longest = max(len(ex.prompt_ids) + len(ex.answer_ids) for ex in
                          (make_example(family, s, **params) for s in range(16)))
            if longest > seq_len:
                raise ValueError(f"{self.key}.tasks.{name}: examples take up to {longest} tokens "
                                 f"(BOS, context, target, EOS), more than seq_len={seq_len}; "
                                 f"lower its length/filler/size params or raise seq_len")
        self._fits.add(seq_len)

    def _params_at(self, family: str, params: dict, r: int) -> dict:
        """A task's params for row r: `filler` ramped up over the first curriculum_rows rows."""
        if not self.curriculum_rows or r >= self.curriculum_rows:
            return params
        full = params.get("filler", TASKS[family].defaults.get("filler"))
        if full is None:            # a generator without a filler parameter
            return params
        return {**params, "filler": int(full * (r + 1) / self.curriculum_rows)}

    def row(self, r: int, seq_len: int) -> Row:
        if seq_len not in self._fits:
            self._check_fits(seq_len)
        rng = random.Random(f"ced.data.synthetic/{self.seed}/{self.split}/{r}")
        ids: list[int] = []
        mask = torch.zeros(seq_len, dtype=torch.bool)
        fams = torch.full((seq_len,), -1, dtype=torch.long)
        placed = 0
        weights = self._weights_at(r)
        for attempt in range(1000):
            t = rng.choices(range(len(self.families)), weights=weights)[0]
            family, _, params = self.tasks[self.families[t]]
            ex = make_example(family, rng.getrandbits(64), **self._params_at(family, params, r))
            prompt, answer = ex.prompt_ids, ex.answer_ids
            if len(ids) + len(prompt) + len(answer) > seq_len:
                if ids:
                    break
                continue                           # rare over-long example: draw another
            first = len(ids) + len(prompt) - 1     # labels[first] = answer[0]
            mask[first:first + len(answer)] = True
            fams[first:first + len(answer)] = t
            # Answers inside the context (multi-query training): context byte c is the
            # target of labels[len(ids) + c] (prompt = [BOS] + context).
            for start, size in ex.meta.get("answer_spans", ()):
                mask[len(ids) + start:len(ids) + start + size] = True
                fams[len(ids) + start:len(ids) + start + size] = t
            ids += prompt + answer
            placed += 1
            if placed == self.examples_per_row:    # None: as many as fit
                break
        else:
            if ids:     # every draw fitted: the row is longer than a thousand examples
                raise ValueError(
                    f"train.seq_len={seq_len}: longer than the tasks fill ({len(ids)} tokens "
                    f"after {placed} examples, a row draws at most 1000); lower train.seq_len "
                    f"to at most {len(ids)}, or make {self.key}.tasks' examples longer (their "
                    "length/filler params)")
            raise ValueError(f"{self.key}.tasks: no example fits seq_len={seq_len} in 1000 draws")
        input_ids = torch.tensor(ids + [_TOK.pad] * (seq_len - len(ids)), dtype=torch.long)
        return input_ids, _next_token_labels(input_ids, _TOK.pad), mask, fams


class CorpusSource(_RowSource):
    """Windows of a packed text stream (stdlib or hf); `streams()` loads lazily, cached."""

    def __init__(self, streams, seed: int, split: str, key: str = "data"):
        self.families = []
        self._streams, self.seed, self.split, self.key = streams, seed, split, key

    @property
    def stream(self) -> torch.Tensor:
        return self._streams()[self.split]

    def row(self, r: int, seq_len: int) -> Row:
        stream = self.stream
        if len(stream) < seq_len + 1:
            raise ValueError(f"{self.key}: the {self.split} split holds {len(stream)} tokens, "
                             f"fewer than seq_len + 1 = {seq_len + 1} (more data, or a larger "
                             f"{self.key}.validation_fraction for validation)")
        offset = random.Random(f"ced.data.corpus/{self.seed}/{self.split}/{r}").randrange(
            len(stream) - seq_len)
        window = stream[offset:offset + seq_len + 1].long()
        input_ids = window[:-1]
        return (input_ids, _next_token_labels(input_ids, int(window[-1])),
                torch.zeros(seq_len, dtype=torch.bool),
                torch.full((seq_len,), -1, dtype=torch.long))


class MixtureSource(_RowSource):
    """Row r = row r of one component, picked by weight from (seed, split, r)."""

    def __init__(self, components: list[_RowSource], weights: list[float], seed: int, split: str):
        self.components, self.weights, self.seed, self.split = components, weights, seed, split
        self.families = []
        for c in components:
            self.families += [f for f in c.families if f not in self.families]
        self._remap = [torch.tensor([self.families.index(f) for f in c.families] + [-1],
                                    dtype=torch.long) for c in components]

    def row(self, r: int, seq_len: int) -> Row:
        rng = random.Random(f"ced.data.mixture/{self.seed}/{self.split}/{r}")
        c = rng.choices(range(len(self.components)), weights=self.weights)[0]
        ids, labels, mask, fams = self.components[c].row(r, seq_len)
        return ids, labels, mask, self._remap[c][fams]      # -1 indexes the trailing -1


# ---- building from a config ---------------------------------------------------------------
def parse_tasks(tasks: Any, key: str, only: Any = None) -> dict[str, tuple[str, float, dict]]:
    """data.tasks (and data.only) -> name -> (task, weight, params), each checked with a probe
    example. Every registered task takes part with its registered weight and defaults, in
    registration order, then the extra names `tasks` defines (`family: <task>`); an entry of
    `tasks` overrides its weight and params, null drops it; `only` narrows to the listed
    names, in that order. An entry's `from_row` is not a generator param: see task_from_rows."""
    tasks = plain(tasks)
    if tasks is None:
        tasks = {}
    if not isinstance(tasks, dict):
        raise ValueError(f"{key} must be a mapping task name -> {{weight, <params>}}, got {tasks!r}")
    names = list(TASKS) + [n for n in tasks if n not in TASKS]
    where = key.rsplit(".", 1)[0] + ".only"
    if only is not None:
        names = _only(plain(only), names, tasks, where)
    out = {}
    for name in names:
        spec = tasks.get(name, {})
        if spec is None:                        # disabled, e.g. data.tasks.needle=null
            continue
        out[str(name)] = _task_spec(name, spec, key)
    if not out:
        raise ValueError(f"{key}: every task is disabled (null); enable at least one")
    return out


def _only(only: Any, names: list, tasks: dict, where: str) -> list:
    """`data.only` checked: a list of known task names (registered or defined in tasks)."""
    if not isinstance(only, list) or not only:
        raise ValueError(f"{where} must be null (every task) or a non-empty list of task "
                         f"names, got {only!r}")
    for name in only:
        if name not in names:
            raise ValueError(f"{where}: unknown task {name!r}; allowed: {', '.join(names)}")
        if name in tasks and tasks[name] is None:
            raise ValueError(f"{where}: task {name!r} is also disabled (data.tasks.{name}=null)")
    return list(dict.fromkeys(only))


def _task_spec(name: Any, spec: Any, key: str) -> tuple[str, float, dict]:
    """One entry of data.tasks -> (task, weight, params); defaults from the registry."""
    if not isinstance(spec, dict):
        raise ValueError(f"{key}.{name} must be a mapping {{weight: 1.0, <params>}} or null, "
                         f"got {spec!r}")
    params = dict(spec)
    params.pop("from_row", None)                # the source's schedule: task_from_rows
    family = params.pop("family", name)
    if family not in TASKS:
        where = f"{key}.{name}.family" if "family" in spec else f"{key}.{name}"
        raise ValueError(f"{where}: unknown task {family!r}; allowed: {', '.join(TASKS)}")
    weight = check_weight(f"{key}.{name}.weight", params.pop("weight", TASKS[family].weight))
    try:
        make_example(family, 0, **params)
    except TaskParamError as e:
        raise ValueError(f"{key}.{name}.{e.param} {e.message}") from None
    return family, weight, params


def task_from_rows(tasks: Any, key: str) -> dict[str, int]:
    """data.tasks.<name>.from_row (default 0), checked: the first training row that draws the
    task. Rows are global (step * batch_size + ...), so a task joins at step from_row /
    batch_size whatever the process count."""
    out = {}
    for name, spec in (plain(tasks) or {}).items():
        if isinstance(spec, dict) and "from_row" in spec:
            out[str(name)] = check_int(f"{key}.{name}.from_row", spec["from_row"], 0)
    return out


def build_source(cfg: Any, split: str) -> SequenceSource:
    """The `split` ('train' | 'validation') source of a DataConfig, an OmegaConf node or a dict.
    Everything is validated here; errors are one-line ValueErrors naming `data.<key>`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return _build(as_dict(cfg, "data"), split, "data")


def _build(c: dict[str, Any], split: str, key: str) -> _RowSource:
    kind = c["kind"]
    if kind not in KINDS:
        raise ValueError(f"{key}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    seed = check_int(f"{key}.seed", c["seed"], 0)

    if kind == "synthetic":
        curriculum = check_int(f"{key}.curriculum_rows", c["curriculum_rows"], 0)
        per_row = c.get("examples_per_row")
        if per_row is not None:
            per_row = check_int(f"{key}.examples_per_row", per_row, 1)
        return SyntheticSource(parse_tasks(c["tasks"], f"{key}.tasks", c["only"]), seed, split,
                               key, curriculum, per_row,
                               task_from_rows(c["tasks"], f"{key}.tasks"))

    if kind == "mixture":
        comps = plain(c["mixture"])
        if not isinstance(comps, list) or not comps:
            raise ValueError(f"{key}.mixture must be a non-empty list of component configs "
                             f"(each with a weight) when {key}.kind=mixture, got {comps!r}")
        sources, weights = [], []
        for i, comp in enumerate(comps):
            ckey = f"{key}.mixture[{i}]"
            if not isinstance(comp, dict):
                raise ValueError(f"{ckey} must be a mapping like {{kind: synthetic, weight: 0.5}}, "
                                 f"got {comp!r}")
            comp = dict(comp)
            weights.append(check_weight(f"{ckey}.weight", comp.pop("weight", 1.0)))
            comp.setdefault("seed", seed)
            comp = as_dict(comp, ckey)
            if comp["kind"] == "mixture":
                raise ValueError(f"{ckey}.kind: mixtures cannot be nested")
            sources.append(_build(comp, split, ckey))
        return MixtureSource(sources, weights, seed, split)

    fraction = check_fraction(f"{key}.validation_fraction", c["validation_fraction"])
    if split == "validation" and fraction == 0:
        raise ValueError(f"{key}.validation_fraction=0 leaves the validation split empty")
    if kind == "stdlib":
        return CorpusSource(functools.partial(corpora.stdlib_streams, fraction), seed, split, key)

    files = corpora.resolve_files(c["files"], f"{key}.files")
    source = corpora.hf_source(c["name"], files, key)
    text_field = check_str(f"{key}.text_field", c["text_field"])
    hf_split = check_str(f"{key}.hf_split", c["hf_split"])
    hub = corpora.hub_options(c, key)
    streams = functools.partial(corpora.hf_streams, source, files, text_field, hf_split,
                                fraction, key, hub)         # a partial: sources pickle
    return CorpusSource(streams, seed, split, key)
