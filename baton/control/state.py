"""Typed records of everything the orchestrator knows: slots, workers, ranks, taints, events.

They are plain dataclasses so they persist as JSON rows and serve as the API's
response shapes without a second schema.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any


class WorkerRole(str, enum.Enum):
    STARTING = "starting"  # process launched, not yet registered
    SPARE = "spare"  # registered, waiting in baton.init()
    RANK = "rank"  # holds a rank
    LEAVING = "leaving"  # handing its rank over, will exit
    GONE = "gone"  # process exited or was killed


class RankState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    MIGRATING = "migrating"
    RECOVERING = "recovering"
    WAITING_SPARE = "waiting-for-spare"
    FINISHED = "finished"
    FAILED = "failed"


class EventKind(str, enum.Enum):
    PLANNED = "planned"
    PREEMPTIVE = "pre-emptive"
    UNPLANNED = "unplanned"
    DIVERGENCE = "divergence"  # a state check found replicas (or a joiner) that differ
    FATAL = "fatal"  # the job ended on a failure no move could take (a rank lost while starting, one that left early)
    PATH_FAILOVER = "path-failover"  # a data path went down: the groups re-formed over the others, no rank moved
    PATH_RESTORED = "path-restored"  # a data path back: used again from a planned boundary
    PATH_DAMPED = "path-damped"  # a flapping data path: not used again until it stays up (not a failure)


@dataclass
class Slot:
    name: str
    taint: str | None = None  # reason, or None when healthy
    tainted_at: float | None = None
    lent_to: str | None = None  # the job of `baton serve` that borrowed it (its spare was stopped)

    @property
    def healthy(self) -> bool:
        return self.taint is None


@dataclass
class Worker:
    id: str
    slot: str
    role: WorkerRole = WorkerRole.STARTING
    pid: int | None = None
    rank: int | None = None
    intended_rank: int | None = None  # initial workers are launched for a rank
    last_seen: float = field(default_factory=time.time)
    exit_code: int | None = None
    transfer_addr: tuple[str, int] | None = None  # where this worker serves its state
    gpu: dict[str, float] | None = None  # its slot's latest NVML readings, where there is a GPU
    held_rank: bool = False  # took a rank at some point (else: its whole CPU was a spare's)
    cpu_s: float = 0.0  # CPU-seconds of the process, as it last reported them
    baton_cpu_s: float = 0.0  # baton's own part of cpu_s (see baton.selfcost)
    unheard: bool = False  # a rank silent while the job steps on: its control path is down, not the rank
    path_addrs: dict[str, tuple[str, int]] = field(default_factory=dict)  # where it answers probes, per data path
    paths_ready: bool = False  # it said where it answers probes (PathsReady)
    found_paths: list[str] | None = None  # its node's data-path candidates (--data-paths auto), once said


@dataclass
class RankInfo:
    rank: int
    worker: str | None = None
    state: RankState = RankState.STARTING
    step: int = 0  # index of the next step this rank will run
    step_at: float = 0.0  # when `step` was reported
    step_age: float | None = None  # how long the rank had been at `step` when it said so
    outside_steps: bool = False  # it said it is outside its steps (Heartbeat.outside_steps)
    metrics: dict[str, float] = field(default_factory=dict)
    # The rank's own state (random streams, buffers, local values) as of its loop start or
    # its latest boundary function: durable here. Step-by-step copies are held by its buddy.
    held: dict[str, Any] | None = None
    loop: dict[str, Any] | None = None  # the loop shape this rank reported
    reached: int = 0  # highest step boundary this rank reported reaching
    ready: bool = False  # reached its step loop (joiners count as ready)
    unmovable: str | None = None  # why its state can no longer move bit for bit: planned moves are refused


@dataclass
class Event:
    id: int
    kind: EventKind
    cause: str
    rank: int | None
    from_slot: str | None
    to_slot: str | None
    detected_at: float
    resumed_at: float | None = None
    downtime_s: float | None = None
    steps_lost: int = 0
    steps_rerun: int = 0
    resolved_without_rollback: bool | None = None
    state_bytes: int | None = None
    transfer_s: float | None = None
    joiner_setup_s: float | None = None  # the joiner's script from its assignment to its step loop
    # a no-code joiner's setup: the random initialisation it left out (its rank's state overwrote it)
    joiner_setup_left_out_mb: float | None = None
    transfer_wait_s: float | None = None  # the part of transfer_s the joiner waited for after its setup
    phases: dict[str, float] | None = None  # where a move's downtime went: the joiner's fetch, load, form, verify; rest
    # Not downtime: how long the first step after the move waited for its state check's pass
    # over the large tensors, which runs beside that step (state_check.verify_state).
    check_after_resume_s: float | None = None
    # A pre-copied planned move: what went on beside training before its pause (the joiner's
    # copy of the replicated state, the optimizer steps it followed, what feeding it cost the leaver).
    pre_copy: dict[str, Any] | None = None
    # An unplanned recovery onto a hot spare: whether its mirror gave the replicated state
    # (then only the rank's own and the small state moved), or why not.
    hot_spare: dict[str, Any] | None = None
    step: int | None = None
    status: str = "in-progress"  # in-progress | resolved | failed
    note: str = ""
    node: str | None = None  # path events: the node whose link changed, and which one
    interface: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kind"] = self.kind.value
        return out


def yoco_ratio(events: list[dict[str, Any]]) -> float | None:
    """Share of failure events resolved with no lost progress; None before any has ended.

    Moves still in progress or cancelled (the job finished first) are not failures to count.
    """
    done = [e for e in events if e.get("status") in ("resolved", "failed")
            and e.get("kind") not in ("divergence", "fatal", "path-restored", "path-damped")]
    if not done:
        return None
    good = [e for e in done if e.get("resolved_without_rollback") and e.get("steps_lost") == 0]
    return round(len(good) / len(done), 4)


def describe_cpu(cpu: dict[str, float]) -> str:
    """One line on what the job's CPU went to (Orchestrator.cpu_summary), for people."""
    def pct(part: float, whole: float) -> str:
        return f"{part / whole:.2%}" if whole > 0 else "n/a"

    return (f"baton's own CPU {cpu['baton_s']:.2f}s of the job's {cpu['total_s']:.1f}s "
            f"({pct(cpu['baton_s'], cpu['total_s'])}): in the ranks {cpu['ranks_baton_s']:.2f}s "
            f"({pct(cpu['ranks_baton_s'], cpu['ranks_s'])} of their {cpu['ranks_s']:.1f}s), "
            f"spares {cpu['spares_s']:.2f}s, control plane {cpu['control_plane_s']:.2f}s"
            + (f"; the workers' imports, once, {cpu['imports_s']:.2f}s" if cpu.get("imports_s") else ""))


def to_json(obj: Any) -> Any:
    """Dataclass -> JSON-safe dict, with enums as their values."""
    if dataclasses.is_dataclass(obj):
        return {k: to_json(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
