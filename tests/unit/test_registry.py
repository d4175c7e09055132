"""One home for each idea: a task is one registry entry (generator, defaults, chance
level, suite sweeps); `data=synthetic` trains every registered task; model configs are a base
plus deltas and studies share a small-model preset. Golden values were computed on main before
the change (tests/unit/golden_configs.json): the training rows, the composed model configs and
every study job's overrides and composed config must be what they were."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

import ced.cli.train as trainer
from ced import ModelConfig
from ced.data import (TASKS, DataConfig, Point, Sweep, build_source, chance_accuracy,
                      family_task, filler_text, task, unregister)
from ced.train_config import model_conf
from evals.suites.families import FAMILIES, SuiteSettings, build_documents
from experiments.study import STUDY_DIR, StudyError, load_study, normalise_overrides

GOLDEN = json.loads((Path(__file__).with_name("golden_configs.json")).read_text())


def rows_hash(source, count: int = 8, seq_len: int = 256) -> str:
    batch = source.rows(0, count, seq_len)
    digest = hashlib.sha256()
    for key in ("input_ids", "labels", "answer_mask", "family_ids"):
        digest.update(key.encode())
        digest.update(batch[key].to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def study_rows_length(composed) -> int:
    """The row length a study job's rows are hashed at: its own train.seq_len where that is
    longer than the 256 every other golden row uses (a job whose examples do not fit 256)."""
    return max(256, int(composed.train.seq_len))


def compose_train(overrides: list[str]):
    """The training config `python -m ced.train <overrides>` composes (free-form task keys
    rewritten as the trainer does)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=trainer.CONF_DIR, version_base="1.3"):
        return compose("train", overrides=trainer.free_form_overrides(overrides))


# ---- training data: bit for bit what main built ----------------------------------------------
@pytest.mark.parametrize("split", ["train", "validation"])
def test_data_synthetic_rows_are_those_of_main(split):
    composed = compose_train(["data=synthetic"]).data
    assert rows_hash(build_source(composed, split)) == GOLDEN["rows"][f"data=synthetic/{split}"]
    assert rows_hash(build_source(DataConfig(), split)) == GOLDEN["rows"][f"data=synthetic/{split}"]


def test_curriculum_and_command_line_task_overrides_are_those_of_main():
    assert (rows_hash(build_source({"curriculum_rows": 64}, "train"))
            == GOLDEN["rows"]["curriculum_rows=64/train"])
    for item in ("data.tasks.needle=null", "data.tasks.copy.span_len=2"):
        overrides = trainer.free_form_overrides([item])
        assert overrides == [f"++{item}"]
        data = compose_train(overrides).data
        assert rows_hash(build_source(data, "train")) == GOLDEN["rows"][item], item


def test_only_narrows_and_orders_the_tasks():
    source = build_source({"only": ["copy", "kv_recall"]}, "train")
    assert source.families == ["copy", "kv_recall"]
    with pytest.raises(ValueError, match=r"^data\.only: unknown task 'kv_recal'; allowed: "):
        build_source({"only": ["kv_recal"]}, "train")
    with pytest.raises(ValueError, match=r"^data\.only must be null"):
        build_source({"only": []}, "train")
    with pytest.raises(ValueError, match=r"^data\.mixture\[0\]\.only: task 'copy' is also "):
        build_source({"kind": "mixture", "mixture": [
            {"kind": "synthetic", "only": ["copy"], "tasks": {"copy": None}}]}, "train")


# ---- the registry: one entry per task, one name per idea -------------------------------------
def test_every_family_belongs_to_one_registered_task():
    expect = {"recall": "kv_recall", "short": "kv_recall", "boundary": "kv_recall",
              "multiturn": "kv_recall", "copy": "copy", "multihop": "variable_tracking",
              "running_count": "running_state", "running_parity": "running_state",
              "running_bracket": "running_state", "multiturn_count": "running_state",
              "needle": "needle"}
    assert {name: family_task(name) for name in FAMILIES} == expect
    assert {name: FAMILIES[name].task for name in FAMILIES} == expect
    with pytest.raises(ValueError, match="unknown family 'kv_recall'"):
        family_task("kv_recall")


def test_names_already_taken_are_refused():
    with pytest.raises(ValueError, match="task 'copy' is already registered"):
        task("copy", chance=lambda p: 0.5, sweeps=())(lambda rng: ("", "", {}))
    with pytest.raises(ValueError, match="sweep name 'recall' is already taken"):
        task("other", chance=lambda p: 0.5,
             sweeps=[Sweep("recall", "distance", lambda s: [])])(lambda rng: ("", "", {}))
    with pytest.raises(ValueError, match="task 'multihop': already the name of a family"):
        task("multihop", chance=lambda p: 0.5, sweeps=())(lambda rng: ("", "", {}))
    assert "other" not in TASKS and "multihop" not in TASKS


def test_chance_levels_come_from_the_registry():
    for name, entry in TASKS.items():
        assert chance_accuracy(name) == entry.chance({**entry.defaults})
    assert chance_accuracy("running_state", kind="parity") == 0.5


# ---- a new task in a few lines, without touching library code --------------------------------
def parrot(rng, word_len: int = 3, distance=None, length=None, filler: int = 8):
    """Repeat the word said `distance` tokens ago: "<word>. ... say?" -> word."""
    word = "".join(rng.choice("XYZ") for _ in range(word_len))
    fact, query = f"{word}. ", "say?"
    gap = rng.randint(0, filler) if distance is None else distance - len(fact) - len(query)
    context = filler_text(rng, 4) + fact + filler_text(rng, gap) + query
    return context, word, {"distance": len(fact) + gap + len(query)}


def points_parrot(settings) -> list[Point]:
    return [Point(d, {"distance": d}) for d in sorted({n + 1 for n in settings.replays})]


@pytest.fixture
def parrot_task():
    task("parrot", chance=lambda p: 1 / 3 ** p["word_len"],
         sweeps=[Sweep("parrot_past_n", "distance", points_parrot, "a word just before N")])(
        parrot)
    yield
    unregister("parrot")


def test_a_new_task_is_swept_by_the_suite_and_trained_by_data_synthetic(parrot_task):
    cfg = ModelConfig(variant="ced", vocab_size=259, d_model=32, n_heads=2, n_encoder_layers=2,
                      n_decoder_layers=2, window=8, topk=8, global_from_layer=1,
                      encoder_kv_groups=1, indexer_heads=2, indexer_dim=8, max_seq_len=256)
    docs = build_documents(SuiteSettings.from_config(cfg, [8, 16]), 2, ["parrot_past_n"])
    assert [(d["x"], d["task"]) for d in docs] == [(9, "parrot")] * 2 + [(17, "parrot")] * 2
    assert all(d["chance"] == 1 / 27 and d["distance"] == d["x"] for d in docs)
    assert "parrot_past_n" in FAMILIES and FAMILIES["parrot_past_n"].task == "parrot"

    composed = compose_train(["data=synthetic"]).data
    source = build_source(composed, "train")
    assert source.families == ["kv_recall", "copy", "variable_tracking", "running_state",
                               "needle", "parrot"]
    batch = source.rows(0, 16, 256)
    assert (batch["family_ids"] == source.families.index("parrot")).any()
    assert build_source({**OmegaConf.to_container(composed), "only": ["parrot"]},
                        "train").families == ["parrot"]


@functools.lru_cache(maxsize=None)
def composed_study_jobs() -> dict[str, DictConfig]:
    """study/scale/job -> the training config of every study job, composed once for this file's
    tests (Hydra's compose costs about 0.1 s a job, and there are some 160). Composition reads
    only the yaml tree and the study files, never the task registry (`free_form_overrides` only
    prefixes keys), so one composition serves before and after a task is registered; nothing
    here mutates the configs it is handed."""
    out = {}
    for path in sorted(STUDY_DIR.glob("*.yaml")):
        for scale in ("demo", "full"):
            study = load_study(path.stem, scale)
            for job in study.jobs:
                out[f"{path.stem}/{scale}/{job.name}"] = compose_train([*study.train,
                                                                        *job.overrides])
    return out


def study_training_data() -> dict[str, tuple[dict, list[str] | None]]:
    """study/scale/job -> (its data config, resolved, and the tasks its training source draws)
    of every study job, as the task registry stands now."""
    return {key: (OmegaConf.to_container(cfg.data, resolve=True),
                  getattr(build_source(cfg.data, "train"), "families", None))
            for key, cfg in composed_study_jobs().items()}


def test_a_new_task_changes_what_no_study_trains():
    """Studies name their tasks (data.only): a task registered later enters data=synthetic's
    mix, not a study's."""
    before = study_training_data()
    task("parrot", chance=lambda p: 1 / 3 ** p["word_len"], sweeps=())(parrot)
    try:
        assert "parrot" in build_source(compose_train(["data=synthetic"]).data,
                                        "train").families
        assert study_training_data() == before
    finally:
        unregister("parrot")


# ---- model configs: a base plus deltas, composed as before ------------------------------------
@pytest.mark.parametrize("name", ["dense", "swa", "yoco", "ced", "tiny"])
def test_model_configs_compose_to_those_of_main(name):
    composed = OmegaConf.to_container(compose_train([f"model={name}"]).model, resolve=True)
    assert composed == GOLDEN["model"][name]
    assert model_conf(name) == GOLDEN["model"][name]


def test_variant_files_are_small_deltas():
    for name in ("dense", "swa", "yoco", "ced"):
        keys = [line for line in (STUDY_DIR.parent / "model" / f"{name}.yaml").read_text()
                .splitlines() if line and not line.startswith(("#", " ", "defaults"))]
        assert len(keys) <= 2, (name, keys)


# ---- studies: the shared small-model preset changes nothing a study trains -------------------
@pytest.mark.parametrize("scale", ["demo", "full"])
@pytest.mark.parametrize("name", sorted(p.stem for p in STUDY_DIR.glob("*.yaml")))
def test_every_study_job_trains_what_it_trained_on_main(name, scale):
    study = load_study(name, scale)
    for job in study.jobs:
        golden = GOLDEN["studies"][f"{name}/{scale}/{job.name}"]
        overrides = [*study.train, *job.overrides]
        assert normalise_overrides(overrides) == golden["overrides"]
        if job.name == "broken":              # tiny's job that fails on purpose
            continue
        composed = composed_study_jobs()[f"{name}/{scale}/{job.name}"]
        cfg = OmegaConf.to_container(composed, resolve=True)
        rest = json.dumps({k: v for k, v in cfg.items() if k != "data"}, sort_keys=True)
        assert hashlib.sha256(rest.encode()).hexdigest()[:16] == golden["config"]
        assert rows_hash(build_source(composed.data, "train"), 4,
                         study_rows_length(composed)) == golden["rows"]


def test_an_unknown_preset_is_one_line_naming_the_key(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text("name: s\npresets: [smal_model]\njobs: [{name: a}]\n")
    with pytest.raises(StudyError, match=r"^study s: presets\[0\]: no preset 'smal_model'; "
                                         r"known presets: \['recipe', 'small_model'\]$"):
        load_study(str(study))
