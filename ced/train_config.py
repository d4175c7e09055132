"""The training run's configuration schema: one dataclass per Hydra config group.

`conf/train.yaml` composes the groups `model`, `data`, `optim`, `train` and `logging`; the
composed config is checked against these dataclasses by `validate`, which turns any unknown key
or invalid value into one `ConfigError` line naming the key and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import ModelConfig, parse_replay_form, replay_length
from .data import DataConfig


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


def _require(ok: bool, key: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}; got {value!r}")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr_ratio * lr`."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0
    # Encoder hold (yoco, ced): the encoder's layers and global KV sources do not learn for the
    # first `encoder_hold_steps` steps, then their learning rate ramps linearly up to the
    # schedule's over `encoder_ramp_steps`. While the encoder is still, the decoder's global
    # read learns retrieval on token-level features; an encoder learning from step 0 fills
    # RMSNorm(H_Le) with its own fast features first, and the decoder's read then stays at
    # the key-blind plateau (FINDINGS.md 0.4). No effect on variants without a decoder.
    encoder_hold_steps: int = 0
    encoder_ramp_steps: int = 0

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", "must be > 0", self.lr)
        _require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0", self.weight_decay)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"optim.{name}", "must lie in [0, 1)", value)
        _require(self.eps > 0, "optim.eps", "must be > 0", self.eps)
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", self.warmup_steps)
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must lie in [0, 1]",
                 self.min_lr_ratio)
        _require(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip",
                 "must be null (no clipping) or > 0", self.grad_clip)
        for name in ("encoder_hold_steps", "encoder_ramp_steps"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"optim.{name}", "must be an integer >= 0", value)

    def encoder_lr_factor(self, step: int) -> float:
        """Multiplier of the encoder's learning rate at `step` (0-based): 0 while held, then a
        linear ramp to 1 (docs: `encoder_hold_steps`)."""
        if step < self.encoder_hold_steps:
            return 0.0
        if self.encoder_ramp_steps == 0:
            return 1.0
        return min(1.0, (step - self.encoder_hold_steps + 1) / self.encoder_ramp_steps)


@dataclass
class ReplaySimulation:
    """Training-time replay simulation (docs/semantics.md 4.4). With probability `probability`
    a sequence gets `starts_per_sequence` replay starts s; `T - s` is exactly `length`
    (distribution=fixed) or uniform in [min_length, length] (distribution=uniform). With one
    start, T is the sequence length; with several, each start's T is a uniformly drawn prompt
    end, so the starts cut the sequence into segments. A query at i is truncated at the latest
    start s <= i, in decoder windows, and in encoder windows too when `encoder` is true.
    `length` takes every replay form (32, W, W/2, 2W, R_exact: `ced.config.parse_replay_form`);
    `TrainConfig` resolves it against the model (`resolved_length`)."""

    probability: float = 0.0
    distribution: str = "fixed"
    length: Any = 32
    min_length: int = 1
    starts_per_sequence: int = 1
    encoder: bool = False

    def __post_init__(self) -> None:
        key = "train.replay"
        _require(0 <= self.probability <= 1, f"{key}.probability", "must lie in [0, 1]",
                 self.probability)
        _require(self.distribution in ("fixed", "uniform"), f"{key}.distribution",
                 "must be 'fixed' or 'uniform'", self.distribution)
        self.length = parse_replay_form(self.length, f"{key}.length")
        _require(self.min_length >= 1, f"{key}.min_length", "must be >= 1", self.min_length)
        if isinstance(self.length, int):
            self.check_min_length(self.length)
        _require(self.starts_per_sequence >= 1, f"{key}.starts_per_sequence", "must be >= 1",
                 self.starts_per_sequence)

    def check_min_length(self, length: int) -> None:
        _require(self.min_length <= length, "train.replay.min_length",
                 f"must lie in [1, length={length}]", self.min_length)

    def resolved_length(self, model: ModelConfig) -> int:
        """`length` as a number of positions for `model` (W forms and R_exact resolved)."""
        return replay_length(model, self.length, name="train.replay.length")


@dataclass
class TrainLoopConfig:
    steps: int = 300
    batch_size: int = 16            # sequences per optimizer step, over all processes
    grad_accum: int = 1
    seq_len: int = 256
    seed: int = 0
    device: str = "auto"            # auto | cpu | cuda
    # null: whatever `accelerate launch --mixed_precision` / `accelerate config` say ("no"
    # without either); no | bf16 | fp16 force it (fp16 needs a GPU); auto: bf16 where this
    # machine computes it natively, else no (ced/train/precision.py; the demo's choice, not a
    # study's: a study's recipe names its precision)
    mixed_precision: Optional[str] = None
    eval_every: int = 100
    eval_batches: int = 2
    save_every: int = 100
    keep_last: int = 2
    resume: str = "never"           # never | auto | a checkpoint directory
    overwrite: bool = False         # replace a run already in the run directory (resume=never
                                    # or a path), or drop checkpoints newer than resume's path
    indexer_kl_weight: float = 1.0
    indexer_warmup_steps: int = 0   # read every global entry (dense) for this many steps
    threads: Optional[int] = None   # torch intra-op threads; null keeps torch's default
    progress: bool = True
    # Which next-token targets carry the loss: "all", or "answers" (the answer tokens of
    # synthetic examples only; filler and task prompts are unpredictable by design).
    loss_on: str = "all"
    # With loss_on=all: the weight of an answer token relative to any other token.
    answer_weight: float = 1.0
    replay: ReplaySimulation = field(default_factory=ReplaySimulation)
    # Document mask: every BOS in a training or validation row starts a new document that sees
    # nothing before it (CEDModel.forward(document_starts=...)), so packed examples cannot
    # see each other's facts. false: attention crosses BOS (data.examples_per_row=1 is the
    # other way to keep examples apart).
    document_mask: bool = False
    # SIGTERM / SIGINT: save a checkpoint at the next step boundary, then stop with
    # signal_exit_code (SIGTERM: 75 by default, sysexits' "try again", for a requeue) or 130
    # (SIGINT). false: the signals keep their default effect (no checkpoint).
    signal_checkpoint: bool = True
    signal_exit_code: int = 75
    # Keys a resume may change (e.g. [train.steps, data.only]); any other key that changes
    # what the run computes is refused at resume. Recorded in the run's config.yaml.
    allow_config_change: List[str] = field(default_factory=list)
    # Train on past `steps` to this step at the schedule's final learning rate (min_lr_ratio x
    # lr): the warm-up and cosine decay keep spanning `steps`, so continuing a finished run
    # (train.resume=auto train.extend_to=N) has no jump in the learning rate, which raising
    # train.steps would give (the cosine recomputed over the new total). null: stop at
    # `steps`. Not in conf/train/default.yaml, so configs that do not set it compose as before.
    extend_to: Optional[int] = None

    @property
    def last_step(self) -> int:
        """The step the run trains to: `extend_to`, or `steps`."""
        return self.extend_to if self.extend_to is not None else self.steps

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every",
                     "eval_batches", "save_every", "keep_last"):
            _require(getattr(self, name) >= 1, f"train.{name}", "must be >= 1", getattr(self, name))
        _require(self.batch_size % self.grad_accum == 0, "train.batch_size",
                 f"must be a multiple of train.grad_accum ({self.grad_accum})", self.batch_size)
        _require(self.device in ("auto", "cpu", "cuda"), "train.device",
                 "must be 'auto', 'cpu' or 'cuda'", self.device)
        _require(self.mixed_precision in (None, "no", "bf16", "fp16", "auto"),
                 "train.mixed_precision",
                 "must be null (accelerate's setting), 'no', 'bf16', 'fp16' or 'auto' (bf16 "
                 "where this machine computes it natively, else 'no')", self.mixed_precision)
        _require(self.indexer_kl_weight >= 0, "train.indexer_kl_weight", "must be >= 0",
                 self.indexer_kl_weight)
        _require(self.indexer_warmup_steps >= 0, "train.indexer_warmup_steps", "must be >= 0",
                 self.indexer_warmup_steps)
        _require(self.threads is None or self.threads >= 1, "train.threads",
                 "must be null or >= 1", self.threads)
        _require(self.loss_on in ("all", "answers"), "train.loss_on",
                 "must be 'all' or 'answers'", self.loss_on)
        _require(isinstance(self.answer_weight, (int, float)) and 0 < self.answer_weight
                 < float("inf"), "train.answer_weight", "must be a finite number > 0",
                 self.answer_weight)
        _require(isinstance(self.document_mask, bool), "train.document_mask",
                 "must be true or false", self.document_mask)
        _require(isinstance(self.signal_checkpoint, bool), "train.signal_checkpoint",
                 "must be true or false", self.signal_checkpoint)
        _require(isinstance(self.signal_exit_code, int) and 1 <= self.signal_exit_code <= 255,
                 "train.signal_exit_code", "must be an exit code in [1, 255]",
                 self.signal_exit_code)
        _require(self.extend_to is None or (isinstance(self.extend_to, int)
                                            and self.extend_to > self.steps),
                 "train.extend_to", f"must be null or an int > train.steps ({self.steps}), "
                 f"the step the schedule ends at", self.extend_to)
        _require(not (self.overwrite and self.resume == "auto"), "train.overwrite",
                 "true discards the checkpoints train.resume=auto would continue from; use one "
                 "or the other", self.overwrite)
        if isinstance(self.replay, dict):
            self.replay = ReplaySimulation(**self.replay)


@dataclass
class LoggingConfig:
    """wandb through accelerate's trackers; `mode` defaults to offline (no key, no network)."""

    wandb: bool = True
    mode: str = "offline"
    project: str = "ced"
    group: Optional[str] = None
    job_type: str = "train"
    tags: List[str] = field(default_factory=list)
    name: Optional[str] = None

    def __post_init__(self) -> None:
        _require(self.mode in ("offline", "online", "disabled"), "logging.mode",
                 "must be 'offline', 'online' or 'disabled'", self.mode)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        sim = self.train.replay
        if sim.probability > 0 and not isinstance(sim.length, int):
            # a W form or R_exact needs the model; an int was checked on its own
            sim.check_min_length(sim.resolved_length(self.model))


def _unknown_keys(node: Any, schema: Any, prefix: str) -> None:
    """Raise for the first key of `node` that the dataclass `schema` does not have."""
    if not isinstance(node, dict) or not is_dataclass(schema):
        return
    allowed = {f.name: f for f in fields(schema)}
    for key, value in node.items():
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}: unknown key; allowed keys of "
                              f"{prefix.rstrip('.') or 'the config'}: {sorted(allowed)}")
        sub = allowed[key].default_factory() if callable(allowed[key].default_factory) else None
        if is_dataclass(sub):
            _unknown_keys(value, sub, f"{prefix}{key}.")


def _non_finite(node: Any, prefix: str) -> None:
    """Raise for the first NaN or infinite number anywhere in the config: every comparison
    with NaN is false and inf passes `> 0`, so range checks alone let them through. Strings
    such as "inf" given to a float key are caught after conversion by the same walk."""
    if isinstance(node, dict):
        for key, value in node.items():
            _non_finite(value, f"{prefix}{key}.")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _non_finite(value, f"{prefix}{i}.")
    elif is_dataclass(node):
        for f in fields(node):
            _non_finite(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{prefix.rstrip('.')}: must be a finite number; got {node!r}")


def validate(cfg: DictConfig | dict) -> TrainConfig:
    """Composed config -> TrainConfig, or a one-line ConfigError naming the bad key."""
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    raw = {k: v for k, v in raw.items() if k != "hydra"}
    if isinstance(raw.get("model"), dict) and raw["model"].get("unmodelled") is not None:
        # Only the cost model's configs describe parts CEDModel does not build (MoE, mHC, ...).
        raise ConfigError("model: this config (e.g. model=deepseek_v41_flash) is for the cost "
                          "model, not for training: python -m ced.cost model=deepseek_v41_flash; "
                          "train one of model=ced|yoco|dense|swa|tiny")
    _unknown_keys(raw, TrainConfig(), "")
    _non_finite(raw, "")
    config = _build(raw)
    _non_finite(config, "")
    return config


def _build(raw: dict) -> TrainConfig:
    try:
        schema = OmegaConf.structured(TrainConfig)
        OmegaConf.set_readonly(schema.model, False)   # ModelConfig is frozen; its node need not be
        merged = OmegaConf.merge(schema, raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        reason = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {reason}") from None
    except ValueError as exc:
        message = str(exc).splitlines()[0].replace("ModelConfig.", "model.")
        raise ConfigError(message) from None


MODEL_CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"


def model_conf(name: str, directory: Path = MODEL_CONF_DIR) -> dict:
    """conf/model/<name>.yaml as a plain dict, for tools that read a model config without
    composing a training config (benchmarks, tests). A file's `defaults:` list (other files
    of conf/model, and `_self_`) is merged in order, as Hydra's `model=<name>` does, so a
    variant that is a delta on small_base.yaml reads the same both ways."""
    path = directory / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError(f"model={name}: no {path}; known: {known}")
    own = OmegaConf.load(path)
    defaults = own.pop("defaults", None) or ["_self_"]
    if "_self_" not in defaults:            # Hydra applies a file's own keys last by default
        defaults = [*defaults, "_self_"]
    merged = OmegaConf.create()
    for entry in defaults:
        if not isinstance(entry, str):
            raise ConfigError(f"model={name}: defaults entries must be names of conf/model "
                              f"files or _self_; got {entry!r}")
        merged = OmegaConf.merge(merged, own if entry == "_self_" else
                                 OmegaConf.create(model_conf(entry, directory)))
    return OmegaConf.to_container(merged, resolve=True)
