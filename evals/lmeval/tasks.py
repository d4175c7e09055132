"""lm-eval task YAMLs for the edge-case families, written with the data they read.

    python -m evals.lmeval.tasks --checkpoint /path/final --replay 8 16 --out /tmp/ced_tasks
    write_tasks(out_dir, settings, examples=20)            # from Python

For each family F of evals.suites (the same documents the suite runner evaluates):
  data/F.jsonl      the documents (context, target, family, x, distance, params, ...)
  ced_F.yaml        output_type loglikelihood, metric acc: every target byte is the argmax,
                    teacher-forced (the suite runner's exact match)
  ced_F_gen.yaml    output_type generate_until, metric exact_match: greedy generation until
                    EOS or a newline, compared with the target
  ced_suite.yaml    the group of every ced_F, with an aggregate acc (mean weighted by size)
  ced_suite_gen.yaml  the group of every ced_F_gen, with an aggregate exact_match
  ced_F_x<x>.yaml   (per_point=True) one loglikelihood task per swept value x of F; tag
                    ced_F_points
Each family's documents are interleaved over its swept values (x1, x2, ..., x1, x2, ...), so
that `--limit k` samples every distance rather than the first k documents of the first one.
The YAMLs hold absolute paths to data/, so they are generated where they are used (never
committed). Every YAML names `process_docs: !function evals.lmeval.tasks.process_docs` (the
identity): lm-eval imports that module, which registers `--model ced`, whenever it resolves the
YAML's functions, so `lm_eval --model ced --tasks <dir>/ced_F.yaml` (or `--tasks <dir>`) works
with the bare lm_eval CLI; with `--include_path <dir> --tasks ced_F` use `python -m evals.lmeval`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterable

from ced.checkpoint import CheckpointError, load_config
from ced.config import describe_replays, parse_replay_form, state_replay
from evals.suites.families import (FAMILIES, SuiteSettings, build_documents, target_ids,
                                   write_jsonl)


def process_docs(dataset):
    """Identity; its real job is to make lm-eval import this package (see the module doc)."""
    return dataset


def _yaml(config: dict) -> str:
    """YAML text; `process_docs` as a !function tag (json.dumps quotes every other string)."""
    lines = []
    for key, value in config.items():
        if key == "process_docs":
            lines.append(f"{key}: !function {value}")
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def _task(name: str, data: Path, tag: str, generate: bool, max_target: int) -> dict:
    config = {
        "task": name,
        **({"tag": [tag]} if tag else {}),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "process_docs": "evals.lmeval.tasks.process_docs",
        "doc_to_text": "context",
        "doc_to_target": "target",
        "target_delimiter": "",
        "num_fewshot": 0,
    }
    if generate:
        config |= {
            "output_type": "generate_until",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": max_target + 1,
                                  "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True}],
        }
    else:
        config |= {
            "output_type": "loglikelihood",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    config["metadata"] = {"version": 1.0}
    return config


def interleave_points(docs: list[dict]) -> list[dict]:
    """Per family, the documents reordered round-robin over their x values (the first
    example of every x, then the second, ...); families keep their order."""
    first: dict[str, int] = {}                  # family -> its first index in docs
    x_order: dict[tuple, int] = {}              # (family, x) -> rank of x within the family
    seen: dict[tuple, int] = {}                 # (family, x) -> documents of it so far
    keyed = []
    for i, doc in enumerate(docs):
        family, point = doc["family"], (doc["family"], doc["x"])
        first.setdefault(family, i)
        if point not in x_order:
            x_order[point] = sum(1 for f, _ in x_order if f == family)
        position = seen.get(point, 0)
        seen[point] = position + 1
        keyed.append(((first[family], position, x_order[point]), i, doc))
    return [doc for _, _, doc in sorted(keyed, key=lambda item: item[:2])]


def _group(name: str, tasks: list[str], metric: str) -> dict:
    """An lm-eval group over `tasks` whose score is `metric` averaged over every document."""
    return {"group": name, "task": tasks,
            "aggregate_metric_list": [{"metric": metric, "aggregation": "mean",
                                       "weight_by_size": True}],
            "metadata": {"version": 1.0}}


def write_tasks(out_dir: str | Path, settings: SuiteSettings, examples: int = 20,
                families: Iterable[str] | None = None, generate: bool = True,
                per_point: bool = False, docs: list[dict] | None = None,
                seed_offset: int = 0) -> dict[str, Path]:
    """Write data/*.jsonl and the task YAMLs into out_dir; returns {task name: yaml path}.
    `docs` (e.g. the suite runner's documents) replaces generation from `settings`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if docs is None:
        docs = build_documents(settings, examples, families, seed_offset=seed_offset)
    docs = interleave_points(docs)
    data = write_jsonl(docs, out / "data")
    written = {}
    for family, path in data.items():
        rows = [d for d in docs if d["family"] == family]
        longest = max(len(target_ids(d)) for d in rows)
        specs = [(f"ced_{family}", path, None, False)]
        if generate:
            specs.append((f"ced_{family}_gen", path, None, True))
        if per_point:
            for x in sorted({d["x"] for d in rows}):
                point = out / "data" / family / f"x{x}.jsonl"
                write_jsonl([d for d in rows if d["x"] == x], point.parent)
                (point.parent / f"{family}.jsonl").rename(point)
                specs.append((f"ced_{family}_x{x}", point, f"ced_{family}_points", False))
        for name, data_path, tag, gen in specs:
            yaml_path = out / f"{name}.yaml"
            yaml_path.write_text(_yaml(_task(name, data_path, tag, gen, longest)))
            written[name] = yaml_path
    groups = [("ced_suite", [f"ced_{f}" for f in data], "acc")]
    if generate:
        groups.append(("ced_suite_gen", [f"ced_{f}_gen" for f in data], "exact_match"))
    for name, members, metric in groups:
        yaml_path = out / f"{name}.yaml"
        yaml_path.write_text(_yaml(_group(name, members, metric)))
        written[name] = yaml_path
    return written


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    p = argparse.ArgumentParser(prog="python -m evals.lmeval.tasks",
                                description="Write lm-eval task YAMLs + JSONL data for the "
                                "edge-case families, sized for a checkpoint's config.")
    p.add_argument("--checkpoint", required=True, help="reads its config.json (W, R_exact, ...)")
    p.add_argument("--replay", nargs="+", required=True, metavar="N",
                   help="N, W, W/k, kW, kW/d or R_exact (resolved against the checkpoint)")
    p.add_argument("--out", required=True)
    p.add_argument("--examples", type=int, default=20, help="examples per family x point")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=None)
    p.add_argument("--turns", type=int, nargs="+", default=[])
    p.add_argument("--distances", type=int, nargs="+", default=[])
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--per-point", action="store_true", help="also one task per swept value")
    p.add_argument("--no-generate", action="store_true", help="skip the *_gen tasks")
    args = p.parse_args(argv)
    try:
        forms = [parse_replay_form(v, "--replay") for v in args.replay]
        cfg = load_config(args.checkpoint)
        # as the suite runner reads them (ced.config.state_replay), so the tasks hold the
        # suite's documents
        stated = [state_replay(cfg, form, name="--replay") for form in forms]
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    replays = [s.n for s in stated]
    print(f"replays: {describe_replays(stated)}")
    for s in stated:
        if s.warning("--replay"):
            print(s.warning("--replay"), file=sys.stderr)
    settings = SuiteSettings.from_config(cfg, replays, args.turns,
                                         extra_distances=tuple(args.distances),
                                         max_length=args.max_length)
    written = write_tasks(args.out, settings, args.examples, args.families,
                          generate=not args.no_generate, per_point=args.per_point)
    print(f"wrote {len(written)} tasks into {Path(args.out).resolve()}: "
          + " ".join(sorted(written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
