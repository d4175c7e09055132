"""An evaluation tool is one module and one registration (`experiments.tools.register`): a
dummy tool written into a temporary module, registered by the one call in it, is accepted as a
study section (its keys checked), run by the driver per model in its own job process (which
imports the module by name), skipped when fresh, rerun alone when one of its options or a
default of its config changes (the built-in erf step beside it stays skipped), and planned by
`only=plan`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from experiments import tools
from experiments.run import DriverConfig, run_study
from experiments.study import StudyError, load_study

MODULE = "probe_tool_under_test"

TOOL = '''"""A dummy evaluation tool: writes the options it ran with into its out."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from experiments.tools import EvaluationTool, register


@dataclass
class ProbeConfig:
    checkpoint: Optional[str] = None
    out: Optional[str] = None
    tokens: int = 4
    label: str = "probe"


def run(config: ProbeConfig) -> None:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(
        {"checkpoint": config.checkpoint, "tokens": config.tokens, "label": config.label}))


register(EvaluationTool(name="probe", module=__name__, config="ProbeConfig", run="run",
                        done="probe.json"))
'''


@pytest.fixture
def probe_tool(tmp_path, monkeypatch):
    """The dummy tool's module in a temporary folder, importable here and in the job's
    process (PYTHONPATH), imported (which registers it); unregistered afterwards."""
    folder = tmp_path / "tool"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(TOOL)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    before = list(tools.TOOLS)
    try:
        __import__(MODULE)
        assert list(tools.TOOLS) == [*before, "probe"]      # one registration, nothing else
        yield tools.TOOLS["probe"]
    finally:
        tools.TOOLS.pop("probe", None)
        sys.modules.pop(MODULE, None)


def study_file(path: Path, tokens: int) -> Path:
    """Two jobs of two steps (ced: decoder windows, read by erf too; dense: not), the built-in
    erf section and the probe's."""
    path.write_text(
        "name: probes\n"
        "train: [model=tiny, debug=fast, train.steps=2]\n"
        "jobs:\n  - {name: a, overrides: []}\n  - {name: d, overrides: [model.variant=dense]}\n"
        "erf: {tasks: [running_state], examples: 2, length: 2W, dtype: float32, bootstrap: 20}\n"
        f"probe: {{tokens: {tokens}}}\n")
    return path


def drive(study: Path, out: Path, only: str) -> dict:
    """The driver run in this process (where the tool is registered): the steps of its
    summary.json."""
    code = run_study(DriverConfig(study=str(study), out=str(out), wandb=False, threads=1,
                                  only=only))
    assert code == 0
    return json.loads((out / "summary.json").read_text())["steps"]


def test_a_registered_tool_runs_skips_and_reruns_alone(probe_tool, tmp_path, capsys):
    out = tmp_path / "out"
    study = study_file(tmp_path / "probes.yaml", tokens=4)
    steps = drive(study, out, "all")
    for job in ("a", "d"):                       # every model: the tool applies to all
        assert steps[f"probe/{job}/seed0"]["state"] == "ok", steps
        written = json.loads((out / "probe" / job / "seed0" / "probe.json").read_text())
        assert written["tokens"] == 4
        assert written["checkpoint"] == str(out / "runs" / job / "seed0" / "final")
    assert steps["erf/a/seed0"]["state"] == "ok"

    steps = drive(study, out, "eval")
    assert {k: v["state"] for k, v in steps.items() if k.startswith(("probe/", "erf/"))} == {
        "probe/a/seed0": "skipped", "probe/d/seed0": "skipped", "erf/a/seed0": "skipped"}

    study_file(study, tokens=5)
    capsys.readouterr()
    drive(study, out, "plan")
    plan = capsys.readouterr().out
    assert "plan probe/a/seed0: RERUN - inputs changed (probe.tokens 4 -> 5)" in plan, plan
    assert "plan erf/a/seed0: SKIP" in plan
    steps = drive(study, out, "eval")
    assert {k: v["state"] for k, v in steps.items() if k.startswith(("probe/", "erf/"))} == {
        "probe/a/seed0": "ok", "probe/d/seed0": "ok", "erf/a/seed0": "skipped"}
    assert json.loads((out / "probe" / "d" / "seed0" / "probe.json").read_text())["tokens"] == 5

    # a default changed in the tool's code (a field the study does not write) reruns it alone
    module = Path(sys.modules[MODULE].__file__)
    module.write_text(TOOL.replace('label: str = "probe"', 'label: str = "probe2"'))
    tools.TOOLS.pop("probe")
    sys.modules.pop(MODULE)
    __import__(MODULE)
    capsys.readouterr()
    drive(study, out, "plan")
    plan = capsys.readouterr().out
    assert "plan probe/a/seed0: RERUN - inputs changed (defaults.label 'probe' -> 'probe2')" \
        in plan, plan
    assert "plan erf/a/seed0: SKIP" in plan
    steps = drive(study, out, "eval")
    assert {k: v["state"] for k, v in steps.items() if k.startswith(("probe/", "erf/"))} == {
        "probe/a/seed0": "ok", "probe/d/seed0": "ok", "erf/a/seed0": "skipped"}
    assert json.loads((out / "probe" / "a" / "seed0" / "probe.json").read_text())["label"] \
        == "probe2"


@pytest.mark.parametrize("section,refused", [
    ("probe: {tokens: 4, tokns: 3}",
     r"probe\.tokns: unknown key; allowed keys of probe: \['label', 'tokens'\]"),
    ("probe: {out: elsewhere}", r"probe\.out: unknown key"),          # the driver sets it
    ("scales: {big: {probe: {tokns: 3}}}", r"scales\.big\.probe\.tokns: unknown key"),
])
def test_a_registered_tool_section_refuses_unknown_and_driven_keys(probe_tool, tmp_path,
                                                                    section, refused):
    study = tmp_path / "probes.yaml"
    study.write_text(f"name: probes\njobs: [{{name: a}}]\n{section}\n")
    with pytest.raises(StudyError, match=refused):
        load_study(str(study))


def test_a_name_is_registered_once(probe_tool):
    with pytest.raises(ValueError, match="'probe': registered already"):
        tools.register(tools.EvaluationTool(name="probe", module=MODULE, config="ProbeConfig",
                                            run="run"))
    with pytest.raises(ValueError, match="EvaluationTool.name"):
        tools.EvaluationTool(name="logs", module=MODULE, config="ProbeConfig", run="run")
    # a merge joins one step per model: a tool over models, or of several steps a model, has
    # nothing to merge
    with pytest.raises(ValueError, match="EvaluationTool.merge"):
        tools.EvaluationTool(name="over", module=MODULE, config="ProbeConfig", run="run",
                             scope=tools.OVER_MODELS, merge="run")
    with pytest.raises(ValueError, match="EvaluationTool.merge"):
        tools.EvaluationTool(name="variants", module=MODULE, config="ProbeConfig", run="run",
                             variants=lambda section, own: [{}, {"topk": 2}], merge="run")
