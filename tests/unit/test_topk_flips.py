"""evals.topk_flips: selections are captured per indexer layer; a model compared with itself
flips nothing; quantised indexer keys flip some contested selections on a random model; the
set metrics are what their definitions say; the CLI writes its outputs."""

from __future__ import annotations

import json

import pytest
import torch

from ced.checkpoint import load_model, save_model
from conftest import make_model, tiny_config
from evals.topk_flips import _as_mask, compare, main, selections

VOCAB = 259


def model_for(seed: int):
    return make_model(tiny_config("ced", vocab_size=VOCAB, topk=3, window=4), seed).float()


def test_a_model_against_itself_changes_nothing_and_fp4_keys_change_something(tmp_path):
    model = model_for(0)
    save_model(model, tmp_path / "final")
    ids = torch.randint(0, VOCAB, (4, 40), generator=torch.Generator().manual_seed(0))
    picked = selections(model, ids)
    indexers = [i for i, b in enumerate(model.blocks) if b.attn.indexer is not None]
    assert sorted(picked) == indexers and indexers
    index, valid = picked[indexers[0]]
    assert index.shape == valid.shape == (4, 40, 3)
    same = compare(model, model, ids)
    assert (same["changed"] == 0).all() and (same["jaccard"] == 1).all()
    # the same weights read back with FP4 indexer keys (ced.checkpoint.load_model's kv)
    changed = load_model(tmp_path / "final", kv="indexer:fp4_block32").to(
        next(model.parameters()).dtype)
    assert changed.cfg.indexer_key_dtype != model.cfg.indexer_key_dtype
    flipped = compare(model, changed, ids)
    assert flipped["changed"].max() > 0 and flipped["jaccard"].min() < 1
    assert ((flipped["swapped"] >= 0) & (flipped["swapped"] <= 3)).all()


def test_selection_masks_ignore_padding_slots():
    index = torch.tensor([[[0, 2, 2]]])
    valid = torch.tensor([[[True, True, False]]])
    assert _as_mask(index, valid, 4).tolist() == [[[True, False, True, False]]]


def test_cli_pools_seeds_and_writes_outputs(tmp_path):
    for seed in (0, 1):
        save_model(model_for(seed), tmp_path / "runs" / "ced" / f"seed{seed}" / "final")
    out = tmp_path / "flips"
    assert main(["--checkpoint", *(str(tmp_path / "runs" / "ced" / f"seed{s}" / "final")
                                   for s in (0, 1)),
                 "--out", str(out), "--kv", "indexer:fp4_block32", "global:fp8",
                 "--examples", "2", "--length", "40", "--bootstrap", "50"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {row["kv"] for row in summary} == {"indexer:fp4_block32", "global:fp8"}
    assert all(row["job"] == "ced" and row["units"] == 2 * 2 * 2 for row in summary)
    assert all(row["changed_ci"][0] <= row["changed"] <= row["changed_ci"][1] for row in summary)
    assert main(["--checkpoint", str(tmp_path / "runs" / "ced" / "seed0" / "final"), "--out",
                 str(out), "--kv", "indexer:fp9"]) == 2


def test_evaluation_overrides_have_one_home(tmp_path):
    """ced.checkpoint.load_model reads a checkpoint back with another top-k ("all" = every
    visible entry) or KV storage formats; a bad override is a ValueError naming it; the
    weights are the same."""
    model = model_for(0)
    save_model(model, tmp_path / "final")
    wide = load_model(tmp_path / "final", topk="all")
    assert wide.cfg.topk == model.cfg.max_seq_len
    assert load_model(tmp_path / "final", topk=2).cfg.topk == 2
    assert load_model(tmp_path / "final", topk="none").cfg == model.cfg
    fp8 = load_model(tmp_path / "final", kv="window:fp8")
    assert fp8.cfg.window_kv_dtype == "fp8"
    for (name, a), b in zip(model.state_dict().items(), fp8.state_dict().values()):
        assert torch.equal(a.float(), b.float()), name
    with pytest.raises(ValueError, match="topk: an int >= 1 or 'all'"):
        load_model(tmp_path / "final", topk="many")
    with pytest.raises(ValueError, match="glob"):
        load_model(tmp_path / "final", kv="glob:fp8")
    dense = tiny_config(topk=None)
    save_model(make_model(dense, 0), tmp_path / "dense")
    with pytest.raises(ValueError, match="no lightning indexer"):
        load_model(tmp_path / "dense", topk=4)
