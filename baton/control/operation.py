"""One reconfiguration in flight: the ranks moving and the generation being formed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from baton.control.state import EventKind


@dataclass
class Move:
    rank: int
    event_id: int
    from_worker: str | None
    to_worker: str | None = None


@dataclass
class Operation:
    """One reconfiguration: the ranks moving and the generation being formed."""

    id: int
    kind: EventKind
    generation: int
    moves: dict[int, Move]
    phase: str  # agree | pausing | collect | spares | forming | done
    started_at: float = field(default_factory=time.time)
    target_step: int | None = None
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    paused: dict[int, float] = field(default_factory=dict)
    boundaries: dict[int, int] = field(default_factory=dict)
    formed: dict[int, float] = field(default_factory=dict)
    collect_deadline: float | None = None
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    waiting_message: str | None = None
    rerun: bool = False  # some survivor discarded a partial step and re-runs it
    target: tuple[int, int] | None = None  # the position the new generation forms at
    failed_at: float | None = None  # when the failure happened (not when it was detected)
    form_deadline: float | None = None  # forming must be over by then, or it is retried
    form_tries: int = 0
