"""evals.cli: a tool's command line is built from its config dataclass, so the options a user
types and the fields the study driver writes are the same set. Checked on a small dataclass
with every kind of field, and on the suite's own SuiteConfig against its CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import pytest

from evals.cli import build_parser, config_from_args, option, unknown_keys


@dataclass
class Example:
    path: str = option(help="required")
    replays: List[str] = option(flag="--replay", metavar="N", help="one or more")
    count: int = option(3, help="an int")
    rate: float = option(0.5, help="a float")
    names: Optional[List[str]] = option(None, choices=lambda: ["a", "b"], help="choices")
    sizes: List[int] = option(factory=list, help="ints")
    limit: Optional[int] = option(None, help="optional int")
    plot: bool = option(True, help="on by default")
    overwrite: bool = option(False, help="off by default")
    hidden: str = option("x", help="set by the caller")


def parse(argv: list[str]) -> Example:
    return config_from_args(Example, build_parser(Example, "prog").parse_args(argv))


def test_defaults_types_and_renamed_flags():
    c = parse(["--path", "p", "--replay", "W", "8"])
    assert c == Example(path="p", replays=["W", "8"])
    c = parse(["--path", "p", "--replay", "1", "--count", "7", "--rate", "0.25", "--names", "b",
               "a", "--sizes", "4", "5", "--limit", "9", "--no-plot", "--overwrite"])
    assert (c.count, c.rate, c.names, c.sizes, c.limit, c.plot, c.overwrite) == (
        7, 0.25, ["b", "a"], [4, 5], 9, False, True)


def test_list_defaults_are_not_shared_between_parses():
    first = parse(["--path", "p", "--replay", "1"])
    first.sizes.append(1)
    assert parse(["--path", "p", "--replay", "1"]).sizes == []


@pytest.mark.parametrize("argv,fragment", [
    (["--replay", "1"], "--path"),                          # required
    (["--path", "p"], "--replay"),                          # required list
    (["--path", "p", "--replay", "1", "--count", "x"], "invalid int"),
    (["--path", "p", "--replay", "1", "--names", "c"], "invalid choice"),
    (["--path", "p", "--replay", "1", "--plot"], "unrecognized"),   # only --no-plot exists
])
def test_bad_command_lines_are_usage_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


def test_hidden_fields_are_not_options_and_are_set_by_the_caller(capsys):
    parser = build_parser(Example, "prog", hidden=["hidden"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "p", "--replay", "1", "--hidden", "y"])
    args = parser.parse_args(["--path", "p", "--replay", "1"])
    assert config_from_args(Example, args, hidden="set").hidden == "set"


def test_unknown_keys():
    assert unknown_keys(Example, ["count", "cuont", "replay"]) == ["cuont", "replay"]


@pytest.mark.parametrize("module,name", [("evals.suites.runner", "SuiteConfig"),
                                         ("evals.real_text", "RealTextConfig"),
                                         ("evals.erf", "ErfConfig"),
                                         ("evals.topk_flips", "TopkFlipsConfig")])
def test_a_tool_cli_has_one_option_per_config_field(module, name):
    import importlib
    cls = getattr(importlib.import_module(module), name)
    parser = build_parser(cls, "prog")
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(cls)}


def test_a_bad_real_text_setting_is_one_line_naming_the_option(tmp_path, capsys):
    from evals.real_text import main
    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--passes", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --passes must be >= 1; got 0"


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_a_study_real_text_reading_setting_means_what_the_cli_option_means():
    """A study's `real_text:` reading keys are RealTextConfig fields under the same name with
    the same defaults (forms such as W compared as the strings the reading receives)."""
    from evals.real_text import RealTextConfig
    from experiments.sections import REAL_TEXT_READING, RealTextSpec
    spec = {f.name: f for f in dataclasses.fields(RealTextSpec)}
    config = {f.name: f for f in dataclasses.fields(RealTextConfig)}
    assert set(REAL_TEXT_READING) <= set(spec) & set(config)
    for name in REAL_TEXT_READING:
        ours, theirs = _default(spec[name]), _default(config[name])
        if name in ("replays", "continuation"):
            ours = [str(v) for v in ours] if isinstance(ours, list) else str(ours)
        assert ours == theirs, name
    # every other spec field is the driver's own (lm-eval), not a reading setting in disguise
    assert not (set(spec) - set(REAL_TEXT_READING)) & set(config)
