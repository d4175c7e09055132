"""How far each inference mode drifts from the exact model: `python -m evals.divergence`.

For every checkpoint, prompt length T and inference mode (bounded replay N for each configured
N, exact replay, YOCO's early exit, every multi-turn policy of docs/semantics.md 4.3, encoder
bounded replay at a prefix-cache hit, its 4.2) it compares the engine's logits with the exact
model's (the engine's full prefill, every token through every layer):

- per step g of a teacher-forced continuation (g = 0 is the first generated position): KL(exact ||
  mode), total variation, top-1 agreement, and the change in log-probability of the reference
  next token;
- under greedy generation: tokens until the mode's output first differs from the exact model's;
- for plain bounded replay: per decoder layer, the relative L2 error of the rebuilt window K/V and
  of the hidden states, by position inside the replay segment.

Outputs in the run directory: `divergence.csv` and `.parquet` (tidy: one row per checkpoint,
T, prompt, mode, metric, step / layer / offset), `summary.json` (mean and bootstrap 95% CI over
prompts), `replays.json` (per checkpoint: W, R_exact and the N each replay form resolved to,
as also printed), PNG plots, and the same tables and plots in wandb (offline by default).

    python -m evals.divergence 'checkpoints=[outputs/train/<run>/final]' 'replays=[1,8,32]'
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from ced import InferenceEngine, exact_replay_length
from ced.checkpoint import CheckpointError, load_model
from ced.cli import check_override_keys, fail
from ced.config import default_hidden_tail, describe_replays, state_replay
from ced.tracking import checkpoint_label, log_scalars, use_checkpoints
from ced.data import build_source
from ced.memory import is_out_of_memory, oom_summary
from ced.records import write_json
from ced.signals import Interrupted, StopSignals, continue_command, stop_point
from ced.train_config import ConfigError
from ced.writable import OutputDirError, check_hydra_output, check_output_dir

from .modes import Mode, mode_generate, mode_logits, named_mode

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@dataclass
class PromptConfig:
    # a conf/data name, a DataConfig mapping, or null: each checkpoint's own training data
    # (the `data` of its run's config.yaml, beside final/; conf/data/synthetic without one)
    data: Any = None
    split: str = "validation"
    count: int = 16
    start_row: int = 0


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = "offline"
    project: str = "ced"
    group: Optional[str] = "divergence"
    tags: List[str] = field(default_factory=list)


@dataclass
class DivergenceConfig:
    checkpoints: List[str] = field(default_factory=list)
    # Ints, or forms resolved per checkpoint ('W', 'W/4', '2W', 'R_exact': its own window and
    # R_exact, so that one run over models of different W reads each at its own N = W).
    replays: List[Any] = field(default_factory=lambda: [1, 4, 16, 64])
    lengths: List[int] = field(default_factory=lambda: [256])
    steps: int = 8                   # teacher-forced continuation steps G
    greedy_steps: int = 16
    policies: List[str] = field(default_factory=lambda: [
        "keep_decoder_swa", "suffix_only", "cached_hidden", "encoder_replay"])
    turn_tokens: int = 4             # m: tokens of the new turn in multi-turn modes
    turn_replay: Optional[int] = None  # N for multi-turn modes (null: the model's window)
    encoder_replays: List[Any] = field(default_factory=lambda: [8, 32, "exact"])
    layer_errors: bool = True
    bootstrap: int = 1000
    dtype: str = "float64"           # float64 makes exact modes exactly comparable
    batch_size: int = 16
    seed: int = 0
    threads: Optional[int] = None    # torch intra-op threads (null: torch's default)
    out_dir: Optional[str] = None    # default: the Hydra run directory
    prompts: PromptConfig = field(default_factory=PromptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


# ---- modes per model -------------------------------------------------------------------------

def stated_replays(cfg, c: DivergenceConfig) -> dict[str, list]:
    """How `c.replays` and `c.encoder_replays` resolve for a model with a decoder
    (`ced.config.state_replay`: W forms against its own W, capped at its exact length), as
    {"replays": [...], "encoder_replays": [...]} of `StatedReplay`s ('exact' in `replays` is
    left out: `modes_for` always adds replay=exact). A bad entry is a ValueError naming it."""
    return {"replays": [state_replay(cfg, n, name="replays") for n in c.replays
                        if n != "exact"],
            "encoder_replays": [state_replay(cfg, n, part="encoder", name="encoder_replays")
                                for n in c.encoder_replays]}


def replays_for(cfg, c: DivergenceConfig) -> list[int]:
    """The decoder replay lengths N of `c.replays` for a model (`stated_replays`), sorted,
    without duplicates."""
    return sorted({s.n for s in stated_replays(cfg, c)["replays"]})


def modes_for(cfg, c: DivergenceConfig) -> list[tuple[Mode, int]]:
    """(mode, N) pairs to compare for a model; N is the decoder replay length the mode uses."""
    if not cfg.has_decoder:
        return []
    exact = exact_replay_length(cfg)
    modes = [(named_mode(replay=n, short=True), n) for n in replays_for(cfg, c)]
    modes.append((named_mode(replay="exact", short=True), exact))
    if cfg.traits.exact_early_exit:
        modes.append((Mode("yoco_early_exit", replay=1), 1))
    turn_n = c.turn_replay or cfg.window
    for policy in c.policies:
        # Prefix-cache policies replay the encoder exactly (isolating the decoder policy),
        # except encoder_replay, whose point is to take H_{L_e} from a bounded encoder replay
        # over the N positions the decoder needs.
        encoder = turn_n if policy == "encoder_replay" else None
        modes.append((named_mode(replay=turn_n, turn=c.turn_tokens, policy=policy,
                                 encoder_replay=encoder, short=True), turn_n))
    for value in sorted({s.n for s in stated_replays(cfg, c)["encoder_replays"]}):
        # cached_hidden with exact decoder replay isolates the encoder's approximation.
        modes.append((named_mode(replay="exact", turn=c.turn_tokens, policy="cached_hidden",
                                 encoder_replay=value, short=True), exact))
    return modes


# ---- metrics -------------------------------------------------------------------------------------

def distribution_metrics(exact: torch.Tensor, approx: torch.Tensor,
                         reference: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """exact, approx: logits [B, G, V]; reference: next tokens [B, G] -> metrics [B, G]."""
    lp_e = torch.log_softmax(exact.double(), -1)
    lp_a = torch.log_softmax(approx.double(), -1)
    p_e, p_a = lp_e.exp(), lp_a.exp()
    out = {"kl": (p_e * (lp_e - lp_a)).sum(-1).clamp_min(0.0),
           "tv": 0.5 * (p_e - p_a).abs().sum(-1),
           "top1_agree": (exact.argmax(-1) == approx.argmax(-1)).double()}
    if reference is not None:
        out["delta_logp"] = (lp_a.gather(-1, reference[..., None])
                             - lp_e.gather(-1, reference[..., None]))[..., 0]
    return out


def first_disagreement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Index of the first differing token per row of two [B, S] generations (S if none)."""
    differ = a != b
    steps = torch.full((a.shape[0],), a.shape[1], dtype=torch.long)
    any_diff = differ.any(1)
    steps[any_diff] = differ.float().argmax(1)[any_diff]
    return steps


def relative_l2(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||a - e|| / ||e|| over the last dimension."""
    return (approx - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)


def layer_errors(engine: InferenceEngine, context: torch.Tensor, n_replay: int) -> list[dict]:
    """Per decoder layer and replay-segment offset: relative L2 error of hidden states and of
    the window K/V (K and V concatenated, over heads) against full prefill. Averaged over the
    batch; one dict per (layer, offset, kind)."""
    full = engine.prefill(context, record_hidden=True)
    approx = engine.prefill(context, replay=n_replay, record_hidden=True)
    t = context.shape[1]
    start = t - approx.replay
    rows = []
    for depth, layer in enumerate(sorted(engine.decoder_layers)):
        h_err = relative_l2(approx.hidden[layer], full.hidden[layer][:, start:])   # [B, N]
        for offset in range(h_err.shape[1]):
            rows.append({"layer": depth, "offset": offset, "metric": "hidden_rel_l2",
                         "value": float(h_err[:, offset].mean())})
        w_a, w_e = approx.cache.state.windows[layer], full.cache.state.windows[layer]
        if w_a is None:
            continue
        kv_a = torch.cat((w_a.k, w_a.v), -1).transpose(1, 2).flatten(2)            # [B, S, 2HDh]
        kv_e = torch.cat((w_e.k, w_e.v), -1).transpose(1, 2).flatten(2)
        index = {int(p): i for i, p in enumerate(w_e.positions)}
        for i, position in enumerate(w_a.positions.tolist()):
            err = relative_l2(kv_a[:, i], kv_e[:, index[position]])
            rows.append({"layer": depth, "offset": position - start, "metric": "kv_rel_l2",
                         "value": float(err.mean())})
    return rows


def bootstrap_ci(values: np.ndarray, resamples: int, rng: np.random.Generator):
    """Mean and percentile-bootstrap 95% interval over the first axis."""
    mean = float(values.mean())
    if len(values) < 2 or resamples < 1:
        return mean, mean, mean
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)
    return mean, float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


# ---- the run ---------------------------------------------------------------------------------------

def checkpoint_data(checkpoint: str | Path) -> Any:
    """The training data config of a checkpoint: the `data` of its run's config.yaml (the
    directory above `final/`), or "synthetic" when there is none."""
    path = Path(checkpoint).parent / "config.yaml"
    try:
        data = OmegaConf.to_container(OmegaConf.select(OmegaConf.load(path), "data"),
                                      resolve=True) if path.exists() else None
    except Exception:       # an unreadable run config: fall back, as without one
        data = None
    return data if isinstance(data, dict) else "synthetic"


def load_prompts(c: DivergenceConfig, length: int,
                 checkpoint: str | Path | None = None) -> torch.Tensor:
    """LongTensor [count, length + steps]: contexts plus their true continuations, from
    `prompts.data`, or (null) the checkpoint's own training data."""
    data = c.prompts.data if c.prompts.data is not None else (
        checkpoint_data(checkpoint) if checkpoint is not None else "synthetic")
    if isinstance(data, str):
        data = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "data" / f"{data}.yaml"))
    source = build_source(data, c.prompts.split)
    rows = source.rows(c.prompts.start_row, c.prompts.count, length + c.steps)
    return rows["input_ids"]


def run(c: DivergenceConfig, out_dir: Path) -> list[dict]:
    """Compute every row of the tidy table (and write the outputs); returns the rows."""
    dtype = _check_run(c)
    rows: list[dict] = []
    resolved: dict[str, dict] = {}     # per checkpoint, each replay form and its N
    for checkpoint in c.checkpoints:
        model = load_model(checkpoint).to(dtype)
        cfg = model.cfg
        label = checkpoint_label(checkpoint)
        if cfg.has_decoder:
            resolved[str(checkpoint)] = _state_replays(cfg, c, label)
        # The cached_hidden policy reads H_{L_e} of N - m prefix positions: keep enough.
        engine = InferenceEngine(model, hidden_tail=default_hidden_tail(
            cfg, [c.turn_replay or cfg.window,
                  *(replays_for(cfg, c) if cfg.has_decoder else [])]))
        base = {"checkpoint": str(checkpoint), "variant": cfg.variant, "window": cfg.window,
                "n_decoder_layers": cfg.n_decoder_layers, "r_exact":
                exact_replay_length(cfg) if cfg.has_decoder else None}
        modes = modes_for(cfg, c)
        if not modes:
            print(f"[divergence] {checkpoint}: variant {cfg.variant!r} has no early exit; "
                  "nothing to compare", flush=True)
            continue
        for length in c.lengths:
            if length + c.steps > cfg.max_seq_len:
                raise ValueError(f"lengths: {length} + steps {c.steps} exceeds the model's "
                                 f"max_seq_len {cfg.max_seq_len}")
            prompts = load_prompts(c, length, checkpoint)
            for b0 in range(0, len(prompts), c.batch_size):
                stop_point()        # a SIGTERM/SIGINT stops here, before anything is written
                rows += _batch_rows(c, engine, modes, prompts[b0:b0 + c.batch_size], length,
                                    b0, {**base, "T": length}, label)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "replays.json").write_text(json.dumps(resolved, indent=1))
    write_outputs(c, rows, out_dir)
    return rows


def run_config(c: DivergenceConfig) -> list[dict]:
    """`run` into the config's own `out_dir` (required here): the study driver's entry
    (`experiments.job divergence`)."""
    if not c.out_dir:
        raise ValueError("out_dir: required (the directory the outputs are written to)")
    return run(c, Path(c.out_dir))


def _check_run(c: DivergenceConfig) -> torch.dtype:
    """The config's errors before any work (every checkpoint's replay forms included, before
    hours go into the first); sets the thread count; returns the dtype."""
    if not c.checkpoints:
        raise ValueError("checkpoints: give at least one trained model directory (its final/)")
    if c.dtype not in ("float64", "float32"):
        raise ValueError(f"dtype: must be 'float64' or 'float32'; got {c.dtype!r}")
    if c.threads is not None:
        if c.threads < 1:
            raise ValueError(f"threads: must be null or an int >= 1; got {c.threads}")
        torch.set_num_threads(c.threads)
    for checkpoint in c.checkpoints:
        modes_for(load_model(checkpoint).cfg, c)     # a bad replay form fails here too
    return {"float64": torch.float64, "float32": torch.float32}[c.dtype]


def _state_replays(cfg, c: DivergenceConfig, label: str) -> dict:
    """Print each replay form of the config beside the N it resolves to for this model (and
    any warning that names R_exact); returns {W, R_exact, <key>: {form: N}} for replays.json."""
    stated = stated_replays(cfg, c)
    print(f"[divergence] {label}: W = {cfg.window}, R_exact = {exact_replay_length(cfg)}; "
          f"replays {describe_replays(stated['replays'])}; "
          f"encoder_replays {describe_replays(stated['encoder_replays'])}", flush=True)
    for key, values in stated.items():
        for s in values:
            if s.warning(key):
                print(f"[divergence] {label}: {s.warning(key)}", flush=True)
    return {"W": cfg.window, "R_exact": exact_replay_length(cfg),
            **{key: {s.form: s.n for s in values} for key, values in stated.items()}}


def _batch_rows(c: DivergenceConfig, engine, modes, batch, length: int, b0: int, base: dict,
                label: str) -> list[dict]:
    """The tidy rows of one batch of prompts: every mode against the exact model."""
    rows = []
    context, continuation = batch[:, :length], batch[:, length:]
    # The reference is the engine's full prefill, which the tests hold equal to the parallel
    # forward up to rounding: on the same kernels as the modes, a top-k near-tie that rounds
    # differently between kernels cannot pass for replay error.
    exact = mode_logits(engine, context, continuation, Mode("full"))
    exact_greedy = mode_generate(engine, context, c.greedy_steps, Mode("full"))
    for mode, n_replay in modes:
        print(f"[divergence] {label} T={length} prompts {b0}-{b0 + len(batch) - 1} "
              f"mode {mode.name}", flush=True)
        approx = mode_logits(engine, context, continuation, mode)
        metrics = distribution_metrics(exact, approx, continuation)
        greedy = first_disagreement(
            exact_greedy, mode_generate(engine, context, c.greedy_steps, mode))
        for i in range(len(batch)):
            common = {**base, "prompt": b0 + i, "mode": mode.name, "N": n_replay}
            for name, values in metrics.items():
                for step in range(values.shape[1]):
                    rows.append({**common, "metric": name, "step": step,
                                 "value": float(values[i, step])})
            rows.append({**common, "metric": "greedy_agree_tokens", "step": 0,
                         "value": float(greedy[i])})
        if c.layer_errors and mode.turn is None and mode.replay != "exact":
            for row in layer_errors(engine, context, n_replay):
                rows.append({**base, "prompt": -1, "mode": mode.name, "N": n_replay,
                             "step": 0, **row})
    return rows


def summarise(rows: list[dict], resamples: int, seed: int) -> list[dict]:
    """Mean and bootstrap CI over prompts per (checkpoint, T, mode, metric, step)."""
    rng = np.random.default_rng(seed)
    groups: dict[tuple, list[float]] = {}
    meta: dict[tuple, dict] = {}
    for row in rows:
        if row["prompt"] < 0:
            continue
        key = (row["checkpoint"], row["T"], row["mode"], row["metric"], row["step"])
        groups.setdefault(key, []).append(row["value"])
        meta[key] = {k: row[k] for k in ("checkpoint", "variant", "window", "n_decoder_layers",
                                         "r_exact", "T", "mode", "N", "metric", "step")}
    summary = []
    for key, values in groups.items():
        mean, low, high = bootstrap_ci(np.asarray(values), resamples, rng)
        summary.append({**meta[key], "mean": mean, "ci_low": low, "ci_high": high,
                        "n": len(values)})
    return summary


def write_outputs(c: DivergenceConfig, rows: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(out_dir / "divergence.csv", index=False)
    table.astype({"N": "int64"}).to_parquet(out_dir / "divergence.parquet", index=False)
    summary = summarise(rows, c.bootstrap, c.seed)
    write_json(out_dir / "summary.json", summary)   # the driver's "done" mark: never torn
    plots = plot(table, summary, out_dir)
    if c.wandb.enabled:
        # lazy: wandb costs ~0.4 s to import, and only a run with wandb enabled needs it
        import wandb
        run = wandb.init(project=c.wandb.project, group=c.wandb.group, job_type="divergence",
                         tags=list(c.wandb.tags), mode=c.wandb.mode, dir=str(out_dir),
                         config=asdict(c))
        use_checkpoints(run, c.checkpoints)
        run.log({"summary": wandb.Table(dataframe=pd.DataFrame(summary)),
                 **{f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}})
        log_scalars(run, divergence_scalars(summary))
        run.finish()
    print(f"[divergence] wrote {out_dir}/divergence.csv, summary.json and {len(plots)} plots",
          flush=True)


def divergence_scalars(summary: list[dict]) -> dict[str, float]:
    """Mean KL(exact || mode) and top-1 agreement at the first generated token, per checkpoint,
    prompt length and mode, as flat scalars (`kl/<run>/T=<T>/replay=<N>`) for dashboards."""
    out, labels = {}, {}        # a checkpoint's label reads its run's record: once each
    for row in summary:
        if row["step"] != 0 or row["metric"] not in ("kl", "top1_agree"):
            continue
        label = labels.setdefault(row["checkpoint"], checkpoint_label(row["checkpoint"]))
        out[f"{row['metric']}/{label}/T={row['T']}/"
            f"{row['mode']}"] = row["mean"]
    return out


def plot(table, summary: list[dict], out_dir: Path) -> list[Path]:
    """Write the run's figures (evals.plots): KL and top-1 agreement at the first generated
    position against N (`kl_vs_replay.png`, `top1_agree_vs_replay.png`) and the per-layer error
    by offset inside the replay segment (`layer_error_by_offset.png`)."""
    # lazy: evals.plots loads matplotlib (~0.6 s); the readers of divergence_scalars and
    # checkpoint_data (analysis.report, evals.real_text) draw nothing
    from . import plots
    figures = [(plots.divergence_figure(summary, metrics=(metric,), title=None),
                f"{metric}_vs_replay.png") for metric in plots.DIVERGENCE_METRICS]
    figures.append((plots.layer_error_figure(table), "layer_error_by_offset.png"))
    return [plots.save(fig, out_dir / name, dpi=120) for fig, name in figures
            if fig is not None]


# ---- entry point ---------------------------------------------------------------------------------

def _hydra_task(cfg) -> None:
    # lazy: Hydra costs ~0.2 s to import; only a run inside the Hydra app calls this
    from hydra.core.hydra_config import HydraConfig
    try:
        schema = OmegaConf.structured(DivergenceConfig)
        config: DivergenceConfig = OmegaConf.to_object(OmegaConf.merge(
            schema, {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"}))
    except Exception as exc:  # omegaconf's exceptions carry the key; keep the first line
        key = getattr(exc, "full_key", None)
        fail(f"config error: {key + ': ' if key else ''}{str(exc).splitlines()[0]}", 2)
    out_dir = Path(config.out_dir or HydraConfig.get().runtime.output_dir)
    try:
        check_output_dir(out_dir, "out_dir")
        with StopSignals():
            run(config, out_dir)
    except Interrupted as exc:
        fail(f"evals.divergence {exc} at a batch boundary; nothing was written to {out_dir}; "
             f"to continue, run again: {continue_command()}", exc.code)
    except CheckpointError as exc:
        fail(f"error: {exc}", 2)
    except ValueError as exc:
        fail(f"config error: {str(exc).splitlines()[0]}", 2)
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        fail(f"evals.divergence stopped: out of memory ({oom_summary(exc)}); nothing was "
             f"written to {out_dir}; lower batch_size (prompts per batch) or lengths", 75)


def main() -> None:
    # Offline Hugging Face libraries unless the environment chose otherwise: a hub dataset name
    # in prompts.data then fails at once instead of after half a minute of retries.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:     # Hydra's own message for a bad override spans several lines and exits 1
        check_override_keys(sys.argv[1:], DivergenceConfig())
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    # lazy: Hydra costs ~0.2 s to import; only running the command needs it
    import hydra
    try:      # before Hydra creates its run directory and opens its log file there
        check_hydra_output(sys.argv[1:], Path(CONF_DIR) / "divergence.yaml")
        for item in sys.argv[1:]:
            if item.split("=", 1)[0].lstrip("+") == "out_dir" and "=" in item:
                check_output_dir(item.split("=", 1)[1], "out_dir")
    except OutputDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="divergence")(_hydra_task)()


if __name__ == "__main__":
    main()
