"""The training recipe's levers, through the real entry point on a CI-sized budget.

Retrieval at a variable distance: `copy` with a 1-character span and up to 32 filler tokens
between the span and its query, so the answer must be found by content (the token after `<`),
not by position. With the loss on answer tokens only, a small yoco learns it completely in 250
steps (about 35 s on one core); with the same budget and the loss on every token it stays near
chance, because the filler words dominate the gradient (measured: 1.00 against 0.02).

Associative recall (`kv_recall`): with `ModelConfig.shift_tokens` (input token mixing) and
zoology's `K7 ... ?K` format, a small yoco learns it in 250 steps (FINDINGS.md section 0)."""

from __future__ import annotations

import json
import subprocess
import sys

from test_train import ENV, ROOT

RETRIEVAL = ["model=yoco", "model.d_model=64", "model.n_heads=4", "model.n_encoder_layers=2",
             "model.n_decoder_layers=2", "model.window=16", "model.max_seq_len=64",
             "train.seq_len=64", "train.batch_size=32", "train.steps=250",
             "train.eval_every=250", "train.eval_batches=4", "train.save_every=250",
             "optim.warmup_steps=20", "data.tasks.copy.span_len=1", "data.tasks.copy.filler=32",
             "data.tasks.kv_recall=null", "data.tasks.variable_tracking=null",
             "data.tasks.running_state=null", "data.tasks.needle=null"]


def run_train(run_dir, *overrides: str, base: list[str] = RETRIEVAL) -> None:
    command = [sys.executable, "-m", "ced.train", *base, "logging=none",
               "train.threads=1", "train.progress=false", f"hydra.run.dir={run_dir}",
               *overrides]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def final_metrics(run_dir) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_loss_on_answers_learns_retrieval_that_the_full_loss_does_not(tmp_path):
    run_train(tmp_path / "answers", "train.loss_on=answers")
    run_train(tmp_path / "all", "train.loss_on=all")
    answers, everything = final_metrics(tmp_path / "answers"), final_metrics(tmp_path / "all")
    assert answers["val/acc/copy"] >= 0.8, answers
    assert everything["val/acc/copy"] < 0.3, everything
    assert answers["val/answer_loss"] < 0.5 * everything["val/answer_loss"]


# Associative recall through ced's global reads (FINDINGS.md 0.4): MQAR-style kv_recall (8 pairs,
# 2 queries, no filler), two examples packed per row with the document mask. With the encoder
# held still for its first 120 steps, a small ced finds each key's value by content within 200
# steps (measured 0.99 at step 200); with the same rows and budget but the encoder learning
# from step 0 it stays near the key-blind level (measured 0.11). Both runs together take about
# 100 s on one thread.
RECALL = ["model=ced", "model.topk=16", "model.d_model=128", "model.n_heads=4",
          "model.n_encoder_layers=2", "model.n_decoder_layers=2", "model.window=8",
          "model.global_from_layer=1", "model.encoder_kv_groups=1", "model.max_seq_len=72",
          "train.seq_len=72", "train.batch_size=32", "train.steps=200", "train.eval_every=200",
          "train.eval_batches=8", "train.save_every=200", "optim.warmup_steps=20",
          "data.only=[kv_recall]", "data.tasks.kv_recall.filler=0",
          "data.tasks.kv_recall.n_pairs=8", "data.tasks.kv_recall.queries=2",
          "train.loss_on=answers", "train.document_mask=true"]


def test_a_held_encoder_lets_ced_learn_associative_recall(tmp_path):
    run_train(tmp_path / "held", "optim.encoder_hold_steps=120", "optim.encoder_ramp_steps=40",
              base=RECALL)
    run_train(tmp_path / "free", base=RECALL)
    held, free = final_metrics(tmp_path / "held"), final_metrics(tmp_path / "free")
    assert held["val/acc/kv_recall"] >= 0.8, held
    assert free["val/acc/kv_recall"] < 0.5, free
