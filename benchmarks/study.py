"""Speed at the studies' own shapes (`make bench-study`).

The studies train d_model 64 models on one thread, so the number of models per cell,
and every model-level CI, is set by how fast ced trains there. This benchmark times, at each
study shape, ced and the dense and swa models of the same layers and width:

- the training step as `ced.train` takes it (`ced.train._train_step`: the step's batch drawn
  from the study's own data source, forward, backward, gradient clipping, AdamW), on the
  run's accelerator, at a step past the recipe's curriculum and encoder hold, so the rows are
  full length. Tokens/s = batch x T / step time, as `ced.train` logs it;
- one evaluation forward as the study reads its models: for a study with a suite (depth), the
  suite's `full` mode (`evals.modes.mode_logits`: an engine prefill and teacher-forced decode
  steps) over one batch (64, the suite's default) of the study's own suite documents of one
  prompt length, built from the ced config; for the real-text study, its parallel forward
  (`model(ids)` without gradients on rows of the training shape, as `evals.real_text.score`
  reads them). Examples/s = documents (rows) / time.

The shapes are composed with Hydra exactly as `python -m ced.train experiment=<study> ...`
composes them (`ced.cli.train.compose_config`), so they cannot drift from the studies:

    depth_L2, depth_L8, depth_L20   experiment=depth model.n_decoder_layers=2 / 8 / 20
    depth_Le20_L20                  ... model.n_encoder_layers=20 model.n_decoder_layers=20
    real_text_L8                    experiment=real_text model.n_decoder_layers=8

and each variant is `model.variant=ced|dense|swa` on top (dense and swa keep the layers:
n_encoder_layers + n_decoder_layers of them, and the width; the fields they do not use are
ignored). One thread, in each study's own precision (`train.mixed_precision`: fp32 for depth and
real_text and real_text_law, bf16 autocast for encoder_w; the encoder_w and real_text_law shapes
are composed from the study file's job: encoder_w_E8_L8, encoder_w_E20_L20, real_text_law_T4_W8,
real_text_law_T8_W8).

The variants take turns round by round (`peer.interleaved_rounds`); after the warm-up rounds
the medians of the timed rounds are reported, and each variant's ratio to dense is the median
over rounds of the paired ratio (dense's time / the variant's, same round), in this one
process. Then a torch.profiler breakdown of ced's and dense's training step at depth_L20
(self CPU time per op and per group of ops, ms a step), and the forward matmul FLOPs of both
(`ced.cost`, executed and ideal, by kind), so that ced's overhead over its arithmetic shows.

    python benchmarks/study.py                          # every shape, 5 rounds (about 10 min)
    python benchmarks/study.py --shapes depth_L20 --rounds 3 --no-profile
    python benchmarks/study.py --shapes encoder_w_E8_L8 --profile-shape encoder_w_E8_L8

Writes benchmarks/results/study.json and study.md (or --out DIR). Not a test: nothing is
asserted about the times.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import ced.train as trainer  # noqa: E402
from ced.cli.train import compose_config  # noqa: E402
from ced.cost import forward_flops  # noqa: E402
from ced.train_config import TrainConfig  # noqa: E402
from evals.modes import mode_logits, named_mode  # noqa: E402
from evals.suites.families import SuiteSettings, build_documents, prompt_ids, target_ids  # noqa: E402
from evals.suites.runner import make_engine  # noqa: E402
from experiments.study import load_study  # noqa: E402
from peer import interleaved_rounds  # noqa: E402

# name -> (study, the overrides its job adds): the studies' shapes
SHAPES = {
    "depth_L2": ("depth", ["model.n_decoder_layers=2"]),
    "depth_L8": ("depth", ["model.n_decoder_layers=8"]),
    "depth_L20": ("depth", ["model.n_decoder_layers=20"]),
    "depth_Le20_L20": ("depth", ["model.n_encoder_layers=20", "model.n_decoder_layers=20"]),
    "real_text_L8": ("real_text", ["model.n_decoder_layers=8"]),
}
# name -> (study, job): shapes of studies that set their precision and tasks per job, composed
# from the study file's own job (its overrides read with `load_study`, so they cannot drift)
JOB_SHAPES = {
    "encoder_w_E8_L8": ("encoder_w", "E8_L8"),
    "encoder_w_E20_L20": ("encoder_w", "E20_L20"),
    "real_text_law_T4_W8": ("real_text_law", "T4_W8"),
    "real_text_law_T8_W8": ("real_text_law", "T8_W8"),
}
for _name, (_study, _job) in JOB_SHAPES.items():
    SHAPES[_name] = (_study, next(j for j in load_study(_study, "full").jobs
                                  if j.name == _job).overrides)
VARIANTS = ("dense", "swa", "ced")
PROFILE_SHAPE = "depth_L20"
SUITE_BATCH = 64   # evals.suites.runner.SuiteConfig.batch_size's default


@functools.lru_cache(maxsize=None)
def compose(shape: str, variant: str, extra: tuple[str, ...] = ()) -> TrainConfig:
    """The training config of `shape` (a SHAPES key) with model.variant=`variant`, as
    `python -m ced.train experiment=<study> <job overrides> model.variant=<variant> <extra>`
    composes it (no tracker, no progress bar); `extra`: --set's overrides, e.g.
    model.global_read=gather, to time a lever that is a config key. Cached (a Hydra
    composition takes about a second); the config is only read."""
    study, overrides = SHAPES[shape]
    return compose_config([f"experiment={study}", *overrides, f"model.variant={variant}",
                           *extra, "logging=none", "train.progress=false"])


def timed_step_index(cfg: TrainConfig) -> int:
    """The 0-based step the benchmark takes, over and over: the first one past the data
    curriculum (rows ramp their filler up over data.curriculum_rows) and the encoder's hold
    and ramp, so its rows and learning rates are those of most of a study's run."""
    o = cfg.optim
    return max(math.ceil(cfg.data.curriculum_rows / cfg.train.batch_size),
               o.encoder_hold_steps + o.encoder_ramp_steps)


def make_run(cfg: TrainConfig, run_dir: Path):
    """A `ced.train._Run` of `cfg` (seeded model, AdamW, the study's data sources) on a fresh
    accelerator, as `ced.train._train` sets one up, without a run directory's files."""
    trainer._reset_accelerate()
    accelerator = trainer.make_accelerator(cfg, run_dir)
    per_micro, per_rank = trainer._rows_per_micro_batch(cfg, accelerator.num_processes)
    model, optimizer, train_source, val_source = trainer._build_model_and_data(cfg, accelerator)
    model.train()
    return trainer._Run(cfg, run_dir, accelerator, model, optimizer, train_source, val_source,
                        per_micro, per_rank)


def suite_batch(shape: str, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(prompts [B, P], targets [B, G]) of the study's suite for the ced model of `cfg`: its
    first family, its options (state_length), N = W, the most common prompt length, at most
    SUITE_BATCH documents; None for a study without a suite."""
    suite = load_study(SHAPES[shape][0], "full").evaluations.get("suite")
    if suite is None:
        return None
    options = suite.options or {}
    settings = SuiteSettings.from_config(cfg.model, [cfg.model.window],
                                         state_length=options.get("state_length"),
                                         span_grid=options.get("span_grid"))
    family = (suite.families or ["running_count"])[0]
    docs = build_documents(settings, SUITE_BATCH // 4, [family])
    length, _ = Counter(len(prompt_ids(d)) for d in docs).most_common(1)[0]
    docs = [d for d in docs if len(prompt_ids(d)) == length]
    docs = [d for d in docs if len(target_ids(d)) == len(target_ids(docs[0]))][:SUITE_BATCH]
    return (torch.tensor([prompt_ids(d) for d in docs]),
            torch.tensor([target_ids(d) for d in docs]))


def make_eval(run, batch: tuple[torch.Tensor, torch.Tensor] | None, rows: torch.Tensor):
    """The evaluation forward of one model: the suite's `full` mode on `batch` (prompts,
    targets), or, without a suite, the parallel forward of `rows` [B, T]; in eval mode without
    gradients, the model put back in training mode after it."""
    model = run.accelerator.unwrap_model(run.model)
    engine = make_engine(model) if batch is not None else None
    full = named_mode()

    def forward() -> None:
        model.eval()
        with torch.no_grad():
            if engine is not None:
                mode_logits(engine, batch[0], batch[1], full)
            else:
                model(rows)
        model.train()

    return forward


def bench_shape(shape: str, variants: list[str], rounds: int, warmup: int, run_dir: Path,
                extra: tuple[str, ...] = ()) -> dict:
    """One row per variant at `shape`: training-step and eval-forward times of every timed
    round, their medians, tokens/s and examples/s, and the ratio to dense paired by round
    (when dense is among `variants`); plus the shape's geometry and the time one batch draw
    takes (inside every step, the same for every variant)."""
    cfgs = {v: compose(shape, v, extra) for v in variants}
    runs = {v: make_run(cfgs[v], run_dir / f"{shape}_{v}") for v in variants}
    first = cfgs[variants[0]]
    step = timed_step_index(first)
    started = time.perf_counter()
    rows = trainer._micro_batches(runs[variants[0]], step)[0]["input_ids"]
    draw_s = time.perf_counter() - started
    ced_cfg = cfgs["ced"] if "ced" in cfgs else compose(shape, "ced", extra)
    batch = suite_batch(shape, ced_cfg)
    fns = {}
    for v in variants:
        fns[v, "step"] = lambda run=runs[v]: trainer._train_step(run, step)
        fns[v, "eval"] = make_eval(runs[v], batch, rows)
    times = interleaved_rounds(fns, warmup, rounds, shape, lambda t: "  ".join(
        f"{v} {t[v, 'step'][-1]:.2f}/{t[v, 'eval'][-1]:.2f}s" for v in variants
        if t[v, "step"]))
    t, m = first.train, first.model
    examples = batch[0].shape[0] if batch is not None else rows.shape[0]
    out = {"geometry": {"study": SHAPES[shape][0], "overrides": SHAPES[shape][1],
                        "d_model": m.d_model, "n_encoder_layers": m.n_encoder_layers,
                        "n_decoder_layers": m.n_decoder_layers, "window": m.window,
                        "topk": ced_cfg.model.topk, "batch": t.batch_size, "seq_len": t.seq_len,
                        "precision": t.mixed_precision if t.mixed_precision not in (None, "no")
                        else "fp32",
                        "step_index": step, "eval": "suite full mode" if batch is not None
                        else "parallel forward", "eval_examples": examples,
                        "eval_prompt_len": (batch[0] if batch is not None else rows).shape[1]},
           "draw_s": draw_s, "variants": {}}
    for v in variants:
        out["variants"][v] = variant_row(times, v, t.batch_size * t.seq_len, examples,
                                         sum(p.numel() for p in runs[v].model.parameters()))
    del runs
    trainer._reset_accelerate()
    return out


def variant_row(times: dict, variant: str, tokens: int, examples: int, params: int) -> dict:
    """The table's cells of one variant: per phase ("step", "eval") the timed rounds, their
    median, the rate (tokens/s of a step, examples/s of an eval forward), and the ratio to
    dense paired by round (dense's time / this variant's time, the median over rounds)."""
    row = {"params": params}
    for phase, units in (("step", tokens), ("eval", examples)):
        own = times[variant, phase]
        median = statistics.median(own)
        cell = {"times_s": own, "median_s": median, "rate": units / median}
        if ("dense", phase) in times:
            cell["ratio_to_dense"] = statistics.median(
                d / x for d, x in zip(times["dense", phase], own))
        row[phase] = cell
    return row


# op-name fragments -> group, tried in order (the first match names the group)
OP_GROUPS = (
    ("attention kernel", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("optimizer", ("adam", "foreach", "lerp", "addcdiv", "addcmul", "vector_norm")),
    ("matmul", ("mm", "matmul", "linear", "einsum", "sampled_addmm")),
    ("topk / sort", ("topk", "sort")),
    ("index / gather / scatter / mask", ("index", "gather", "scatter", "masked", "where",
                                         "nonzero", "tril", "triu")),
    ("copy / cat / fill / alloc", ("copy", "clone", "cat", "stack", "contiguous", "_to",
                                   "empty", "zero", "fill", "ones", "full", "arange")),
    ("views", ("view", "reshape", "transpose", "permute", "slice", "select", "as_strided",
               "narrow", "unsqueeze", "squeeze", "expand", "split", "unbind", "chunk", "t",
               "flatten", "alias", "detach", "unflatten")),
    ("elementwise / reduction", ("add", "mul", "sub", "div", "exp", "log", "neg", "sqrt",
                                 "pow", "silu", "sigmoid", "relu", "softmax", "mean", "sum",
                                 "max", "min", "clamp", "cumsum", "eq", "ne", "lt", "gt", "le",
                                 "ge", "and", "or", "not", "rsub", "cos", "sin", "abs", "sign",
                                 "any", "all", "isfinite", "cross_entropy", "nll")),
)


def op_group(name: str) -> str:
    """The group of a profiled op (`aten::mm` -> "matmul"); autograd nodes and Python
    functions (names without `aten::`) go to "autograd / python", the rest to "other"."""
    if not name.startswith("aten::"):
        return "autograd / python"
    bare = name[len("aten::"):].strip("_")
    for group, parts in OP_GROUPS:
        if any(bare == p or (len(p) > 1 and p in bare) for p in parts):
            return group
    return "other"


def profile_step(run, step: int, totals: dict) -> float:
    """One training step of `run` under torch.profiler: adds each op's self CPU ms and calls
    into `totals` (op -> [ms, calls]); returns the step's wall ms under the profiler."""
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer._train_step(run, step)
    wall = (time.perf_counter() - started) * 1e3
    for event in prof.key_averages():
        cell = totals.setdefault(event.key, [0.0, 0])
        cell[0] += event.self_cpu_time_total / 1e3
        cell[1] += event.count
    return wall


def grouped(ops: list[dict]) -> dict[str, dict]:
    """Per op group: self CPU ms a step and calls a step, summed over its ops."""
    groups: dict[str, dict] = {}
    for row in ops:
        cell = groups.setdefault(op_group(row["op"]), {"self_ms": 0.0, "calls": 0.0})
        cell["self_ms"] += row["self_ms"]
        cell["calls"] += row["calls"]
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["self_ms"]))


def flops_by_kind(cfg: TrainConfig) -> dict[str, dict[str, int]]:
    """The forward's matmul FLOPs of one training batch of `cfg` (ced.cost), by kind, counted
    as executed (what the kernels multiply: window rectangles per query block, a top-k read
    as a masked matmul over every visible entry) and ideal (only what each query sees)."""
    t = cfg.train
    return {counting: forward_flops(cfg.model, t.seq_len, counting=counting,
                                    batch=t.batch_size).as_dict()
            for counting in ("executed", "causal")}


def profile_shape(shape: str, steps: int, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    """ced's and dense's training step at `shape` under the profiler, taking turns for
    `steps` rounds after one unprofiled step each (so machine load hits both alike): per
    model the wall ms a step under the profiler, per op and per group (`grouped`) the self CPU
    ms and calls a step, largest first, and the forward FLOPs by kind (`flops_by_kind`)."""
    cfgs = {v: compose(shape, v, extra) for v in ("ced", "dense")}
    runs = {v: make_run(cfg, run_dir / f"profile_{v}") for v, cfg in cfgs.items()}
    step = timed_step_index(cfgs["ced"])
    totals: dict = {v: {} for v in runs}
    walls: dict = {v: [] for v in runs}
    for run in runs.values():
        trainer._train_step(run, step)
    for _ in range(steps):
        for v, run in runs.items():
            walls[v].append(profile_step(run, step, totals[v]))
    out = {}
    for v in runs:
        ops = sorted(({"op": op, "self_ms": ms / steps, "calls": calls / steps}
                      for op, (ms, calls) in totals[v].items()), key=lambda r: -r["self_ms"])
        out[v] = {"wall_ms": sum(walls[v]) / steps, "ops": ops, "groups": grouped(ops),
                  "flops": flops_by_kind(cfgs[v])}
    del runs
    trainer._reset_accelerate()
    return out


def markdown(results: dict, meta: dict) -> str:
    """The study-shape table: per shape and variant the training step's tokens/s and the
    eval forward's examples/s, each with its ratio to dense paired by round."""
    lines = [f"Study shapes: training step (`ced.train._train_step`: batch draw, forward, "
             f"backward, clip, AdamW) and eval forward, in each study's precision, "
             f"{meta['threads']} thread(s), "
             f"median of {meta['rounds']} interleaved rounds after {meta['warmup']} warm-up; "
             f"ratio to dense paired by round; torch {meta['torch']}, commit {meta['commit']}"
             + (f"; overrides {' '.join(meta['set'])}" if meta["set"] else "") + ".",
             "", "| shape | B x T | precision | variant | train tok/s | vs dense | eval ex/s | "
             "vs dense |", "|---|---|---|---|---|---|---|---|"]
    for shape, res in results.items():
        g = res["geometry"]
        for v, row in res["variants"].items():
            ratio = {p: f"{row[p]['ratio_to_dense']:.2f}x" if "ratio_to_dense" in row[p]
                     else "" for p in ("step", "eval")}
            lines.append(f"| {shape} (L_e {g['n_encoder_layers']}, L_d {g['n_decoder_layers']}) "
                         f"| {g['batch']} x {g['seq_len']} | {g.get('precision', 'fp32')} | {v} | "
                         f"{row['step']['rate']:.0f} | "
                         f"{ratio['step']} | {row['eval']['rate']:.1f} | {ratio['eval']} |")
    lines += ["", "Eval forward: " + "; ".join(
        f"{s}: {r['geometry']['eval']}, {r['geometry']['eval_examples']} x "
        f"{r['geometry']['eval_prompt_len']}" for s, r in results.items()),
        "Batch draw inside every step (ms, the same for each variant): " + ", ".join(
        f"{s} {r['draw_s'] * 1e3:.0f}" for s, r in results.items())]
    return "\n".join(lines) + "\n"


def markdown_profile(prof: dict, shape: str, top: int = 15) -> str:
    """ced's step against dense's at `shape`: self CPU ms a step by op group, ced's top ops,
    and both forwards' FLOPs by kind."""
    ced, dense = prof["ced"], prof["dense"]
    lines = [f"Profile of one training step at {shape} (torch.profiler, self CPU time, ms a "
             f"step; mean wall time under the profiler: ced {ced['wall_ms']:.0f} ms, dense "
             f"{dense['wall_ms']:.0f} ms):", "", "| op group | ced ms | dense ms | ced - dense |",
             "|---|---|---|---|"]
    for group in dict.fromkeys([*ced["groups"], *dense["groups"]]):
        c = ced["groups"].get(group, {}).get("self_ms", 0.0)
        d = dense["groups"].get(group, {}).get("self_ms", 0.0)
        lines.append(f"| {group} | {c:.0f} | {d:.0f} | {c - d:+.0f} |")
    gaps = [r["wall_ms"] - sum(g["self_ms"] for g in r["groups"].values()) for r in (ced, dense)]
    lines.append(f"| outside ops (Python, the profiler) | {gaps[0]:.0f} | {gaps[1]:.0f} | "
                 f"{gaps[0] - gaps[1]:+.0f} |")
    lines += ["", f"ced's top {top} ops by self CPU time:", "",
              "| op | group | ms a step | calls a step | dense ms |", "|---|---|---|---|---|"]
    dense_ops = {r["op"]: r["self_ms"] for r in dense["ops"]}
    for row in ced["ops"][:top]:
        lines.append(f"| `{row['op']}` | {op_group(row['op'])} | {row['self_ms']:.1f} | "
                     f"{row['calls']:.0f} | {dense_ops.get(row['op'], 0.0):.1f} |")
    kinds = ("linear", "sources", "window_attention", "global_attention", "indexer", "head",
             "total")
    lines += ["", "Forward matmul FLOPs of one batch (ced.cost; GFLOP, executed / ideal):", "",
              "| model | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name, res in (("ced", ced), ("dense", dense)):
        f = res["flops"]
        lines.append(f"| {name} | " + " | ".join(
            f"{f['executed'][k] / 1e9:.2f} / {f['causal'][k] / 1e9:.2f}" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the studies: 1)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help=f"profile ced's and dense's step at {PROFILE_SHAPE}")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps a model")
    parser.add_argument("--profile-shape", default=PROFILE_SHAPE, choices=sorted(SHAPES),
                        help=f"the shape profiled (default {PROFILE_SHAPE})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override added to every variant's config, e.g. "
                             "--set model.global_read=gather")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    args.set = tuple(args.set)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for key, given, allowed in (("shapes", args.shapes, SHAPES), ("variants", args.variants,
                                                                  VARIANTS)):
        if not given or set(given) - set(allowed):
            parser.error(f"--{key}: of {', '.join(allowed)}; got {given}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def commit() -> str:
    """The repository's short HEAD (with -dirty when tracked files differ), or 'unknown'."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ced", "evals"],
                               cwd=ROOT, check=False).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = {"threads": torch.get_num_threads(), "rounds": args.rounds, "warmup": args.warmup,
            "torch": torch.__version__, "commit": commit(),
            "machine": platform.processor() or platform.machine(),
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "set": list(args.set)}
    results, prof = {}, None
    with tempfile.TemporaryDirectory(prefix="bench-study-") as tmp:
        for shape in args.shapes:
            print(f"[bench-study] {shape}", flush=True)
            results[shape] = bench_shape(shape, args.variants, args.rounds, args.warmup,
                                         Path(tmp), args.set)
        if args.profile:
            print(f"[bench-study] profile at {args.profile_shape}", flush=True)
            prof = profile_shape(args.profile_shape, args.profile_steps, Path(tmp), args.set)
    tables = [markdown(results, meta)] + ([markdown_profile(prof, args.profile_shape)]
                                          if prof else [])
    print("\n" + "\n".join(tables))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps(
        {"meta": meta, "results": results, "profile": prof}, indent=2))
    (args.out / "study.md").write_text("\n".join(tables))
    print(f"wrote {args.out / 'study.json'} and {args.out / 'study.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
