"""What the orchestrator decides under its lock and does after releasing it.

Deciding is fast and in memory; doing can be slow (starting a process, signalling one
and waiting for it to dump its stacks, writing SQLite, printing). So decisions queue
typed effects, and the thread that releases the outermost hold of the lock applies
them in the order they were decided, one thread at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass(frozen=True)
class StartWorker:
    worker_id: str
    slot: str


@dataclass(frozen=True)
class KillWorker:
    worker_id: str
    dump_stacks: bool = False


@dataclass(frozen=True)
class Emit:
    kind: str
    data: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class WriteEvent:
    event_id: int
    body: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class WriteRows:
    rows: list[tuple[str, str, dict[str, Any]]] = field(hash=False)


@dataclass(frozen=True)
class ProbeNode:
    """Ask the scheduler whether a node still runs anything; it answers with NodeProbed."""

    node: str


@dataclass(frozen=True)
class ProbeLinks:
    """Ask the scheduler for the state of a node's data links; it answers with NodeLinks."""

    node: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class DrainNode:
    """Tell the scheduler to place nothing new on a node (Slurm: state=drain with the reason)."""

    node: str
    reason: str


@dataclass(frozen=True)
class ResumeNode:
    node: str


@dataclass(frozen=True)
class BorrowNode:
    """Ask the scheduler for one more node (Slurm: preempting a lower-priority job); it answers
    with NodeBorrowed."""


@dataclass(frozen=True)
class ReleaseNode:
    """Give a borrowed node back to its lender."""

    node: str


Effect = Union[StartWorker, KillWorker, Emit, WriteEvent, WriteRows, ProbeNode, DrainNode, ResumeNode, BorrowNode,
               ReleaseNode, ProbeLinks]


class DecisionLock:
    """A re-entrant lock whose outermost release applies the effects queued under it."""

    def __init__(self, apply: Callable[[Effect], None]):
        self._lock = threading.RLock()
        self._depth = 0
        self._queue: deque[Effect] = deque()
        self._applying = threading.RLock()
        self._apply = apply

    def __enter__(self) -> "DecisionLock":
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        outermost = self._depth == 0
        self._lock.release()
        if outermost:
            self.drain()

    def add(self, effect: Effect) -> None:
        self._queue.append(effect)

    def drain(self) -> None:
        with self._applying:
            while self._queue:
                self._apply(self._queue.popleft())
