"""Bounded replay on real text: per-token KL(exact || replay) on held-out source files, by the
token's distance from the replay start and by token class: `python -m evals.real_text`.

    python -m evals.real_text --checkpoint RUN/seed0/final RUN/seed1/final --out DIR \
        [--replays 1 W/2 W 2W R_exact] [--continuation W] [--passes 4] [--context 128]

Every validation file of the checkpoint's `data=stdlib` split (the files its training never
saw) is read whole, as the model was trained: BOS file EOS, cut into rows of `--row-len` bytes
that overlap by `--context`, so that every scored byte has at least `--context` bytes before it
and is scored in exactly one row.

How a replay is read, for every byte at once. A bounded replay of N tokens at a prompt boundary
T is the parallel forward with every decoder window truncated at the replay start s = T - N
(docs/semantics.md 4.1, 4.4; tests/integration/test_invariants.py holds it equal to the
engine's early-exit prefill followed by decode steps, and tests/unit/test_real_text.py holds
this module's numbers equal to `evals.modes.mode_logits`). A forward with replay starts every
S positions therefore reads, at each position, the continuation of some replay: the byte at
distance d = (its position) - s from the latest start s is the (d - N)-th continuation byte of
a prompt replayed with N, for every N <= d. One forward per pass covers every byte; `--passes`
P shifts the starts by S / P so that each byte is read at P distances. S = R_exact + G, with G
the continuation length (`--continuation`, default W): "replay N" below is the G bytes that
follow a prompt replayed with N, i.e. the bytes at distance N <= d < N + G (an N above
R_exact is read as R_exact). At N = R_exact every KL is zero up to rounding: the check that
the read is right. `--context` must be at least R_exact + G, so that every scored byte has a
replay start before it in its row and its model's whole reach inside the row. A model
without a decoder, or with an exact early exit (yoco), is read for its NLL only.

Token classes (`evals.code_tokens`, from Python's tokenize over the whole file):
identifier_far (a name whose latest earlier occurrence, in code, a comment or a string,
starts more than W bytes back and before the replay start), closer_before_replay (a closing
bracket, or the first byte of a dedenting line, whose opener lies before the replay start)
and other; the finer classes are kept in `class` (evidence before the row, which neither
reading sees, is `evidence_outside_row`, in other).

Writes into --out:
  tokens.parquet     one row per (checkpoint, pass, scored byte): file, byte, distance, replay
                     start, class, KL(exact || replay), NLL under each
  kl_by_position.csv per checkpoint and distance d: bytes, mean, median, p99 and max KL
  kl_by_class.csv    per checkpoint, N and class group (and `all`): bytes, mean / median / p99 /
                     max KL, NLL exact and replay, delta perplexity, with a 95% CI over files
                     (cluster bootstrap: the files are the examples), and per job pooled over
                     checkpoints with the seed-level CI (models and files drawn crossed: the
                     models read the same files)
  baselines.csv      per checkpoint (every variant: dense and yoco are read only here) its
                     parameters and exact NLL on the scored bytes, beside the unigram
                     and bigram NLL on the same bytes (counts from the train split; add-k
                     smoothing with k chosen on the validation bytes themselves, which favours
                     the baselines) and `xz -9` on the same files (`xz_nll`: as one stream,
                     and per file on the bytes after the context)
  kl_by_position.png, kl_by_class.png
  settings.json      the reading's settings, its held-out files (validation_fraction and a
                     digest of their paths and bytes) and each model's replay forms

`merge_readings` writes the same files from readings of a few models each (made with the same
settings on the same held-out files), as one reading of all of them: a study reads each model
once, in its own folder, and merges (`experiments.tools`: the `real_text` tool's merge).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import pandas as pd
import torch

from ced import exact_replay_length
from ced.checkpoint import CheckpointError, load_config, load_model
from ced.config import describe_replays, parse_replay_form, replay_length, state_replay
from ced.data.corpora import in_validation, stdlib_paths, stdlib_streams
from ced.data.tokenizer import ByteTokenizer
from ced.memory import is_out_of_memory, oom_summary
from ced.tracking import job_and_seed, log_scalars, use_checkpoints
from ced.signals import Interrupted, StopSignals, continue_command, stop_point
from ced.writable import check_output_dir

from .cli import build_parser, config_from_args, list_written, option
from .code_tokens import Annotation, annotate, classify, group_of
from .divergence import checkpoint_data
from .suites.stats import crossed_bootstrap, percentile_interval

_TOK = ByteTokenizer()
# every file `run` writes into --out (wandb/ aside)
OUTPUTS = ("tokens.parquet", "kl_by_position.csv", "kl_by_class.csv", "baselines.csv",
           "kl_by_position.png", "kl_by_class.png", "settings.json")
DEFAULT_REPLAYS = ("1", "W/2", "W", "2W", "R_exact")


# ---- the held-out files, as rows ------------------------------------------------------------

def held_out_digest(files: list[tuple[str, bytes]]) -> str:
    """A digest of the held-out files read (their paths and bytes): readings of the same
    bytes, and only those, share it (the files come from the local Python's stdlib)."""
    digest = hashlib.sha256()
    for rel, data in files:
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def validation_files(fraction: float = 0.05) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every stdlib file in the validation split of `data=stdlib`
    with this `validation_fraction` (ced.data.corpora: the same hash, the same files)."""
    out = []
    for rel, path in stdlib_paths():
        if in_validation(rel, fraction):
            with open(path, "rb") as fh:
                out.append((rel, fh.read()))
    return out


@dataclass
class Rows:
    """Overlapping rows over the files' streams (BOS file EOS).

    ids     LongTensor [R, L] token ids, PAD after a file's end
    file    LongTensor [R]    index into the file list
    offset  LongTensor [R]    stream offset of row position 0 (stream offset 0 is BOS, so
                              file byte b is stream offset b + 1)
    scored  BoolTensor [R, L] position i is scored: the byte it predicts (stream offset
                              offset + i + 1) is a file byte, at least `context` bytes in,
                              and no other row scores it
    """

    ids: torch.Tensor
    file: torch.Tensor
    offset: torch.Tensor
    scored: torch.Tensor


def build_rows(files: list[bytes], row_len: int, context: int) -> Rows:
    """Rows of `row_len` tokens, consecutive rows of a file overlapping by context + 1."""
    if not 0 <= context < row_len - 1:
        raise ValueError(f"context: must lie in [0, row_len - 2 = {row_len - 2}]; got {context}")
    stride = row_len - 1 - context
    ids, file_index, offsets, scored = [], [], [], []
    for f, data in enumerate(files):
        stream = torch.tensor([_TOK.bos, *data, _TOK.eos], dtype=torch.long)
        last_byte = len(data)                     # stream offset of the file's last byte
        start = 0
        while start + context + 1 <= last_byte:
            row = torch.full((row_len,), _TOK.pad, dtype=torch.long)
            piece = stream[start:start + row_len]
            row[:len(piece)] = piece
            predicted = start + torch.arange(row_len) + 1      # stream offset predicted at i
            # the last position's successor is not in the row: the next row scores it
            positions = torch.arange(row_len)
            mask = (positions >= context) & (positions < row_len - 1) & (predicted <= last_byte)
            ids.append(row), file_index.append(f), offsets.append(start), scored.append(mask)
            start += stride
    if not ids:
        raise ValueError(f"no file is longer than context {context}: nothing to score")
    return Rows(torch.stack(ids), torch.tensor(file_index), torch.tensor(offsets),
                torch.stack(scored))


def replay_starts(row_len: int, period: int, offset: int) -> torch.Tensor:
    """LongTensor [K]: a replay start every `period` positions from `offset` (< row_len)."""
    return torch.arange(offset, row_len, period, dtype=torch.long)


def distances(row_len: int, starts: torch.Tensor) -> torch.Tensor:
    """LongTensor [L]: for the byte predicted at each position i (it sits at i + 1), its
    distance i + 1 - s from the latest start s <= i; 0 where no start precedes."""
    positions = torch.arange(row_len)
    latest = torch.searchsorted(starts, positions, right=True) - 1
    out = positions + 1 - starts[latest.clamp_min(0)]
    return torch.where(latest >= 0, out, torch.zeros_like(out))


# ---- scoring one model ------------------------------------------------------------------------

def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """LongTensor [R, L]: the token each position predicts (PAD after the row's last; that
    position is never scored)."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), _TOK.pad)], 1)


def nll_of(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position: log_probs [R, L, V], targets [R, L] -> [R, L]."""
    return -log_probs.gather(-1, targets[..., None])[..., 0]


@torch.no_grad()
def score(model, rows: Rows, period: int, passes: int, batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per scored byte and pass: KL(exact || replay) and the NLL under each, with the byte's
    distance from the replay start and that start (stream offset). Columns of equal length."""
    length = rows.ids.shape[1]
    columns: dict[str, list] = {k: [] for k in ("pass", "row", "position", "distance", "start",
                                                "kl", "nll_exact", "nll_replay")}
    offsets = sorted({round(p * period / passes) for p in range(passes)})
    for b0 in range(0, rows.ids.shape[0], batch_size):
        stop_point()        # a SIGTERM/SIGINT stops here, before anything is written
        ids = rows.ids[b0:b0 + batch_size]
        targets = next_tokens(ids)
        lp_exact = torch.log_softmax(model(ids).double(), -1)
        for p, offset in enumerate(offsets):
            starts = replay_starts(length, period, offset)
            d = distances(length, starts)
            keep = rows.scored[b0:b0 + batch_size] & (d > 0)[None]
            lp = torch.log_softmax(
                model(ids, decoder_replay_start=starts.expand(ids.shape[0], -1)).double(), -1)
            kl = (lp_exact.exp() * (lp_exact - lp)).sum(-1).clamp_min(0.0)
            nll_e, nll_r = nll_of(lp_exact, targets), nll_of(lp, targets)
            r, i = keep.nonzero(as_tuple=True)
            latest = starts[torch.searchsorted(starts, i, right=True) - 1]
            columns["pass"].append(torch.full_like(r, p))
            columns["row"].append(r + b0)
            columns["position"].append(i)
            columns["distance"].append(d[i])
            columns["start"].append(rows.offset[r + b0] + latest)
            for name, values in (("kl", kl), ("nll_exact", nll_e), ("nll_replay", nll_r)):
                columns[name].append(values[r, i])
    return {k: torch.cat(v).numpy() for k, v in columns.items()}


def token_table(scores: dict[str, np.ndarray], rows: Rows, names: list[str],
                annotations: list[Annotation | None], window: int):
    """The scores as a DataFrame with file, byte (offset in the file of the predicted byte),
    start (file offset of the replay start; -1 when it is the BOS before the file) and class.
    Files `tokenize` rejected keep their bytes, as class `unparsed`."""
    row = scores["row"]
    file = rows.file.numpy()[row]
    byte = rows.offset.numpy()[row] + scores["position"]       # stream offset - 1
    start = scores["start"] - 1
    # the first file byte the model is shown: the row's (stream offset o is file byte o - 1)
    visible = np.maximum(rows.offset.numpy()[row] - 1, 0)
    classes = np.full(len(row), "unparsed", dtype=object)
    for f in np.unique(file):
        ann = annotations[f]
        if ann is not None:
            at = file == f
            classes[at] = classify(ann, byte[at], start[at], window, visible[at])
    table = pd.DataFrame({"file": np.asarray(names, dtype=object)[file], "byte": byte,
                          "pass": scores["pass"], "distance": scores["distance"],
                          "start": start, "class": classes, "kl": scores["kl"],
                          "nll_exact": scores["nll_exact"], "nll_replay": scores["nll_replay"]})
    table["group"] = [group_of(c) if c != "unparsed" else "unparsed" for c in table["class"]]
    # millions of rows per model: the repeated strings as categories
    return table.astype({"file": "category", "class": "category", "group": "category"})


# ---- summaries ----------------------------------------------------------------------------

def cluster_bootstrap(parts, resamples: int = 1000, seed: int = 0,
                      confidence: float = 0.95) -> tuple[float, float]:
    """Interval of a mean of token values whose tokens come in files, read by one or several
    models.

    parts: array [models, files, 2] of (sum of values, token count) per model and file, the
    files in the same order for every model (a file a model did not read: zeros). The models
    read the same files, so files and models are crossed (`stats.crossed_bootstrap` with the
    token counts as weights): a replicate draws the models with replacement and, once, the
    files with replacement, and averages the drawn models' ratio means (sum / count) over
    those files. The model is the unit; within it the file is the example. With one model
    only files are drawn. Returns the percentile interval (NaN, NaN without tokens)."""
    parts = np.asarray(parts, dtype=float).reshape(-1, *np.shape(parts)[-2:])
    parts = parts[parts[:, :, 1].sum(1) > 0]
    if parts.size == 0:
        return math.nan, math.nan
    replicates = crossed_bootstrap(parts[:, :, 0], resamples, seed, counts=parts[:, :, 1])
    return percentile_interval(replicates, confidence)


def replay_groups(table, replays: dict[str, int], continuation: int):
    """Rows of `table` read as the continuation of a replay of N: distance in [N, N + G).
    replays: {label: N}. Yields (label, N, the rows)."""
    for label, n in replays.items():
        part = table[(table["distance"] >= n) & (table["distance"] < n + continuation)]
        yield label, n, part


def _file_sums(part, values) -> np.ndarray:
    """[models, files, 2]: per model (checkpoint) and file, the sum of `values` (a Series
    aligned with `part`) and the count, files aligned across models."""
    grouped = (values.groupby([part["checkpoint"], part["file"]], observed=True)
               .agg(["sum", "count"]))
    sums = grouped["sum"].unstack(fill_value=0.0)
    counts = grouped["count"].unstack(fill_value=0)
    return np.stack([sums.to_numpy(float), counts.to_numpy(float)], axis=-1)


def class_summary(part, resamples: int, seed: int) -> dict:
    """Token statistics of one (model or job, N, class) cell; `part` may hold several models
    (column `checkpoint`): its CIs are then seed-level."""
    kl = part["kl"].to_numpy()
    ci = cluster_bootstrap(_file_sums(part, part["kl"]), resamples, seed)
    dnll = part["nll_replay"] - part["nll_exact"]
    ci_dnll = cluster_bootstrap(_file_sums(part, dnll), resamples, seed)
    nll_e, nll_r = float(part["nll_exact"].mean()), float(part["nll_replay"].mean())
    return {"models": part["checkpoint"].nunique(), "files": part["file"].nunique(), "bytes": len(part),
            "kl_mean": float(kl.mean()), "kl_ci_low": ci[0], "kl_ci_high": ci[1],
            "kl_median": float(np.median(kl)), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_max": float(kl.max()), "nll_exact": nll_e, "nll_replay": nll_r,
            "dnll_mean": float(dnll.mean()), "dnll_ci_low": ci_dnll[0],
            "dnll_ci_high": ci_dnll[1], "delta_ppl": math.exp(nll_r) - math.exp(nll_e)}


def by_class(table, replays: dict[str, int], continuation: int, level: str,
             resamples: int = 1000, seed: int = 0):
    """kl_by_class rows: per (`level` key: checkpoint or job), N and class group (and `all`)."""
    out = []
    for key, unit in table.groupby(level):
        for label, n, part in replay_groups(unit, replays, continuation):
            for group, cell in [("all", part), *part.groupby("group", observed=True)]:
                if len(cell):
                    out.append({level: key, "replay": label, "N": n, "group": group,
                                **class_summary(cell, resamples, seed)})
    return pd.DataFrame(out)


def by_position(table):
    """kl_by_position rows: per checkpoint and distance, bytes and mean / median / p99 / max KL."""
    grouped = table.groupby(["checkpoint", "distance"])["kl"]
    out = grouped.agg(bytes="count", kl_mean="mean", kl_median="median",
                      kl_max="max").reset_index()
    out["kl_p99"] = grouped.quantile(0.99).to_numpy()
    return out


# ---- n-gram baselines ---------------------------------------------------------------------

def ngram_nll(train: np.ndarray, targets: np.ndarray, previous: np.ndarray,
              ks: tuple = (1e-3, 1e-2, 0.1, 1.0)) -> dict[str, float]:
    """Mean NLL (nats) of `targets` under a unigram and a bigram model counted on `train`
    (token ids), each with add-k smoothing, k the best of `ks` on these targets (which favours
    the baselines). previous: the token before each target."""
    vocab = _TOK.vocab_size
    uni = np.bincount(train, minlength=vocab).astype(float)
    bi = np.zeros((vocab, vocab))
    np.add.at(bi, (train[:-1], train[1:]), 1.0)
    best = {}
    for k in ks:
        p_uni = (uni + k) / (uni.sum() + k * vocab)
        p_bi = (bi + k) / (bi.sum(1, keepdims=True) + k * vocab)
        for name, nll in (("unigram", -np.log(p_uni[targets]).mean()),
                          ("bigram", -np.log(p_bi[previous, targets]).mean())):
            if nll < best.get(name, (math.inf,))[0]:
                best[name] = (float(nll), k)
    return {"unigram_nll": best["unigram"][0], "unigram_k": best["unigram"][1],
            "bigram_nll": best["bigram"][0], "bigram_k": best["bigram"][1]}


# ---- the run ------------------------------------------------------------------------------

def stdlib_fraction(checkpoint: str) -> float:
    """The validation_fraction of a checkpoint's `data=stdlib` (its run's config.yaml); a
    checkpoint trained on other data is refused: its held-out split is not these files."""
    data = checkpoint_data(checkpoint)
    if not isinstance(data, dict) or data.get("kind") != "stdlib":
        kind = data.get("kind") if isinstance(data, dict) else data
        raise ValueError(f"--checkpoint {checkpoint}: trained on data kind {kind!r}; the "
                         "real-text evaluation reads the held-out files of data=stdlib")
    return float(data.get("validation_fraction", 0.05))


@torch.no_grad()
def exact_nll(model, rows: Rows, batch_size: int = 8) -> np.ndarray:
    """NLL of every scored byte under the full forward, in the order of `rows.scored`."""
    out = []
    for b0 in range(0, rows.ids.shape[0], batch_size):
        stop_point()        # a SIGTERM/SIGINT stops here, before anything is written
        ids = rows.ids[b0:b0 + batch_size]
        lp = torch.log_softmax(model(ids).double(), -1)
        out.append(nll_of(lp, next_tokens(ids))[rows.scored[b0:b0 + batch_size]])
    return torch.cat(out).numpy()


def geometry(cfg, checkpoint: str, replays: list[str], continuation: str, context: int,
             passes: int) -> tuple[dict[str, int], int] | None:
    """({form: N}, G) for a model whose replay is read, None for one read for its NLL only
    (no decoder, or an exact early exit: yoco). N above R_exact is read as R_exact (a replay
    that long is exact: `ced.config.state_replay`). Refuses, naming the flag, a context shorter than R_exact + G (the
    period of the replay starts: a byte needs a start before it inside its row and its
    model's whole reach in the row) and more passes than the period has positions."""
    if not cfg.has_decoder or cfg.traits.exact_early_exit:
        return None
    r_exact = exact_replay_length(cfg)
    lengths = {form: state_replay(cfg, form, name="--replays").n for form in replays}
    g = replay_length(cfg, parse_replay_form(continuation, "--continuation"),
                      name="--continuation")
    if context < r_exact + g:
        raise ValueError(f"--context: {context} is shorter than R_exact + G = {r_exact} + {g} "
                         f"of {checkpoint}; give at least {r_exact + g}")
    if passes > r_exact + g:
        raise ValueError(f"--passes: {passes} is more than the {r_exact + g} positions between "
                         f"replay starts of {checkpoint}")
    return lengths, g


def score_checkpoint(checkpoint: str, replays: list[str], continuation: str, passes: int,
                     context: int, row_len: int, dtype: torch.dtype, batch_size: int,
                     max_files: int | None = None):
    """One checkpoint: (its token table with checkpoint, job, seed, W and R_exact columns, or
    None for a model whose replay is not read (`geometry`); {form: N}; G; {its exact NLL and
    byte count})."""
    fraction = stdlib_fraction(checkpoint)
    model = load_model(checkpoint).to(dtype).eval()
    cfg = model.cfg
    files = validation_files(fraction)[:max_files]
    rows = build_rows([data for _, data in files], min(row_len, cfg.max_seq_len), context)
    job, seed = job_and_seed(checkpoint)
    label = {"checkpoint": str(checkpoint), "job": job, "seed": seed, "variant": cfg.variant,
             "parameters": sum(p.numel() for p in model.parameters())}
    t0 = time.time()
    read = geometry(cfg, checkpoint, replays, continuation, context, passes)
    if read is None:               # nothing to replay: its exact NLL, for the baselines table
        nll = exact_nll(model, rows, batch_size)
        print(f"[real_text] {checkpoint}: {cfg.variant}, exact NLL {nll.mean():.4f} on "
              f"{len(nll)} bytes in {time.time() - t0:.0f}s", flush=True)
        return None, {}, 0, {**label, "nll_exact": float(nll.mean()), "bytes": len(nll)}
    lengths, g = read
    r_exact = exact_replay_length(cfg)
    stated = [state_replay(cfg, form, name="--replays") for form in replays]
    print(f"[real_text] {checkpoint}: W = {cfg.window}, R_exact = {r_exact}; replays "
          f"{describe_replays(stated)}", flush=True)
    for s in stated:
        if s.warning("--replays"):
            print(f"[real_text] {checkpoint}: {s.warning('--replays')}", flush=True)
    scores = score(model, rows, r_exact + g, passes, batch_size)
    table = token_table(scores, rows, [name for name, _ in files],
                        [annotate(data) for _, data in files], cfg.window)
    for k, (key, value) in enumerate(list(label.items())[:3]):
        table.insert(k, key, value)
    table["W"], table["R_exact"] = cfg.window, r_exact
    first = table[table["pass"] == 0]["nll_exact"]
    print(f"[real_text] {checkpoint}: {len(files)} files, {rows.ids.shape[0]} rows, "
          f"{len(table)} byte readings in {time.time() - t0:.0f}s", flush=True)
    return table, lengths, g, {**label, "nll_exact": float(first.mean()), "bytes": len(first)}


def xz_nll(files: list[bytes], context: int) -> dict[str, float]:
    """What `xz -9` pays for the held-out bytes, in nats per byte (bits per byte * ln 2): the
    familiar anchor a language model of bytes should beat.

    xz9_nll        every file concatenated into one `xz -9` stream (.xz container,
                   `lzma.compress(preset=9)`), over all their bytes: what
                   `cat FILES | xz -9 | wc -c` gives. The stricter anchor: xz reads across
                   files, which the model never does.
    xz9_scored_nll each file alone, raw LZMA2 at preset 9 (no container): the compressed size
                   of the whole file less that of its first `context` bytes, over the bytes
                   after them, i.e. xz's cost of the bytes the model scores given the prefix
                   the model has too (xz then reads the whole file back; the model at most its
                   row)."""
    raw = [{"id": lzma.FILTER_LZMA2, "preset": 9}]

    def size(data: bytes) -> int:
        return len(lzma.compress(data, format=lzma.FORMAT_RAW, filters=raw)) if data else 0

    total = sum(len(d) for d in files)
    after = [d for d in files if len(d) > context]
    scored = sum(len(d) - context for d in after)
    if not total or not scored:
        raise ValueError(f"no file is longer than context {context}: nothing for xz to score")
    cost = sum(size(d) - size(d[:context]) for d in after)
    nats = 8 * math.log(2)
    return {"xz9_nll": nats * len(lzma.compress(b"".join(files), preset=9)) / total,
            "xz9_scored_nll": nats * cost / scored}


def baselines(fraction: float, rows: Rows, files: list[bytes], context: int) -> dict[str, float]:
    """Unigram and bigram NLL on the scored bytes of `rows`, counted on the train split, and
    `xz -9` on the held-out `files` (`xz_nll`)."""
    train = stdlib_streams(fraction)["train"].numpy().astype(np.int64)
    targets = next_tokens(rows.ids)[rows.scored].numpy()
    previous = rows.ids[rows.scored].numpy()
    return ngram_nll(train, targets, previous) | xz_nll(files, context)


@dataclass
class RealTextConfig:
    """Everything one reading reads: `python -m evals.real_text` builds its options from these
    fields (`evals.cli`), and the study driver writes them as JSON for `experiments.job`."""

    checkpoint: List[str] = option(help="trained model directories (final/) of data=stdlib "
                                        "runs")
    out: str = option(help="output directory")
    replays: List[str] = option(factory=lambda: list(DEFAULT_REPLAYS), help=(
        "replay lengths N: ints or forms W, W/2, 2W, R_exact (per model)"))
    continuation: str = option("W", help="G: the bytes read after each replayed prompt (int or "
                                         "W form)")
    passes: int = option(4, help="readings per byte, at replay starts shifted by "
                                 "(R_exact + G) / P")
    context: int = option(128, help="bytes of a file every scored byte has before it")
    row_len: int = option(512, help="bytes per row of the exact reading")
    max_files: Optional[int] = option(None, help="only the first K validation files (a quick "
                                                 "look)")
    dtype: str = option("float32", choices=["float32", "float64"], help="the models' dtype")
    batch_size: int = option(8, help="rows per forward pass")
    bootstrap: int = option(1000, help="bootstrap resamples")
    wandb: bool = option(True, help="write no wandb run")
    wandb_project: str = option("ced", help="the one project of every ced run")
    wandb_group: Optional[str] = option(None, help=(
        "default: $WANDB_RUN_GROUP (the study driver's), else real_text"))


def run(config: RealTextConfig) -> dict:
    """Score every checkpoint, write the tables and plots into `config.out` (and, unless
    `config.wandb` is off, into an offline-by-default wandb run); returns their paths. Bad
    settings are a ValueError naming the option."""
    c = config
    if c.passes < 1:
        raise ValueError(f"--passes must be >= 1; got {c.passes}")
    checkpoints, out, replays = list(c.checkpoint), Path(c.out), list(c.replays)
    continuation, passes, context, row_len = c.continuation, c.passes, c.context, c.row_len
    dtype, batch_size, resamples, max_files = c.dtype, c.batch_size, c.bootstrap, c.max_files
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    for form in replays:                    # every argument, before the first model costs minutes
        parse_replay_form(form, "--replays")
    parse_replay_form(continuation, "--continuation")
    for checkpoint in checkpoints:
        geometry(load_config(checkpoint), checkpoint, replays, continuation, context, passes)
    fractions = {stdlib_fraction(checkpoint) for checkpoint in checkpoints}
    if len(fractions) != 1:
        raise ValueError(f"--checkpoint: the models hold out different stdlib splits "
                         f"(validation_fraction {sorted(fractions)}); read them apart")
    tables, forms, models = [], {}, []
    started = time.time()
    for i, checkpoint in enumerate(checkpoints, 1):
        table, lengths, g, nll = score_checkpoint(checkpoint, replays, continuation, passes,
                                                  context, row_len, torch_dtype, batch_size,
                                                  max_files)
        models.append(nll)
        # minutes a model at the findings scale: say how far the reading is and what is left
        spent = time.time() - started
        print(f"[real_text] {i}/{len(checkpoints)} read: {checkpoint} "
              f"({0 if table is None else len(table)} readings, NLL {nll['nll_exact']:.4f}); "
              f"{spent / 60:.1f} min so far, about {spent / i * (len(checkpoints) - i) / 60:.1f}"
              f" min left", file=sys.stderr, flush=True)
        if table is not None:
            tables.append(table)
            forms[checkpoint] = (lengths, g)
    fraction = fractions.pop()
    files = validation_files(fraction)[:max_files]
    # every byte at least `context` in is scored once whatever the row length: the same bytes
    data = [d for _, d in files]
    base = baselines(fraction, build_rows(data, row_len, context), data, context)
    settings = {"checkpoints": checkpoints, "replays": replays, "continuation": continuation,
                "passes": passes, "context": context, "row_len": row_len, "dtype": dtype,
                "resamples": resamples, "max_files": max_files,
                "validation_fraction": fraction, "held_out": held_out_digest(files),
                "forms": {ckpt: {"lengths": lengths, "continuation": g}
                          for ckpt, (lengths, g) in forms.items()}}
    return _write_reading(out, pd.DataFrame([{**m, **base} for m in models]), tables, settings,
                          c)


# the settings every reading merged into one must share (`merge_readings`); the held-out
# files (their split and digest) must agree among the readings that record them
SHARED_SETTINGS = ("replays", "continuation", "passes", "context", "row_len", "dtype",
                   "max_files")
HELD_OUT = ("validation_fraction", "held_out")


def merge_readings(config: RealTextConfig, readings: list[str]) -> dict:
    """Readings of one model each (or of several), made on the same held-out bytes with the
    same settings, as one reading of all their models in `config.out`: the tables and plots
    `run` would write reading every checkpoint at once (the per job rows pool the models, with
    seed-level CIs; `config.bootstrap` resamples). So a study reads each model once, in its
    own folder, and a model added later is read alone. `config.checkpoint`: every checkpoint
    the readings must hold, in order (a reading of any other, or one missing, is a ValueError);
    `config.wandb`: one wandb run of the merged reading. Returns the written paths."""
    settings = _mergeable_settings(readings)
    base = pd.concat([pd.read_csv(Path(r) / "baselines.csv", float_precision="round_trip",
                                  dtype={"checkpoint": str, "job": str}) for r in readings],
                     ignore_index=True)
    # a reading names its models by the paths it read; a study directory moved since (or an
    # archive put back elsewhere) holds them elsewhere now: match a study's model by its job
    # and seed, any other by its path
    here = {_identity(ckpt, *job_and_seed(ckpt)): ckpt for ckpt in config.checkpoint}
    moved = {row.checkpoint: here.get(_identity(row.checkpoint, row.job, row.seed))
             for row in base.itertuples()}
    if sorted(map(str, moved.values())) != sorted(config.checkpoint) or len(moved) != len(base):
        raise ValueError(f"readings {list(readings)}: they read {sorted(moved)}, not each of "
                         f"--checkpoint {sorted(config.checkpoint)} once")
    forms = {moved[ckpt]: form for s in settings for ckpt, form in s.get("forms", {}).items()}
    # the models in --checkpoint's order, as `run` reads them (the bootstrap draws by order)
    order = {ckpt: i for i, ckpt in enumerate(config.checkpoint)}
    tables = [pd.read_parquet(Path(r) / "tokens.parquet") for r in readings
              if (Path(r) / "tokens.parquet").exists()]
    if tables:
        table = pd.concat(tables, ignore_index=True)
        table["checkpoint"] = table["checkpoint"].map(moved)
    unread = sorted(set(forms) - (set(table["checkpoint"]) if tables else set()))
    if unread:
        raise ValueError(f"readings {list(readings)}: no tokens.parquet rows of {unread}, "
                         "whose replay they read; read those models again")
    if tables:
        tables = [table.sort_values("checkpoint", key=lambda c: c.map(order), kind="stable")]
    base["checkpoint"] = base["checkpoint"].map(moved)
    base = base.sort_values("checkpoint", key=lambda c: c.map(order), kind="stable")
    held_out = {name: s[name] for s in settings for name in HELD_OUT if name in s}
    merged = {**settings[0], **held_out, "checkpoints": list(config.checkpoint),
              "forms": forms, "resamples": config.bootstrap,
              "readings": [str(r) for r in readings]}
    return _write_reading(Path(config.out), base.reset_index(drop=True), tables, merged, config)


def _mergeable_settings(readings: list[str]) -> list[dict]:
    """Each reading's settings.json, refused (ValueError) unless they share `SHARED_SETTINGS`
    and, among those that record them, the held-out files (`HELD_OUT`: a reading made before
    they were recorded is taken as it stands), and each records its models' replay forms."""
    settings = [json.loads((Path(r) / "settings.json").read_text()) for r in readings]
    for name in (*SHARED_SETTINGS, *HELD_OUT):
        values = {json.dumps(s.get(name)) for s in settings
                  if name in SHARED_SETTINGS or name in s}
        if len(values) > 1:
            raise ValueError(f"readings {list(readings)}: their {name} differ ({sorted(values)})"
                             f"; merge readings of the same settings and held-out files only")
    if without := [r for r, s in zip(readings, settings) if "forms" not in s]:
        raise ValueError(f"readings {without}: no forms in settings.json (read before "
                         "readings could be merged); read those models again")
    return settings


def _identity(checkpoint: str, job: str, seed) -> tuple:
    """A model as a merge matches it: (job, seed) for a study's training run, else its path."""
    return ("run", job, int(seed)) if seed is not None and not pd.isna(seed) else \
        ("path", str(checkpoint))


def _write_reading(out: Path, base: pd.DataFrame, tables: list, settings: dict,
                   c: RealTextConfig) -> dict:
    """A reading's files: baselines.csv (per model, with the baselines), the tables and plots
    of the token readings `tables` (one frame per model whose replay was read), settings.json,
    and the wandb run unless `c.wandb` is off."""
    out.mkdir(parents=True, exist_ok=True)
    base.to_csv(out / "baselines.csv", index=False)
    written = {"baselines": out / "baselines.csv"}
    forms = {ckpt: (f["lengths"], f["continuation"]) for ckpt, f in settings["forms"].items()}
    if tables:
        written |= _write_tables(pd.concat(tables, ignore_index=True), forms,
                                 settings["replays"], settings["resamples"], out)
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    if c.wandb:
        _log_wandb(out, settings, written, project=c.wandb_project, group=c.wandb_group)
    return written


def real_text_scalars(classes, base) -> dict[str, float]:
    """Flat scalars for dashboards: mean KL per job, replay and class group
    (`kl/<job>/<replay>/<group>`, seed-level rows), exact NLL per job (`nll/<job>`) and the
    baselines (`nll/unigram`, `nll/bigram`, `nll/xz9`)."""
    out = {}
    for row in classes[classes["level"] == "seeds"].itertuples():
        out[f"kl/{row.job}/{row.replay}/{row.group}"] = row.kl_mean
    for job, part in base.groupby("job"):
        out[f"nll/{job}"] = part["nll_exact"].mean()
    if len(base):
        for name in ("unigram", "bigram", "xz9"):
            out[f"nll/{name}"] = base[f"{name}_nll"].iloc[0]
    return out


def _log_wandb(out: Path, settings: dict, written: dict, project: str = "ced",
               group: str | None = None) -> None:
    """The tables, plots and scalars in a wandb run (offline unless WANDB_MODE says
    otherwise; `wandb sync <out>/wandb/offline-run-*`), the checkpoints as its inputs."""
    # lazy: wandb costs ~0.4 s to import, and only a run that logs to wandb needs it
    import wandb as wb
    run = wb.init(project=project, dir=str(out), job_type="real_text",
                  group=group or os.environ.get("WANDB_RUN_GROUP") or "real_text",
                  mode=os.environ.get("WANDB_MODE", "offline"), config=settings)
    tables = {name: pd.read_csv(path) for name, path in written.items()
              if str(path).endswith(".csv")}
    run.log({name: wb.Table(dataframe=table.astype(str) if name == "baselines" else table)
             for name, table in tables.items() if name != "kl_by_position"})
    run.log({f"plots/{name[:-4]}": wb.Image(str(path)) for name, path in written.items()
             if str(path).endswith(".png")})
    use_checkpoints(run, settings["checkpoints"])
    empty = pd.DataFrame(columns=["level", "job", "replay", "group", "kl_mean"])
    log_scalars(run, real_text_scalars(tables.get("kl_by_class", empty), tables["baselines"]))
    run.finish()


def _write_tables(table, forms: dict, replays: list[str], resamples: int,
                  out: Path) -> dict[str, Path]:
    table.to_parquet(out / "tokens.parquet", index=False)
    position = by_position(table)
    position.to_csv(out / "kl_by_position.csv", index=False)
    classes = _class_tables(table, forms, replays, resamples)
    classes.to_csv(out / "kl_by_class.csv", index=False)
    return {"tokens": out / "tokens.parquet", "kl_by_position": out / "kl_by_position.csv",
            "kl_by_class": out / "kl_by_class.csv",
            **_write_figures(position, table, classes, out)}


def _write_figures(position, table, classes, out: Path) -> dict[str, Path]:
    # lazy: evals.plots loads matplotlib (~0.6 s), needed only once figures are written;
    # evals.lmeval.code_tasks imports this module and draws nothing
    from . import plots
    geometry = table.groupby("job")[["W", "R_exact"]].first()
    marks = {job: {"W": int(r.W), "R_exact": int(r.R_exact)} for job, r in geometry.iterrows()}
    jobs = table.groupby("checkpoint")["job"].first()
    figures = {"kl_by_position_png": plots.real_text_position_figure(
                   position.assign(job=position["checkpoint"].map(jobs)), marks),
               "kl_by_class_png": plots.real_text_class_figure(classes)}
    written = {}
    for name, fig in figures.items():
        if fig is not None:
            written[name] = plots.save(fig, out / f"{name[:-4]}.png")
    return written


def _class_tables(table, forms: dict, replays: list[str], resamples: int):
    """kl_by_class: per checkpoint (example-level CIs) and per job (seed-level CIs)."""
    parts = []
    for checkpoint, unit in table.groupby("checkpoint"):
        lengths, g = forms[checkpoint]
        part = by_class(unit, lengths, g, "checkpoint", resamples)
        part.insert(1, "job", unit["job"].iloc[0])
        part.insert(2, "level", "model")
        parts.append(part)
    for job, unit in table.groupby("job"):
        # a job's models share their geometry (one config, several seeds)
        lengths, g = forms[unit["checkpoint"].iloc[0]]
        part = by_class(unit, lengths, g, "job", resamples).rename(columns={"job": "checkpoint"})
        part["checkpoint"] = "pooled"
        part.insert(1, "job", job)
        part.insert(2, "level", "seeds")
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(RealTextConfig, prog="python -m evals.real_text",
                          description=__doc__.split("\n\n")[0])
    config = config_from_args(RealTextConfig, parser.parse_args(argv))

    def checked_run() -> dict:
        check_output_dir(config.out, "--out")      # before any checkpoint is read
        return run(config)

    try:
        with StopSignals():
            return list_written("real_text", checked_run,
                                errors=(ValueError, CheckpointError, FileNotFoundError))
    except Interrupted as exc:
        print(f"evals.real_text {exc} at a batch boundary; nothing was written to "
              f"{config.out}; to continue, run again: {continue_command()}", file=sys.stderr)
        return exc.code
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        print(f"evals.real_text stopped: out of memory ({oom_summary(exc)}); nothing was "
              f"written to {config.out}; lower --batch-size or --row-len", file=sys.stderr)
        return 75


if __name__ == "__main__":
    sys.exit(main())
