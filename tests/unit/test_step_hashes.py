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
        "divergence": "f8ace4f624d2",
        "erf/ced/seed0": "6106ace5e85d",
        "erf/ced/seed1": "161b064cf90b",
        "real_text/ced/seed0": "7d16d5c0b7fc",
        "real_text/ced/seed1": "e5ba6520a37a",
        "real_text/dense/seed0": "d5fa5ca3024e",
        "real_text/dense/seed1": "320bf4bf77e5",
        "real_text/yoco/seed0": "cfac281fb813",
        "real_text/yoco/seed1": "040c7729ce3f",
        "suite/ced/seed0": "2f0024017180",
        "suite/ced/seed0@kv=global:fp8": "99c317199841",
        "suite/ced/seed0@topk=2": "4363e5650b05",
        "suite/ced/seed0@topk=2@kv=global:fp8": "63828ae36ee8",
        "suite/ced/seed1": "4180022b6751",
        "suite/ced/seed1@kv=global:fp8": "e72c661babc1",
        "suite/ced/seed1@topk=2": "06c7c443221d",
        "suite/ced/seed1@topk=2@kv=global:fp8": "dacf8dc2af73",
        "suite/dense/seed0": "a4df97c684a7",
        "suite/dense/seed0@kv=global:fp8": "08fba9b8449f",
        "suite/dense/seed1": "256ea82ced91",
        "suite/dense/seed1@kv=global:fp8": "19e86bbb4818",
        "suite/yoco/seed0": "7d1e91d6018b",
        "suite/yoco/seed0@kv=global:fp8": "2a4111bd3052",
        "suite/yoco/seed1": "3c4b95cbef4d",
        "suite/yoco/seed1@kv=global:fp8": "c601582f5abb",
    },
    "small": {
        "divergence": "84d18fe93288",
        "erf/ced/seed0": "92bc066cad38",
        "erf/ced/seed1": "a81506c02ee4",
        "real_text/ced/seed0": "7ae9609d4baf",
        "real_text/ced/seed1": "4d7d3e83399d",
        "real_text/dense/seed0": "ff8ff56bb238",
        "real_text/dense/seed1": "4df7b0ab5feb",
        "real_text/yoco/seed0": "ba38a93f9aa0",
        "real_text/yoco/seed1": "ffd7c3151ef1",
        "suite/ced/seed0": "fafeef02e3ae",
        "suite/ced/seed0@kv=global:fp8": "0f8b6b1234aa",
        "suite/ced/seed0@topk=2": "c339053ad3fd",
        "suite/ced/seed0@topk=2@kv=global:fp8": "acfb166e88e0",
        "suite/ced/seed1": "f042eb61d3dc",
        "suite/ced/seed1@kv=global:fp8": "3f1d967b2277",
        "suite/ced/seed1@topk=2": "f093339a52b8",
        "suite/ced/seed1@topk=2@kv=global:fp8": "4faf795d6e7a",
        "suite/dense/seed0": "ab0b60c3340f",
        "suite/dense/seed0@kv=global:fp8": "76cf4e7af957",
        "suite/dense/seed1": "a70748a235e4",
        "suite/dense/seed1@kv=global:fp8": "32ec4929873d",
        "suite/yoco/seed0": "de0346e06251",
        "suite/yoco/seed0@kv=global:fp8": "e707e28336db",
        "suite/yoco/seed1": "f1049936a539",
        "suite/yoco/seed1@kv=global:fp8": "9dab1b332194",
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
