"""lm-eval tasks from held-out Python files: where bounded replay could hurt a code model.

    python -m evals.lmeval write-code-tasks --checkpoint RUN/final --out /tmp/code_tasks
    python -m evals.lmeval --model ced --model_args checkpoint=RUN/final,replay=W,bos=false \
        --include_path /tmp/code_tasks --tasks ced_code --log_samples --output_path OUT

Documents come from the validation files of `data=stdlib` (the files the checkpoint never
trained on; its run's validation_fraction), annotated by `evals.code_tokens`; every context is
the `--context` bytes before the point, which starts mid-file: read it with model_args
bos=false (the real_text study does), as training rows that start mid-file had no BOS; every
document
records its file, byte offset and `distance`: how far back (in bytes, from the context's end)
the evidence lies. Only points whose evidence lies more than `--min-distance` bytes back
(default 2W: before the replay start of every N <= 2W) and inside the context are kept.

  ced_code_identifier  complete a name: the context ends after the first two bytes of a name
                       (four bytes or longer) whose latest earlier occurrence (in code, a
                       comment or a string) starts more than min-distance bytes back, and
                       within the context; the target is the rest of the name (loglikelihood,
                       acc: every target byte is the argmax)
  ced_code_close       close a bracket: the context ends before a closing bracket whose opener
                       lies more than min-distance bytes back; the target is the bracket
  ced_code_dedent      close a block: the context ends at the start of a dedenting line; the
                       choices are the indentations of the open blocks (multiple_choice, each
                       followed by the line's first byte, so that each choice says where the
                       indentation stops); the answer is the one of the block header the line
                       returns to, more than min-distance bytes back (a document whose last
                       non-blank line is a comment at the answer's indentation is left out)
  ced_code             the group of the three, with its aggregate acc (weighted by size)
  ced_code_turn        the identifier task on other points, to read with a multi-turn mode
                       (model_args turn=M,policy=P): the context's last M bytes are a new turn
                       on a cached prefix, under each policy of docs/semantics.md 4.3

The task YAMLs hold absolute paths to data/ (generated where they are used, never committed).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

from ced.checkpoint import CheckpointError, load_config
from ced.config import parse_replay_form, replay_length
from evals.code_tokens import annotate
from evals.real_text import stdlib_fraction, validation_files
from evals.suites.families import write_jsonl

from .tasks import _group, _task, _yaml

TASKS = ("code_identifier", "code_close", "code_dedent", "code_turn")
GROUP = "ced_code"


def _text(data: bytes, start: int, end: int) -> tuple[str, int]:
    """data[start:end] as text, the start moved forward off UTF-8 continuation bytes (a
    context never begins inside a character); returns (text, the start used)."""
    while start < end and data[start] & 0xC0 == 0x80:
        start += 1
    return data[start:end].decode("utf-8", errors="replace"), start


def _distance_bin(distance: int, context: int) -> int:
    """Documents' x, for per-distance reading: the power of two at or above `distance`,
    capped at the context (no evidence lies farther back than that)."""
    return min(1 << max(0, int(distance - 1).bit_length()), context)


def name_runs(ann) -> list[tuple[int, int]]:
    """(begin, end) of every name occurrence: the maximal runs of bytes inside names (two
    names never touch: a separator lies between)."""
    inside = ann.name_gap >= -1
    edges = np.diff(np.r_[0, inside.astype(np.int8), 0])
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


def identifier_points(data: bytes, ann, context: int, min_distance: int) -> list[dict]:
    """Every name occurrence of >= 4 bytes whose latest earlier occurrence starts more than
    `min_distance` bytes before the context's end (two bytes into the name) and inside the
    context."""
    out = []
    for begin, end in name_runs(ann):
        gap = int(ann.name_gap[begin])
        cut = begin + 2
        previous = begin - gap
        distance = cut - previous
        if gap < 0 or end - begin < 4 or cut < context or distance <= min_distance \
                or previous < cut - context or not data[begin:cut].isascii():
            continue             # (a cut inside a character would score bytes not in the file)
        out.append({"cut": cut, "end": end, "distance": distance})
    return out


def close_points(data: bytes, ann, context: int, min_distance: int, kind: int) -> list[dict]:
    """Closers of `kind` (1 bracket, 2 dedent) whose opener lies more than `min_distance`
    bytes before the context's end, and inside the context (for a dedent, the context ends at
    the line's start)."""
    out = []
    for at in np.nonzero(ann.closer_kind == kind)[0].tolist():
        cut = at if kind == 1 else data.rfind(b"\n", 0, at) + 1
        distance = cut - int(ann.opener[at])
        if cut >= context and min_distance < distance <= context:    # the opener in context
            out.append({"cut": cut, "at": at, "distance": distance})
    return out


def dedent_choices(data: bytes, ann, at: int) -> tuple[list[str], int] | None:
    """For a dedenting line whose first byte is at `at`: the indentations it could take (0
    and every open block's, from `evals.code_tokens`), each followed by the line's first byte,
    and the index of the true one. None when the line's indentation is not spaces or is not
    one of them."""
    cut = data.rfind(b"\n", 0, at) + 1
    truth = data[cut:at]
    levels = ann.levels.get(at)
    if levels is None or truth.strip(b" ") or len(truth) not in levels:
        return None
    if _comment_at(data, cut, len(truth)):
        return None                       # a comment just above gives the indentation away
    first = data[at:at + 1].decode("utf-8", errors="replace")
    choices = [" " * k + first for k in levels]
    return choices, levels.index(len(truth))


def _comment_at(data: bytes, cut: int, width: int) -> bool:
    """Whether the last non-blank line before byte `cut` (a line start) is a comment indented
    by exactly `width` spaces."""
    end = cut - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        line = data[start:end]
        if line.strip():
            body = line.lstrip(b" ")
            return body.startswith(b"#") and len(line) - len(body) == width
        end = start - 1
    return False


def documents(files: list[tuple[str, bytes]], task: str, context: int, min_distance: int,
              examples: int, seed: int = 0) -> list[dict]:
    """Up to `examples` documents of `task` drawn uniformly (seeded) from every qualifying
    point of every file; code_turn draws from the identifier points the others leave."""
    points = []
    for name, data in files:
        ann = annotate(data)
        if ann is None:
            continue
        if task in ("code_identifier", "code_turn"):
            found = identifier_points(data, ann, context, min_distance)
        else:
            found = close_points(data, ann, context, min_distance,
                                 1 if task == "code_close" else 2)
        points += [(name, data, ann, p) for p in found]
    rng = random.Random(f"{seed}:{'code_identifier' if task == 'code_turn' else task}")
    rng.shuffle(points)
    if task == "code_turn":                    # the identifier task's points come first
        points = points[examples:]
    out = []
    for name, data, ann, p in points:
        doc = _document(task, name, data, ann, p, context)
        if doc is not None:
            out.append(doc)
        if len(out) == examples:
            break
    return out


def _document(task: str, name: str, data: bytes, ann, point: dict,
              context: int) -> dict | None:
    text, start = _text(data, point["cut"] - context, point["cut"])
    doc = {"family": task, "file": name, "byte": point["cut"], "distance": point["distance"],
           "x": _distance_bin(point["distance"], context), "context": text}
    if task in ("code_identifier", "code_turn"):
        doc["target"] = data[point["cut"]:point["end"]].decode("utf-8", errors="replace")
    elif task == "code_close":
        doc["target"] = data[point["at"]:point["at"] + 1].decode()
    else:
        found = dedent_choices(data, ann, point["at"])
        if found is None:
            return None
        doc["choices"], doc["answer"] = found
        doc["target"] = doc["choices"][doc["answer"]]
    return doc


def _multiple_choice(name: str, data: Path) -> dict:
    config = _task(name, data, "", False, 1)
    config |= {"output_type": "multiple_choice", "doc_to_choice": "choices",
               "doc_to_target": "answer"}
    return config


def write_code_tasks(out_dir: str | Path, files: list[tuple[str, bytes]], context: int,
                     min_distance: int, examples: int, seed: int = 0) -> dict[str, Path]:
    """data/<task>.jsonl and ced_<task>.yaml for every task, and the group ced_code.yaml;
    returns {task name: yaml path}. Each task needs at least one document."""
    out = Path(out_dir)
    docs = []
    for task in TASKS:
        found = documents(files, task, context, min_distance, examples, seed)
        if not found and task != "code_turn":    # code_turn: the points the others leave
            raise ValueError(f"{task}: no point qualifies (context {context}, min distance "
                             f"{min_distance}, {len(files)} files)")
        docs += found
    paths = write_jsonl(docs, out / "data")
    written = {}
    for task, path in paths.items():
        name = f"ced_{task}"
        longest = max(len(d["target"].encode()) for d in docs if d["family"] == task)
        config = (_multiple_choice(name, path) if task == "code_dedent"
                  else _task(name, path, "", False, longest))
        written[name] = out / f"{name}.yaml"
        written[name].write_text(_yaml(config))
    written[GROUP] = out / f"{GROUP}.yaml"
    written[GROUP].write_text(_yaml(_group(GROUP, [f"ced_{t}" for t in TASKS
                                                   if t != "code_turn"], "acc")))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.lmeval write-code-tasks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="a data=stdlib run's final/: its W and its held-out files")
    p.add_argument("--out", required=True)
    p.add_argument("--examples", type=int, default=500, help="documents per task")
    p.add_argument("--context", type=int, default=384, help="context bytes per document")
    p.add_argument("--min-distance", default="2W",
                   help="evidence farther back than this (bytes, or a W form): default 2W")
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.checkpoint)
        min_distance = replay_length(cfg, parse_replay_form(args.min_distance,
                                                            "--min-distance"),
                                     name="--min-distance")
        if args.context + 2 > cfg.max_seq_len:
            raise ValueError(f"--context: {args.context} + the target must fit the model's "
                             f"max_seq_len {cfg.max_seq_len}")
        files = validation_files(stdlib_fraction(args.checkpoint))[:args.max_files]
        written = write_code_tasks(args.out, files, args.context, min_distance, args.examples,
                                   args.seed)
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} tasks into {Path(args.out).resolve()}: "
          + " ".join(sorted(written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
