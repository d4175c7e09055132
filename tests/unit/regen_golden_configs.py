"""Recompute tests/unit/golden_configs.json after a *deliberate* change of what the configs
compose to (a new model key, a changed study):

    .venv/bin/python tests/unit/regen_golden_configs.py

and say why in the commit message (git log is the goldens' changelog). test_registry.py then
holds every later change to them. Never run it to silence a failure you cannot explain: the
golden is the record of what studies trained."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ced.cli.train as trainer  # noqa: E402
from ced.data import build_source  # noqa: E402
from experiments.study import STUDY_DIR, load_study, normalise_overrides  # noqa: E402
from test_registry import compose_train, rows_hash, study_rows_length  # noqa: E402

PATH = Path(__file__).with_name("golden_configs.json")


COMMENT = ("What each model preset and study job composes to (config hashes, rows of its "
           "training data): tests/unit/test_registry.py holds the configs to it. Recompute with "
           "tests/unit/regen_golden_configs.py after a deliberate change, and say why in the "
           "commit message.")


def regenerate() -> dict:
    old = json.loads(PATH.read_text())
    golden = {"_comment": COMMENT, "model": {}, "rows": {}, "studies": {}}
    for name in old["model"]:
        golden["model"][name] = OmegaConf.to_container(
            compose_train([f"model={name}"]).model, resolve=True)
    composed = compose_train(["data=synthetic"]).data
    for split in ("train", "validation"):
        golden["rows"][f"data=synthetic/{split}"] = rows_hash(build_source(composed, split))
    golden["rows"]["curriculum_rows=64/train"] = rows_hash(
        build_source({"curriculum_rows": 64}, "train"))
    for item in ("data.tasks.needle=null", "data.tasks.copy.span_len=2"):
        data = compose_train(trainer.free_form_overrides([item])).data
        golden["rows"][item] = rows_hash(build_source(data, "train"))
    for path in sorted(STUDY_DIR.glob("*.yaml")):
        for scale in ("demo", "full"):
            study = load_study(path.stem, scale)
            for job in study.jobs:
                overrides = [*study.train, *job.overrides]
                entry = {"overrides": normalise_overrides(overrides)}
                if job.name != "broken":          # tiny's job that fails on purpose
                    cfg = OmegaConf.to_container(compose_train(overrides), resolve=True)
                    rest = json.dumps({k: v for k, v in cfg.items() if k != "data"},
                                      sort_keys=True)
                    entry["config"] = hashlib.sha256(rest.encode()).hexdigest()[:16]
                    composed = compose_train(overrides)
                    entry["rows"] = rows_hash(build_source(composed.data, "train"), 4,
                                              study_rows_length(composed))
                golden["studies"][f"{path.stem}/{scale}/{job.name}"] = entry
    return golden


if __name__ == "__main__":
    if len(sys.argv) != 1:
        sys.exit(__doc__)
    PATH.write_text(json.dumps(regenerate(), indent=1) + "\n")
    print(f"wrote {PATH}: say why in the commit message")
