"""Stopping cleanly on SIGTERM (a scheduler's pre-emption) and SIGINT (Ctrl-C).

A long job installs `StopSignals` around its work. The first signal only sets a flag, which
the job reads at its next boundary (a training step, an evaluation batch): training saves a
checkpoint there and stops; an evaluation calls `stop_point()` between batches, which raises
`Interrupted` so that nothing after it (the tables, the summary a driver takes for "done") is
written. A second SIGINT interrupts at once. The exit codes: 75 after SIGTERM (sysexits'
"try again", for a requeue), 130 after SIGINT (the shell's 128 + 2).
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading

EXIT_CODES = {"SIGTERM": 75, "SIGINT": 130}


class Interrupted(Exception):
    """A job stopped at a boundary by a signal; `name` ('SIGTERM' or 'SIGINT'), `code` (its
    exit code)."""

    def __init__(self, name: str):
        self.name, self.code = name, EXIT_CODES.get(name, 75)
        super().__init__(f"stopped by {name}")


_active: list["StopSignals"] = []


class StopSignals:
    """Context manager: SIGTERM and SIGINT set `received` (the signal's name) and say what
    happens next (DOING); a second SIGINT raises KeyboardInterrupt at once. `enabled=False`,
    or outside the main thread (signals cannot be caught there): the signals keep their
    default effect."""

    NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
    DOING = "finishing this batch"

    def __init__(self, enabled: bool = True):
        self.enabled, self.received, self.previous = enabled, None, {}

    def __enter__(self) -> "StopSignals":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in self.NAMES:
                self.previous[sig] = signal.signal(sig, self._handle)
        _active.append(self)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt       # the second Ctrl-C: stop now
        self.received = self.NAMES.get(signum, str(signum))
        print(f"\n{self.received} received: {self.DOING}, then stopping (Ctrl-C again to "
              f"stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        _active.remove(self)


def stop_point() -> None:
    """A boundary where a job may stop: raises Interrupted if the innermost active
    StopSignals received a signal (nothing happens without one)."""
    if _active and _active[-1].received is not None:
        raise Interrupted(_active[-1].received)


def continue_command() -> str:
    """The command that reruns this process as it was started (`python -m <module> <args>`),
    for the line an interrupted job prints."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    # `python -m pkg` runs pkg.__main__, and the user typed pkg
    module = spec.name.removesuffix(".__main__") if spec is not None else None
    program = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


__all__ = ["StopSignals", "Interrupted", "stop_point", "continue_command", "EXIT_CODES"]
