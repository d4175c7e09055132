"""ced against ced with one change, at a study's shape: the A/B of a speed lever that is a config
key, on the study's own model, trained weights if given.

    python benchmarks/ab.py real_text_law_T4_W8 --set model.global_read=union \
        [--weights findings/real_text_law/archive/runs/T4_W8/seed0/final] [--rounds 6]

Both arms are composed as `benchmarks/study.py` composes a shape (`study.compose`: the study's
config, model.variant=ced; arm B adds --set), set up as `ced.train` sets a run up
(`study.make_run`), and, with --weights, loaded with the same trained weights (a lever whose
speed depends on what the model learned, such as the union of a block's top-k picks, shows
only there). They take turns round by round (`peer.interleaved_rounds`): the training step as
`ced.train` takes it at the step past the curriculum, and the evaluation forward (the
parallel forward of that step's rows). Printed: each arm's median seconds and the median
over rounds of A's time over B's, the same round (above 1: B is faster). Nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import study  # noqa: E402
from peer import interleaved_rounds  # noqa: E402

import ced.train as trainer  # noqa: E402
from ced.checkpoint import load_model  # noqa: E402


def ab_times(shape: str, change: tuple[str, ...], rounds: int, warmup: int,
             weights: Path | None, run_dir: Path) -> dict:
    """{(arm, "step"|"eval"): [seconds per timed round]} for arms "A" (the shape's ced) and
    "B" (with `change`), optionally both loaded with `weights`."""
    arms = {"A": (), "B": change}
    runs = {arm: study.make_run(study.compose(shape, "ced", extra), run_dir / arm)
            for arm, extra in arms.items()}
    if weights is not None:
        state = load_model(weights).state_dict()
        for run in runs.values():
            run.accelerator.unwrap_model(run.model).load_state_dict(state)
    step = study.timed_step_index(runs["A"].cfg)
    rows = trainer._micro_batches(runs["A"], step)[0]["input_ids"]
    fns = {}
    for arm, run in runs.items():
        fns[arm, "step"] = lambda run=run: trainer._train_step(run, step)
        fns[arm, "eval"] = study.make_eval(run, None, rows)
    return interleaved_rounds(fns, warmup, rounds, shape, lambda t: "  ".join(
        f"{arm} {t[arm, 'step'][-1]:.2f}/{t[arm, 'eval'][-1]:.2f}s" for arm in arms
        if t[arm, "step"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(study.SHAPES))
    parser.add_argument("--set", action="append", required=True, metavar="KEY=VALUE",
                        help="arm B's override(s), e.g. model.global_read=union")
    parser.add_argument("--weights", type=Path, default=None,
                        help="a trained model directory (final/) both arms load")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/ced_bench_ab"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    times = ab_times(args.shape, tuple(args.set), args.rounds, args.warmup, args.weights,
                     args.run_dir)
    print(f"{args.shape}: A = ced, B = ced {' '.join(args.set)}"
          f"{f', weights {args.weights}' if args.weights else ', untrained'}")
    for kind in ("step", "eval"):
        paired = [a / b for a, b in zip(times["A", kind], times["B", kind])]
        print(f"  {kind}: A {statistics.median(times['A', kind]):.3f} s, "
              f"B {statistics.median(times['B', kind]):.3f} s, "
              f"A / B {statistics.median(paired):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
