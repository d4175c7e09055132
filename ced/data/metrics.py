"""Per-task answer accuracy from a batch of SequenceSource rows."""

from __future__ import annotations

import torch


def answer_accuracy(predictions: torch.Tensor, batch: dict[str, torch.Tensor],
                    families: list[str]) -> dict[str, dict[str, float]]:
    """predictions: LongTensor[B, T] aligned with batch["labels"] (e.g. logits.argmax(-1)).

    Returns {family: {"token_acc", "exact_match", "examples"}} for every family with answers
    in the batch. An example is one contiguous run of answer_mask (its target bytes and EOS);
    exact_match counts the examples whose every answer token is predicted.
    """
    mask, fams = batch["answer_mask"], batch["family_ids"]
    correct = predictions.eq(batch["labels"]) & mask
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    starts = (mask & ~prev).flatten()
    run = torch.cumsum(starts.long(), 0) - 1                         # example index per position
    flat_mask = mask.flatten()
    n_runs = int(starts.sum())
    wrong = torch.zeros(n_runs, dtype=torch.long).index_add_(
        0, run[flat_mask], (~correct.flatten()[flat_mask]).long())
    run_family = fams.flatten()[starts]
    out = {}
    for i, name in enumerate(families):
        positions = mask & fams.eq(i)
        if positions.any():
            runs = run_family.eq(i)
            out[name] = {"token_acc": float(correct[positions].float().mean()),
                         "exact_match": float(wrong[runs].eq(0).float().mean()),
                         "examples": int(runs.sum())}
    return out
