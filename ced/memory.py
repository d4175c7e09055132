"""How much memory a training run needs, checked before it allocates it.

A training step holds the weights, their gradients and AdamW's two moments (16 bytes a
parameter in fp32; the parameters stay fp32 under mixed precision), plus the activations the
forward pass saves for the backward pass, which grow with the rows of a micro-batch
(`train.batch_size / train.grad_accum` per process) and with `train.seq_len`. Evaluation reads
`train.batch_size` rows at once without gradients; its peak is the logits and a layer's
transients.

- `static_bytes` counts the parameter-sized part from the config alone (`ced.cost`), so a model
  too large to build is refused before it is built.
- `activation_bytes` measures what a forward pass saves for backward on one short row of the
  real model (autograd's saved-tensor hooks; unique storages, parameters excluded) at two
  lengths, fits bytes(T) = a T + b T^2 (the T^2 term: the indexer's scores of every compressed
  entry) and scales it to the configured rows and length. The probe allocates only a row of
  at most `PROBE_TOKENS` tokens.
- `available_bytes` is what the device can give: CUDA's free memory, or on CPU the least of
  MemAvailable, the cgroup's limit and the address-space limit (`ulimit -v`).

`check_training_memory` turns an estimate above what is available into a `MemoryRefused` (a
one-line ConfigError): the estimate, what is available, and the keys to lower, naming
`train.grad_accum=K` when a smaller micro-batch would fit. The estimate is checked against the
measured peak RSS of real runs (tests/integration/test_fault_lines.py, within
`TOLERANCE`).
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from .cost import model_params
from .train_config import ConfigError

# bytes per parameter held during training: fp32 weight, gradient, AdamW exp_avg, exp_avg_sq
BYTES_PER_PARAM = 4 * 4
# the backward pass's own transients (a layer's gradients in flight, the loss's float copy of
# the logits) on top of what the forward saved; measured against peak RSS, see TOLERANCE
TRANSIENT_FACTOR = 1.25
# The estimate against the measured peak RSS of one training step (the test's three shapes,
# the process's memory before the run subtracted): within this relative error.
TOLERANCE = 0.35
PROBE_TOKENS = 256
# what a run holds beside the model and its batch (the trainer's buffers, a few data rows,
# accelerate's state), from the same measurements
FIXED_BYTES = 64 * 2 ** 20
GIB = 2 ** 30


class MemoryRefused(ConfigError):
    """A run whose estimated memory exceeds what the device has; the message is one line."""


@dataclass
class Estimate:
    """Bytes a training run needs: parameter-sized state, activations of one micro-batch,
    the evaluation's peak, and the total (the larger of the two phases)."""
    static: int
    activations: int
    evaluation: int

    @property
    def total(self) -> int:
        return FIXED_BYTES + self.static + max(self.activations, self.evaluation)


def static_bytes(model_cfg) -> int:
    """Weights, gradients and AdamW state of a model config, without building it."""
    return model_params(model_cfg)["total"] * BYTES_PER_PARAM


def _saved_bytes(model, length: int) -> int:
    """Bytes a training-mode forward (and its loss) of one row of `length` tokens saves for
    the backward pass: unique storages, the parameters' own excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    device = next(model.parameters()).device
    ids = torch.randint(1, model.cfg.vocab_size, (1, length), device=device)
    was_training = model.training
    model.train()
    # the probe draws random numbers (ids, any dropout): the run's own stream must not move
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # the loss's float copy and log-softmax of the logits, as cross-entropy saves them
            # (called as a tensor method: the probe leaves F.cross_entropy's callers alone)
            model(ids).float().log_softmax(-1)
    model.train(was_training)
    return sum(seen.values())


def activation_bytes(model, rows: int, seq_len: int) -> int:
    """Activations saved for backward by a micro-batch of `rows` x `seq_len` tokens, from two
    one-row probes of at most PROBE_TOKENS tokens (exact at those lengths; extrapolated beyond
    by a T + b T^2), times TRANSIENT_FACTOR."""
    t2 = min(seq_len, PROBE_TOKENS)
    t1 = max(1, t2 // 2)
    m1, m2 = _saved_bytes(model, t1), _saved_bytes(model, t2)
    if t1 == t2:
        per_row = m2
    else:
        # m(T) = a T + b T^2 through both probes; b >= 0 (a negative one is noise)
        b = max(0.0, (m2 / t2 - m1 / t1) / (t2 - t1))
        a = m2 / t2 - b * t2
        per_row = a * seq_len + b * seq_len ** 2
    return int(rows * per_row * TRANSIENT_FACTOR)


def evaluation_bytes(model_cfg, rows: int, seq_len: int) -> int:
    """Peak of a no-grad evaluation batch: the logits in float32 with the loss's per-token
    copy and its softmax (about three logit-sized tensors), and a few layer widths."""
    tokens = rows * seq_len
    return tokens * 4 * (3 * model_cfg.vocab_size + 8 * model_cfg.d_model)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes the device can still give, where that number comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)}"
    found = [(_meminfo("MemAvailable"), "MemAvailable")]
    limit = _cgroup_limit()
    if limit is not None:
        found.append(limit)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append((max(0, soft - _meminfo("VmSize", "/proc/self/status")),
                      f"ulimit -v {soft // 1024}"))
    return min((f for f in found if f[0] is not None), key=lambda f: f[0])


def _meminfo(field: str, path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_limit() -> tuple[int, str] | None:
    """(bytes left under the cgroup v2 memory limit, 'cgroup memory.max'), or None."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((base / "memory.current").read_text())
        return max(0, int(limit) - used), "cgroup memory.max"
    except (OSError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.0f} MiB"


MODEL_KEYS = "model.d_model, model.n_encoder_layers, model.n_decoder_layers or model.d_ff"


def advice(t, fits_accum: int | None) -> str:
    """Which keys to lower (the `train` config `t`); `train.grad_accum=K` first when a
    micro-batch of batch_size / K rows fits."""
    keys = f"train.batch_size, train.seq_len, {MODEL_KEYS}"
    if fits_accum is not None:
        return (f"set train.grad_accum={fits_accum} (micro-batches of "
                f"{t.batch_size // fits_accum} rows; the same batch) or lower {keys}")
    return f"lower {keys}"


def check_static(cfg, device: torch.device) -> None:
    """Refuse (MemoryRefused) a model whose weights, gradients and optimizer state alone
    exceed what `device` has, before it is built."""
    need = static_bytes(cfg.model)
    have, where = available_bytes(device)
    if need > have:
        raise MemoryRefused(
            f"model: weights, gradients and AdamW state need about {_gib(need)} "
            f"({need // BYTES_PER_PARAM:,} parameters x {BYTES_PER_PARAM} bytes), more than "
            f"the {_gib(have)} available ({where}); lower {MODEL_KEYS}")


def check_training_memory(cfg, model, processes: int, device: torch.device) -> Estimate:
    """The run's Estimate for one of `processes` processes; MemoryRefused (one line: estimate,
    available, keys to lower) when it exceeds what `device` has. `model`: the built model
    (probed on one short row)."""
    t = cfg.train
    rows = t.batch_size // t.grad_accum // processes
    per_row = activation_bytes(model, 1, t.seq_len)
    estimate = Estimate(static_bytes(cfg.model), rows * per_row,
                        evaluation_bytes(cfg.model, t.batch_size, t.seq_len))
    have, where = available_bytes(device)
    if estimate.total <= have:
        return estimate
    # the smallest grad_accum whose micro-batch fits (it must split the batch evenly over the
    # processes), if evaluation, which reads whole batches, fits too
    fits = None
    if FIXED_BYTES + estimate.static + estimate.evaluation <= have:
        for accum in range(t.grad_accum + 1, t.batch_size + 1):
            if t.batch_size % (accum * processes) == 0 and FIXED_BYTES + estimate.static + \
                    t.batch_size // accum // processes * per_row <= have:
                fits = accum
                break
    raise MemoryRefused(
        f"train.batch_size={t.batch_size}, train.seq_len={t.seq_len}: training needs about "
        f"{_gib(estimate.total)} (weights, gradients and AdamW state {_gib(estimate.static)}, "
        f"activations of a micro-batch of {rows} rows {_gib(estimate.activations)}, "
        f"evaluation {_gib(estimate.evaluation)}), more than the {_gib(have)} available "
        f"({where}); {advice(t, fits)}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (CPU or CUDA)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                              or "out of memory" in text.lower())


def oom_summary(exc: BaseException) -> str:
    """What an allocation failure tried to allocate, in a few words (CPU: 'could not allocate
    1.2 GiB'; CUDA: its 'Tried to allocate ...')."""
    text = str(exc)
    match = re.search(r"tried to allocate (\d+) bytes", text)
    if match:
        return f"could not allocate {_gib(int(match.group(1)))}"
    match = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if match:
        return f"could not allocate {match.group(1)} on the GPU"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:120]


__all__ = ["oom_summary", "Estimate", "MemoryRefused", "static_bytes", "activation_bytes", "evaluation_bytes",
           "available_bytes", "check_static", "check_training_memory", "is_out_of_memory",
           "advice", "TOLERANCE"]
