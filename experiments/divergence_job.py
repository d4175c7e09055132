"""`python -m experiments.divergence_job CONFIG.json [THREADS]`: evals.divergence.run on a
DivergenceConfig written as JSON by the study driver (a subprocess, so a crash cannot take the
driver down)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch
    from omegaconf import OmegaConf

    from evals.divergence import DivergenceConfig, run

    raw = json.loads(Path(sys.argv[1]).read_text())
    if len(sys.argv) > 2:
        torch.set_num_threads(int(sys.argv[2]))
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DivergenceConfig), raw))
    run(config, Path(config.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
