"""One reconfiguration in flight: the ranks moving and the generation being formed.

An operation is always in exactly one phase, and every phase has a deadline:
    planned:   agree -> pausing -> forming -> done
    unplanned: collect -> (spares) -> forming -> done
What happens when a deadline passes is the orchestrator's `_expired_<phase>`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from baton.control.state import EventKind

Phase = Literal["prepare", "pre-copy", "agree", "pausing", "collect", "spares", "forming"]


@dataclass
class Move:
    rank: int
    event_id: int
    from_worker: str | None
    to_worker: str | None = None


@dataclass(frozen=True)
class RetryMove:
    """A planned or pre-emptive move that a failure interrupted; it runs again once the job
    has re-formed, unless its leaver is lost first (then a recovery has already moved the rank).
    Its kind and cause are its event's."""

    rank: int
    event_id: int  # the interrupted move's event
    leaver: str | None  # the worker that held the rank when the move was asked for


@dataclass
class Operation:
    """One reconfiguration: the ranks moving and the generation being formed."""

    id: int
    kind: EventKind
    generation: int
    moves: dict[int, Move]
    phase: Phase
    started_at: float = field(default_factory=time.time)
    target_step: int | None = None
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    paused: dict[int, float] = field(default_factory=dict)
    boundaries: dict[int, tuple[int, int]] = field(default_factory=dict)  # survivors: where their state is
    # Sharded jobs: the boundaries each survivor holds its own shard snapshot of, and those
    # it holds for its wards (ward -> boundaries).
    snapshots: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    held: dict[int, dict[int, set[tuple[int, int]]]] = field(default_factory=dict)
    replicas: dict[int, set[int]] = field(default_factory=dict)  # HSDP: who holds each survivor's shards
    formed: dict[int, float] = field(default_factory=dict)
    deadline: float = float("inf")  # when the current phase has run out of time
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    joiner_setup_s: float = 0.0  # the slowest joiner's script setup after its assignment
    joiner_setup_left_out_bytes: int = 0  # the initialisation a no-code joiner's setup left out
    walked_ahead: dict[str, int] = field(default_factory=dict)  # joiner -> step-loop iteration it walked ahead to
    transfer_wait_s: float = 0.0  # the longest a joiner waited for its state after its setup
    joiner_phases: dict[str, float] = field(default_factory=dict)  # the slowest joiner's (Formed.phases)
    waiting_message: str | None = None
    rerun: bool = False  # some survivor discarded a partial step and re-runs it
    target: tuple[int, int] | None = None  # the position the new generation forms at
    failed_at: float | None = None  # when the failure happened (not when it was detected)
    planned_at: float | None = None  # unplanned: when the (latest) plan went out, every survivor heard from
    # When the first survivor blocked in the collective that failed: where a hung rank's
    # downtime starts (its last heartbeat, `failed_at`, came before the hang).
    stalled_at: float | None = None
    form_tries: int = 0  # generations that did not form in time (each retry gets twice the time)
    path_events: list[int] = field(default_factory=list)  # path-failover events this operation resolves
    agree_tries: int = 0  # pause requests sent again to ranks that had not answered
    ready_joiners: set[str] = field(default_factory=set)  # planned: joiners at their step loop (prepare)
    # planned, pre-copied: each joiner's CaughtUp (by worker id) and each leaver's cost (by rank)
    caught_up: dict[str, dict[str, Any]] = field(default_factory=dict)
    pre_copy: bool | None = None  # this move's own choice (MigrateRequest.pre_copy); None: the job's
    pre_copy_cost: dict[int, dict[str, Any]] = field(default_factory=dict)
    # planned: the moves whose leaver was told to serve, and joiner to form, as the leaver paused
    # (rank -> the boundary it paused at), ahead of the other ranks
    handed_early: dict[int, tuple[int, int]] = field(default_factory=dict)
    hot_joiners: set[str] = field(default_factory=set)  # joiners whose mirror kept pace when assigned (--hot-spares)

    def enter(self, phase: Phase, seconds: float) -> None:
        """Start `phase`, which must be over within `seconds`."""
        self.phase = phase
        self.deadline = time.time() + seconds
