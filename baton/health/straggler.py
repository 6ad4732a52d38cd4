"""Straggler detector: a rank whose own work per step stays above the others' median by
`factor` for `steps` consecutive steps is about to hold the whole job back (a throttling
GPU, a failing fan, a noisy neighbour). It is reported once, and the orchestrator taints
its slot `straggler` and moves it pre-emptively.

It reads each rank's *busy* time (step start -> its last gradient bucket ready, before it
waits for anyone), not wall step time: in synchronous data parallelism every rank waits
for the slowest, so their wall step times are all the same.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIN_EXCESS_S = 0.05  # slower by less than this is scheduling noise, whatever the ratio


@dataclass
class StragglerDetector:
    factor: float  # 0: off
    steps: int = 20
    _busy: dict[int, float] = field(default_factory=dict)
    _step: dict[int, int] = field(default_factory=dict)
    _slow_since: dict[int, int] = field(default_factory=dict)

    def observe(self, rank: int, step: int, busy_s: float) -> str | None:
        """A rank's latest busy time at `step`; returns why it is a straggler, once, or None."""
        if self.factor <= 0 or step <= self._step.get(rank, -1):
            return None
        self._step[rank], self._busy[rank] = step, busy_s
        others = [b for r, b in self._busy.items() if r != rank]
        if not others:
            return None
        median = statistics.median(others)
        if median <= 0 or busy_s <= self.factor * median or busy_s - median < MIN_EXCESS_S:
            self._slow_since.pop(rank, None)
            return None
        since = self._slow_since.setdefault(rank, step)
        if step - since + 1 < self.steps:
            return None
        self.forget(rank)
        return (f"straggler: its own work per step ({busy_s * 1000:.0f} ms) stayed above {self.factor:g}x the "
                f"other ranks' median ({median * 1000:.0f} ms) for {self.steps} steps")

    def forget(self, rank: int) -> None:
        """The rank moved (or its history no longer applies): start over."""
        self._busy.pop(rank, None)
        self._step.pop(rank, None)
        self._slow_since.pop(rank, None)
