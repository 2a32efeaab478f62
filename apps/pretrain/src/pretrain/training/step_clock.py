"""The step time the log reports: the mean over the steps since the last log line, the GPU's time
(read at a log step, after the host waited for the queue), not the launches'.

What runs between steps (starting a profile, the log line, a trace, an evaluation, a checkpoint) is not a
step's time: :meth:`StepClock.paused` leaves it out, :meth:`StepClock.restart` starts a new interval after it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepClock:
    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """A new interval from now, with no step in it."""
        self.began, self.steps = time.time(), 0

    def count_step(self) -> None:
        self.steps += 1

    @contextmanager
    def paused(self):
        """What runs inside is left out of the interval."""
        began = time.time()
        try:
            yield
        finally:
            self.began += time.time() - began

    def mean_step_s(self) -> float:
        """The mean seconds per step of the interval."""
        return (time.time() - self.began) / self.steps
