"""The recipe levers that made small yoco/ced models retrieve (FINDINGS.md 0.4), as mechanisms:
the encoder hold (optim.encoder_hold_steps / encoder_ramp_steps), the random init of the input
token mixing (model.shift_init) and the document mask of packed rows (train.document_mask).
Whether they make models learn is test_recipe.py's business; here: that each does exactly
what it says, through the real trainer."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import set_seed

from ced import CEDModel
from ced.checkpoint import load_config, load_model
from ced.train import document_starts, param_groups
from ced.train_config import ConfigError, OptimConfig
from conftest import tiny_config
from test_train import run_train


def test_encoder_lr_factor_holds_then_ramps():
    o = OptimConfig(encoder_hold_steps=3, encoder_ramp_steps=4)
    assert [o.encoder_lr_factor(s) for s in range(9)] == [0, 0, 0, 0.25, 0.5, 0.75, 1, 1, 1]
    assert [OptimConfig(encoder_hold_steps=2).encoder_lr_factor(s) for s in range(4)] == [0, 0, 1, 1]
    assert OptimConfig().encoder_lr_factor(0) == 1.0


@pytest.mark.parametrize("key,bad", [("encoder_hold_steps", -1), ("encoder_ramp_steps", 1.5),
                                     ("encoder_hold_steps", True)])
def test_bad_encoder_hold_is_rejected_by_name(key, bad):
    with pytest.raises(ConfigError, match=f"optim.{key}"):
        OptimConfig(**{key: bad})


@pytest.mark.parametrize("variant", ["dense", "swa", "yoco", "ced"])
def test_param_groups_cover_every_parameter_once_and_mark_the_encoder(variant):
    model = CEDModel(tiny_config(variant, topk=3 if variant == "ced" else None))
    groups = param_groups(model, OptimConfig())
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    encoder = {id(p) for g in groups if g["encoder"] for p in g["params"]}
    if not model.cfg.has_decoder:
        assert not encoder
        return
    expected = {id(p) for spec in model.plan.part("encoder")
                for p in model.blocks[spec.index].parameters()}
    expected |= {id(p) for s in model.plan.sources if s.part == "encoder"
                 for p in model.sources[s.index].parameters()}
    assert encoder == expected and expected
    decoder_source = model.sources[model.plan.decoder_source.index]
    assert not {id(p) for p in decoder_source.parameters()} & encoder
    assert id(model.embed.weight) not in encoder


def initial_model(run_dir) -> CEDModel:
    """The weights the trainer started from: the seed is set first, then the model built."""
    set_seed(0)
    return CEDModel(load_config(run_dir / "final"))


@pytest.mark.parametrize("steps,held", [(3, True), (5, False)])
def test_a_held_encoder_does_not_move_while_the_decoder_learns(tmp_path, steps, held):
    run_train(tmp_path, f"train.steps={steps}", f"train.save_every={steps}",
              f"train.eval_every={steps}", "optim.encoder_hold_steps=3",
              "optim.encoder_ramp_steps=2")
    start, final = initial_model(tmp_path), load_model(tmp_path / "final")
    before = dict(start.named_parameters())
    encoder = {id(p) for p in final.encoder_parameters()}
    moved = {name: not torch.equal(p, before[name]) for name, p in final.named_parameters()}
    enc_moved = [moved[n] for n, p in final.named_parameters() if id(p) in encoder]
    dec_moved = [moved[n] for n, p in final.named_parameters() if id(p) not in encoder]
    assert enc_moved and all(m == (not held) for m in enc_moved), moved
    assert any(dec_moved)


def test_shift_init_sets_the_token_mixing_std():
    torch.manual_seed(0)
    weights = CEDModel(tiny_config("ced", d_model=512, shift_tokens=3, shift_init=0.5)).shift_weights
    assert abs(float(weights.detach().std()) - 0.5) < 0.03
    zero = CEDModel(tiny_config("ced", shift_tokens=2, shift_init=0.0)).shift_weights
    assert torch.equal(zero, torch.zeros_like(zero))


@pytest.mark.parametrize("bad", [-0.1, float("inf"), True, "1"])
def test_bad_shift_init_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="ModelConfig.shift_init"):
        tiny_config("ced", shift_tokens=2, shift_init=bad)


def test_document_starts_are_the_bos_positions_of_each_row():
    bos, pad = 256, 258
    ids = torch.tensor([[bos, 5, 6, bos, 7, pad], [bos, 1, 2, 3, 4, 5], [9, 9, bos, 1, bos, 2]])
    assert document_starts(ids, True).tolist() == [[0, 3], [0, 0], [2, 4]]
    assert document_starts(ids, False) is None


def test_document_mask_trains_and_is_rejected_when_not_a_bool(tmp_path):
    run_train(tmp_path / "ok", "train.steps=2", "train.save_every=2", "train.eval_every=2",
              "train.document_mask=true")
    done = run_train(tmp_path / "bad", "train.document_mask=maybe", "train.steps=2", check=False)
    assert done.returncode != 0 and "train.document_mask" in done.stderr
