"""The hashes of a study's evaluation steps are the record that its finished steps are fresh:
a change to how the driver builds a step (not to what the step computes) must leave every hash
as it was, or every finished study on disk would rerun. A fabricated study (three models, every
evaluation section, scale overrides) is planned, and each step's hash held to its pinned value.
A deliberate change of what a step computes changes its hash: re-pin it and say why in the
commit message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ced import ModelConfig
from experiments.run import Study
from experiments.study import load_study

STUDY = """\
name: pinned
train: [model=tiny, debug=fast, train.steps=2]
jobs:
  - {name: ced, overrides: [model=ced]}
  - {name: yoco, overrides: [model=yoco]}
  - {name: dense, overrides: [model.variant=dense]}
seeds: [0, 1]
divergence:
  replays: [1, W/2, "4", exact, R_exact]
  lengths: [128]
  steps: 2
  prompts: {count: 2}
suite:
  replay: [4, W, 2W, R_exact, exact]
  examples: 3
  topk: [null, 2]
  kv: [null, "global:fp8"]
  families: [recall, multiturn]
  turns: [W/2, "3"]
  distances: [W, 40, R_exact]
  sweep_replay: [W]
  below_exact: true
  options: {state_length: 160}
real_text:
  replays: ["1", W]
  continuation: W/2
  lm_eval_modes: [full, replay=W/2]
  lm_eval_turn_modes: [replay=W]
  lm_eval_jobs: [ced, dense]
erf:
  tasks: [running_state]
  examples: 2
  length: 2W
  params: {running_state: {window_len: 3W/2, filler: 5}}
scales:
  small:
    suite: {examples: 1, families: null}
    erf: {examples: 1}
    divergence: {steps: 1}
    real_text: {passes: 2}
"""

SMALL = dict(d_model=32, n_heads=2, n_encoder_layers=2, window=8, global_from_layer=1,
             encoder_kv_groups=1, indexer_heads=2, indexer_dim=8, max_seq_len=256)
MODELS = {"ced": dict(SMALL, variant="ced", n_decoder_layers=2, topk=4),
          "yoco": dict(SMALL, variant="yoco", n_decoder_layers=2),
          "dense": dict(SMALL, variant="dense", n_decoder_layers=0)}

# the lm-eval reads of the real_text section, which the scale does not change
LM_EVAL = {
    "lm_eval/ced/seed0": "142bc8f4003e",
    "lm_eval/ced/seed0/ced_code/full": "723c61ff9366",
    "lm_eval/ced/seed0/ced_code/replay=W/2": "656c10015645",
    "lm_eval/ced/seed0/ced_code_turn/replay=W": "660c208733f3",
    "lm_eval/ced/seed1": "94f43c2b64b9",
    "lm_eval/ced/seed1/ced_code/full": "cb0caae64ba0",
    "lm_eval/ced/seed1/ced_code/replay=W/2": "c769748c6797",
    "lm_eval/ced/seed1/ced_code_turn/replay=W": "629d0302b1b6",
    "lm_eval/dense/seed0": "304fb6a64b5f",
    "lm_eval/dense/seed0/ced_code/full": "166156e7bb75",
    "lm_eval/dense/seed1": "448d9454a668",
    "lm_eval/dense/seed1/ced_code/full": "48bb38ec6f2b",
}

# the driver's plan of the fabricated study at each scale: step key -> hash (LM_EVAL too)
PINNED = {
    "demo": {
        "divergence": "450a0c4cbe37",
        "erf/ced/seed0": "385e88a5a233",
        "erf/ced/seed1": "b3b108616911",
        "real_text": "3edaa77945f4",
        "suite/ced/seed0": "5c24ab7bfa58",
        "suite/ced/seed0@kv=global:fp8": "2c9524a3acc8",
        "suite/ced/seed0@topk=2": "245d3c196db2",
        "suite/ced/seed0@topk=2@kv=global:fp8": "a866a083df0d",
        "suite/ced/seed1": "33ceb00c334e",
        "suite/ced/seed1@kv=global:fp8": "374efe7edb61",
        "suite/ced/seed1@topk=2": "b2cbe0ba349f",
        "suite/ced/seed1@topk=2@kv=global:fp8": "da719a9f1835",
        "suite/dense/seed0": "c631f35055db",
        "suite/dense/seed0@kv=global:fp8": "ee39dd1e5e73",
        "suite/dense/seed1": "087806b23a3c",
        "suite/dense/seed1@kv=global:fp8": "961204dfb59c",
        "suite/yoco/seed0": "fa1aea3fd183",
        "suite/yoco/seed0@kv=global:fp8": "83abb155b402",
        "suite/yoco/seed1": "c3efaea302b9",
        "suite/yoco/seed1@kv=global:fp8": "dda9cbb9d27c",
    },
    "small": {
        "divergence": "cac42607e8a9",
        "erf/ced/seed0": "be89d5a8f5ae",
        "erf/ced/seed1": "a416736cbc3f",
        "real_text": "f62eaa099b06",
        "suite/ced/seed0": "8959bb05d3be",
        "suite/ced/seed0@kv=global:fp8": "efdc0d250e8c",
        "suite/ced/seed0@topk=2": "a1892d6498a3",
        "suite/ced/seed0@topk=2@kv=global:fp8": "02483cd6e5f8",
        "suite/ced/seed1": "d3e5398b5b89",
        "suite/ced/seed1@kv=global:fp8": "ff40e343209e",
        "suite/ced/seed1@topk=2": "05a1cb4f10c9",
        "suite/ced/seed1@topk=2@kv=global:fp8": "1f114c27a353",
        "suite/dense/seed0": "c7f87a8d6f22",
        "suite/dense/seed0@kv=global:fp8": "82d17ef58e3c",
        "suite/dense/seed1": "7bdd7275b6d2",
        "suite/dense/seed1@kv=global:fp8": "66f1eba9cf7f",
        "suite/yoco/seed0": "a40fd32bf4e5",
        "suite/yoco/seed0@kv=global:fp8": "26182d04a3b4",
        "suite/yoco/seed1": "9feb752b4344",
        "suite/yoco/seed1@kv=global:fp8": "501fcf85cbb7",
    },
}


def fabricated_study(tmp_path, monkeypatch, scale: str) -> Study:
    """The pinned study over fabricated checkpoints (a config.json, an empty weights file and
    a training record whose hash names the run), with the registries its suite hash reads
    fixed, so that a family or policy added later does not move the pinned hashes."""
    import ced.inference
    import evals.suites.families as families
    monkeypatch.setattr(families, "FAMILIES", {name: families.FAMILIES[name] for name in
                                               ("recall", "short", "multiturn")})
    monkeypatch.setattr(ced.inference, "POLICIES", ("keep_decoder_swa", "suffix_only"))
    path = tmp_path / "pinned.yaml"
    path.write_text(STUDY)
    # the divergence step's hash holds its checkpoints' paths: relative, as the same study
    # directory read from the same place
    monkeypatch.chdir(tmp_path)
    out = Path("out")
    for job, config in MODELS.items():
        for seed in (0, 1):
            final = out / "runs" / job / f"seed{seed}" / "final"
            final.mkdir(parents=True)
            (final / "config.json").write_text(json.dumps(ModelConfig(**config).to_dict()))
            (final / "model.safetensors").write_bytes(b"")
            (final.parent / "study_step.json").write_text(
                json.dumps({"hash": f"trained-{job}-{seed}"}))
    study = Study(load_study(str(path), scale), out, 1, wandb=False)
    # the training rows are not what is pinned: every run counts as trained and skipped
    monkeypatch.setattr(study, "config_errors", lambda: {})
    monkeypatch.setattr(study, "decide", lambda job, seed, label: ("skip", "", "trained"))
    return study


def planned_hashes(study: Study) -> dict[str, str]:
    """step key -> hash of every evaluation step the plan lists."""
    return {row["run"]: row["hash"] for row in study.plan() if "hash" in row and row["hash"]}


@pytest.mark.parametrize("scale", ["demo", "small"])
def test_every_evaluation_step_keeps_its_hash(tmp_path, monkeypatch, scale):
    hashes = planned_hashes(fabricated_study(tmp_path, monkeypatch, scale))
    assert hashes == {**PINNED[scale], **LM_EVAL}
