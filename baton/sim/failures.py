"""Failure classes and arrival processes for the simulator.

A failure's *class* decides which mechanism can save it, so the simulator can
say why a strategy lost time, not just how much. Shares default to the Llama 3
405B interruption table (Meta, "The Llama 3 Herd of Models", Table 5: 419
unexpected interruptions in 54 days on 16,384 H100s, plus 47 planned ones).

Shares are taken from the published *counts*: the published percentage for
"Faulty GPU" (30.1%) disagrees with its count (148 / 419 = 35.3%), and the
counts are the ones that add up to 419.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Mechanism(str, Enum):
    """What can resolve a failure of a class without rolling the whole job back."""

    PATH_FAILOVER = "path_failover"  # link flap: traffic moves to another path, no rank moves
    MIGRATION = "migration"  # the rank moves to a spare: pre-emptive if warned, else unplanned
    RESTART = "restart"  # nothing saves it (deterministic bug, corrupted state): restart everyone


@dataclass(frozen=True)
class FailureClass:
    name: str
    share: float  # of all failures; normalised over the table
    mechanism: Mechanism
    warning_share: float = 0.0  # of this class that gives warning first (pre-emptive migration)
    count: int | None = None  # published count, when the share comes from one


def _llama(name: str, count: int, mechanism: Mechanism, warning: float = 0.0) -> FailureClass:
    return FailureClass(name, count / 419, mechanism, warning, count)


M = Mechanism
# Mechanism and warning shares are our assumptions, stated in docs/economics.md:
# a bug or silent data corruption is in every replica, so only a restart helps;
# switch/cable faults are link-level and fail over to another path; HBM and
# thermal faults often announce themselves (ECC error rates, temperature), host
# maintenance is initiated by the operator and so always warned.
LLAMA3_405B: tuple[FailureClass, ...] = (
    _llama("faulty GPU", 148, M.MIGRATION),
    _llama("GPU HBM3 memory", 72, M.MIGRATION, 0.3),
    _llama("software bug", 54, M.RESTART),
    _llama("network switch/cable", 35, M.PATH_FAILOVER),
    _llama("host maintenance", 32, M.MIGRATION, 1.0),
    _llama("GPU SRAM memory", 19, M.MIGRATION),
    _llama("GPU system processor", 17, M.MIGRATION),
    _llama("NIC", 7, M.MIGRATION),
    _llama("NCCL watchdog timeout", 7, M.MIGRATION),
    _llama("silent data corruption", 6, M.RESTART),
    _llama("GPU thermal interface + sensor", 6, M.MIGRATION, 0.5),
    _llama("SSD", 3, M.MIGRATION),
    _llama("power supply", 3, M.MIGRATION),
    _llama("server chassis", 2, M.MIGRATION),
    _llama("IO expansion board", 2, M.MIGRATION),
    _llama("dependency", 2, M.RESTART),
    _llama("CPU", 2, M.MIGRATION),
    _llama("system memory", 2, M.MIGRATION),
)
LLAMA3_PLANNED = FailureClass("planned maintenance", 47 / 419, M.MIGRATION, 1.0, 47)

CLASS_TABLES: dict[str, tuple[FailureClass, ...]] = {
    "llama3-405b": LLAMA3_405B,
    "llama3-405b+planned": LLAMA3_405B + (LLAMA3_PLANNED,),
}

DISTRIBUTIONS = ("exponential", "weibull", "uniform")


@dataclass(frozen=True)
class ArrivalProcess:
    """Renewal process of failures in wall-clock hours (the cluster fails whether or not the job runs)."""

    distribution: str = "exponential"
    mttf_h: float = 7.9
    weibull_shape: float = 1.0
    uniform_min_h: float = 0.0
    uniform_max_h: float = 0.0

    @property
    def mean_gap_h(self) -> float:
        if self.distribution == "uniform":
            return (self.uniform_min_h + self.uniform_max_h) / 2.0
        return self.mttf_h

    def gaps(self, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        if self.distribution == "exponential":
            return rng.exponential(self.mttf_h, size=shape)
        if self.distribution == "weibull":
            scale = self.mttf_h / math.gamma(1.0 + 1.0 / self.weibull_shape)
            return scale * rng.weibull(self.weibull_shape, size=shape)
        if self.distribution == "uniform":
            return rng.uniform(self.uniform_min_h, self.uniform_max_h, size=shape)
        raise ValueError(f"unknown distribution {self.distribution!r}")


class FailureStream:
    """Failure times, classes and warnings for all trials, drawn lazily in blocks.

    Every strategy reads the same stream (common random numbers), so the
    difference between strategies is the strategy, not the luck of the draw.
    """

    def __init__(self, process: ArrivalProcess, classes: tuple[FailureClass, ...], trials: int, seed: int):
        self.process = process
        self.classes = classes
        self.trials = trials
        self._rng = np.random.default_rng(seed)
        shares = np.array([c.share for c in classes], dtype=float)
        self._cum = np.cumsum(shares / shares.sum())
        self._warn = np.array([c.warning_share for c in classes], dtype=float)
        self.mechanism = np.array([_MECH_CODE[c.mechanism] for c in classes], dtype=np.int8)
        self.times = np.empty((trials, 0))
        self.cls = np.empty((trials, 0), dtype=np.int16)
        self.warned = np.empty((trials, 0), dtype=bool)

    def ensure(self, columns: int) -> None:
        """Make at least `columns` failures per trial available."""
        have = self.times.shape[1]
        if columns <= have:
            return
        block = max(columns - have, have, 64)
        gaps = self.process.gaps(self._rng, (self.trials, block))
        start = self.times[:, -1:] if have else np.zeros((self.trials, 1))
        times = start + np.cumsum(gaps, axis=1)
        cls = np.searchsorted(self._cum, self._rng.random((self.trials, block)), side="right")
        cls = np.minimum(cls, len(self.classes) - 1).astype(np.int16)
        warned = self._rng.random((self.trials, block)) < self._warn[cls]
        self.times = np.concatenate([self.times, times], axis=1)
        self.cls = np.concatenate([self.cls, cls], axis=1)
        self.warned = np.concatenate([self.warned, warned], axis=1)


MECH_PATH, MECH_MIGRATION, MECH_RESTART = 0, 1, 2
_MECH_CODE = {M.PATH_FAILOVER: MECH_PATH, M.MIGRATION: MECH_MIGRATION, M.RESTART: MECH_RESTART}
