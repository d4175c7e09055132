"""`python -m ced.train` (or `ced-train`): the training application over `ced.train`, Hydra
config root `conf/`.

    python -m ced.train model=ced data=synthetic train.steps=500
    python -m ced.train -m model=ced,yoco train.replay.probability=0,0.5     # a sweep
    python -m ced.train train.resume=auto hydra.run.dir=<run>              # continue a run

Composes and checks the config (one-line errors naming the key), expands `experiment=<study>`,
names a sweep's runs by what varies, continues a run from its own config.yaml, runs
`ced.train.train` and turns each way a run can stop into its line and exit code (2 bad
input, 3 diverged, 75 stopped with everything kept).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ced.checkpoint import CheckpointError, StorageFull
from ced.runlock import DirectoryLocked
from ced.data import build_source
from ced.train import NOT_FINISHED, Stopped, override_key, train
from ced.train.run_dir import (CONFIG_YAML, FINAL, TrainingDiverged, check_resumable,
                               checkpoint_dirs, flatten)
from ced.train_config import ConfigError, TrainConfig, validate
from ced.memory import advice, is_out_of_memory, oom_summary
from ced.presets import StudyError, study_train_overrides
from ced.writable import OutputDirError, check_hydra_output

from . import check_override_keys
from . import fail as _fail

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def _hydra_task(cfg) -> float | None:
    # lazy: Hydra costs ~0.2 s to import, and only a run inside the Hydra app calls this
    from hydra.core.hydra_config import HydraConfig
    hydra_cfg = HydraConfig.get()
    metrics: dict = {}
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        config = validate(from_run_config(cfg, hydra_cfg.overrides.task, run_dir))
        if config.logging.name is None and hydra_cfg.job.override_dirname:
            # A sweep's runs are named by what varies (group and folder keys excluded in
            # conf/train.yaml), so the dashboard tells them apart without opening configs.
            config.logging.name = hydra_cfg.job.override_dirname
        metrics = train(config, run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            print(finished_line(run_dir, metrics), flush=True)
    except ConfigError as exc:
        _fail(f"config error: {exc}", 2)
    except CheckpointError as exc:
        _fail(f"error: {exc}", 2)
    except TrainingDiverged as exc:
        _fail(f"training stopped: {exc}", 3)
    except Stopped as exc:
        _fail(f"{exc}; {resume_hint(run_dir)}", exc.code)
    except DirectoryLocked as exc:
        _fail(f"error: {exc}", 2)
    except StorageFull as exc:
        _fail(f"training stopped: {exc}; {resume_hint(run_dir)}", NOT_FINISHED)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        _fail(f"training stopped: no space left on the device ({exc.filename or run_dir}); "
              f"{resume_hint(run_dir)}", NOT_FINISHED)
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        # beyond the estimate (another process took memory, or the estimate fell short):
        # the same advice as a refusal, and nothing written but the checkpoints before it
        what = oom_summary(exc)
        keys = advice(config.train, None) if "config" in locals() else "lower train.batch_size"
        _fail(f"training stopped: out of memory ({what}); {keys}; {resume_hint(run_dir)}",
              NOT_FINISHED)
    finally:
        if int(os.environ.get("RANK", "0")) > 0:   # the throwaway Hydra dir of main()
            shutil.rmtree(hydra_cfg.runtime.output_dir, ignore_errors=True)
    return metrics.get("val/loss", metrics.get("loss"))


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir`: this run's own command-line overrides
    with train.resume=auto (inside the Hydra app; else the bare form)."""
    # lazy: Hydra costs ~0.2 s to import, and a resume hint is printed only when a run stops
    from hydra.core.hydra_config import HydraConfig
    given = []
    if HydraConfig.initialized():
        given = [o for o in HydraConfig.get().overrides.task
                 if override_key(o) not in ("train.resume", "hydra.run.dir", "train.overwrite")]
    return " ".join(["python -m ced.train", *given, "train.resume=auto",
                     f"hydra.run.dir={run_dir}"])


def resume_hint(run_dir: Path) -> str:
    """'the last checkpoint is X; resume with: <command>' for a stopped run."""
    saved = checkpoint_dirs(run_dir)
    last = saved[-1] if saved else "none yet (a resume starts from step 0)"
    return f"the last checkpoint is {last}; resume with: {resume_command(run_dir)}"


def from_run_config(cfg, given: list[str], run_dir: Path):
    """The config a run continues with. A resume of the run in `run_dir` (train.resume=auto,
    or a checkpoint of that run) starts from the run's own config.yaml, and only the keys the
    command line sets (`given`, Hydra's task overrides) replace its values, so
    `python -m ced.train train.resume=auto hydra.run.dir=<run>` needs nothing else; a key that
    changes what the run computes is then refused unless allowed (`config_changes`). Anything
    else (a new run, another run's checkpoint, a run without config.yaml): `cfg` as composed."""
    saved = run_dir / CONFIG_YAML
    resume = str(OmegaConf.select(cfg, "train.resume", default="never"))
    if resume == "never" or not saved.exists() or (
            resume != "auto" and run_dir.resolve() not in Path(resume).resolve().parents):
        return cfg
    try:
        base = OmegaConf.load(saved)
    except Exception as exc:
        raise CheckpointError(f"{saved}: cannot be read ({type(exc).__name__})") from None
    for item in given:
        key = override_key(item)
        if key.startswith("hydra") or ("=" not in item and not item.startswith("~")):
            continue
        if item.startswith("~"):
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(base, parent) if parent else base
            if node is not None and leaf in node:
                node.pop(leaf)
            continue
        for path in _keys_set_by(key, item.split("=", 1)[1], cfg):
            OmegaConf.update(base, path, OmegaConf.select(cfg, path), merge=False,
                             force_add=True)
    return base


def _keys_set_by(key: str, value: str, cfg) -> list[str]:
    """The config paths an override sets: itself, or for the choice of a group whose file is
    a `_global_` package (debug=fast) every leaf that file sets."""
    if "." in key or key in cfg:
        return [key]
    path = Path(CONF_DIR) / key / f"{value}.yaml"
    if not path.exists():
        return [key]
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return [k for k in flatten(values) if k != "defaults"] if isinstance(values, dict) else [key]


def finished_line(run_dir: Path, metrics: dict) -> str:
    """The last line of a finished run: where it is and how it ended (the final validation:
    answer loss, every task's accuracy, and the all-token loss, labelled as such)."""
    parts = [f"{k.removeprefix('val/acc/')} {v:.3f}" for k, v in sorted(metrics.items())
             if k.startswith("val/acc/")]
    loss = [f"answer loss {metrics['val/answer_loss']:.4f}"] if "val/answer_loss" in metrics else []
    loss += [f"all-token loss {metrics['val/loss']:.4f}"] if "val/loss" in metrics else []
    return (f"done: {run_dir} (step {metrics.get('step', '?')}); validation: "
            + ", ".join(loss + (["accuracy " + ", ".join(parts)] if parts else []))
            + f"; model: {run_dir / FINAL}")


GROUPS = ("model", "data", "optim", "train", "logging", "debug")


def check_overrides(overrides: list[str]) -> None:
    """Reject overrides Hydra cannot parse and `a.b=v` overrides of keys the schema lacks,
    before Hydra composes (`ced.cli.check_override_keys`). Keys under a free-form dict (e.g.
    data.tasks) pass."""
    check_override_keys(overrides, TrainConfig(), groups=GROUPS, also=("experiment",))


# `train.extend_to` is a TrainConfig key conf/train/default.yaml leaves out, so that every
# config that does not set it composes exactly as before (tests/unit/golden_configs.json)
FREE_FORM = ("data.tasks.", "train.extend_to=")


def free_form_overrides(overrides: list[str]) -> list[str]:
    """`data.tasks.<name>...=v` -> `++data.tasks.<name>...=v`. conf/data/synthetic.yaml leaves
    `tasks` empty so that every registered task is trained, and Hydra's struct mode refuses a
    plain override of a key it does not hold; `++` adds or overrides, so the documented
    `data.tasks.needle=null` and `data.tasks.copy.span_len=2` keep working. The same for
    `train.extend_to`, which the yaml leaves out."""
    return [f"++{item}" if item.startswith(FREE_FORM) and "=" in item else item
            for item in overrides]


def expand_experiment(overrides: list[str]) -> list[str]:
    """`experiment=<study>` -> the study's shared `train` overrides (conf/experiment/<study>.yaml,
    scale demo), placed before the other overrides; a key the command line also sets is taken
    from the command line. This is the preset of lightning-hydra-template's `experiment=`:
    `python -m ced.train experiment=demo model=yoco` trains like the demo study's yoco job.
    Studies are override lists for several jobs, not config fragments, so the expansion happens
    here rather than in Hydra's defaults list."""
    chosen = [o for o in overrides if override_key(o) == "experiment"]
    if not chosen:
        return list(overrides)
    if len(chosen) > 1 or "," in chosen[0]:
        raise ConfigError("experiment: one study per run (a sweep over studies is "
                          "`python -m experiments.run -m study=a,b`); got "
                          + " ".join(chosen))
    try:
        shared = study_train_overrides(chosen[0].split("=", 1)[1])
    except StudyError as exc:
        raise ConfigError(f"experiment: {exc}") from None
    rest = [o for o in overrides if o not in chosen]
    given = {override_key(o) for o in rest if "=" in o}
    preset = [o for o in shared if override_key(o) not in given]
    return preset + rest


def _check_launcher(overrides: list[str]) -> None:
    """hydra/launcher=slurm needs the optional plugin; say how to get it, in one line, instead
    of Hydra's 'Could not find submitit_slurm' from deep in the defaults list."""
    if not any(o.replace(" ", "") == "hydra/launcher=slurm" for o in overrides):
        return
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:       # no Hydra plugin at all: no hydra_plugins package
        found = False
    if not found:
        raise ConfigError("hydra/launcher=slurm: needs hydra-submitit-launcher, the `slurm` "
                          "extra: pip install -e '.[slurm]' (or pip install 'ced[slurm]')")


def compose_config(overrides: list[str]) -> TrainConfig:
    """What `python -m ced.train <overrides>` would train, composed and checked without
    training: the overrides' keys, the composed config's values, and whether the data source
    builds a row. A one-line ConfigError otherwise. Uses a fresh Hydra composition, so it
    cannot run inside a Hydra app (the study driver calls it in a subprocess:
    experiments/check_jobs.py)."""
    # lazy: Hydra costs ~0.2 s to import, paid only by a caller that composes a config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    args = expand_experiment(overrides)
    check_overrides(args)
    _check_launcher(args)
    args = [a for a in free_form_overrides(args)
            if not override_key(a).startswith("hydra")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            composed = compose("train", overrides=args)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError((str(exc).strip().splitlines() or ["cannot compose"])[0]) from None
    finally:
        GlobalHydra.instance().clear()
    config = validate(composed)
    try:
        build_source(config.data, "train").rows(0, 1, config.train.seq_len)
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    return config


# conf/train.yaml's hydra.job.config.override_dirname.exclude_keys: keys that say where a run
# goes, not what it trains (kept in sync by tests/integration/test_daily_loop.py)
NAME_EXCLUDES = ["hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra/launcher",
                 "logging", "logging.wandb", "logging.group", "logging.name",
                 "logging.project", "logging.mode", "logging.job_type", "logging.tags",
                 "train.resume", "train.threads", "train.progress", "experiment", "debug"]


def _sweeps(value: str) -> bool:
    """Whether an override value sweeps (Hydra's `a,b` at the top level, or range/choice/
    glob/interval), rather than setting one value."""
    if value.strip().startswith(("range(", "choice(", "glob(", "interval(")):
        return True
    depth = 0
    for ch in value:
        depth += ch in "[{(" and 1 or 0
        depth -= ch in "]})" and 1 or 0
        if ch == "," and depth == 0:
            return True
    return False


def name_sweep_by_what_varies(args: list[str]) -> list[str]:
    """For a multirun (-m): name each job by the keys whose values differ between the sweep's
    jobs only: its run name (logging.name, from Hydra's override_dirname) and its folder
    (`<job number>_<those keys>`); the overrides every job shares stay in each run's config.
    A command line that names its own subdir or exclusions is left as it is."""
    if not any(a in ("-m", "--multirun") for a in args) or any(
            override_key(a) in ("hydra.sweep.subdir",
                                 "hydra.job.config.override_dirname.exclude_keys")
            for a in args if "=" in a):
        return args
    items = [a for a in args if "=" in a and not a.startswith("-")]
    varying = [a for a in items if _sweeps(a.split("=", 1)[1])]
    if not varying:
        return args
    constant = sorted({override_key(a) for a in items if a not in varying
                       and not override_key(a).startswith("hydra")})
    excludes = ",".join(NAME_EXCLUDES + [k for k in constant if k not in NAME_EXCLUDES])
    return args + [f"hydra.job.config.override_dirname.exclude_keys=[{excludes}]",
                   "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"]


def check_resume_target(args: list[str]) -> None:
    """train.resume=auto on a single run: the directory must hold a run (`check_resumable`),
    checked before Hydra creates the directory, so that a mistyped path leaves nothing behind.
    A multirun's jobs are checked one by one when they start."""
    if any(a in ("-m", "--multirun") for a in args):
        return
    values = {override_key(a): a.split("=", 1)[1] for a in args if "=" in a}
    if values.get("train.resume", "").strip() != "auto":
        return
    if "hydra.run.dir" not in values:
        raise ConfigError("train.resume=auto: nothing to resume without hydra.run.dir=<run> "
                          "(a run without it goes to a new dated directory); name the run "
                          "directory, or drop train.resume to start a new run")
    check_resumable(Path(values["hydra.run.dir"]))


def set_offline_defaults() -> None:
    """Offline Hugging Face libraries unless the environment already chose: without it, a hub
    dataset name on a machine with no network retries for half a minute before its error.
    `HF_HUB_OFFLINE=0` (and `HF_DATASETS_OFFLINE=0`) in the environment go online."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main() -> None:
    """Console entry: Hydra main over conf/train.yaml. Processes other than rank 0 of a
    distributed launch keep Hydra from writing anything (rank 0's directory is broadcast)."""
    set_offline_defaults()   # before anything imports huggingface_hub, which reads it once
    # lazy: Hydra costs ~0.2 s to import; only running the command needs it
    import hydra
    try:
        args = expand_experiment(sys.argv[1:])
        check_overrides(args)
        _check_launcher(args)
        check_resume_target(args)
        args = name_sweep_by_what_varies(free_form_overrides(args))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:    # other ranks write to a throwaway dir
        try:     # before Hydra creates the run directory and opens its log file there
            check_hydra_output(args, Path(CONF_DIR) / "train.yaml")
        except OutputDirError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    sys.argv[1:] = args
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none",
                     "hydra/hydra_logging=none",
                     f"hydra.run.dir={os.environ.get('TMPDIR', '/tmp')}/ced-rank"
                     f"{os.environ['RANK']}-{os.getpid()}"]
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")(_hydra_task)()


