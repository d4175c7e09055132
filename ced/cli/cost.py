"""`python -m ced.cost` (or `ced-cost`): the cost model's report for any model config, Hydra
config root `conf/` (conf/cost.yaml).

    python -m ced.cost model=deepseek_v41_flash [--json | json=true] [seq_len=...]
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from ced.config import ModelConfig
from ced.cost.report import render, report

from . import fail

COST_KEYS = ("json", "seq_len", "counting", "dtype")


def check_cost_overrides(args: list[str]) -> None:
    """Unknown keys as one line naming the key and the allowed ones, before Hydra composes
    (whose own message spans several lines): the cost model's keys, `model=<file>` and
    `model.<ModelConfig field>` (and `model.unmodelled.<...>`)."""
    model_keys = sorted(f.name for f in fields(ModelConfig))
    for item in args:
        if "=" not in item or item[0] in "+~-" or item.startswith("hydra"):
            continue
        key = item.split("=", 1)[0]
        if key == "model" or key in COST_KEYS or key.startswith("model.unmodelled."):
            continue
        if key.startswith("model."):
            if key.split(".", 2)[1] not in model_keys:
                raise ValueError(f"{key}: unknown key; allowed keys of model: {model_keys}")
            continue
        raise ValueError(f"{key}: unknown key; allowed: {list(COST_KEYS)}, model=<conf/model "
                         f"file>, model.<key>")


def _cli(conf) -> None:
    # lazy: OmegaConf (~0.1 s) comes with Hydra when `main` runs; importing this module to
    # check overrides does not need it
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(conf, resolve=True)
    try:
        seq_len = values.get("seq_len", 131072)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len: expected an int >= 1; got {seq_len!r}")
        cfg = ModelConfig.from_dict(values["model"])
        rep = report(cfg, seq_len=seq_len, counting=values.get("counting", "causal"),
                     dtype=values.get("dtype"))
    except (ValueError, TypeError) as exc:
        fail(f"config error: {str(exc).splitlines()[0].replace('ModelConfig.', 'model.')}", 2)
    if values.get("json"):
        print(json.dumps(rep, indent=2))
    else:
        print(render(rep))


def main(argv: list[str] | None = None) -> None:
    # lazy: Hydra costs ~0.2 s to import; only running the command needs it
    import hydra

    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:
        args = [a for a in args if a != "--json"] + ["json=true"]
    try:
        check_cost_overrides(args)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [sys.argv[0]] + args
    # An absolute path: found the same way under `python -m ced.cost` and when imported.
    conf_dir = str(Path(__file__).resolve().parents[2] / "conf")
    hydra.main(config_path=conf_dir, config_name="cost", version_base="1.3")(_cli)()


