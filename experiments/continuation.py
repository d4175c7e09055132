"""A study's `on_change=continue`: a finished run whose only change is a raised `train.steps`
is trained on from where it ended (`ced.train train.resume=auto train.extend_to=N`) instead of
retrained from step 0.

Why a separate rule and not a plain resume: raising `train.steps` on a resumed run recomputes
the cosine schedule, so the learning rate jumps back up at the step the run resumes from
(docs/training.md: 3.0e-4 -> 1.02e-3 on a 400-step run raised to 2000). `train.extend_to` keeps the run's own schedule and trains
the extra steps at its final learning rate, and `ced.train` records the change in the run's
config changes. A continued run is therefore *not* the run a fresh `train.steps=N` would
train; the driver's record of the run (`study_step.json`) says it was extended, from which
step, so that nobody compares it to a fresh run unawares."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# the keys a continuation may change: the run's schedule length and where it trains to
STEP_KEYS = frozenset({"train.steps", "train.extend_to"})


@dataclass(frozen=True)
class Extension:
    """How a trained run relates to a study's raised `train.steps`.

    schedule_steps: the run's own `train.steps` (its cosine schedule ends there; kept);
    ends_at: the step the run trained to (its `train.extend_to`, or `schedule_steps`);
    wanted: the step the study now asks for (its composed `train.steps`)."""

    schedule_steps: int
    ends_at: int
    wanted: int

    @property
    def continues(self) -> bool:
        """True when the study asks for more steps than the run trained."""
        return self.wanted > self.ends_at

    def overrides(self) -> list[str]:
        """The `ced.train` overrides that continue the run to `wanted` on its own schedule
        (appended after the study's, so its `train.steps` goes back to the schedule's)."""
        return [f"train.steps={self.schedule_steps}", f"train.extend_to={self.wanted}"]

    def describe(self) -> str:
        return (f"train.steps raised {self.ends_at} -> {self.wanted}: steps "
                f"{self.ends_at + 1}-{self.wanted} train on at the end of the run's own "
                f"{self.schedule_steps}-step schedule (train.extend_to={self.wanted}), not "
                f"retrained from step 0")

    def record(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_record(cls, payload: dict[str, Any]) -> "Extension":
        return cls(**{k: int(payload[k]) for k in ("schedule_steps", "ends_at", "wanted")})


def extension(trained: dict[str, Any], wanted: dict[str, Any]) -> Extension | None:
    """The `Extension` from the config a run trained to the config a study now composes for
    it (both `experiments.training_runs.training_view`s: flat dotted keys), or None when anything but
    the step keys differs, or when the study itself sets `train.extend_to`."""
    differing = {k for k in set(trained) | set(wanted) if trained.get(k) != wanted.get(k)}
    if not differing <= STEP_KEYS or wanted.get("train.extend_to") is not None:
        return None
    try:
        schedule = int(trained["train.steps"])
        wanted_steps = int(wanted["train.steps"])
    except (KeyError, TypeError, ValueError):
        return None
    ends = trained.get("train.extend_to")
    return Extension(schedule, int(ends) if ends is not None else schedule, wanted_steps)
