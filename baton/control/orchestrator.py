"""The orchestrator: the one brain. It owns every decision about ranks, spares, taints and moves.

Inputs arrive as method calls (from the HTTP API: worker reports, CLI requests;
from the scheduler: process exits; from its own ticker: heartbeat deadlines).
Outputs leave as commands in worker mailboxes and as scheduler calls. All state
changes happen under one lock and are persisted before the lock is released, so
what the API shows is what SQLite holds.

Protocols (see DESIGN.md):
- planned / pre-emptive: agree on a boundary step T with every rank (pause/ack,
  re-target when a rank is already past T), the leaver publishes its state, the
  joiner fetches it, everyone forms generation g+1, the leaver is released.
- unplanned: survivors absorb the failed step and report the boundary their
  state is at; ranks that neither report nor heartbeat are declared dead; the
  most advanced boundary wins; spares fetch replicated state from every
  survivor at that boundary (striped), behind survivors catch up the same way.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from baton.control.mailbox import Mailboxes
from baton.control.state import (
    Event,
    EventKind,
    RankInfo,
    RankState,
    Slot,
    Worker,
    WorkerRole,
    to_json,
    yoco_ratio,
)
from baton.store.sqlite import SqliteStore

log = logging.getLogger("baton.orchestrator")


class RequestError(Exception):
    """A request the orchestrator refuses; `status` is the HTTP status to answer with."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class Scheduler(Protocol):
    """What the orchestrator needs from a scheduler plugin (local, slurm, kubernetes)."""

    def slots(self) -> list[str]: ...

    def start(self, worker_id: str, slot: str) -> int: ...

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None: ...


@dataclass
class Config:
    world_size: int
    spares: int = 1
    job_id: str = "job"
    heartbeat_timeout_s: float = 3.0  # no heartbeat for this long: the worker is hung
    op_timeout_s: float = 5.0  # per-collective timeout inside workers
    collect_grace_s: float = 2.0  # extra wait for survivors' reports after op_timeout
    formation_timeout_s: float = 120.0


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


class Orchestrator:
    def __init__(self, config: Config, store: SqliteStore, scheduler: Scheduler | None = None):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.mail = Mailboxes()
        self._lock = threading.RLock()
        self.slots: dict[str, Slot] = {}
        self.workers: dict[str, Worker] = {}
        self.ranks: dict[int, RankInfo] = {r: RankInfo(rank=r) for r in range(config.world_size)}
        self.events: list[Event] = []
        self.generation = 0
        self.op: Operation | None = None
        self._op_ids = 0
        self._worker_ids = 0
        self.exit_code: int | None = None  # set when the job is over
        self._training_done = False  # every rank reported finished
        self.failure: str | None = None  # user error text that ended the job
        self.done = threading.Event()
        self._last_persist = 0.0
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Create slots and launch the initial ranks and spares."""
        assert self.scheduler is not None
        with self._lock:
            for name in self.scheduler.slots():
                self.slots[name] = Slot(name=name)
            names = list(self.slots)
            need = self.config.world_size + self.config.spares
            if len(names) < need:
                raise RequestError(f"{need} slots needed (ranks + spares), scheduler has {len(names)}")
            for r in range(self.config.world_size):
                self._launch(names[r], intended_rank=r)
            for i in range(self.config.spares):
                self._launch(names[self.config.world_size + i])
            self._persist(force=True)

    def _launch(self, slot: str, intended_rank: int | None = None) -> Worker:
        wid = f"w{self._worker_ids}"
        self._worker_ids += 1
        worker = Worker(id=wid, slot=slot, intended_rank=intended_rank)
        self.workers[wid] = worker
        assert self.scheduler is not None
        worker.pid = self.scheduler.start(wid, slot)
        return worker

    def tick(self) -> None:
        """Periodic checks: hung workers, collect deadlines, spare replenishment."""
        now = time.time()
        with self._lock:
            if self.exit_code is not None:
                return
            training = self._training()
            for w in list(self.workers.values()):
                if w.role not in (WorkerRole.RANK, WorkerRole.SPARE, WorkerRole.LEAVING):
                    continue
                # Ranks that are stepping get the tight timeout; a worker still importing or
                # warming up (or an idle spare) may legitimately starve its heartbeat thread.
                limit = self.config.heartbeat_timeout_s if training and w.role == WorkerRole.RANK \
                    else max(30.0, 10 * self.config.heartbeat_timeout_s)
                if now - w.last_seen > limit:
                    self._worker_lost(w, f"no heartbeat for {now - w.last_seen:.1f}s (hung)")
            op = self.op
            if op and op.phase == "collect" and op.collect_deadline and now > op.collect_deadline:
                for r, info in self.ranks.items():
                    if r not in op.moves and r not in op.boundaries:
                        w = self.workers.get(info.worker or "")
                        if w:
                            self._worker_lost(w, "did not report after the failed step (hung)")
                self._advance_collect()
            self._replenish()
            self._persist()

    # ------------------------------------------------------------------ worker API
    def register(self, worker_id: str, pid: int, transfer_addr: list[Any] | None) -> dict[str, Any]:
        with self._lock:
            w = self._worker(worker_id)
            if w.role == WorkerRole.GONE:
                raise RequestError(f"worker {worker_id} is no longer part of the job", 410)
            w.pid = pid
            w.last_seen = time.time()
            w.transfer_addr = tuple(transfer_addr) if transfer_addr else None
            w.role = WorkerRole.SPARE
            if w.intended_rank is not None and self.generation == 0 and self.op is None:
                w.role = WorkerRole.RANK
                w.rank = w.intended_rank
                self.ranks[w.rank].worker = w.id
                self._maybe_start_generation0()
            elif not self.slots[w.slot].healthy:
                # The slot was tainted while this spare was starting: keep nothing there.
                w.role = WorkerRole.GONE
                self.mail.post(w.id, {"type": "stop", "reason": f"slot {w.slot} is tainted"})
            else:
                self._emit("spare", {"worker": w.id, "slot": w.slot})
                self._on_spare_available()
            self._persist(force=True)
            return {"worker_id": w.id, "world_size": self.config.world_size, "role": w.role.value,
                    "op_timeout_s": self.config.op_timeout_s,
                    "formation_timeout_s": self.config.formation_timeout_s}

    def _maybe_start_generation0(self) -> None:
        if all(
            info.worker and self.workers[info.worker].role == WorkerRole.RANK for info in self.ranks.values()
        ):
            for r, info in self.ranks.items():
                info.state = RankState.RUNNING
                assert info.worker
                self.mail.post(info.worker, {"type": "assign", "rank": r, "generation": 0,
                                             "world_size": self.config.world_size, "joiner": False})
                self.mail.post(info.worker, {"type": "form", "generation": 0, "step": 0})
            self._emit("started", {"world_size": self.config.world_size})

    def commands(self, worker_id: str, after: int, timeout: float) -> list[dict[str, Any]]:
        with self._lock:
            self._worker(worker_id)
        return self.mail.wait(worker_id, after, timeout)

    def report(self, worker_id: str, report: dict[str, Any]) -> dict[str, Any]:
        kind = report.get("type")
        handler = getattr(self, f"_on_{kind}", None) if isinstance(kind, str) else None
        if handler is None:
            raise RequestError(f"unknown report type {kind!r}")
        with self._lock:
            w = self._worker(worker_id)
            w.last_seen = time.time()
            result = handler(w, report) or {}
            self._persist(force=kind != "heartbeat")
            return result

    def _on_heartbeat(self, w: Worker, rep: dict[str, Any]) -> None:
        if w.role == WorkerRole.RANK and w.rank is not None:
            info = self.ranks[w.rank]
            if info.worker != w.id:
                return
            if isinstance(rep.get("step"), int):
                info.step = rep["step"]
                info.step_at = time.time()
            if isinstance(rep.get("metrics"), dict):
                info.metrics = rep["metrics"]
            if rep.get("local_state") is not None:
                info.local_state = rep["local_state"]
                info.local_state_step = rep.get("local_state_step")
            elif isinstance(rep.get("local_state_step"), int) and info.local_state is not None:
                info.local_state_step = rep["local_state_step"]  # unchanged RNG, newer step
            if isinstance(rep.get("step_time"), (int, float)):
                info.metrics["step_time"] = float(rep["step_time"])

    def _on_pause_ack(self, w: Worker, rep: dict[str, Any]) -> None:
        op = self.op
        if op is None or rep.get("op") != op.id or w.rank is None or op.phase != "agree":
            return
        op.acks[w.rank] = rep
        self._advance_agree()

    def _on_paused(self, w: Worker, rep: dict[str, Any]) -> None:
        op = self.op
        if op is None or rep.get("op") != op.id or w.rank is None:
            return
        op.paused[w.rank] = time.time()
        self.ranks[w.rank].state = RankState.PAUSED
        self.ranks[w.rank].step = int(rep.get("step", op.target_step or 0))
        self._advance_pausing()

    def _on_recover(self, w: Worker, rep: dict[str, Any]) -> None:
        """A survivor absorbed a failed step; its state is at boundary `step`."""
        if w.rank is None or w.role != WorkerRole.RANK:
            return
        info = self.ranks[w.rank]
        info.state = RankState.RECOVERING
        info.step = int(rep["step"])
        op = self.op
        if op is None or op.kind != EventKind.UNPLANNED:
            # The survivor saw the failure first (e.g. a hung peer): open the recovery now;
            # the culprit is found by heartbeats or by not reporting.
            self._open_recovery(cause=f"rank {w.rank} saw a failed collective: {rep.get('error', '')[:200]}")
            op = self.op
        assert op is not None
        if w.rank not in op.moves:
            op.boundaries[w.rank] = int(rep["step"])
            op.rerun = op.rerun or bool(rep.get("rerun"))
        self._advance_collect()

    def _on_formed(self, w: Worker, rep: dict[str, Any]) -> None:
        op = self.op
        if w.rank is None:
            return
        info = self.ranks[w.rank]
        info.state = RankState.RUNNING
        info.step = int(rep.get("step", info.step))
        if rep.get("bytes"):
            if op:
                op.transfer_bytes = max(op.transfer_bytes, int(rep["bytes"]))
                op.transfer_s = max(op.transfer_s, float(rep.get("seconds", 0.0)))
        if op is None or rep.get("generation") != op.generation:
            return
        op.formed[w.rank] = time.time()
        if len(op.formed) == self.config.world_size:
            self._finish_op(op)

    def _on_finished(self, w: Worker, rep: dict[str, Any]) -> None:
        if w.rank is not None and self.ranks[w.rank].worker == w.id:
            self.ranks[w.rank].state = RankState.FINISHED
            self.ranks[w.rank].step = int(rep.get("step", self.ranks[w.rank].step))
        if all(i.state == RankState.FINISHED for i in self.ranks.values()) and not self._training_done:
            self._training_done = True
            op = self.op
            if op is not None:
                # The job reached its last step before the agreed boundary: nothing to move.
                for move in op.moves.values():
                    ev = self.events[move.event_id - 1]
                    ev.status, ev.note = "cancelled", "the job finished before the agreed step boundary"
                    self.store.put_event(ev.id, ev.to_json())
                self._emit("cancelled", {"op": op.id, "reason": "job finished first"})
                self.op = None
            self._emit("finished", {})
            # Spares are no longer needed; ranks may still run code after job.finish()
            # (saving a checkpoint, say): the job ends when their processes exit.
            for spare in self.workers.values():
                if spare.role in (WorkerRole.SPARE, WorkerRole.STARTING):
                    spare.role = WorkerRole.GONE
                    self.mail.post(spare.id, {"type": "stop", "reason": "training finished"})
                    if self.scheduler is not None and spare.pid is None:
                        self.scheduler.kill(spare.id)
        self._maybe_end_after_finish()

    def _maybe_end_after_finish(self) -> None:
        if not self._training_done:
            return
        rank_workers = {i.worker for i in self.ranks.values()}
        if all(self.workers[w].role == WorkerRole.GONE for w in rank_workers if w):
            self._end(0)

    def _on_user_error(self, w: Worker, rep: dict[str, Any]) -> None:
        text = str(rep.get("traceback", ""))[-20000:]
        self.failure = text
        if w.rank is not None:
            self.ranks[w.rank].state = RankState.FAILED
        self._emit("user-error", {"rank": w.rank, "traceback": text})
        self._end(int(rep.get("exit_code", 1)) or 1, spare_worker=w.id)

    def _on_ready(self, w: Worker, rep: dict[str, Any]) -> None:
        """The rank entered its step loop: from here on it is recoverable."""
        if w.rank is not None:
            self.ranks[w.rank].ready = True

    def _training(self) -> bool:
        return all(i.ready for i in self.ranks.values())

    def _on_left(self, w: Worker, rep: dict[str, Any]) -> None:
        w.role = WorkerRole.GONE

    # ------------------------------------------------------------------ scheduler input
    def worker_exited(self, worker_id: str, returncode: int) -> None:
        with self._lock:
            w = self.workers.get(worker_id)
            if w is None:
                return
            w.exit_code = returncode
            prev = w.role
            if prev in (WorkerRole.GONE, WorkerRole.LEAVING) or self.exit_code is not None:
                w.role = WorkerRole.GONE
                self._persist(force=True)
                return
            if returncode > 0 and prev == WorkerRole.RANK:
                # The script ended with an error of its own: a bug, not a hardware failure.
                self.failure = self.failure or f"rank {w.rank} exited with code {returncode}"
                self._emit("user-error", {"rank": w.rank, "exit_code": returncode})
                w.role = WorkerRole.GONE
                self._end(returncode)
            elif prev == WorkerRole.RANK and w.rank is not None and (
                    returncode == 0 or self.ranks[w.rank].state == RankState.FINISHED):
                # A clean exit (or any end after the rank reported finished) is completion.
                w.role = WorkerRole.GONE
                self._on_finished(w, {"step": self.ranks[w.rank].step})
            else:
                how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
                self._worker_lost(w, f"process {how}")
            self._persist(force=True)

    def _worker_lost(self, w: Worker, cause: str) -> None:
        """A worker is dead or hung: make sure it is gone and start recovery if it held a rank."""
        role, rank = w.role, w.rank
        w.role = WorkerRole.GONE
        if self.scheduler is not None:
            self.scheduler.kill(w.id, dump_stacks="hung" in cause)
        self._emit("worker-lost", {"worker": w.id, "slot": w.slot, "rank": rank, "cause": cause})
        if rank is None or role not in (WorkerRole.RANK,):
            return
        if self.ranks[rank].worker != w.id:
            return  # a joiner that never took over, or already replaced
        self.ranks[rank].state = RankState.FAILED
        if not self._training():
            # Before every rank reached its step loop there is no consistent state to hand
            # over (the initial broadcast may be half done): fail clearly instead of guessing.
            self.failure = (f"rank {rank} was lost during startup ({cause}), before training began; "
                            "nothing to migrate yet: start the job again")
            self._emit("fatal", {"message": self.failure})
            self._end(1)
            return
        self._open_recovery(cause=cause, dead_rank=rank, dead_worker=w)

    # ------------------------------------------------------------------ CLI / API requests
    def request_migration(self, rank: int, kind: EventKind = EventKind.PLANNED, cause: str = "requested") -> dict:
        with self._lock:
            if not isinstance(rank, int) or rank not in self.ranks:
                raise RequestError(f"unknown rank {rank}: this job has ranks 0..{self.config.world_size - 1}", 404)
            self._check_running()
            if self.op is not None:
                raise RequestError(f"a {self.op.kind.value} migration is already in progress (op {self.op.id})", 409)
            spares = self._ready_spares()
            if not spares:
                raise RequestError("no spare available: wait for one to start, or untaint a slot", 409)
            op = self._start_planned([rank], kind, cause)
            self._persist(force=True)
            return {"op": op.id, "events": [m.event_id for m in op.moves.values()]}

    def taint(self, slot: str, reason: str) -> dict[str, Any]:
        with self._lock:
            s = self._slot(slot)
            if not reason or not isinstance(reason, str):
                raise RequestError("a taint needs a reason (e.g. ecc, thermal, maintenance)")
            s.taint, s.tainted_at = reason, time.time()
            self._emit("taint", {"slot": slot, "reason": reason})
            moved: list[int] = []
            for w in self.workers.values():
                if w.slot != slot:
                    continue
                if w.role == WorkerRole.SPARE:
                    w.role = WorkerRole.GONE
                    self.mail.post(w.id, {"type": "stop", "reason": f"slot {slot} tainted"})
                elif w.role == WorkerRole.RANK and w.rank is not None:
                    moved.append(w.rank)
            result: dict[str, Any] = {"slot": slot, "reason": reason, "moving_ranks": moved}
            if moved and self.exit_code is None:
                if self.op is None and self._ready_spares():
                    op = self._start_planned(moved, EventKind.PREEMPTIVE, f"taint: {reason}")
                    result["op"] = op.id
                else:
                    result["note"] = "rank will move when a spare is free and no other migration runs"
            self._persist(force=True)
            return result

    def untaint(self, slot: str) -> dict[str, Any]:
        with self._lock:
            s = self._slot(slot)
            was = s.taint
            s.taint, s.tainted_at = None, None
            self._emit("untaint", {"slot": slot})
            self._replenish()
            self._persist(force=True)
            return {"slot": slot, "was": was}

    # ------------------------------------------------------------------ planned / pre-emptive
    def _start_planned(self, ranks: list[int], kind: EventKind, cause: str) -> Operation:
        spares = self._ready_spares()
        ranks = ranks[: len(spares)]
        self.generation += 1
        self._op_ids += 1
        op = Operation(id=self._op_ids, kind=kind, generation=self.generation, moves={}, phase="agree")
        for rank, spare in zip(ranks, spares):
            leaver = self.workers[self.ranks[rank].worker or ""]
            ev = self._new_event(kind, cause, rank, leaver.slot)
            move = Move(rank=rank, event_id=ev.id, from_worker=leaver.id, to_worker=spare.id)
            op.moves[rank] = move
            self._assign_joiner(spare, rank, op)
            self.ranks[rank].state = RankState.MIGRATING
        self.op = op
        op.target_step = self._estimate_target()
        self._emit("migration", {"kind": kind.value, "ranks": ranks, "cause": cause, "at_step": op.target_step})
        for r, info in self.ranks.items():
            assert info.worker
            self.mail.post(info.worker, {"type": "pause", "op": op.id, "at_step": op.target_step})
        return op

    def _estimate_target(self) -> int:
        """Pick a boundary just ahead of where the fastest rank is now.

        Step reports arrive with heartbeats, so each is extrapolated by its age at the
        rank's step rate, plus ~50 ms for the pause to reach the ranks. Aiming short is
        safe (a rank already past answers so and the target moves); aiming long only
        costs steps of waiting for the move to start.
        """
        now = time.time()
        best = 0.0
        for info in self.ranks.values():
            step_time = info.metrics.get("step_time", 0.0)
            guess = float(info.step)
            if step_time > 0 and info.step_at:
                guess += (now - info.step_at + 0.05) / step_time
            best = max(best, guess)
        return int(math.ceil(best)) + 1

    def _advance_agree(self) -> None:
        op = self.op
        assert op is not None
        if len(op.acks) < len(self.ranks):
            return
        late = [a for a in op.acks.values() if not a.get("ok")]
        if late:
            new_target = max(int(a.get("next_step", 0)) for a in op.acks.values()) + 2
            op.target_step = new_target
            op.acks = {}
            self._emit("retarget", {"op": op.id, "at_step": new_target})
            for info in self.ranks.values():
                assert info.worker
                self.mail.post(info.worker, {"type": "pause", "op": op.id, "at_step": new_target})
            return
        op.phase = "pausing"
        self._advance_pausing()

    def _advance_pausing(self) -> None:
        op = self.op
        assert op is not None
        if op.phase != "pausing" or len(op.paused) < len(self.ranks):
            return
        op.phase = "forming"
        step = op.target_step or 0
        for r, info in self.ranks.items():
            assert info.worker
            move = op.moves.get(r)
            if move is None:
                self.mail.post(info.worker, {"type": "form", "generation": op.generation, "step": step})
                continue
            leaver = self.workers[move.from_worker or ""]
            self.mail.post(leaver.id, {"type": "publish", "generation": op.generation, "step": step,
                                       "leave": True})
            assert move.to_worker
            self.mail.post(move.to_worker, {"type": "form", "generation": op.generation, "step": step,
                                            "fetch_from": [leaver.transfer_addr], "full_state": True})

    # ------------------------------------------------------------------ unplanned
    def _open_recovery(self, cause: str, dead_rank: int | None = None, dead_worker: Worker | None = None) -> None:
        op = self.op
        carried: dict[int, str] = {}  # rank -> joiner that can take it over in the recovery
        if op is not None and op.kind != EventKind.UNPLANNED:
            # A failure in the middle of a planned move: fold everything into one recovery.
            self._emit("note", {"message": f"failure during {op.kind.value} migration: recovering instead"})
            for rank, move in op.moves.items():
                ev = self.events[move.event_id - 1]
                ev.status, ev.note = "failed", "superseded by an unplanned failure during the move"
                self.store.put_event(ev.id, ev.to_json())
                joiner = self.workers.get(move.to_worker or "")
                if joiner is None or joiner.role != WorkerRole.RANK:
                    continue
                if move.from_worker == (dead_worker.id if dead_worker else None):
                    carried[rank] = joiner.id  # the leaver died: its joiner takes the rank over
                else:
                    # The leaver lives on as a survivor; the joiner (already running the
                    # script as that rank) cannot serve another rank: stop it, free the slot.
                    joiner.role = WorkerRole.GONE
                    if self.scheduler is not None:
                        self.scheduler.kill(joiner.id)
            op = None
            self.op = None
        if op is None:
            self.generation += 1
            self._op_ids += 1
            op = Operation(id=self._op_ids, kind=EventKind.UNPLANNED, generation=self.generation,
                           moves={}, phase="collect")
            op.collect_deadline = time.time() + self.config.op_timeout_s + self.config.collect_grace_s
            self.op = op
            for info in self.ranks.values():
                if info.worker and self.workers[info.worker].role == WorkerRole.RANK and info.rank != dead_rank:
                    self.mail.post(info.worker, {"type": "abort", "op": op.id, "generation": op.generation})
            self._emit("recovery", {"op": op.id, "cause": cause})
        if dead_rank is not None and dead_rank not in op.moves:
            ev = self._new_event(EventKind.UNPLANNED, cause, dead_rank, dead_worker.slot if dead_worker else None)
            op.moves[dead_rank] = Move(rank=dead_rank, event_id=ev.id,
                                       from_worker=dead_worker.id if dead_worker else None,
                                       to_worker=carried.get(dead_rank))
            op.boundaries.pop(dead_rank, None)
            if op.phase in ("forming", "spares"):
                # Lost someone while forming: everyone goes back to collecting.
                op.phase = "collect"
                op.formed.clear()
                op.collect_deadline = time.time() + self.config.op_timeout_s + self.config.collect_grace_s
                self.generation += 1
                op.generation = self.generation
                for info in self.ranks.values():
                    if info.worker and self.workers[info.worker].role == WorkerRole.RANK and info.rank not in op.moves:
                        self.mail.post(info.worker, {"type": "abort", "op": op.id, "generation": op.generation})
        self._advance_collect()

    def _advance_collect(self) -> None:
        op = self.op
        if op is None or op.kind != EventKind.UNPLANNED or op.phase not in ("collect", "spares"):
            return
        survivors = [r for r in self.ranks if r not in op.moves]
        if any(r not in op.boundaries for r in survivors):
            return
        if not survivors:
            self._emit("fatal", {"message": "every rank failed at once: nothing to recover from"})
            self._end(1)
            return
        op.target_step = max(op.boundaries[r] for r in survivors)
        # Spares for the dead ranks.
        for rank, move in sorted(op.moves.items()):
            if move.to_worker is None:
                spares = self._ready_spares()
                if not spares:
                    op.phase = "spares"
                    msg = (f"rank {rank} lost and no spare is available: the job is paused until a "
                           "spare starts (free a slot or untaint one)")
                    if op.waiting_message != msg:
                        op.waiting_message = msg
                        self.ranks[rank].state = RankState.WAITING_SPARE
                        self._emit("waiting-for-spare", {"rank": rank, "message": msg})
                    return
                move.to_worker = spares[0].id
                self._assign_joiner(spares[0], rank, op)
        op.phase = "forming"
        op.waiting_message = None
        target = op.target_step
        sources = [r for r in survivors if op.boundaries[r] == target]
        addrs = [self.workers[self.ranks[r].worker or ""].transfer_addr for r in sources]
        for r in survivors:
            wid = self.ranks[r].worker
            assert wid
            if op.boundaries[r] == target:
                self.mail.post(wid, {"type": "form", "generation": op.generation, "step": target,
                                     "publish": True})
            else:
                self.mail.post(wid, {"type": "form", "generation": op.generation, "step": target,
                                     "fetch_from": addrs})
        for rank, move in op.moves.items():
            info = self.ranks[rank]
            local = info.local_state if info.local_state_step is not None else None
            assert move.to_worker
            self.mail.post(move.to_worker, {"type": "form", "generation": op.generation, "step": target,
                                            "fetch_from": addrs, "local_state": local,
                                            "local_state_step": info.local_state_step})

    # ------------------------------------------------------------------ shared
    def _assign_joiner(self, spare: Worker, rank: int, op: Operation) -> None:
        spare.role = WorkerRole.RANK
        spare.rank = rank
        self.mail.post(spare.id, {"type": "assign", "rank": rank, "generation": op.generation,
                                  "world_size": self.config.world_size, "joiner": True})

    def _finish_op(self, op: Operation) -> None:
        now = time.time()
        first_stop = min(op.paused.values(), default=op.started_at)
        for rank, move in op.moves.items():
            ev = self.events[move.event_id - 1]
            if move.from_worker:
                leaver = self.workers[move.from_worker]
                if op.kind != EventKind.UNPLANNED and leaver.role != WorkerRole.GONE:
                    leaver.role = WorkerRole.LEAVING
                    leaver.rank = None
                    self.mail.post(leaver.id, {"type": "release"})
            assert move.to_worker
            joiner = self.workers[move.to_worker]
            self.ranks[rank].worker = joiner.id
            ev.to_slot = joiner.slot
            ev.resumed_at = now
            start = ev.detected_at if op.kind == EventKind.UNPLANNED else first_stop
            ev.downtime_s = round(now - start, 4)
            ev.step = op.target_step
            ev.state_bytes = op.transfer_bytes or None
            ev.transfer_s = round(op.transfer_s, 4) if op.transfer_s else None
            ev.steps_lost = 0
            if op.kind == EventKind.UNPLANNED:
                # The in-flight step is re-run unless every survivor had already completed it.
                ev.steps_rerun = 1 if op.rerun else 0
            ev.resolved_without_rollback = True
            ev.status = "resolved"
            self.store.put_event(ev.id, ev.to_json())
            self._emit("resolved", ev.to_json())
        self.op = None
        # Taints that arrived while this op ran still need their ranks moved.
        self._pending_taint_moves()
        self._replenish()

    def _pending_taint_moves(self) -> None:
        if self.op is not None or self.exit_code is not None:
            return
        for w in self.workers.values():
            if w.role == WorkerRole.RANK and w.rank is not None and not self.slots[w.slot].healthy:
                if self._ready_spares():
                    self._start_planned([w.rank], EventKind.PREEMPTIVE, f"taint: {self.slots[w.slot].taint}")
                return

    def _on_spare_available(self) -> None:
        op = self.op
        if op is not None and op.phase == "spares":
            self._advance_collect()
        elif op is None:
            self._pending_taint_moves()

    def _replenish(self) -> None:
        """Keep `spares` warm spares, each on a healthy slot nobody else uses."""
        if self.scheduler is None or self.exit_code is not None:
            return
        if self.op is not None and self.op.phase != "spares":
            return  # a move is running: do not steal CPU/IO from it; refill right after
        live = [w for w in self.workers.values() if w.role != WorkerRole.GONE]
        spares = [w for w in live if w.role in (WorkerRole.SPARE, WorkerRole.STARTING) and w.intended_rank is None]
        missing = self.config.spares - len(spares)
        if missing <= 0:
            return
        used = {w.slot for w in live}
        free = [s for s in self.slots.values() if s.healthy and s.name not in used]
        for slot in free[:missing]:
            w = self._launch(slot.name)
            self._emit("spare-starting", {"worker": w.id, "slot": slot.name})

    def _ready_spares(self) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.role == WorkerRole.SPARE and self.slots[w.slot].healthy]

    def _new_event(self, kind: EventKind, cause: str, rank: int | None, from_slot: str | None) -> Event:
        ev = Event(id=len(self.events) + 1, kind=kind, cause=cause, rank=rank, from_slot=from_slot,
                   to_slot=None, detected_at=time.time())
        self.events.append(ev)
        self.store.put_event(ev.id, ev.to_json())
        return ev

    def _end(self, code: int, spare_worker: str | None = None) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        for w in self.workers.values():
            if w.role in (WorkerRole.SPARE, WorkerRole.STARTING, WorkerRole.LEAVING):
                self.mail.post(w.id, {"type": "stop", "reason": "job ended"})
        if code != 0:
            for w in self.workers.values():
                # The worker that reported the error exits by itself, printing its traceback.
                if w.role != WorkerRole.GONE and self.scheduler is not None and w.id != spare_worker:
                    self.scheduler.kill(w.id)
        self.done.set()

    def _check_running(self) -> None:
        if self.exit_code is not None:
            raise RequestError("the job has ended", 409)
        if any(i.state == RankState.STARTING for i in self.ranks.values()):
            raise RequestError("the job is still starting: try again once every rank is stepping", 409)

    def _worker(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise RequestError(f"unknown worker {worker_id!r}", 404)
        return w

    def _slot(self, slot: str) -> Slot:
        s = self.slots.get(slot)
        if s is None:
            known = ", ".join(self.slots) or "none"
            raise RequestError(f"unknown slot {slot!r}; slots are: {known}", 404)
        return s

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        log.info("%s %s", kind, data)
        for fn in self.listeners:
            try:
                fn(kind, data)
            except Exception:  # a listener must never break the brain
                log.exception("listener failed")

    # ------------------------------------------------------------------ views
    def yoco_ratio(self) -> float | None:
        return yoco_ratio([e.to_json() for e in self.events])

    def status(self) -> dict[str, Any]:
        with self._lock:
            ranks = []
            for r, info in sorted(self.ranks.items()):
                w = self.workers.get(info.worker or "")
                ranks.append({"rank": r, "pid": w.pid if w else None, "slot": w.slot if w else None,
                              "step": info.step, "state": info.state.value,
                              "metrics": info.metrics})
            spares = [{"worker": w.id, "slot": w.slot, "pid": w.pid, "state": w.role.value}
                      for w in self.workers.values()
                      if w.role in (WorkerRole.SPARE, WorkerRole.STARTING) and w.intended_rank is None]
            taints = [{"slot": s.name, "reason": s.taint, "since": s.tainted_at}
                      for s in self.slots.values() if s.taint]
            job = {
                "id": self.config.job_id,
                "world_size": self.config.world_size,
                "generation": self.generation,
                "state": self._job_state(),
                "ranks": ranks,
                "spares": spares,
                "taints": taints,
                "slots": [{"slot": s.name, "taint": s.taint} for s in self.slots.values()],
                "yoco_ratio": self.yoco_ratio(),
                "operation": None if self.op is None else {
                    "id": self.op.id, "kind": self.op.kind.value, "phase": self.op.phase,
                    "target_step": self.op.target_step, "ranks": sorted(self.op.moves),
                    "message": self.op.waiting_message},
                "exit_code": self.exit_code,
            }
            return {"jobs": [job]}

    def _job_state(self) -> str:
        if self.exit_code is not None:
            return "succeeded" if self.exit_code == 0 else "failed"
        if self.op is not None:
            return "waiting-for-spare" if self.op.phase == "spares" else "migrating"
        if any(i.state == RankState.STARTING for i in self.ranks.values()):
            return "starting"
        return "running"

    def event_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e.to_json() for e in self.events]

    def _persist(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_persist < 1.0:
            return
        self._last_persist = now
        rows: list[tuple[str, str, dict[str, Any]]] = []
        rows += [("slot", s.name, to_json(s)) for s in self.slots.values()]
        rows += [("worker", w.id, to_json(w)) for w in self.workers.values()]
        rows += [("rank", str(r), to_json(i)) for r, i in self.ranks.items()]
        rows.append(("job", self.config.job_id, {"generation": self.generation, "exit_code": self.exit_code,
                                                 "world_size": self.config.world_size}))
        self.store.put_many(rows)
