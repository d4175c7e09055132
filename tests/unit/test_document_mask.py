"""The document mask (CEDModel.forward(document_starts=...), docs/semantics.md 7.1): on a packed
row, every document is computed as if it stood alone.

Documents start at multiples of every compression ratio (the mask's one approximation is a
block that straddles a start: it is readable by no one, which a document alone would not
lose), and RoPE is relative, so the packed logits of a document equal its logits alone up to
summation order. Float64; tolerance TOL = 1e-10 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOL, VOCAB, make_model, random_ids, tiny_config
from ced.semantics import first_visible_entry, select_entries

VARIANTS = ["dense", "swa", "yoco", "ced"]


def packed(lengths: list[int], seed: int) -> tuple[torch.Tensor, list[int]]:
    """One row [1, sum(lengths)] of random documents and their start positions."""
    docs = [random_ids(1, n, seed + i) for i, n in enumerate(lengths)]
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return torch.cat(docs, dim=1), starts


@settings(max_examples=25, deadline=None)
@given(variant=st.sampled_from(VARIANTS), seed=st.integers(0, 10_000),
       blocks=st.lists(st.integers(1, 9), min_size=2, max_size=4),
       topk=st.sampled_from([None, 1, 3]), shift=st.sampled_from([0, 2]),
       dense_read=st.booleans())
def test_each_packed_document_equals_the_document_alone(variant, seed, blocks, topk, shift,
                                                        dense_read):
    cfg = tiny_config(variant, topk=topk if variant == "ced" else None, shift_tokens=shift)
    model = make_model(cfg, seed)
    lengths = [2 * b for b in blocks]           # multiples of every compression ratio (1, 2)
    ids, starts = packed(lengths, seed)
    out = model(ids, document_starts=torch.tensor([starts]), dense_global_read=dense_read)
    for start, n in zip(starts, lengths):
        alone = model(ids[:, start:start + n], dense_global_read=dense_read)
        assert (out[:, start:start + n] - alone).abs().max() < TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_gradient_and_no_change_crosses_a_document_start(variant):
    cfg = tiny_config(variant, topk=2 if variant == "ced" else None, shift_tokens=2)
    model = make_model(cfg, 3)
    ids, starts = packed([10, 12], 3)
    docs = torch.tensor([starts])
    base = model(ids, document_starts=docs)
    changed = ids.clone()
    changed[:, :10] = (changed[:, :10] + 1) % VOCAB          # rewrite the whole first document
    moved = model(changed, document_starts=docs)
    assert (moved[:, 10:] - base[:, 10:]).abs().max() < TOL
    # ... and without the mask the second document does see the first
    assert (model(changed)[:, 10:] - model(ids)[:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_starts_at_zero_or_none_change_nothing(variant):
    model = make_model(tiny_config(variant, shift_tokens=2), 1)
    ids = random_ids(2, 19, 1)
    plain = model(ids)
    assert torch.equal(model(ids, document_starts=None), plain)
    assert (model(ids, document_starts=torch.zeros(2, 3, dtype=torch.long)) - plain
            ).abs().max() < TOL


def test_document_mask_composes_with_replay_starts():
    """A replay start inside a document truncates that document's decoder windows, exactly as
    in the document alone (the latest start of either kind wins)."""
    model = make_model(tiny_config("ced", topk=3, shift_tokens=2), 5)
    ids, starts = packed([8, 16], 5)
    out = model(ids, document_starts=torch.tensor([starts]), decoder_replay_start=8 + 11)
    alone = model(ids[:, 8:], decoder_replay_start=11)
    assert (out[:, 8:] - alone).abs().max() < TOL


def test_a_block_straddling_a_start_is_readable_by_no_one():
    # ratio 2, a document starting at 5: entry 2 pools tokens 4-5, complete from query 5 on,
    # but it begins before 5, so no query of the second document reads it either.
    first = first_visible_entry(torch.arange(10), 2, torch.tensor([[0, 5]]))
    assert first.tolist() == [[0, 0, 0, 0, 0, 3, 3, 3, 3, 3]]
    scores = torch.ones(1, 10, 5)
    n_visible = torch.div(torch.arange(10) + 1, 2, rounding_mode="floor")
    index, valid = select_entries(scores, n_visible, 5, first)
    chosen = [sorted(index[0, i][valid[0, i]].tolist()) for i in range(10)]
    assert chosen[4] == [0, 1] and chosen[5] == [] and chosen[7] == [3] and chosen[9] == [3, 4]


def test_bad_document_starts_are_rejected_by_name():
    model = make_model(tiny_config("ced"), 0)
    ids = random_ids(2, 8, 0)
    with pytest.raises(ValueError, match="document_starts"):
        model(ids, document_starts=torch.tensor([[0, -1], [0, 2]]))
    with pytest.raises(ValueError, match="document_starts"):
        model(ids, document_starts=torch.zeros(3, 1, dtype=torch.long))
