"""Run the edge-case suite on a checkpoint: every family x point x inference mode, scored on the
engine path, with confidence intervals and paired tests against the exact model.

Scoring: teacher-forced exact match through `evals.modes.mode_logits` (the engine: prefill
with the mode's replay / turn policy, then one decode step per target token). An example is
correct iff the argmax at every target position is the target token. This equals greedy
generation of len(target) tokens exactly (greedy output first departs from the target at the
first position where the teacher-forced argmax does), and is batched. EOS is not scored.

Also recorded per example and mode: the target's negative log-likelihood, the greedy (argmax)
prediction, and the largest |logit difference| from the `full` mode on the target positions
(exact modes should show float round-off only).

Statistics: accuracy with a 95% Wilson interval per (family, x, mode), and per (family, mode)
pooled over x. Each approximate mode is compared with `full` (the exact model) on the same
examples by an exact McNemar test (two-sided binomial test on the discordant pairs). A cell is a
capability drop when p < alpha (0.05, uncorrected) and the mode loses more pairs than it wins;
`p_holm` (Holm over all per-x cells of the run) is reported alongside for a family-wise view.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, List, Optional

import torch
from torch import Tensor

from ced import CEDModel, InferenceEngine
from ced.checkpoint import load_model, stated_override
from ced.config import (default_hidden_tail, describe_replays, exact_replay_length,
                        parse_replay_form, replay_length, resolve_replay, state_replay)
from ced.data import ByteTokenizer
from ced.inference import POLICIES
from ced.records import write_json
from ced.signals import stop_point
from ced.tracking import log_scalars, use_checkpoints
from evals.cli import option
from evals.modes import MODE_COLUMNS, Mode, mode_columns, mode_logits, named_mode

from .families import (FAMILIES, SPAN_GRIDS, SuiteSettings, build_documents, describe,
                       prompt_ids, target_ids, write_jsonl)
from .stats import holm, mcnemar_exact, wilson_interval

_TOK = ByteTokenizer()
FULL = "full"


# ---- model ----------------------------------------------------------------------------------

def load_checkpoint(path: str | Path, topk: int | str | None = None, dtype: str = "float32",
                    device: str = "cpu", kv: str | None = None,
                    decoder_global: str | None = None) -> CEDModel:
    """`ced.checkpoint.load_model` with its evaluation overrides (`topk`: an int or "all";
    `kv`: storage formats such as "global:fp4_block16"; `decoder_global`: "off" removes the
    decoder's global read, docs/semantics.md 4.6), cast to `dtype`."""
    if dtype not in ("float32", "float64", "bfloat16"):
        raise ValueError(f"dtype: one of float32, float64, bfloat16; got {dtype!r}")
    model = load_model(path, map_location=device, topk=topk, kv=kv,
                       decoder_global=decoder_global)
    return model.to(dtype=getattr(torch, dtype)).eval()


def make_engine(model: CEDModel, replays: Iterable[int] = ()) -> InferenceEngine:
    """An engine whose H_(L_e) tail covers R_exact and every N (the cached_hidden policy)."""
    return InferenceEngine(model, hidden_tail=default_hidden_tail(model.cfg, replays))


# ---- modes ----------------------------------------------------------------------------------

def suite_mode_values(cfg, replays: Iterable[int],
                      turns: Iterable[int] = ()) -> tuple[list[Mode], list[Mode]]:
    """(modes for every family, extra multi-turn modes for families with turn_modes).

    Every family: full, replay=N for each N, replay=exact (dense/swa: full only).
    Multi-turn: turn=m,policy=P,replay=R for each m, each policy of docs/semantics.md 4.3, R in
    N's + exact (a prefix cache, its 4.2, with exact encoder replay: evals.modes' default,
    which the labels leave out)."""
    if not cfg.has_decoder:
        return [named_mode()], []
    replays = sorted(set(replays))
    base = [named_mode()] + [named_mode(replay=n) for n in [*replays, "exact"]]
    turn = [named_mode(replay=r, turn=m, policy=p, short=True) for m in sorted(set(turns))
            for p in POLICIES for r in [*replays, "exact"]]
    return base, turn


def suite_modes(cfg, replays: Iterable[int],
                turns: Iterable[int] = ()) -> tuple[list[str], list[str]]:
    """The labels of `suite_mode_values`' modes (as summary.json records them)."""
    base, turn = suite_mode_values(cfg, replays, turns)
    return [m.name for m in base], [m.name for m in turn]


# ---- evaluation ------------------------------------------------------------------------------

def length_batches(docs: list[dict], batch_size: int):
    """Batches of documents with equal prompt and target lengths (the engine batches rows of
    one length)."""
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for doc in docs:
        groups[(len(prompt_ids(doc)), len(target_ids(doc)))].append(doc)
    for key in sorted(groups):
        rows = groups[key]
        for i in range(0, len(rows), batch_size):
            yield rows[i:i + batch_size]


def _beyond(doc: dict, n: int | None) -> int | str:
    """How many of the example's facts start before the replay start (distance > N)."""
    if n is None:
        return 0
    chain = doc["meta"].get("chain_distances")
    if chain:
        return sum(d > n for d in chain)
    d = doc.get("distance")
    return "" if d is None else int(d > n)


@torch.no_grad()
def evaluate_documents(model: CEDModel, docs: list[dict], base_modes: list[Mode],
                       turn_modes: list[Mode], batch_size: int = 64, engine=None,
                       progress: bool = False, topk_read: str | None = None,
                       kv: str | None = None) -> tuple[list[dict], list[str]]:
    """Score every document under every mode. Returns (rows, warnings); one row per
    (document, mode), its mode as the label and as `evals.modes.mode_columns` (`topk_read`,
    `kv`: the run's evaluation-time overrides, None where the model reads as trained; the
    decoder_global column is read off the model's config)."""
    engine = engine or make_engine(model)
    cfg = model.cfg
    r_exact = exact_replay_length(cfg) if cfg.has_decoder else None
    columns = {m.name: mode_columns(m, r_exact, cfg.window, topk_read=topk_read, kv=kv,
                                    decoder_global=None if cfg.decoder_global_read else "off")
               for m in [named_mode(), *base_modes, *turn_modes]}
    rows: list[dict] = []
    warnings: list[str] = []
    by_family: dict[str, list[dict]] = defaultdict(list)
    for doc in docs:
        by_family[doc["family"]].append(doc)
    device = next(model.parameters()).device
    start = time.time()
    for fam_name, fam_docs in by_family.items():
        fam = FAMILIES.get(fam_name)
        modes = base_modes + (turn_modes if fam is None or fam.turn_modes else [])
        modes = [named_mode()] + [m for m in modes if m.name != FULL]   # full first: the reference
        for batch in length_batches(fam_docs, batch_size):
            stop_point()        # a SIGTERM/SIGINT stops here, before anything is written
            ctx = torch.tensor([prompt_ids(d) for d in batch], device=device)
            tgt = torch.tensor([target_ids(d) for d in batch], device=device)
            reference = reference_logp = None
            for mode in modes:
                try:
                    logits = mode_logits(engine, ctx, tgt, mode).double()
                except ValueError as err:
                    msg = f"{fam_name} T={ctx.shape[1]}: mode {mode.name} skipped: {err}"
                    if msg not in warnings:
                        warnings.append(msg)
                    continue
                logp = torch.log_softmax(logits, -1)
                if mode.name == FULL:
                    reference, reference_logp = logits, logp
                rows += _score_rows(cfg, batch, fam_name, mode, columns[mode.name], ctx, tgt,
                                    logits, logp, reference, reference_logp)
        if progress:
            print(f"  {fam_name}: {len(fam_docs)} examples x {len(modes)} modes "
                  f"({time.time() - start:.1f}s)", file=sys.stderr)
    return rows, warnings


def _score_rows(cfg, batch: list[dict], family: str, mode: Mode, columns: dict, ctx: Tensor,
                tgt: Tensor, logits: Tensor, logp: Tensor, reference: Tensor,
                reference_logp: Tensor) -> list[dict]:
    """One result row per document of a batch under one mode (its label and its `columns`,
    `evals.modes.mode_columns`): exact match of the answer, its NLL, KL(full || mode) at the
    answer and the largest logit difference to `full`.
    logits, logp [B, A, V] (A answer tokens, teacher-forced); reference*: `full`'s."""
    nll = -logp.gather(-1, tgt[..., None])[..., 0].sum(-1)
    # KL(full || mode) at the answer: summed over the target's (teacher-forced) positions, in
    # nats; the divergence that the accuracy is judged on
    kl_answer = (reference_logp.exp() * (reference_logp - logp)).sum(-1).sum(-1)
    pred = logits.argmax(-1)
    correct = pred.eq(tgt).all(-1)
    diff = (logits - reference).abs().amax((-1, -2))
    # Decoder positions replayed at the end of the prompt (None: no truncation).
    n_eff = None if mode.replay is None else resolve_replay(cfg, mode.replay, ctx.shape[1])
    return [{"id": doc["id"], "family": family, "x_name": doc["x_name"], "x": doc["x"],
             "seed": doc["seed"], "mode": mode.name,
             "replay": "" if mode.replay is None else mode.replay,
             "turn": "" if mode.turn is None else mode.turn, "policy": mode.policy or "",
             **columns,
             "distance": "" if doc.get("distance") is None else doc["distance"],
             "length": doc["length"], "beyond_replay": _beyond(doc, n_eff),
             "target": doc["target"], "prediction": _TOK.decode(pred[i]),
             "correct": int(correct[i]), "nll": float(nll[i]),
             "kl_answer": max(float(kl_answer[i]), 0.0), "logit_diff": float(diff[i]),
             "chance": doc.get("chance", "")}
            for i, doc in enumerate(batch)]


# ---- summaries -------------------------------------------------------------------------------

def _sort_x(x):
    return (1, 0) if x == "all" else (0, x)


def summarize(rows: list[dict]) -> list[dict]:
    """Accuracy per (family, x, mode) and pooled over x (x = "all"), with Wilson 95% CIs;
    beside each mode label its columns (`evals.modes.MODE_COLUMNS`) where the rows carry them."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["family"], r["x_name"], r["x"], r["mode"])].append(r)
        cells[(r["family"], r["x_name"], "all", r["mode"])].append(r)
    full_pred = {r["id"]: r["prediction"] for r in rows if r["mode"] == FULL}
    out = []
    for (family, x_name, x, mode), rs in cells.items():
        n, k = len(rs), sum(r["correct"] for r in rs)
        lo, hi = wilson_interval(k, n)
        chance = [r["chance"] for r in rs if r["chance"] != ""]
        out.append({
            "family": family, "x_name": x_name, "x": x, "mode": mode,
            **{name: rs[0][name] for name in MODE_COLUMNS if name in rs[0]}, "n": n, "correct": k,
            "accuracy": k / n, "ci_low": lo, "ci_high": hi,
            "chance": sum(chance) / len(chance) if chance else "",
            "mean_nll": sum(r["nll"] for r in rs) / n,
            "mean_kl_answer": sum(r["kl_answer"] for r in rs) / n,
            "agree_with_full": sum(r["prediction"] == full_pred.get(r["id"]) for r in rs) / n,
            "max_logit_diff": max(r["logit_diff"] for r in rs),
        })
    order = {name: i for i, name in enumerate(FAMILIES)}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    out.sort(key=lambda s: (order.get(s["family"], 99), s["family"], _sort_x(s["x"]),
                            modes.index(s["mode"])))
    return out


def paired_tests(rows: list[dict], alpha: float = 0.05) -> list[dict]:
    """Every non-full mode against full on the same examples (exact McNemar), per (family, x)
    and pooled over x; significant = p < alpha and more pairs lost than won."""
    outcome: dict[tuple, dict[str, int]] = defaultdict(dict)     # (family, x_name, mode) -> id
    xs: dict[str, object] = {}
    for r in rows:
        outcome[(r["family"], r["x_name"], r["mode"])][r["id"]] = r["correct"]
        xs[r["id"]] = r["x"]
    tests = []
    for (family, x_name, mode), results in outcome.items():
        if mode == FULL:
            continue
        reference = outcome.get((family, x_name, FULL), {})
        ids = [i for i in results if i in reference]
        by_x: dict[object, list[str]] = defaultdict(list)
        for i in ids:
            by_x[xs[i]].append(i)
        for x, members in [*by_x.items(), ("all", ids)]:
            ref = [bool(reference[i]) for i in members]
            got = [bool(results[i]) for i in members]
            t = mcnemar_exact(ref, got)
            n = len(members)
            tests.append({
                "family": family, "x_name": x_name, "x": x, "mode": mode, "n": n,
                "acc_full": sum(ref) / n, "acc_mode": sum(got) / n,
                "delta": (sum(got) - sum(ref)) / n,
                "full_only": t["b"], "mode_only": t["c"], "p_value": t["p_value"],
                "significant": int(t["p_value"] < alpha and t["b"] > t["c"]),
            })
    per_x = [t for t in tests if t["x"] != "all"]
    for t, p in zip(per_x, holm([t["p_value"] for t in per_x])):
        t["p_holm"] = p
    for t in tests:
        t.setdefault("p_holm", "")
    order = {name: i for i, name in enumerate(FAMILIES)}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    tests.sort(key=lambda s: (order.get(s["family"], 99), s["family"], _sort_x(s["x"]),
                              modes.index(s["mode"])))
    return tests


# ---- output ----------------------------------------------------------------------------------

def write_csv(rows: list[dict], path: Path, fields: list[str] | None = None) -> Path:
    fields = fields or (list(rows[0]) if rows else [])
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


DROP_FIELDS = ["family", "x_name", "x", "mode", "n", "acc_full", "acc_mode", "delta",
               "full_only", "mode_only", "p_value", "p_holm", "significant"]


def plot(summary: list[dict], settings: SuiteSettings, path: Path,
         title: str = "") -> Path | None:
    """Write the run's accuracy figure (evals.plots.accuracy_figure): accuracy against x per
    family, a line per mode with its 95% CI band, N, W and R_exact marked, chance dotted."""
    # lazy: evals.plots loads matplotlib (~0.6 s); lm-eval's CEDLM and the study driver import
    # this module and draw nothing
    from evals import plots
    fig = plots.accuracy_figure(summary, replays=settings.replays, window=settings.window,
                                r_exact=settings.r_exact, title=title)
    if fig is None:
        return None
    return plots.save(fig, path, dpi=110, title_room=bool(title))


def format_table(summary: list[dict], drops: list[dict], width: int = 9) -> str:
    """Plain-text accuracy table (family x point rows, mode columns) and the drop list."""
    lines = []
    families = list(dict.fromkeys(s["family"] for s in summary))
    for family in families:
        cells = [s for s in summary if s["family"] == family]
        modes = list(dict.fromkeys(s["mode"] for s in cells))
        short = {m: m.replace("policy=", "").replace("turn=", "t").replace("replay=", "r=")
                 for m in modes}
        xs = list(dict.fromkeys(s["x"] for s in cells))
        acc = {(s["x"], s["mode"]): s["accuracy"] for s in cells}
        lines.append(f"{family} (x = {cells[0]['x_name']}, n = {cells[0]['n']} per cell)")
        head = "  x     " + "".join(f"{short[m]:>{max(width, len(short[m]) + 1)}}"
                                     for m in modes)
        lines.append(head)
        for x in xs:
            lines.append(f"  {str(x):6s}" + "".join(
                f"{acc.get((x, m), float('nan')):>{max(width, len(short[m]) + 1)}.2f}"
                for m in modes))
    lines.append("")
    sig = [d for d in drops if d["significant"]]
    lines.append(f"capability drops (exact McNemar vs full, p < 0.05): {len(sig)}")
    for d in sig:
        lines.append(f"  {d['family']:16s} {d['x_name']}={str(d['x']):5s} {d['mode']:40s} "
                     f"{d['acc_full']:.2f} -> {d['acc_mode']:.2f}  (lost {d['full_only']}, "
                     f"won {d['mode_only']}, p={d['p_value']:.2g}, holm={d['p_holm'] if d['p_holm'] == '' else round(d['p_holm'], 3)})")
    return "\n".join(lines)


@dataclasses.dataclass
class SuiteConfig:
    """Everything one suite run reads: `python -m evals.suites` builds its options from these
    fields (`evals.cli`), and the study driver writes them as JSON for `experiments.job`."""

    checkpoint: str = option(help="directory written by ced.checkpoint.save_model (e.g. a "
                                  "training run's final/)")
    replays: List[str] = option(flag="--replay", metavar="N", help=(
        "bounded replay lengths to test: N, W, W/k, kW, kW/d or R_exact, resolved against the "
        "checkpoint (replay=exact and full always run)"))
    out: str = option(help="output directory")
    examples: int = option(50, help="examples per family x point")
    families: Optional[List[str]] = option(None, choices=lambda: list(FAMILIES),
                                           help="default: all")
    turns: List[int] = option(factory=list, metavar="M", help=(
        "new-turn sizes for the multiturn family (default: min(N) // 2)"))
    distances: List[int] = option(factory=list, metavar="D",
                                  help="extra distances for the distance families")
    max_length: Optional[int] = option(None,
                                       help="cap on prompt length (default: max_seq_len - 8)")
    needle_distractors: Optional[int] = option(None, help="default: topk + 1")
    state_length: Optional[int] = option(None, metavar="T", help=(
        "running_count/_parity/_bracket prompts of at least T tokens (a longer random prefix "
        "before `|`; default: as short as the window allows)"))
    state_filler: Optional[int] = option(None, metavar="F", help=(
        "running_count/_parity/_bracket prompts laid out as training lays them out: a random "
        "prefix of 0..F symbols before `|`, drawn per example (default: one prompt length for "
        "every point; not with --state-length)"))
    span_grid: Optional[str] = option(None, choices=lambda: list(SPAN_GRIDS), help=(
        "the running families' span starts on a named grid instead of around each --replay: "
        "uncensored = W/2, W, W+1, 3W/2, 2W, 3W, 4W, 6W, ... below R_exact, R_exact, 1.5 "
        "R_exact (evals.suites.families.uncensored_span_starts), plus --distances"))
    sweep_replays: Optional[List[str]] = option(None, metavar="N", help=(
        "place the distance and window sweeps' points around these replay lengths only "
        "(default: every --replay); every --replay is still evaluated on every document"))
    topk: Optional[str] = option(None, help="override the checkpoint's top-k (int or 'all')")
    kv: Optional[str] = option(None, help=(
        "override KV storage formats, e.g. window:fp8,global:fp4_block16,indexer:fp4_block32 "
        "(fake quantisation at the storage points)"))
    decoder_global: Optional[str] = option(None, choices=["on", "off"], help=(
        "off: read the model without its decoder's global read, the path ablation of "
        "docs/semantics.md 4.6 (what the decoder's window chain carries alone); default: as "
        "trained"))
    batch_size: int = option(64, help="documents per forward pass")
    dtype: str = option("float32", choices=["float32", "float64", "bfloat16"],
                        help="the model's dtype")
    device: str = option("cpu", help="torch device")
    threads: Optional[int] = option(None, help="torch intra-op threads")
    alpha: float = option(0.05, help="significance level of the drops")
    seed_offset: int = option(0, help="first example seed")
    plot: bool = option(True, help="do not draw accuracy.png")
    wandb: bool = option(True, help=(
        "do not log to wandb (by default the tables and the plot are logged, offline unless "
        "WANDB_MODE is set, as training and divergence do)"))
    wandb_project: str = option("ced", help="the one project of every ced run")
    wandb_group: Optional[str] = option(None, help=(
        "wandb group (default: $WANDB_RUN_GROUP, else 'suite')"))
    overwrite: bool = option(False, help=(
        "replace the suite run already in --out (by default it is refused, as ced.train "
        "refuses a run directory that holds a run)"))
    quiet: bool = option(False, help="no progress and no table")


def check_out(config: SuiteConfig, name: str = "out") -> None:
    """A ValueError naming `out` (as `name`) when it holds a suite run and `overwrite` is
    off, as ced.train refuses a run directory that holds a run."""
    held = [n for n in ("results.csv", "summary.json") if (Path(config.out) / n).exists()]
    if held and not config.overwrite:
        raise ValueError(f"{name} {config.out} already holds a suite run ({', '.join(held)}); "
                         f"choose another {name}, or set overwrite (--overwrite) to replace it")


def _stated_replays(cfg, forms: list) -> list:
    """Each replay form (W, W/2, R_exact, ...) resolved against this checkpoint's own config,
    its warning printed where it is capped. The modes run at most R_exact (`s.n`,
    ced.config.state_replay: a longer replay computes what R_exact does); the documents are
    placed around the forms' own lengths (`s.length`), so that every variant of a study reads
    the same documents (a yoco model, R_exact 1, included)."""
    stated = [state_replay(cfg, n, name="replays") for n in forms]
    for s in stated:
        if s.warning("--replay"):
            print(s.warning("--replay"), file=sys.stderr)
    return stated


def run_suite(config: SuiteConfig) -> dict:
    """The whole run; returns {"summary", "drops", "tests", "rows", "paths", "warnings",
    "settings", "seconds"}. Bad settings are a ValueError naming the field."""
    c = config
    check_out(c)
    out = Path(c.out)
    model = load_checkpoint(c.checkpoint, topk=c.topk, dtype=c.dtype, device=c.device, kv=c.kv,
                            decoder_global=c.decoder_global)
    out.mkdir(parents=True, exist_ok=True)   # only once the checkpoint loaded
    cfg = model.cfg
    stated = _stated_replays(cfg, c.replays)
    replays = [s.length for s in stated]
    sweep_replays = None if c.sweep_replays is None else [
        replay_length(cfg, parse_replay_form(n, "sweep_replays"), name="sweep_replays")
        for n in c.sweep_replays]
    settings = SuiteSettings.from_config(cfg, replays, c.turns,
                                         extra_distances=tuple(c.distances),
                                         max_length=c.max_length,
                                         needle_distractors=c.needle_distractors,
                                         sweep_replays=sweep_replays,
                                         state_length=c.state_length,
                                         state_filler=c.state_filler,
                                         span_grid=c.span_grid)
    docs = build_documents(settings, c.examples, c.families, seed_offset=c.seed_offset)
    write_jsonl(docs, out / "data")
    base, turn = suite_mode_values(cfg, sorted({s.n for s in stated}), settings.turns)
    if not c.quiet:
        print(describe(settings), file=sys.stderr)
        print(f"replays: {describe_replays(stated)}", file=sys.stderr)
        print(f"modes: {[m.name for m in base]} + {len(turn)} multi-turn modes on "
              f"{[f for f in FAMILIES if FAMILIES[f].turn_modes]}", file=sys.stderr)
    t0 = time.time()
    rows, warnings = evaluate_documents(model, docs, base, turn, batch_size=c.batch_size,
                                        engine=make_engine(model, [s.n for s in stated]),
                                        progress=not c.quiet, topk_read=stated_override(c.topk),
                                        kv=stated_override(c.kv))
    elapsed = time.time() - t0
    run_info = {
        "checkpoint": str(c.checkpoint), "config": cfg.to_dict(),
        "settings": dataclasses.asdict(settings), "examples": c.examples,
        "modes": [m.name for m in base], "turn_modes": [m.name for m in turn],
        "alpha": c.alpha, "seconds": elapsed,
        "replays": {s.form: s.n for s in stated},
        "scoring": "teacher-forced exact match on the engine path (evals.modes.mode_logits)",
        "warnings": warnings,
    }
    result = _write_results(rows, run_info, out, c.alpha)
    if c.plot and (figure := plot(result["summary"], settings, out / "accuracy.png",
                                  title=f"{Path(c.checkpoint).name}: {cfg.variant}, "
                                        f"W={cfg.window}, R_exact={settings.r_exact}")):
        result["paths"]["plot"] = figure
    if c.wandb:
        _log_wandb(c.wandb_project, run_info, result["summary"], result["drops"],
                   result["paths"], out, group=c.wandb_group)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return {**result, "rows": rows, "warnings": warnings, "settings": settings,
            "seconds": elapsed}


def _write_results(rows: list[dict], run_info: dict, out: Path, alpha: float) -> dict:
    """results.csv, summary.csv, paired_tests.csv, capability_drop.csv and summary.json of a
    suite run; returns {"summary", "drops", "tests", "paths"}."""
    summary = summarize(rows)
    tests = paired_tests(rows, alpha)
    drops = [t for t in tests if t["significant"]]
    paths = {
        "results": write_csv(rows, out / "results.csv"),
        "summary": write_csv(summary, out / "summary.csv"),
        "paired_tests": write_csv(tests, out / "paired_tests.csv", DROP_FIELDS),
        "capability_drop": write_csv(drops, out / "capability_drop.csv", DROP_FIELDS),
    }
    # written last and atomically: a study driver takes summary.json for "this run finished"
    paths["summary_json"] = out / "summary.json"
    write_json(paths["summary_json"], json.loads(json.dumps(
        {"run": run_info, "summary": summary, "capability_drop": drops}, default=str)))
    return {"summary": summary, "drops": drops, "tests": tests, "paths": paths}


def _table_row(row: dict, columns: list[str]) -> list:
    """One row of a wandb.Table: x as text (a distance or `all`), and "" (a cell without a
    value, e.g. p_holm of a pooled row) as None, so that every column keeps one type; wandb
    refuses a table whose column mixes numbers and strings."""
    return [str(row[c]) if c == "x" else None if row[c] == "" else row[c] for c in columns]


def _log_wandb(project: str, run_info: dict, summary: list[dict], drops: list[dict],
               paths: dict, out: Path, group: str | None = None) -> None:
    """Offline unless WANDB_MODE says otherwise; `wandb sync <out>/wandb/offline-run-*`.
    The group defaults to WANDB_RUN_GROUP (set by the study driver), else "suite"."""
    # lazy: wandb costs ~0.4 s to import, and only a run that logs to wandb needs it
    import wandb
    run = wandb.init(project=project, dir=str(out), job_type="suite",
                     group=group or os.environ.get("WANDB_RUN_GROUP") or "suite",
                     mode=os.environ.get("WANDB_MODE", "offline"),
                     config={k: v for k, v in run_info.items() if k != "warnings"})
    cols = list(summary[0]) if summary else []
    run.log({"summary": wandb.Table(columns=cols, data=[_table_row(s, cols) for s in summary]),
             "capability_drop": wandb.Table(columns=DROP_FIELDS,
                                            data=[_table_row(d, DROP_FIELDS) for d in drops])})
    if "plot" in paths:
        run.log({"accuracy": wandb.Image(str(paths["plot"]))})
    use_checkpoints(run, [run_info["checkpoint"]])
    log_scalars(run, suite_scalars(summary))
    run.summary["capability_drops"] = len(drops)
    run.finish()


def suite_scalars(summary: list[dict]) -> dict[str, float]:
    """Accuracy per (family, mode) pooled over distances (`acc/<family>/<mode>`, the mode
    naming N, e.g. replay=8) and per (family, mode, x) (`acc/<family>/<mode>/<x_name>=<x>`),
    as flat scalars for dashboards."""
    out = {}
    for s in summary:
        key = f"acc/{s['family']}/{s['mode']}"
        out[key if str(s["x"]) == "all" else f"{key}/{s['x_name']}={s['x']}"] = s["accuracy"]
    return out
