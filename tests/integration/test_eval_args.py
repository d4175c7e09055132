"""Evaluation arguments. A misspelt lm-eval `model_args` key, a bad mode
string, and a missing or damaged checkpoint given to lm-eval, `evals.divergence` or
`evals.suites` are errors in one line naming the key or the path (never a warning followed by
a run of the wrong mode, never a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ced.checkpoint import CheckpointError, save_model
from conftest import make_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "WANDB_SILENT": "true", "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_model(make_model(tiny_config(vocab_size=259, topk=3), 0),
                      tmp_path_factory.mktemp("ckpt") / "final")


@pytest.fixture
def damaged(checkpoint, tmp_path) -> Path:
    import shutil
    bad = tmp_path / "damaged"
    shutil.copytree(checkpoint, bad)
    (bad / "config.json").write_text('{"variant": "ced", ')
    return bad


def last_line(text: str) -> str:
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.strip()][-1]


FORMS = "replay: expected N (an int >= 1), W, W/k, kW, kW/d, R_exact or exact; got"


# ---- mode strings --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("replay=abc", f"{FORMS} 'abc'"),
    ("replay=0", f"{FORMS} '0'"),
    ("replay=", f"{FORMS} ''"),
    ("replay=W/0", f"{FORMS} 'W/0'"),
    ("turn=x,policy=suffix_only", "turn must be an int >= 1; got 'x'"),
    ("turn=exact,policy=suffix_only", "turn must be an int >= 1; got 'exact'"),
    ("turn=3,policy=suffix_only,encoder_replay=2.5", "encoder_replay: expected N (an int >= 1)"),
    ("turn=3,prefix_cache=maybe", "prefix_cache must be 0, 1, false or true; got 'maybe'"),
    ("turn=3,policy=magic", "policy must be one of"),
    ("replya=4", "unknown key(s) ['replya']; allowed:"),
])
def test_bad_mode_strings_are_one_line_errors_naming_the_key(text, message):
    from evals.modes import parse_mode
    with pytest.raises(ValueError) as info:
        parse_mode(text)
    assert str(info.value).startswith(f"mode {text!r}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


# ---- lm-eval model_args ---------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    ({"replya": "4"}, "unknown model_args key(s) ['replya']; allowed: ['checkpoint', 'replay'"),
    ({"replay": "4", "polcy": "suffix_only"}, "unknown model_args key(s) ['polcy']"),
    ({"replay": "abc"}, f"{FORMS} 'abc'"),
    ({"mode": "replay=x"}, f"mode 'replay=x': {FORMS} 'x'"),
    ({"turn": "two", "replay": "4"}, "turn must be an int >= 1; got 'two'"),
    ({"max_gen_toks": "many"}, "max_gen_toks must be an int >= 1"),
    ({"topk": "lots"}, "ced: topk: an int >= 1 or 'all'; got 'lots'"),
])
def test_lm_eval_model_args_are_checked(checkpoint, args, message):
    from evals.lmeval.model import CEDLM, ModelArgsError
    with pytest.raises(ModelArgsError) as info:
        CEDLM(checkpoint=str(checkpoint), **args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_lm_eval_on_a_missing_or_damaged_checkpoint_names_the_path(checkpoint, damaged, tmp_path):
    from evals.lmeval.model import CEDLM, ModelArgsError
    with pytest.raises(ModelArgsError, match=rf"ced: {tmp_path / 'nowhere'}: no such checkpoint"):
        CEDLM(checkpoint=str(tmp_path / "nowhere"))
    with pytest.raises(ModelArgsError, match=rf"ced: {damaged / 'config.json'}: not valid JSON"):
        CEDLM(checkpoint=str(damaged))
    assert CEDLM(checkpoint=str(checkpoint), replay="4").mode_name == "replay=4"


def test_lm_eval_entry_point_refuses_a_typo_in_one_line(checkpoint):
    """Before: a warning, then `full` scored with exit 0. The built-in task name is only looked
    up: the model is built (and refused) before any data would be fetched."""
    done = subprocess.run(
        [sys.executable, "-m", "evals.lmeval", "--model", "ced", "--model_args",
         f"checkpoint={checkpoint},replya=4", "--tasks", "lambada_openai", "--device", "cpu"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert last_line(done.stderr).startswith("error: ced: unknown model_args key(s) ['replya']")


# ---- evals.suites and evals.divergence on bad checkpoints ------------------------------------

def test_suite_on_a_missing_or_damaged_checkpoint_is_one_line(damaged, tmp_path, capsys):
    from evals.suites.__main__ import main
    for path, message in [(tmp_path / "nowhere", "no such checkpoint directory"),
                          (damaged, f"{damaged / 'config.json'}: not valid JSON")]:
        code = main(["--checkpoint", str(path), "--replay", "2", "--out", str(tmp_path / "o"),
                     "--quiet", "--no-plot"])
        assert code == 2
        err = capsys.readouterr().err
        assert last_line(err) == err.strip() and err.startswith("error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_divergence_checks_every_checkpoint_before_running(checkpoint, damaged, tmp_path):
    from evals.divergence import DivergenceConfig, run
    out = tmp_path / "div"
    config = DivergenceConfig(checkpoints=[str(checkpoint), str(damaged)], replays=[2],
                              lengths=[16])
    with pytest.raises(CheckpointError, match=rf"{damaged / 'config.json'}: not valid JSON"):
        run(config, out)
    assert not out.exists()   # the good first checkpoint was not evaluated for nothing


def test_divergence_entry_point_on_a_missing_checkpoint_is_one_line(tmp_path):
    missing = tmp_path / "nowhere" / "final"
    done = subprocess.run(
        [sys.executable, "-m", "evals.divergence", f"checkpoints=[{missing}]", "replays=[2]",
         f"hydra.run.dir={tmp_path / 'out'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert last_line(done.stderr) == f"error: {missing}: no such checkpoint directory"


def test_divergence_entry_point_runs_offline_by_default():
    """Class 7: the divergence entry point sets the offline flags as defaults (the trainer's
    are tested in test_run_safety.py)."""
    code = ("import os, sys; os.environ.pop('HF_HUB_OFFLINE', None); "
            "os.environ['HF_DATASETS_OFFLINE'] = '0'; import evals.divergence as d; "
            "sys.argv = ['x', '--help']; d.main()")
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    probe = ("import atexit, os; atexit.register(lambda: print('FLAGS', "
             "os.environ.get('HF_HUB_OFFLINE'), os.environ.get('HF_DATASETS_OFFLINE')))")
    done = subprocess.run([sys.executable, "-c", probe + "; " + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "FLAGS 1 0" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
