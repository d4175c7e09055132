"""Compose-only checks of every Hydra config, in the style of lightning-hydra-template: every
study and every job of it composes into a valid training config, the presets (model=tiny,
debug=fast, experiment=<study>) compose, the sweep settings are what sweeps need, the SLURM
launcher config composes, and bad study files or presets fail with one line naming the key.
Nothing here trains or starts a subprocess."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import ced.cli.train as trainer
import ced.train as training
from ced.train_config import ConfigError, validate
from experiments.run import DRIVER_KEYS, DriverConfig, check_driver_overrides
from experiments.training_runs import training_overrides
from experiments.study import STUDY_DIR, StudyError, load_study

STUDIES = sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


def compose_train(overrides: list[str], hydra_config: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=trainer.CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_config)


@pytest.mark.parametrize("scale", ["demo", "full"])
@pytest.mark.parametrize("name", STUDIES)
def test_every_job_of_every_study_composes_into_a_valid_training_config(name, scale):
    study = load_study(name, scale)
    for job in study.jobs:
        for seed in study.seeds:
            overrides = [*study.train, *job.overrides, f"train.seed={seed}"]
            # (tiny's job `broken` composes too: it fails on purpose at run time, diverging)
            config = validate(compose_train(overrides))
            assert config.train.seed == seed


@pytest.mark.parametrize("name", STUDIES)
def test_experiment_preset_for_ced_train(name):
    """`python -m ced.train experiment=<study>` = the study's shared overrides; a key given on
    the command line wins over the study's."""
    study = load_study(name)
    args = trainer.expand_experiment([f"experiment={name}", "train.steps=7", "model=yoco"])
    assert args[-2:] == ["train.steps=7", "model=yoco"]
    assert not any(a.startswith(("train.steps=", "model=")) for a in args[:-2])
    assert set(args[:-2]) <= set(study.train)
    config = validate(compose_train(args))
    assert config.train.steps == 7 and config.model.variant == "yoco"


def test_experiment_preset_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"^experiment: study=nope: no .*known studies"):
        trainer.expand_experiment(["experiment=nope"])
    with pytest.raises(ConfigError, match="one study per run"):
        trainer.expand_experiment(["experiment=demo,tiny"])


def test_tiny_and_fast_presets_make_a_seconds_long_run_in_two_overrides():
    config = validate(compose_train(["model=tiny", "debug=fast"]))
    assert config.model.d_model == 32 and config.model.variant == "ced"
    assert config.train.steps == 4 and config.train.seq_len <= config.model.max_seq_len
    assert config.logging.wandb is False
    # the command line still wins over the preset
    assert validate(compose_train(["model=tiny", "debug=fast", "train.steps=9"])).train.steps == 9


def test_paper_scale_model_is_refused_in_one_line_naming_the_cost_model():
    with pytest.raises(ConfigError) as err:
        validate(compose_train(["model=deepseek_v41_flash"]))
    message = str(err.value)
    assert "\n" not in message and "cost model" in message
    assert "python -m ced.cost model=deepseek_v41_flash" in message


def test_sweep_folders_are_job_numbers_and_run_names_leave_out_folder_and_group_keys():
    cfg = compose_train(["model=tiny"], hydra_config=True)
    from omegaconf import OmegaConf
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
    assert {"hydra.run.dir", "hydra.sweep.dir", "logging.group", "logging.name",
            "experiment"} <= excluded


def test_slurm_launcher_config_composes():
    """With hydra-submitit-launcher installed its schema checks our keys; without it, a
    stand-in node takes its place so that our file's composition is still checked."""
    import importlib.util
    try:
        have_plugin = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        have_plugin = False
    if not have_plugin:
        from hydra.core.config_store import ConfigStore
        ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm", node={
            "_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
            "timeout_min": 60, "nodes": 1, "tasks_per_node": 1, "gpus_per_node": None,
            "cpus_per_task": None, "mem_gb": None, "partition": None})
    cfg = compose_train(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                        hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.partition == "gpu" and launcher.gpus_per_node == 1
    assert launcher.timeout_min == 240


def test_missing_slurm_plugin_names_the_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if "submitit" in name else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[slurm\]'"):
        trainer._check_launcher(["-m", "hydra/launcher=slurm"])
    trainer._check_launcher(["model=ced"])       # no launcher asked for: nothing to check


def test_unknown_group_is_one_line():
    with pytest.raises(ConfigError, match=r"^modle: unknown config group; allowed: "):
        trainer.check_overrides(["modle=ced"])
    trainer.check_overrides(["debug=fast", "model=tiny"])


# ---- study files -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,key", [
    ("jobs:\n  - {name: a, overides: [model=yoco]}\n", "jobs[0].overides"),
    ("jobs: [{name: a}]\nsuite: {replay: [4], exampels: 3}\n", "suite.exampels"),
    ("jobs: [{name: a}]\ndivergance: {replays: [1]}\n", "divergance"),
    ("jobs: [{name: a}]\ndivergence: {prompts: {cont: 3}}\n", "divergence.prompts.cont"),
    ("jobs: [{name: a}]\nscales: {full: {trian: []}}\n", "scales.full.trian"),
    ("jobs: [{name: a}]\nseed: [1, 2]\n", "seed"),
    ("jobs: [{name: a}]\nreal_text: {pases: 2}\n", "real_text.pases"),
    ("jobs: [{name: a}]\nscales: {full: {real_text: {contxt: 9}}}\n", "scales.full.real_text.contxt"),
])
def test_a_study_with_a_misspelt_key_is_rejected_naming_the_key(tmp_path, text, key):
    message = _study_error(tmp_path, text)
    assert "\n" not in message
    assert f"{key}: unknown key; allowed keys of " in message


def _study_error(tmp_path, text: str) -> str:
    """The StudyError message of loading a study file `name: bad` + text."""
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\n" + text)
    with pytest.raises(StudyError) as err:
        load_study(str(path))
    return str(err.value)


@pytest.mark.parametrize("text,fragment", [
    ("jobs: [{name: a}]\nseeds: [a]\n", "seeds"),
    ("jobs: [{name: a}, {name: a}]\n", "distinct names"),
    ("jobs: [{name: a}]\nseeds: []\n", "at least one seed"),
    ("jobs: [{name: a/b}]\n", "directory name"),
    ("jobs: [{name: a}]\nsuite: {kv: [null, 'global:fp5']}\n", r"suite.kv\[1\]: .*fp5"),
    ("jobs: [{name: a}]\nsuite: {kv: ['globl:fp8']}\n", r"suite.kv\[0\]: .*POINT:FORMAT"),
    ("jobs: [{name: a}]\nsuite: {distances: [4, 0]}\n", r"suite.distances\[1\]: expected"),
    ("jobs: [{name: a}]\nsuite: {distances: [Rexact]}\n", r"suite.distances\[0\]: .*'Rexact'"),
    ("jobs: [{name: a}]\nsuite: {options: {state_lenght: 9}}\n",
     r"suite.options: \['state_lenght'\] cannot be set here; allowed: .*state_length"),
    ("jobs: [{name: a}]\nsuite: {options: {replays: [W]}}\n",
     r"suite.options: \['replays'\] cannot be set here"),
    ("jobs: [{name: a}]\nsuite: {options: {state_length: long}}\n",
     r"suite.options.state_length: .*'long'"),
])
def test_bad_study_values_are_one_line(tmp_path, text, fragment):
    message = _study_error(tmp_path, text)
    assert re.search(fragment, message), message
    assert "\n" not in message


def test_suite_distances_resolve_against_the_reference_model():
    """`suite.distances` reaches evals.suites as `distances`, W forms and R_exact resolved for
    the reference model (R_exact dropped for a model without a decoder), other options kept."""
    from ced import ModelConfig
    from ced.config import exact_replay_length
    from experiments.sections import SuiteSpec, suite_options
    spec = SuiteSpec(replay=["W"], examples=7, families=["recall"],
                     distances=["R_exact", "2W", 62, 5], options={"state_length": 40})
    ced = ModelConfig(variant="ced", n_encoder_layers=2, n_decoder_layers=2, window=16,
                      encoder_kv_groups=0)
    options = suite_options(spec, ced, ced, kv="window:fp8")
    r = exact_replay_length(ced)
    assert options == {"replays": ["16"], "examples": 7, "families": ["recall"],
                       "distances": [r, 32, 62, 5], "kv": "window:fp8", "state_length": 40}
    dense = ModelConfig(variant="dense", n_encoder_layers=2, n_decoder_layers=2, window=16,
                        encoder_kv_groups=0)
    assert suite_options(spec, dense, dense)["distances"] == [32, 62, 5]
    assert "distances" not in suite_options(SuiteSpec(replay=["W/2"]), ced, ced)


def test_suite_options_are_a_suite_config():
    """What the driver writes for `experiments.job suite` loads as a SuiteConfig, field for
    field: the driver and the command line configure the suite through the same dataclass."""
    from ced import ModelConfig
    from evals.suites.runner import SuiteConfig
    from experiments.job import load_job
    from experiments.sections import SuiteSpec, suite_options
    spec = SuiteSpec(replay=["W/2", "W"], examples=3, turns=[2], sweep_replay=["W"],
                     options={"needle_distractors": 17})
    ced = ModelConfig(variant="ced", n_encoder_layers=2, n_decoder_layers=2, window=16,
                      encoder_kv_groups=0)
    raw = {**suite_options(spec, ced, ced, topk="all"), "checkpoint": "c", "out": "o"}
    config, _ = load_job("suite", raw)
    assert isinstance(config, SuiteConfig)
    assert (config.replays, config.examples, config.turns, config.sweep_replays,
            config.topk, config.needle_distractors) == (["8", "16"], 3, [2], ["16"], "all", 17)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['replay'\]"):
        load_job("suite", {**raw, "replay": ["W"]})
    with pytest.raises(ValueError, match="KIND: one of"):
        load_job("suites", raw)


def test_suite_replays_and_turns_resolve_against_each_model():
    """A study over several windows (the scaling study) reads each model at its own N = W and
    W/2 and cuts its turns at its own W/4, while every model is read at the reference's
    distances; a model without a decoder takes the reference's replays (it runs `full` only)."""
    from ced import ModelConfig
    from experiments.sections import SuiteSpec, suite_options

    def ced(window: int) -> ModelConfig:
        return ModelConfig(variant="ced", n_encoder_layers=2, n_decoder_layers=2,
                           window=window, encoder_kv_groups=0)
    spec = SuiteSpec(replay=["W/2", "W", "R_exact"], examples=5, turns=[2, "W/4"],
                     distances=["2W"])
    ref = ced(16)
    for window in (8, 16, 32):
        own = ced(window)
        r = 2 * (window - 1) + 1
        turns = [2] + ([window // 4] if window // 4 != 2 else [])   # duplicates dropped
        assert suite_options(spec, ref, own) == {
            "replays": [str(window // 2), str(window), str(r)], "examples": 5,
            "turns": turns, "distances": [32]}
    swa = ModelConfig(variant="swa", n_encoder_layers=2, n_decoder_layers=2, window=8,
                      encoder_kv_groups=0)
    assert suite_options(spec, ref, swa)["replays"] == ["8", "16", "31"]


def test_seeds_default_to_one_and_can_be_overridden():
    assert load_study("tiny").seeds == [0]
    assert load_study("tiny", seeds=[0, 1, 2]).seeds == [0, 1, 2]


def test_scales_apply_and_unknown_scale_is_rejected():
    demo, full = load_study("demo", "demo"), load_study("demo", "full")
    assert full.train[:len(demo.train)] == demo.train and len(full.train) > len(demo.train)
    assert full.evaluations["suite"].examples > demo.evaluations["suite"].examples
    with pytest.raises(StudyError, match="scale=huge"):
        load_study("demo", "huge")


# ---- the driver's own config -------------------------------------------------------------------

@pytest.mark.parametrize("name", STUDIES)
def test_driver_config_composes_for_every_study(name):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=trainer.CONF_DIR, version_base="1.3"):
        cfg = compose("study", overrides=[f"study={name}", "seeds=[0,1]", "only=eval"])
    opts = DriverConfig(**cfg)
    opts.check()
    assert opts.study == name and opts.seeds == [0, 1] and sorted(cfg) == DRIVER_KEYS


def test_driver_rejects_unknown_keys_and_values_in_one_line():
    with pytest.raises(StudyError, match=r"^studdy: unknown driver key; allowed: "):
        check_driver_overrides(["studdy=demo"])
    check_driver_overrides(["-m", "study=demo", "hydra.verbose=true", "--cfg", "job"])
    with pytest.raises(StudyError, match="only: must be"):
        DriverConfig(study="demo", only="everything").check()
    with pytest.raises(StudyError, match="study: required"):
        DriverConfig().check()


def test_driver_help_lists_every_study():
    """The list is read from conf/experiment/ when --help runs, so a new study is in it."""
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "experiments.run", "--help"],
                          cwd=Path(trainer.CONF_DIR).parent, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines()
                if ln.strip().startswith("Studies (conf/experiment/):"))
    assert [s.strip() for s in line.split(":", 1)[1].split(",")] == STUDIES


def test_mixed_precision_defers_to_accelerate(monkeypatch, tmp_path):
    """train.mixed_precision defaults to null: `accelerate launch --mixed_precision bf16` (which
    sets ACCELERATE_MIXED_PRECISION) decides; fp16 from there is still refused on CPU."""
    config = validate(compose_train(["model=tiny", "debug=fast", "train.device=cpu"]))
    assert config.train.mixed_precision is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    try:
        assert training.make_accelerator(config, tmp_path).mixed_precision == "bf16"
    finally:
        training._reset_accelerate()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="fp16 does nothing on CPU"):
        training.make_accelerator(config, tmp_path)


@pytest.mark.parametrize("precision,slowdown,warned", [
    ("bf16", 27.0, True), ("bf16", 1.0, False), ("no", 27.0, False)])
def test_bf16_on_a_cpu_that_emulates_it_warns_before_training(monkeypatch, tmp_path, capsys,
                                                               precision, slowdown, warned):
    """A CPU run in bf16 autocast on a CPU whose bf16 matmuls are emulated (the probe's
    slowdown, stubbed here) says so on stderr, naming the key; fp32, or native bf16, says
    nothing."""
    monkeypatch.setattr(training, "bf16_matmul_slowdown", lambda: slowdown)
    config = validate(compose_train(["model=tiny", "debug=fast", "train.device=cpu",
                                     f"train.mixed_precision={precision}"]))
    try:
        training.make_accelerator(config, tmp_path)
    finally:
        training._reset_accelerate()
    err = capsys.readouterr().err
    assert ("train.mixed_precision=bf16 on a CPU without native bf16" in err) == warned
    if warned:
        assert "27x slower" in err


@pytest.mark.parametrize("slowdown,resolved", [(27.0, "no"), (1.2, "bf16")])
def test_auto_precision_trains_in_bf16_only_where_the_cpu_computes_it(monkeypatch, tmp_path,
                                                                       capsys, slowdown,
                                                                       resolved):
    """train.mixed_precision=auto resolves on the machine: bf16 autocast where the probe says
    bf16 is native, fp32 where it is emulated; it says which, and never warns (it chose)."""
    monkeypatch.setattr(training, "bf16_matmul_slowdown", lambda: slowdown)
    config = validate(compose_train(["model=tiny", "debug=fast", "train.device=cpu",
                                     "train.mixed_precision=auto"]))
    assert config.train.mixed_precision == "auto"
    try:
        assert training.make_accelerator(config, tmp_path).mixed_precision == resolved
    finally:
        training._reset_accelerate()
    err = capsys.readouterr().err
    assert f"train.mixed_precision=auto: {'fp32' if resolved == 'no' else 'bf16'}" in err
    assert "warning" not in err


def test_an_unknown_precision_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="train.mixed_precision.*'auto'"):
        validate(compose_train(["model=tiny", "train.mixed_precision=fp8"]))


# The findings scale trains each shared run once: these jobs of different studies must train the
# very same thing (same overrides, so the same hash), or `reuse=` silently retrains them.
SHARED_RUNS = [("replay_length", "no_sim"), ("variants", "ced"), ("topk", "k16"),
               ("multi_turn", "no_sim"), ("kv_precision", "no_sim"), ("scaling", "L2_W16")], [
    ("replay_length", "sim_uniform_2W"), ("multi_turn", "sim_uniform_2W")]


@pytest.mark.parametrize("scale", ["demo", "full"])
@pytest.mark.parametrize("group", SHARED_RUNS, ids=["no_sim", "sim_uniform_2W"])
def test_jobs_shared_between_studies_train_the_same_run(group, scale):
    trained = {(name, job): training_overrides(load_study(name, scale), job, 0)
               for name, job in group}
    first = next(iter(trained.values()))
    assert all(t == first for t in trained.values()), trained
