"""Training: `train(config, run_dir)` trains one model into its run directory. The command line
(`python -m ced.train`, `ced-train`: Hydra config root `conf/`) lives in ced/cli/train.py.

    python -m ced.train model=ced data=synthetic train.steps=500
    python -m ced.train -m model=ced,yoco train.replay.probability=0,0.5     # a sweep
    accelerate launch --cpu --num_processes 2 -m ced.train ...               # DDP over gloo

Each run writes into its Hydra output directory: `config.yaml` (resolved), `metrics.jsonl`,
`checkpoints/step_XXXXXXXX/` (accelerate's state: safetensors weights, optimizer, RNG; plus
`trainer_state.json` with the step, which fixes the data position and the learning rate), and
`final/` (model.safetensors + config.json, see `ced.checkpoint.load_model`).

Nothing is lost or silently wrong: a directory that already holds a run is refused unless the
run continues it (`train.resume=auto`) or replaces it (`train.overwrite=true`); every file a
resume depends on is checked before anything is written, and `resume=auto` falls back, with a
warning, past damaged checkpoints to the newest intact one; weights are checked finite before
every save; the Hugging Face libraries run offline unless the environment says otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from ..checkpoint import TRAINER_STATE, CheckpointError, read_json, remove_orphans, save_model
from ..config import ModelConfig
from ..data import ByteTokenizer, answer_accuracy, build_source
from ..attention import current_attention_kernel
from ..memory import check_static, check_training_memory
from ..model import CEDModel
from ..runlock import DirectoryLocked, directory_lock
from ..signals import StopSignals
from ..tracking import log_model_artifact, new_run_id
from ..train_config import ConfigError, OptimConfig, ReplaySimulation, TrainConfig
from .precision import bf16_cpu_warning, bf16_matmul_slowdown
from .run_dir import (CHECKPOINTS, CONFIG_CHANGES, CONFIG_YAML, METRICS, RunPlan,
                      TrainingDiverged, broadcast, check_finite, checkpoint_dirs, config_changes,
                      discard_run, flatten, last_good_checkpoint, plan_run, save_checkpoint)

# Exit codes of `python -m ced.train`: 0 done, 2 refused (config, checkpoint), 3 diverged,
# NOT_FINISHED: stopped before the last step with everything written so far intact (a full
# disk, a pre-emption signal); run the printed resume command to continue. 75 is sysexits'
# EX_TEMPFAIL ("temporary failure, try again"), which schedulers and wrappers can requeue on.
NOT_FINISHED = 75


# ---- replay simulation (docs/semantics.md section 4.4) ---------------------------------------

def sample_replay_starts(sim: ReplaySimulation, row_ids: torch.Tensor, seq_len: int,
                         seed: int, model: ModelConfig | None = None) -> torch.Tensor | None:
    """Replay starts LongTensor[B, K] for the rows `row_ids` [B] (global row indices, so the
    draw does not depend on how rows are split over processes); 0 means no truncation.
    Returns None when the simulation is off. `model` resolves a length written as a form
    (train.replay.length=W); an int length needs none."""
    if sim.probability <= 0:
        return None
    longest = sim.length if isinstance(sim.length, int) else sim.resolved_length(model)
    starts = torch.zeros(len(row_ids), sim.starts_per_sequence, dtype=torch.long)
    for b, row in enumerate(row_ids.tolist()):
        rng = random.Random(f"replay:{seed}:{row}")
        if rng.random() >= sim.probability:
            continue
        for k in range(sim.starts_per_sequence):
            prompt_end = seq_len if sim.starts_per_sequence == 1 else rng.randint(1, seq_len)
            length = (longest if sim.distribution == "fixed"
                      else rng.randint(sim.min_length, longest))
            starts[b, k] = max(prompt_end - length, 0)
    return starts


# ---- loss weights ------------------------------------------------------------------------------

def document_starts(input_ids: torch.Tensor, enabled: bool) -> torch.Tensor | None:
    """The document mask's starts of rows [B, T]: each row's BOS positions, LongTensor[B, K]
    (K the most BOS in a row; shorter rows padded with 0, a start that truncates nothing), or
    None when train.document_mask is off."""
    if not enabled:
        return None
    is_bos = input_ids == ByteTokenizer.bos
    k = max(1, int(is_bos.sum(-1).max())) if input_ids.numel() else 1
    positions = torch.where(is_bos, torch.arange(input_ids.shape[1]), input_ids.shape[1])
    starts = positions.sort(dim=-1).values[:, :k]
    return torch.where(starts < input_ids.shape[1], starts, 0)


def token_weights(batch: dict, loss_on: str, answer_weight: float) -> torch.Tensor:
    """Per-target loss weight FloatTensor[B, T]: 0 where there is no target (label -100);
    loss_on="answers": 1 on the answer tokens of synthetic examples, 0 elsewhere;
    loss_on="all": `answer_weight` on answer tokens, 1 on every other target."""
    has_target = batch["labels"] != -100
    answer = batch["answer_mask"] & has_target
    if loss_on == "answers":
        return answer.float()
    return torch.where(answer, float(answer_weight), has_target.float())


# ---- schedule ----------------------------------------------------------------------------------

def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---- evaluation --------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, source, cfg: TrainConfig, accelerator) -> dict[str, float]:
    """Validation loss, and per-family exact-match accuracy of whole answers (teacher-forced)
    on the first `eval_batches` validation batches."""
    model.eval()
    t = cfg.train
    total_loss, total_tokens = 0.0, 0
    answer_loss, answer_tokens = 0.0, 0
    hits: dict[str, list[float]] = {}
    for i in range(t.eval_batches):
        batch = source.rows(i * t.batch_size, t.batch_size, t.seq_len)
        labels = batch["labels"].to(accelerator.device)
        docs = document_starts(batch["input_ids"], t.document_mask)
        with accelerator.autocast():
            logits = model(batch["input_ids"].to(accelerator.device),
                           document_starts=None if docs is None else docs.to(accelerator.device))
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                    ignore_index=-100, reduction="none")
        total_loss += per_token.sum().item()
        total_tokens += int((labels != -100).sum())
        answers = (batch["answer_mask"] & (batch["labels"] != -100)).flatten()
        answer_loss += per_token[answers.to(per_token.device)].sum().item()
        answer_tokens += int(answers.sum())
        scores = answer_accuracy(logits.argmax(-1).cpu(), batch, source.families)
        for family, score in scores.items():
            done = hits.setdefault(family, [0.0, 0])
            done[0] += score["exact_match"] * score["examples"]
            done[1] += score["examples"]
    model.train()
    metrics = {"val/loss": total_loss / max(total_tokens, 1)}
    if answer_tokens:
        metrics["val/answer_loss"] = answer_loss / answer_tokens
    for family, (correct, examples) in sorted(hits.items()):
        metrics[f"val/acc/{family}"] = correct / examples
    return metrics


# ---- the run -------------------------------------------------------------------------------------

def make_accelerator(cfg: TrainConfig, run_dir: Path):
    # lazy: accelerate costs ~0.1 s to import; the readers of a run directory (analysis/,
    # experiments/) import this package and never start a run
    from accelerate import Accelerator
    t = cfg.train
    cpu = t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available())
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but no GPU is available; use 'auto' "
                          "or 'cpu'")
    # None lets accelerate read `accelerate launch --mixed_precision` / `accelerate config`
    # (ACCELERATE_MIXED_PRECISION); the fp16-on-CPU check looks at what it will read.
    precision = t.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")
    if cpu and precision == "fp16":
        raise ConfigError("train.mixed_precision: fp16 does nothing on CPU (accelerate ignores "
                          "it silently); use 'bf16' or 'no'")
    chosen = t.mixed_precision
    if precision == "auto":
        chosen = auto_precision(cpu)
    elif cpu and precision == "bf16":
        warning = bf16_cpu_warning(bf16_matmul_slowdown())
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return Accelerator(cpu=cpu, mixed_precision=chosen,
                       gradient_accumulation_steps=t.grad_accum,
                       log_with="wandb" if cfg.logging.wandb else None,
                       project_dir=str(run_dir))


def auto_precision(cpu: bool) -> str:
    """What `train.mixed_precision=auto` trains in: "bf16" where this machine computes it
    natively (a GPU that supports it; a CPU whose bf16 matmul is at most EMULATED_SLOWDOWN
    times slower than fp32's, `bf16_matmul_slowdown`), else "no" (fp32). Says which on stderr:
    the run's config records "auto", each line of its metrics.jsonl what it resolved to
    (`bf16`: 1 or 0)."""
    if cpu:
        slowdown = bf16_matmul_slowdown()
        chosen = "no" if bf16_cpu_warning(slowdown) else "bf16"
        why = f"a bf16 matmul is {slowdown:.1f}x an fp32 one on this CPU"
    else:
        chosen = "bf16" if torch.cuda.is_bf16_supported() else "no"
        why = "this GPU " + ("supports" if chosen == "bf16" else "does not support") + " bf16"
    print(f"train.mixed_precision=auto: {'bf16' if chosen == 'bf16' else 'fp32'} ({why})",
          file=sys.stderr, flush=True)
    return chosen


def train(cfg: TrainConfig, run_dir: Path) -> dict:
    """Run one training job into `run_dir`; returns the last logged metrics. The main process
    holds the run directory's lock (`ced.runlock`) throughout: a second writer is refused."""
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    # accelerate logs four INFO lines per checkpoint about its temporary files
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    accelerator = make_accelerator(cfg, run_dir)
    run_dir = Path(broadcast(accelerator, str(run_dir)))
    try:
        with ExitStack() as lock:
            _on_main(accelerator, lambda: lock.enter_context(directory_lock(run_dir)))
            with _Signals(t.signal_checkpoint) as signals:
                return _train(cfg, run_dir, accelerator, signals)
    finally:
        accelerator.end_training()
        _reset_accelerate()


class Stopped(RuntimeError):
    """SIGTERM or SIGINT stopped the run at a step boundary, after its checkpoint was saved;
    the message is one line with the signal and the step (the command line adds the checkpoint
    and how to resume: `ced.cli.train.resume_hint`)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class _Signals(StopSignals):
    """SIGTERM (what SLURM and Kubernetes send before a kill) and SIGINT (Ctrl-C) set a flag
    that the loop reads at the next step boundary, where it saves a checkpoint and stops
    (`train.signal_checkpoint`; false: the signals keep their default effect). A second SIGINT
    interrupts at once (`ced.signals.StopSignals`)."""

    DOING = "saving a checkpoint at the end of this step"


def _reset_accelerate() -> None:
    """accelerate keeps process-wide singletons; a Hydra multirun in one process needs each
    job to start clean."""
    # lazy: accelerate costs ~0.1 s to import, needed only once a run starts
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@dataclass
class _Run:
    """The live objects of one training run, shared by the pieces of the loop in `_train`.
    trainer_state: what every checkpoint carries beside the step (the wandb run id); it is
    filled in by the resume and by `_init_wandb`, and is the one dict every save writes."""

    cfg: TrainConfig
    run_dir: Path
    accelerator: Any
    model: Any
    optimizer: Any
    train_source: Any
    val_source: Any
    per_micro: int
    per_rank: int
    trainer_state: dict = field(default_factory=dict)

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / METRICS


def _train(cfg: TrainConfig, run_dir: Path, accelerator, signals: _Signals | None = None) -> dict:
    """Set the run up, take the steps, finish; returns the last logged metrics.

    The pieces run every operation and every random draw in the order of the single function
    they were split from, which the bitwise reproducibility and resume tests depend on
    (tests/integration/test_train.py, test_run_safety.py)."""
    t = cfg.train
    per_micro, per_rank = _rows_per_micro_batch(cfg, accelerator.num_processes)
    model, optimizer, train_source, val_source = _build_model_and_data(cfg, accelerator)
    # Nothing is written into the run directory until the plan (and every file it relies on)
    # is checked: a refused or failed start leaves an earlier run exactly as it was.
    plan = _on_main(accelerator, lambda: plan_run(t, run_dir, accelerator.unwrap_model(model)))
    if plan.resume_from is not None and run_dir.resolve() in plan.resume_from.resolve().parents:
        plan.changes = _on_main(accelerator, lambda: config_changes(cfg, run_dir))
    run = _Run(cfg, run_dir, accelerator, model, optimizer, train_source, val_source,
               per_micro, per_rank, _load_resume_state(accelerator, plan, run_dir))
    _prepare_run_dir(run, plan)
    progress = _Progress(t.last_step, plan.start_step,
                         enabled=t.progress and accelerator.is_main_process)
    last: dict = {}
    model.train()
    for step in range(plan.start_step, t.last_step):
        last = _train_step(run, step)
        _record_step(run, step, last, progress)
        received = broadcast(accelerator, signals.received if signals else None)
        if received and step + 1 < t.last_step:
            progress.close()
            _stop_on_signal(run, step + 1, received)
    progress.close()
    _finish_run(run, last)
    return last


# ---- setting a run up --------------------------------------------------------------------------

def _rows_per_micro_batch(cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(rows per micro-batch over all processes, rows per micro-batch on one process), after
    checking that the batch splits evenly and fits the model's context."""
    t = cfg.train
    per_micro = t.batch_size // t.grad_accum
    if per_micro % world:
        raise ConfigError(f"train.batch_size: {t.batch_size} / grad_accum {t.grad_accum} must be "
                          f"divisible by the number of processes ({world})")
    per_rank = per_micro // world
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len: must be <= model.max_seq_len "
                          f"({cfg.model.max_seq_len}); got {t.seq_len}")
    return per_micro, per_rank


def param_groups(model: CEDModel, o: OptimConfig) -> list[dict]:
    """AdamW's parameter groups: matrices decay, vectors (norms, sinks, token-mixing weights)
    do not; the encoder's parameters (`CEDModel.encoder_parameters`) form groups of their own
    (`"encoder": True`) so that `optim.encoder_hold_steps` can hold them still. Groups left
    empty are dropped; the parameter order within the model is kept."""
    encoder = {id(p) for p in model.encoder_parameters()}
    groups = []
    for in_encoder in (False, True):
        for decays in (True, False):
            params = [p for p in model.parameters()
                      if (id(p) in encoder) == in_encoder and (p.dim() >= 2) == decays]
            if params:
                groups.append({"params": params, "encoder": in_encoder,
                               "weight_decay": o.weight_decay if decays else 0.0})
    return groups


def _build_model_and_data(cfg: TrainConfig, accelerator):
    """The seeded model, its AdamW optimizer (both prepared by accelerate), and the training
    and validation sources: (model, optimizer, train_source, val_source). The seed is set
    first, so the initial weights depend on train.seed alone."""
    # lazy: accelerate costs ~0.1 s to import, needed only once a run starts
    from accelerate.utils import set_seed
    t = cfg.train
    set_seed(t.seed)
    # memory before allocation: the parameter-sized state from the config before the model
    # exists; the activations (a one-row probe of the built model) once the data is known good
    check_static(cfg, accelerator.device)
    model = CEDModel(cfg.model)
    try:
        train_source = build_source(cfg.data, "train")
        val_source = build_source(cfg.data, "validation")
        train_source.rows(0, 1, t.seq_len)   # data errors (a task longer than seq_len, a
        val_source.rows(0, 1, t.seq_len)     # missing file) surface now, as config errors
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if cfg.model.vocab_size < 259:
        raise ConfigError(f"model.vocab_size: the byte tokenizer needs >= 259; got "
                          f"{cfg.model.vocab_size}")
    check_training_memory(cfg, model, accelerator.num_processes, accelerator.device)
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2),
                                  eps=o.eps)
    # The learning rate is a pure function of the step (set in `_train_step`), so there is no
    # scheduler state to save, and none of accelerate's per-process scheduler stepping to
    # account for.
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, train_source, val_source


def _load_resume_state(accelerator, plan: RunPlan, run_dir: Path) -> dict:
    """Load the plan's checkpoint, if any, into the prepared model, optimizer and RNGs; returns
    the trainer state the run carries on with (the wandb run id of a checkpoint of this run
    directory, else nothing)."""
    if plan.resume_from is None:
        return {}
    try:
        accelerator.load_state(str(plan.resume_from))
    except Exception as exc:   # what the check cannot see, e.g. a damaged RNG state file
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{plan.resume_from}: cannot be loaded ({type(exc).__name__}: "
                              f"{reason})") from None
    # The wandb run id travels with the checkpoint, so a resumed run continues the same
    # wandb run instead of starting a second one (plan_run has checked this file). A
    # checkpoint of another run directory starts a new wandb run: its history is not ours.
    if run_dir.resolve() in plan.resume_from.resolve().parents:
        saved = read_json(plan.resume_from / TRAINER_STATE)
        return {k: v for k, v in saved.items() if k in ("wandb_run_id", "config_changes")}
    return {}


def _prepare_run_dir(run: _Run, plan: RunPlan) -> None:
    """Carry the checked plan out on the main process: print its warnings, clear what it
    discards, deletes or sets aside, remove leftovers of interrupted saves, write the config and
    the kept metrics, and start (or continue) the wandb run."""
    accelerator, cfg, run_dir = run.accelerator, run.cfg, run.run_dir
    if not accelerator.is_main_process:
        return
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    if plan.discard:
        discard_run(run_dir)
    for path in plan.delete:
        shutil.rmtree(path)
    for path in plan.set_aside:
        aside = path.with_name(f".damaged-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)   # an older copy set aside before
        path.rename(aside)
    for orphan in remove_orphans(run_dir) + remove_orphans(run_dir / CHECKPOINTS):
        print(f"warning: removed {orphan}, left by an interrupted save", file=sys.stderr)
    if plan.changes:
        record = {"step": plan.start_step, "changed": plan.changes,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(run_dir / CONFIG_CHANGES, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        run.trainer_state.setdefault("config_changes", []).append(record)
        print(f"warning: resuming at step {plan.start_step} with changed config (allowed by "
              f"train.allow_config_change or train.extend_to): " + ", ".join(
                  f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in plan.changes.items())
              + f"; recorded in {run_dir / CONFIG_CHANGES}", file=sys.stderr)
    _write_config(run_dir / CONFIG_YAML, cfg)
    _state_replay_simulation(run)
    _state_extension(run)
    run.metrics_file.write_text("".join(line + "\n" for line in plan.metrics))
    if plan.resume_from is not None:
        print(f"resumed from {plan.resume_from} at step {plan.start_step}")
    if cfg.logging.wandb:
        _init_wandb(accelerator, cfg, run_dir, run.trainer_state)


def _state_replay_simulation(run: _Run) -> None:
    """Say the replay simulation's length form beside its N ('train.replay.length W/2 -> 4'),
    and record both in the trainer state every checkpoint saves (config.yaml keeps the form
    as written). Not capped at R_exact as the evaluations' replays are: a simulated replay
    start changes training at every length (docs/semantics.md 4.4)."""
    sim, model = run.cfg.train.replay, run.cfg.model
    if sim.probability == 0:
        return
    n = sim.resolved_length(model)
    said = str(sim.length) if str(sim.length) == str(n) else f"{sim.length} -> {n}"
    print(f"replay simulation: train.replay.length {said} (W = {model.window}), probability "
          f"{sim.probability}", flush=True)
    run.trainer_state["replay_simulation"] = {"length": str(sim.length), "N": n}


def _state_extension(run: _Run) -> None:
    """train.extend_to: say what it does to the learning rate, since a run extended by raising
    train.steps instead would jump up the recomputed cosine."""
    t, o = run.cfg.train, run.cfg.optim
    if t.extend_to is None:
        return
    print(f"train.extend_to={t.extend_to}: steps {t.steps + 1}-{t.extend_to} run at the "
          f"schedule's final learning rate {o.lr * o.min_lr_ratio:.3g} (optim.min_lr_ratio "
          f"{o.min_lr_ratio} x optim.lr {o.lr:.3g}); the warm-up and cosine decay keep "
          f"spanning steps 1-{t.steps}, so the rate does not jump", flush=True)


# ---- one step ----------------------------------------------------------------------------------

def _train_step(run: _Run, step: int) -> dict:
    """Set the step's learning rate, draw its batches, take one optimizer step over them;
    returns the step's metrics (the loss averaged over every loss-bearing token of the step on
    every process). Raises TrainingDiverged on a non-finite loss."""
    t, o, accelerator = run.cfg.train, run.cfg.optim, run.accelerator
    started = time.perf_counter()
    lr = o.lr * lr_factor(step, o.warmup_steps, t.steps, o.min_lr_ratio)
    encoder_lr = lr * o.encoder_lr_factor(step)
    for group in run.optimizer.param_groups:
        group["lr"] = encoder_lr if group["encoder"] else lr
    micro_batches = _micro_batches(run, step)
    global_tokens = _global_loss_tokens(run, micro_batches)
    step_loss, step_kl = _accumulate_gradients(run, micro_batches, global_tokens,
                                               dense_read=step < t.indexer_warmup_steps)
    total = accelerator.reduce(torch.stack([step_loss, step_kl]), reduction="sum")
    loss_value = total[0].item() / max(global_tokens, 1e-12)
    kl_value = total[1].item() / accelerator.num_processes
    if not math.isfinite(loss_value):
        good = last_good_checkpoint(run.run_dir, accelerator.unwrap_model(run.model))
        raise TrainingDiverged(f"non-finite training loss ({loss_value}) at step {step + 1}; "
                               f"the last good checkpoint is {good}")
    elapsed = time.perf_counter() - started
    return {"step": step + 1, "loss": loss_value, "indexer_kl": kl_value, "lr": lr,
            "processes": accelerator.num_processes,
            # what the step computed in (1: bf16 autocast), whatever train.mixed_precision said
            # (null and auto are resolved by accelerate and `auto_precision`)
            "bf16": int(accelerator.mixed_precision == "bf16"),
            "tokens_per_s": run.per_micro * t.grad_accum * t.seq_len / elapsed}


def _micro_batches(run: _Run, step: int) -> list[dict]:
    """This process's rows of every micro-batch of the step, each with its replay starts and
    loss weights. Row ids are global, so the data and the replay starts do not depend on the
    process count."""
    t = run.cfg.train
    micro_batches = []
    for micro in range(t.grad_accum):
        first = (step * t.batch_size + micro * run.per_micro
                 + run.accelerator.process_index * run.per_rank)
        batch = run.train_source.rows(first, run.per_rank, t.seq_len)
        batch["replay_starts"] = sample_replay_starts(
            t.replay, torch.arange(first, first + run.per_rank), t.seq_len, t.seed,
            run.cfg.model)
        micro_batches.append(batch)
    for batch in micro_batches:
        batch["weights"] = token_weights(batch, t.loss_on, t.answer_weight)
    return micro_batches


def _global_loss_tokens(run: _Run, micro_batches: list[dict]) -> float:
    """The loss-bearing tokens (summed weights) of the whole step over every process: the loss
    is normalised by it, so the gradient is the same whatever the process count and
    accumulation split."""
    accelerator, t = run.accelerator, run.cfg.train
    local_tokens = sum(float(b["weights"].sum()) for b in micro_batches)
    global_tokens = float(accelerator.reduce(
        torch.tensor(local_tokens, device=accelerator.device), reduction="sum"))
    if global_tokens <= 0 and t.loss_on == "answers":
        raise ConfigError("train.loss_on: 'answers' but a training step has no answer "
                          "tokens (only synthetic tasks mark answers); use 'all'")
    return global_tokens


def _accumulate_gradients(run: _Run, micro_batches: list[dict], global_tokens: float,
                          dense_read: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over the micro-batches under accelerate's accumulation, stepping
    the optimizer when it syncs; returns this process's summed weighted token loss and its mean
    indexer KL, both detached. dense_read: the indexer warm-up (global read over every entry)."""
    cfg, accelerator, model, optimizer = run.cfg, run.accelerator, run.model, run.optimizer
    t, o = cfg.train, cfg.optim
    step_loss = torch.zeros((), device=accelerator.device)
    step_kl = torch.zeros((), device=accelerator.device)
    for batch in micro_batches:
        ids = batch["input_ids"].to(accelerator.device)
        labels = batch["labels"].to(accelerator.device)
        weights = batch["weights"].to(accelerator.device)
        starts = batch["replay_starts"]
        starts = None if starts is None else starts.to(accelerator.device)
        docs = document_starts(batch["input_ids"], t.document_mask)
        docs = None if docs is None else docs.to(accelerator.device)
        with accelerator.accumulate(model):
            with accelerator.autocast():
                logits, aux = model(
                    ids, decoder_replay_start=starts if cfg.model.has_decoder else None,
                    encoder_replay_start=starts if t.replay.encoder else None,
                    return_aux=True, dense_global_read=dense_read, document_starts=docs)
            token_loss = (F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                          ignore_index=-100, reduction="none")
                          * weights.flatten()).sum()
            # accelerate divides by grad_accum and DDP averages over processes: undo both.
            scale = accelerator.num_processes * t.grad_accum / max(global_tokens, 1e-12)
            accelerator.backward(token_loss * scale
                                 + t.indexer_kl_weight * aux["indexer_kl"])
            if accelerator.sync_gradients and o.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), o.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_loss += token_loss.detach()
        step_kl += aux["indexer_kl"].detach().float() / t.grad_accum
    return step_loss, step_kl


# ---- after each step, and at the end -----------------------------------------------------------

def _record_step(run: _Run, step: int, last: dict, progress: _Progress) -> None:
    """Evaluate when due (adding the validation metrics to `last`), append `last` to
    metrics.jsonl and wandb, show progress, and save a checkpoint (weights checked finite
    first) when due."""
    cfg, accelerator, t = run.cfg, run.accelerator, run.cfg.train
    if (step + 1) % t.eval_every == 0 or step + 1 == t.last_step:
        last.update(evaluate(run.model, run.val_source, cfg, accelerator))
    if accelerator.is_main_process:
        with open(run.metrics_file, "a") as handle:
            handle.write(json.dumps(last) + "\n")
        if cfg.logging.wandb:
            accelerator.log({k: v for k, v in last.items() if k != "step"}, step=step + 1)
    progress.update(last)
    if (step + 1) % t.save_every == 0 or step + 1 == t.last_step:
        check_finite(accelerator, run.model, run.optimizer, step + 1, run.run_dir)
        save_checkpoint(accelerator, run.model, run.run_dir, step + 1, t.keep_last,
                        run.trainer_state)


def _stop_on_signal(run: _Run, step: int, received: str) -> None:
    """Save a checkpoint at `step` (unless one was just saved), mark the wandb run as not
    finished, and raise Stopped with the exit code: `train.signal_exit_code` for SIGTERM (a
    pre-emption: requeue), 130 for SIGINT (the shell's code for Ctrl-C)."""
    t, accelerator = run.cfg.train, run.accelerator
    saved = checkpoint_dirs(run.run_dir)
    if not saved or saved[-1].name != f"step_{step:08d}":
        check_finite(accelerator, run.model, run.optimizer, step, run.run_dir)
        save_checkpoint(accelerator, run.model, run.run_dir, step, t.keep_last,
                        run.trainer_state)
    code = t.signal_exit_code if received == "SIGTERM" else 130
    if run.cfg.logging.wandb and accelerator.is_main_process:
        tracker = accelerator.get_tracker("wandb", unwrap=True)
        if received == "SIGTERM" and hasattr(tracker, "mark_preempting"):
            tracker.mark_preempting()
        tracker.finish(exit_code=code)    # a stopped run is not "finished" on the dashboard
    raise Stopped(f"training stopped by {received} at step {step} of {t.last_step}", code)


def _finish_run(run: _Run, last: dict) -> None:
    """Save the final model (and, with wandb, log it as an artifact with the last validation
    metrics) on the main process, then wait for every process."""
    accelerator, cfg = run.accelerator, run.cfg
    if accelerator.is_main_process:
        save_model(accelerator.unwrap_model(run.model), run.run_dir / "final")
        if cfg.logging.wandb:
            log_model_artifact(accelerator.get_tracker("wandb", unwrap=True),
                               run.run_dir / "final",
                               metadata={"step": cfg.train.last_step,
                                         **{k: v for k, v in last.items()
                                            if k.startswith("val/")}})
    accelerator.wait_for_everyone()


def _init_wandb(accelerator, cfg: TrainConfig, run_dir: Path, trainer_state: dict) -> None:
    """Start (or, with an id from a resumed checkpoint, continue) the wandb run, with the full
    config; the id is put into `trainer_state` so that every checkpoint carries it."""
    log = cfg.logging
    run_id = trainer_state.get("wandb_run_id") or new_run_id()
    trainer_state["wandb_run_id"] = run_id
    # The effective precision and process count: the config may leave them to accelerate.
    # The attention kernel is process state, not config (both kernels give the same result up
    # to rounding, so it stays out of the config hashes), but it changes summation order.
    config = {**flatten(asdict(cfg)), "accelerate.mixed_precision": accelerator.mixed_precision,
              "accelerate.num_processes": accelerator.num_processes,
              "attention_kernel": current_attention_kernel(),
              "resume.config_changes": json.dumps(trainer_state.get("config_changes", []))}
    accelerator.init_trackers(log.project, config=config, init_kwargs={
        "wandb": {"mode": log.mode, "group": log.group, "job_type": log.job_type,
                  "tags": list(log.tags), "name": log.name, "dir": str(run_dir),
                  "id": run_id, "resume": "allow"}})
    run = accelerator.get_tracker("wandb", unwrap=True)
    # The dashboard's summary shows the best validation loss, not the last one.
    run.define_metric("val/loss", summary="min")


def _write_config(path: Path, cfg: TrainConfig) -> None:
    """The resolved config as YAML, written atomically (a crash leaves the old file or the new)."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    os.replace(tmp, path)


def _on_main(accelerator, decide):
    """Run `decide` on the main process and hand its result, or its one-line error, to every
    process, so that all of them go on or all stop with the same message."""
    refusals = {cls.__name__: cls for cls in (ConfigError, CheckpointError, DirectoryLocked)}
    outcome = None
    if accelerator.is_main_process:
        try:
            outcome = ("ok", decide())
        except tuple(refusals.values()) as exc:
            outcome = (type(exc).__name__, str(exc))
    outcome = broadcast(accelerator, outcome)
    if outcome[0] == "ok":
        return outcome[1]
    raise refusals.get(outcome[0], CheckpointError)(outcome[1])



class _Progress:
    """A tqdm bar with step, loss, tokens/s and ETA (ETA from tqdm's own rate)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True,
                            mininterval=1.0, file=sys.stdout)

    def update(self, metrics: dict) -> None:
        if self.bar is not None:
            shown = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics['tokens_per_s']:.0f}"}
            if "val/loss" in metrics:
                shown["val"] = f"{metrics['val/loss']:.4f}"
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- overrides ------------------------------------------------------------------------------

def override_key(item: str) -> str:
    """The key of a command-line override: `+a.b=1`, `~a.b` -> `a.b`."""
    return item.split("=", 1)[0].lstrip("+~")
