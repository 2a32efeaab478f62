"""A stand-in for ``torch.cuda.Event`` on a machine without a GPU, to prove what the CUDA timing
reads and when: every event records at a known time, and a read of one (``elapsed_time``,
``synchronize``, ``query``: what waits for the device on a GPU) is counted."""

from __future__ import annotations


class FakeEvents:
    """Used as an event class: ``FakeEvents()(enable_timing=True)`` is a new event. The k-th event
    recorded (from 1) stands at ``scale_ms * k * k`` milliseconds, so every pair's elapsed time differs.
    As on CUDA, an event can be timed only once one recorded at or after it was synchronized."""

    def __init__(self, scale_ms: float = 1.0) -> None:
        self.scale_ms = scale_ms
        self.recorded: list[FakeEvent] = []  # in the order recorded
        self.reads = 0  # elapsed_time, synchronize and query calls
        self.synchronized = 0  # synchronize calls
        self.settled = 0  # events 1..settled are complete

    def __call__(self, enable_timing: bool = False) -> "FakeEvent":
        if not enable_timing:
            raise ValueError("error: an event without enable_timing=True cannot be timed")
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, clock: FakeEvents) -> None:
        self.clock, self.index = clock, 0  # index 0: not recorded

    @property
    def ms(self) -> float:
        return self.clock.scale_ms * self.index * self.index

    def record(self, stream=None) -> None:
        self.clock.recorded.append(self)
        self.index = len(self.clock.recorded)

    def synchronize(self) -> None:
        self.clock.reads += 1
        self.clock.synchronized += 1
        self.clock.settled = max(self.clock.settled, self.index)

    def query(self) -> bool:
        self.clock.reads += 1
        return 0 < self.index <= self.clock.settled

    def elapsed_time(self, end: "FakeEvent") -> float:
        self.clock.reads += 1
        if not (0 < self.index and 0 < end.index <= self.clock.settled):
            raise RuntimeError(f"CUDA error: device not ready (events {self.index}, {end.index}; "
                               f"{self.clock.settled} complete)")
        return end.ms - self.ms
