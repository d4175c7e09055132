"""Which path carries the evidence past a bounded replay's start: `python -m evals.paths`.

    python -m evals.paths --suite STUDY/suite/<job>/seed<k> [...] --out DIR [--replay W]

Evidence before a replay start s = T - N reaches the decoder at positions >= s by the decoder's
global read or by its window chain (docs/semantics.md 4.6). On the documents a finished suite
run read (its data/*.jsonl, so the same examples as its `full` and replay modes), each model is
read four ways at the same s, by the parallel forward (`CEDModel.forward`):

| reading | global read of entries before s | decoder window chain across s |
|---|---|---|
| `full` | kept | kept |
| `replay` (bounded replay N) | kept | cut |
| `global_cut` | cut | kept |
| `both` | cut | cut (only the encoder carries it) |

Per model and N, over the documents whose evidence lies before s (distance > N) that `full`
answers: the share each reading still answers (`retained`, Wilson 95% CI over examples) and the
chance level of those documents. A chain-carried answer survives `global_cut` and dies under
`replay`; a global-carried one the reverse. Per job, the mean over models with a Student t
interval (seed level). Writes rows.csv (one row per document, N and reading), retained.csv
(per model), jobs.csv (per job) and summary.json into --out.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pandas as pd
import torch

from ced.checkpoint import CheckpointError
from ced.config import parse_replay_form, replay_length
from ced.records import write_json
from ced.run_id import of_checkpoint

from .cli import build_parser, config_from_args, option
from .suites.families import prompt_ids, read_jsonl, target_ids
from .suites.runner import length_batches, load_checkpoint
from .suites.stats import seed_t_test, wilson_interval

READINGS = ("full", "replay", "global_cut", "both")
# what a run writes into --out (the study driver clears them before a rerun)
OUTPUTS = ("rows.csv", "retained.csv", "jobs.csv", "summary.json")


@dataclass
class PathsConfig:
    """`python -m evals.paths` (see the module docstring)."""

    suite: List[str] = option(help=(
        "finished suite runs (evals.suites --out; a study's suite/<job>/seed<k>): their "
        "documents are read again, their checkpoint unless --checkpoint says otherwise"))
    out: str = option(help="output directory")
    checkpoint: Optional[List[str]] = option(None, help=(
        "the models, one per --suite in the same order (default: each suite's own checkpoint; "
        "give them for an archived suite whose checkpoint path has moved)"))
    replays: List[str] = option(factory=lambda: ["W"], flag="--replay", metavar="N", help=(
        "cut positions s = T - N: N, W, kW, kW/d (R_exact is pointless: nothing to cut)"))
    families: Optional[List[str]] = option(None, help=(
        "read these families' documents only (e.g. running_count running_bracket; default: "
        "every family the suite read)"))
    dtype: str = option("float32", choices=["float32", "float64"], help="the models' dtype")
    batch_size: int = option(64, help="documents per forward pass")


def _score(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match [B] of the teacher-forced answer and its NLL [B]; logits [B, A, V]."""
    logp = torch.log_softmax(logits.double(), -1)
    return (logits.argmax(-1).eq(target).all(-1),
            -logp.gather(-1, target[..., None])[..., 0].sum(-1))


def read_batch(model, docs: list[dict], ns: list[int]) -> dict[tuple[int, str], tuple]:
    """Per (N, reading), (correct [B], nll [B]) of each document's answer, teacher-forced as
    the suite scores it (`evals.modes.mode_logits`): the prompt and the answer's first A - 1
    tokens in, logits from the prompt's last position on; every cut at s = T - N also applies
    to the answer's positions, as a decode after a bounded replay does. `full` is computed once
    and stands for every N. Documents of one batch share their prompt and target lengths
    (`length_batches`)."""
    prompt = torch.tensor([prompt_ids(d) for d in docs])
    target = torch.tensor([target_ids(d) for d in docs])
    ids = torch.cat((prompt, target[:, :-1]), 1)
    first = prompt.shape[1] - 1
    full = _score(model(ids)[:, first:], target)
    out = {}
    for n in ns:
        s = max(prompt.shape[1] - n, 0)
        cuts = {"replay": {"decoder_replay_start": s},
                "global_cut": {"decoder_global_start": s},
                "both": {"decoder_replay_start": s, "decoder_global_start": s}}
        out[(n, "full")] = full
        for reading, kwargs in cuts.items():
            out[(n, reading)] = _score(model(ids, **kwargs)[:, first:], target)
    return out


@torch.no_grad()
def read_model(model, docs: list[dict], ns: list[int], batch_size: int) -> pd.DataFrame:
    """One row per (document, N, reading): family, x, distance, chance, correct, nll (`full`
    repeated under every N, so that each N's rows stand alone)."""
    rows = []
    for batch in length_batches(docs, batch_size):
        got = read_batch(model, batch, ns)
        for n in ns:
            for reading in READINGS:
                correct, nll = got[(n, reading)]
                rows += [{"id": d["id"], "family": d["family"], "x": d["x"],
                          "distance": d.get("distance"), "chance": d.get("chance"), "N": n,
                          "reading": reading, "correct": int(correct[i]),
                          "nll": float(nll[i])}
                         for i, d in enumerate(batch)]
    return pd.DataFrame(rows)


def retained(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (model columns, N, reading): of the documents with distance > N that `full`
    answers, how many each reading answers (`retained` with its Wilson CI) and their mean
    chance level. rows: `read_model`'s, with the model columns (job, seed, model) added."""
    keys = ["job", "seed", "model", "N"]
    twice = rows.duplicated(["model", "N", "id", "reading"])
    if twice.any():
        raise ValueError(f"paths rows: {int(twice.sum())} readings of a document twice under one "
                         f"model name (e.g. {rows.loc[twice, 'model'].iloc[0]}): two checkpoints "
                         "outside a study share a folder name, or one model was read twice")
    wide = rows.pivot_table(index=keys + ["id", "distance", "chance"], columns="reading",
                            values="correct").reset_index()
    beyond = wide[(wide["distance"] > wide["N"]) & (wide["full"] == 1)]
    out = []
    for key, group in beyond.groupby(keys):
        for reading in READINGS[1:]:
            k, n = int(group[reading].sum()), len(group)
            low, high = wilson_interval(k, n)
            out.append({**dict(zip(keys, key)), "reading": reading, "n": n, "kept": k,
                        "retained": k / n, "ci_low": low, "ci_high": high,
                        "chance": float(group["chance"].mean())})
    return pd.DataFrame(out, columns=keys + ["reading", "n", "kept", "retained", "ci_low",
                                             "ci_high", "chance"])


def by_job(per_model: pd.DataFrame) -> pd.DataFrame:
    """Per (job, N, reading): the mean retained share over models, its Student t interval
    (seed level) and the models it covers."""
    out = []
    for (job, n, reading), group in per_model.groupby(["job", "N", "reading"]):
        low, high, _ = seed_t_test(group["retained"])
        out.append({"job": job, "N": n, "reading": reading, "models": len(group),
                    "retained": float(group["retained"].mean()), "model_ci_low": low,
                    "model_ci_high": high, "chance": float(group["chance"].mean())})
    return pd.DataFrame(out, columns=["job", "N", "reading", "models", "retained",
                                      "model_ci_low", "model_ci_high", "chance"])


def _suite_documents(suite: Path, families: list[str] | None) -> list[dict]:
    files = sorted((suite / "data").glob("*.jsonl"))
    if not files or not (suite / "summary.json").exists():
        raise ValueError(f"--suite {suite}: no data/*.jsonl and summary.json (not a finished "
                         "suite run)")
    if families:
        missing = sorted(set(families) - {f.stem for f in files})
        if missing:
            raise ValueError(f"--families: {missing} not read by the suite in {suite} (it "
                             f"read {sorted(f.stem for f in files)})")
        files = [f for f in files if f.stem in families]
    return [d for f in files for d in read_jsonl(f)]


def _suite_run(suite: Path) -> dict:
    return json.loads((suite / "summary.json").read_text())["run"]


def check_as_read(model_config: dict, suite: Path) -> None:
    """A ValueError when the suite read its checkpoint under another model config than the one
    loaded here (an eval-time top-k, KV format or decoder_global override): its `full` and
    replay modes would then not be what this reads. Keys either side lacks (written before the
    key existed) are not compared."""
    read = _suite_run(suite).get("config") or {}
    differ = sorted(k for k in set(read) & set(model_config) if read[k] != model_config[k])
    if differ:
        there = ", ".join(f"{k}={read[k]!r}" for k in differ)
        here = ", ".join(f"{k}={model_config[k]!r}" for k in differ)
        raise ValueError(f"--suite {suite}: it read the model with {there}, the checkpoint here "
                         f"has {here}; evals.paths reads models as trained")


def run(c: PathsConfig) -> dict:
    """Read every model; write the tables; return the summary. A bad option or a suite run
    that cannot be read again is a ValueError naming it."""
    suites = [Path(s) for s in c.suite]
    documents = [_suite_documents(s, c.families) for s in suites]
    checkpoints = c.checkpoint or [_suite_run(s)["checkpoint"] for s in suites]
    if len(checkpoints) != len(suites):
        raise ValueError(f"--checkpoint: one per --suite ({len(suites)}); got "
                         f"{len(checkpoints)}")
    frames, t0 = [], time.time()
    for suite, docs, checkpoint in zip(suites, documents, checkpoints):
        model = load_checkpoint(checkpoint, dtype=c.dtype)
        check_as_read(model.cfg.to_dict(), suite)
        if model.cfg.variant != "ced":
            raise ValueError(f"--checkpoint {checkpoint}: variant {model.cfg.variant!r}; the "
                             "two paths exist in ced only")
        ns = sorted({replay_length(model.cfg, parse_replay_form(r, "replays"), name="replays")
                     for r in c.replays})
        run_id = of_checkpoint(Path(checkpoint).resolve())
        job, seed = (run_id.job, run_id.seed) if run_id else (Path(checkpoint).parent.name, 0)
        rows = read_model(model, docs, ns, c.batch_size)
        frames.append(rows.assign(job=job, seed=seed, model=f"{job}/seed{seed}"))
        print(f"[paths] {job}/seed{seed}: {len(docs)} documents x N {ns} "
              f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    rows = pd.concat(frames, ignore_index=True)
    per_model = retained(rows)
    jobs = by_job(per_model)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "rows.csv", index=False)
    per_model.to_csv(out / "retained.csv", index=False)
    jobs.to_csv(out / "jobs.csv", index=False)
    summary = {"suites": [str(s) for s in suites], "checkpoints": [str(x) for x in checkpoints],
               "replays": list(c.replays), "families": c.families, "dtype": c.dtype,
               "seconds": time.time() - t0, "jobs": jobs.to_dict(orient="records")}
    write_json(out / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = build_parser(PathsConfig, prog="python -m evals.paths",
                     description=__doc__.split("\n\n")[0])
    c = config_from_args(PathsConfig, p.parse_args(argv))
    try:
        summary = run(c)
    except (ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = pd.DataFrame(summary["jobs"])
    if len(table):
        print(table.round(3).to_string(index=False))
    print(f"[paths] wrote {c.out}/rows.csv, retained.csv, jobs.csv, summary.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
