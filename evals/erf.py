"""Effective receptive field of the decoder's sliding windows: `python -m evals.erf`.

    python -m evals.erf --checkpoint RUN/seed0/final RUN/seed1/final --out DIR \
        [--tasks running_state kv_recall copy] [--examples 16] [--length 128] \
        [--params '{"running_state": {"window_len": 24}}'] [--divergence DIV/divergence.csv]

A ced decoder's window state can in principle carry information from L_d (W - 1) positions
back (R_exact - 1); the paper says the effective reach is much shorter, which is why bounded
replay of N = W would be enough. For every checkpoint and prompt (suite-style task prompts of
`--length` tokens, whose last position is where the answer is produced) this measures how the
output at the last position depends on decoder window state at distance d = (T - 1) - p:

- **gradient**: the norm of the gradient of log p(y) (y: the model's own top-1 token at the
  last position) with respect to each decoder layer's input h_l[p], the residual stream
  entering layer l. The decoder's global KV is projected from the encoder's output, which is
  also decoder layer 0's input; that path is cut (its input detached), so what remains flows
  through decoder windows only. Layer 0's input gradient is the **total**: every path from
  position p through the decoder starts there. It is exactly 0 beyond (L_d - l)(W - 1).
- **ablation of the cached state** (`cache_drop`): the engine prefills T - 1 tokens, one
  window entry at distance d (1 <= d < W) is removed from one decoder layer's cache (or from
  every decoder layer's: `all`), and the last token is decoded: KL(full || ablated) and max
  |delta logit|. This is the state a bounded replay must rebuild, as the last query reads it.
- **ablation of everything at distance >= d** (`replay`): the parallel forward with every
  decoder window truncated at T - d, i.e. bounded replay N = d (docs/semantics.md 4.1; tests
  hold the engine equal): KL and max |delta logit| at the last position, d = 1 .. R_exact.

Influence is summarised per checkpoint and pooled over checkpoints (seeds): the distance
holding 99% and 99.9% of the gradient influence at d >= 1 (the cumulative share of the mean
profile), and the distance beyond which dropping all state costs at most 1% / 0.1% of the KL
of dropping all of it (N = 1), each with a bootstrap 95% CI over (checkpoint, prompt); and the
answer to "is N = W enough": KL of replay N = W with its CI, and the gradient share at d >= W
(of the same mean profile). `--from DIR` summarises a saved erf.csv again without measuring.

Writes into --out: `erf.csv` (tidy: checkpoint, task, prompt, view, layer, distance, value),
`summary.json`, `erf.md` (the statements and tables) and `erf.png` (evals.plots.erf_figure).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

import numpy as np
import pandas as pd
import torch

from ced import InferenceEngine, exact_replay_length
from ced.checkpoint import CheckpointError, load_model
from ced.data.registry import TASKS, make_example
from ced.inference.engine import Cache
from ced.model import ModelState
from ced.run_id import of_checkpoint
from ced.tracking import job_and_seed

from . import plots
from .cli import build_parser, config_from_args, option
from .modes import replay_lengths

SHARES = (0.99, 0.999)
# every file `run` writes into --out
OUTPUTS = ("erf.csv", "summary.json", "erf.md", "erf.png")


# ---- prompts ------------------------------------------------------------------------------

def build_prompts(tasks: list[str], examples: int, length: int, params: dict,
                  seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """LongTensor [P, length] of task prompts (the answer is due after the last token) and the
    task of each row. Every example gets `length=length` so the rows stack."""
    ids, kinds = [], []
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"--tasks: unknown task {task!r}; known: {sorted(TASKS)}")
        for i in range(examples):
            example = make_example(task, seed + i, **{**params.get(task, {}), "length": length})
            if len(example.prompt_ids) != length:
                raise ValueError(f"--tasks {task}: a prompt of {len(example.prompt_ids)} "
                                 f"tokens, not --length {length}")
            ids.append(example.prompt_ids)
            kinds.append(task)
    return torch.tensor(ids), kinds


# ---- the three views ----------------------------------------------------------------------

def decoder_input_gradients(model, ids: torch.Tensor) -> torch.Tensor:
    """|| d log p(y_last) / d h_l[p] || for every decoder layer l and position p, where h_l is
    the residual stream entering decoder layer l and y_last the model's top-1 token at the
    last position; the decoder's global KV does not carry gradient (its source, the encoder
    output, is detached where the decoder source reads it). Returns [L_d, B, T]."""
    captured: list[torch.Tensor] = []

    def keep(module, args):
        args[0].retain_grad()
        captured.append(args[0])

    def cut(module, args):
        return (args[0].detach(),)

    hooks = [model.blocks[spec.index].attn_norm.register_forward_pre_hook(keep)
             for spec in model.plan.part("decoder")]
    hooks.append(model.encoder_output_norm.register_forward_pre_hook(cut))
    try:
        with torch.enable_grad():
            logits = model(ids)[:, -1]
            logp = torch.log_softmax(logits, -1)
            top = logp.argmax(-1, keepdim=True)
            model.zero_grad(set_to_none=True)
            logp.gather(-1, top).sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([h.grad.norm(dim=-1) for h in captured]).detach()


def _kl_and_delta(reference: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """KL(reference || other) and max |delta logit| per row of logits [B, V]."""
    lp_r, lp_o = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    kl = (lp_r.exp() * (lp_r - lp_o)).sum(-1).clamp_min(0.0)
    return kl, (reference - other).abs().amax(-1)


def cache_drop(model, ids: torch.Tensor) -> list[dict]:
    """Remove the cached window entry at distance d (1 <= d < W) from one decoder layer, or from
    all of them, before the last token is decoded: KL and max |delta logit| per prompt."""
    engine = InferenceEngine(model)
    t = ids.shape[1]
    decoder = [spec.index for spec in model.plan.part("decoder")
               if model.blocks[spec.index].attn.has_window]
    prompt = engine.prefill(ids[:, :-1]).cache
    reference = engine.decode(ids[:, -1], _copy(prompt))
    rows = []
    for d in range(1, model.cfg.window):
        position = t - 1 - d
        for depth, layers in [*((str(k), [i]) for k, i in enumerate(decoder)), ("all", decoder)]:
            cache = _copy(prompt)
            for i in layers:
                w = cache.state.windows[i]
                keep = w.positions != position
                w.k, w.v, w.positions = w.k[:, :, keep], w.v[:, :, keep], w.positions[keep]
            kl, delta = _kl_and_delta(reference, engine.decode(ids[:, -1], cache))
            rows += _rows("cache_drop", depth, d, kl, delta)
    return rows


def _copy(cache: Cache) -> Cache:
    """A cache a decode step may advance without touching `cache`: the engine and the model
    rebind a cache's tensors and never write into them, so new holders suffice."""
    state = ModelState([None if w is None else replace(w) for w in cache.state.windows],
                       [replace(s) for s in cache.state.sources])
    return replace(cache, state=state)


def replay_drop(model, ids: torch.Tensor) -> list[dict]:
    """Every decoder window truncated at T - d (bounded replay N = d), d = 1 .. R_exact: KL and
    max |delta logit| at the last position."""
    t = ids.shape[1]
    reference = model(ids)[:, -1]
    rows = []
    for d in range(1, min(exact_replay_length(model.cfg), t) + 1):
        kl, delta = _kl_and_delta(reference, model(ids, decoder_replay_start=t - d)[:, -1])
        rows += _rows("replay", "all", d, kl, delta)
    return rows


def _rows(view: str, layer: str, distance: int, kl: torch.Tensor,
          delta: torch.Tensor) -> list[dict]:
    return [{"view": view, "layer": layer, "distance": distance, "metric": metric,
             "prompt": i, "value": float(v)}
            for metric, values in (("kl", kl), ("max_abs_dlogit", delta))
            for i, v in enumerate(values.tolist())]


def measure(model, ids: torch.Tensor) -> pd.DataFrame:
    """Every view for one model on prompts ids [P, T] (rows without checkpoint/task)."""
    with torch.no_grad():
        rows = cache_drop(model, ids) + replay_drop(model, ids)
    grads = decoder_input_gradients(model, ids)
    t = ids.shape[1]
    for depth in range(grads.shape[0]):
        name = "total" if depth == 0 else str(depth)
        for prompt in range(grads.shape[1]):
            for d in range(t):
                rows.append({"view": "gradient", "layer": name, "distance": d, "metric": "norm",
                             "prompt": prompt, "value": float(grads[depth, prompt, t - 1 - d])})
    return pd.DataFrame(rows)


# ---- summaries ----------------------------------------------------------------------------

def share_distance(profile: np.ndarray, share: float) -> int:
    """The smallest D with sum_{1<=d<=D} profile[d] >= share * sum_{d>=1} profile[d] (profile
    indexed by distance, d = 0 ignored); 0 when there is no influence at d >= 1."""
    tail = np.asarray(profile, dtype=float)[1:]
    total = tail.sum()
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(tail) / total, share - 1e-12) + 1)


def share_beyond(profile: np.ndarray, distance: int) -> float:
    """sum_{d >= distance} profile[d] / sum_{d >= 1} profile[d] (0 without influence)."""
    profile = np.asarray(profile, dtype=float)
    total = profile[1:].sum()
    return float(profile[distance:].sum() / total) if total > 0 else 0.0


def erf_shares(erf_dir: Path) -> pd.DataFrame:
    """Per checkpoint of an evals.erf output directory (its erf.csv and summary.json): job,
    seed, and the share of the decoder's total gradient influence (layer-0 input, mean profile
    over the checkpoint's prompts) at distance >= W and >= 2W (`share_beyond`)."""
    table = pd.read_csv(erf_dir / "erf.csv")
    summary = json.loads((erf_dir / "summary.json").read_text())
    geometry = summary.get("geometry", {})
    grad = table[(table["view"] == "gradient") & (table["layer"] == "total")
                 & (table["metric"] == "norm")]
    rows = []
    for checkpoint, part in grad.groupby("checkpoint"):
        job, seed = job_and_seed(checkpoint)
        w = geometry.get(job, {}).get("W")
        profile = part.groupby("distance")["value"].mean()
        profile = profile.reindex(range(int(profile.index.max()) + 1), fill_value=0.0).to_numpy()
        rows.append({"job": job, "seed": seed, "share_beyond_W": share_beyond(profile, w),
                     "share_beyond_2W": share_beyond(profile, 2 * w)})
    return pd.DataFrame(rows)


def residual_distance(kl_by_n: np.ndarray, share: float) -> int:
    """The smallest N with KL(replay N) <= (1 - share) * KL(replay 1) (kl_by_n indexed by N,
    index 0 unused): beyond it, dropping all the state costs at most that fraction."""
    kl = np.asarray(kl_by_n, dtype=float)
    if kl[1] <= 0:
        return 1
    below = np.nonzero(kl[1:] <= (1 - share) * kl[1])[0]
    return int(below[0] + 1) if len(below) else len(kl)


def _profiles(table: pd.DataFrame, view: str, layer: str, metric: str) -> np.ndarray:
    """[units, distances] matrix of one view (a unit: one checkpoint's prompt)."""
    part = table[(table["view"] == view) & (table["layer"] == layer)
                 & (table["metric"] == metric)]
    wide = part.pivot_table(index=["checkpoint", "prompt"], columns="distance", values="value")
    width = int(part["distance"].max()) + 1
    return wide.reindex(columns=range(width), fill_value=0.0).fillna(0.0).to_numpy()


def _ci(samples: list[float]) -> list[float]:
    return [float(np.quantile(samples, 0.025)), float(np.quantile(samples, 0.975))]


def summarize(table: pd.DataFrame, window: int, reach: int, bootstrap: int = 1000,
              seed: int = 0) -> dict:
    """Share distances with bootstrap CIs over (checkpoint, prompt), KL at N = W and N = 1,
    and the gradient share beyond W, for the rows of `table` (one job, any seeds)."""
    rng = np.random.default_rng(seed)
    grad = _profiles(table, "gradient", "total", "norm")
    kl = _profiles(table, "replay", "all", "kl")
    n_units = grad.shape[0]
    draws = [rng.integers(0, n_units, n_units) for _ in range(bootstrap)]
    out: dict = {"units": int(n_units), "window": window, "reach": reach}
    for share in SHARES:
        key = f"{share * 100:g}"
        out[f"gradient_d{key}"] = share_distance(grad.mean(0), share)
        out[f"gradient_d{key}_ci"] = _ci([share_distance(grad[i].mean(0), share) for i in draws])
        out[f"replay_d{key}"] = residual_distance(kl.mean(0), share)
        out[f"replay_d{key}_ci"] = _ci([residual_distance(kl[i].mean(0), share) for i in draws])
    # the share of the same mean profile the d99 / d99.9 read (a mean of per-prompt shares would
    # weigh a prompt with almost no influence like one with much, and disagree with d99)
    out["gradient_share_beyond_W"] = share_beyond(grad.mean(0), window)
    out["gradient_share_beyond_W_ci"] = _ci([share_beyond(grad[i].mean(0), window) for i in draws])
    for n in (1, window):
        if n < kl.shape[1]:
            out[f"kl_replay_{n}"] = float(kl[:, n].mean())
            out[f"kl_replay_{n}_ci"] = _ci([kl[i, n].mean() for i in draws])
    return out


def verdict(name: str, s: dict) -> str:
    """'Is N = W enough, and why' for one job, in measured terms."""
    w, reach = s["window"], s["reach"]
    kl_w, kl_1 = s.get(f"kl_replay_{w}", math.nan), s.get("kl_replay_1", math.nan)
    enough = s["gradient_d99.9_ci"][1] <= w and s["replay_d99.9_ci"][1] <= w
    why = (f"99.9% of the gradient influence lies within d <= {s['gradient_d99.9']} "
           f"(95% CI {s['gradient_d99.9_ci'][0]:g}-{s['gradient_d99.9_ci'][1]:g}; 99% within "
           f"{s['gradient_d99']}), against a theoretical reach of {reach - 1}; "
           f"{100 * s['gradient_share_beyond_W']:.2g}% of it lies at d >= W = {w}; dropping "
           f"all window state beyond N = W moves the last token by KL {kl_w:.3g} nats "
           f"(CI {s[f'kl_replay_{w}_ci'][0]:.3g}-{s[f'kl_replay_{w}_ci'][1]:.3g}), against "
           f"{kl_1:.3g} at N = 1; 99.9% of that KL is gone by N = {s['replay_d99.9']}")
    return (f"{name}: N = W is {'enough' if enough else 'not enough'} at the 99.9% level "
            f"({s['units']} prompts x seeds): {why}.")


# ---- the run ------------------------------------------------------------------------------

def job_of(checkpoint: Path) -> str:
    """The job of a study's checkpoint (`ced.run_id`); else the run directory's name."""
    run_id = of_checkpoint(checkpoint.resolve())
    if run_id is not None:
        return run_id.job
    return checkpoint.resolve().parent.name if checkpoint.name == "final" else checkpoint.name


def run(checkpoints: list[Path], out: Path, tasks: list[str], examples: int, length: int,
        params: dict, dtype: torch.dtype = torch.float64, bootstrap: int = 1000,
        divergence: Path | None = None) -> dict:
    """Measure every checkpoint, write the outputs into `out`; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    frames, geometry = [], {}
    ids, kinds = build_prompts(tasks, examples, length, params)
    for checkpoint in checkpoints:
        model = load_model(checkpoint).to(dtype)
        cfg = model.cfg
        if not cfg.traits.decoder_windows:
            raise ValueError(f"--checkpoint {checkpoint}: variant {cfg.variant!r} has no decoder "
                             "windows, so there is no window state to measure")
        if length > cfg.max_seq_len:
            raise ValueError(f"--length {length} exceeds the model's max_seq_len "
                             f"{cfg.max_seq_len}")
        job = job_of(checkpoint)
        geometry[job] = {"W": cfg.window, "R_exact": exact_replay_length(cfg),
                         "L_d": cfg.n_decoder_layers}
        table = measure(model, ids)
        frames.append(table.assign(checkpoint=str(checkpoint), job=job,
                                   task=[kinds[p] for p in table["prompt"]]))
        print(f"[erf] {checkpoint}: {len(ids)} prompts of {length} tokens", flush=True)
    table = pd.concat(frames, ignore_index=True)
    table.to_csv(out / "erf.csv", index=False, float_format="%.6g")
    settings = {"tasks": tasks, "examples": examples, "length": length, "params": params,
                "checkpoints": [str(c) for c in checkpoints]}
    return write_outputs(table, geometry, settings, out, bootstrap, divergence)


def resummarize(source: Path, out: Path, bootstrap: int = 1000,
                divergence: Path | None = None) -> dict:
    """Summaries, verdicts and plot again from an earlier run's `erf.csv` and `summary.json`
    (settings and geometry) in `source`, without measuring: into `out`."""
    try:
        earlier = json.loads((source / "summary.json").read_text())
        table = pd.read_csv(source / "erf.csv", dtype={"layer": str})
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from {source}: not an evals.erf output ({exc})") from None
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != source.resolve():
        table.to_csv(out / "erf.csv", index=False, float_format="%.6g")
    return write_outputs(table, earlier["geometry"], earlier["settings"], out, bootstrap,
                         divergence)


def write_outputs(table: pd.DataFrame, geometry: dict, settings: dict, out: Path,
                  bootstrap: int, divergence: Path | None) -> dict:
    """summary.json, erf.md and erf.png of a measured table (rows of `measure` plus checkpoint,
    job and task); returns the summary."""
    summary = {"settings": settings, "geometry": geometry, "jobs": {}}
    for job, part in table.groupby("job", sort=False):
        g = geometry[job]
        summary["jobs"][job] = summarize(part, g["W"], g["R_exact"], bootstrap)
        summary["jobs"][job]["verdict"] = verdict(job, summary["jobs"][job])
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    reference = _divergence_curve(divergence) if divergence else None
    plots.save(plots.erf_figure(table, geometry, reference), out / "erf.png")
    lines = ["# Effective receptive field of the decoder windows (python -m evals.erf)",
             *(summary["jobs"][job]["verdict"] for job in summary["jobs"])]
    (out / "erf.md").write_text("\n\n".join(lines) + "\n")
    for job in summary["jobs"]:
        print(summary["jobs"][job]["verdict"], flush=True)
    return summary


def _divergence_curve(path: Path) -> pd.DataFrame:
    """First-token KL against N per job from an evals.divergence table (csv or parquet)."""
    table = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    # N of each single-turn replay written as a number (divergence writes resolved lengths);
    # replay=exact, full and the multi-turn modes have none (no R_exact is given here)
    table = table.assign(N=replay_lengths(table))
    table = table[(table["metric"] == "kl") & (table["step"] == 0) & table["N"].notna()]
    # a checkpoint's job reads its run's record: once per checkpoint, not per row
    jobs = {c: job_of(Path(c)) for c in table["checkpoint"].unique()}
    table = table.assign(job=table["checkpoint"].map(jobs),
                         N=table["N"].astype(int))
    return table.groupby(["job", "N"], as_index=False)["value"].mean()


@dataclass
class ErfConfig:
    """The options of `python -m evals.erf` (its command line is built from these fields by
    `evals.cli`): measure `checkpoint`s, or summarise an earlier run again (`source`)."""

    out: str = option(help="output directory")
    source: Optional[str] = option(None, flag="--from", metavar="DIR", help=(
        "summarise an earlier run's erf.csv again (no --checkpoint, no measuring)"))
    checkpoint: Optional[List[str]] = option(None, help=(
        "one or more trained ced models (a run's final/); seeds of one job "
        "(.../<job>/seed<k>/final) are pooled"))
    tasks: List[str] = option(factory=lambda: ["running_state", "kv_recall", "copy"],
                              help="synthetic tasks the prompts come from")
    examples: int = option(16, help="prompts per task")
    length: int = option(128, help="prompt length T (tokens)")
    params: str = option("{}", help=(
        'generator params per task, JSON: {"running_state": {"window_len": 24}}'))
    divergence: Optional[str] = option(None, help=(
        "an evals.divergence divergence.csv/.parquet to draw beside (optional)"))
    dtype: str = option("float64", choices=["float64", "float32"], help="the models' dtype")
    bootstrap: int = option(1000, help="bootstrap resamples")


class SettingsError(ValueError):
    """An option of ErfConfig that cannot work, named (the command line's usage error)."""


def run_config(c: ErfConfig) -> dict:
    """Measure (or, with `source`, summarise again) as `c` says; the study driver's entry
    (`experiments.job erf`). A bad option is a SettingsError naming it; a checkpoint that
    cannot be measured a ValueError or CheckpointError."""
    if c.examples < 1:
        raise SettingsError(f"--examples: must be >= 1, got {c.examples}")
    try:
        params = json.loads(c.params)
        if not isinstance(params, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise SettingsError(f"--params: {exc}") from None
    if (c.source is None) == (c.checkpoint is None):
        raise SettingsError("give either --checkpoint (measure) or --from DIR (summarise "
                            "again), not both")
    divergence = Path(c.divergence) if c.divergence else None
    if c.source is not None:
        return resummarize(Path(c.source), Path(c.out), c.bootstrap, divergence)
    return run([Path(x) for x in c.checkpoint], Path(c.out), c.tasks, c.examples, c.length,
               params, getattr(torch, c.dtype), c.bootstrap, divergence)


def main(argv: list[str] | None = None) -> int:
    p = build_parser(ErfConfig, prog="python -m evals.erf", description=__doc__.split("\n\n")[0])
    c = config_from_args(ErfConfig, p.parse_args(argv))
    try:
        run_config(c)
    except SettingsError as exc:
        p.error(str(exc))
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[erf] wrote {c.out}/erf.csv, summary.json, erf.md, erf.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
