"""The orchestrator: the one brain. It owns every decision about ranks, spares, taints and moves.

Inputs arrive as typed messages (`messages.py`): worker reports through `report()`,
everything else (CLI requests, process exits from the scheduler, ticks from the
launcher's clock) through `handle()`. Each is decided under one lock. Outputs leave
as commands in worker mailboxes and as typed effects (start or kill a worker, write
the ledger, print) that are applied in order after the decision lock is released
(`effects.py`). The protocols live in their own modules, mixed in here: `planned.py`,
`recovery.py`, `spares.py`; one move in flight is an `Operation`.

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
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pydantic import BaseModel

from baton.control import effects as fx
from baton.control import messages as m
from baton.control.effects import DecisionLock
from baton.control.errors import RequestError
from baton.control.homing import Homing
from baton.control.hot import HotSpareFeeds
from baton.control.mailbox import Mailboxes
from baton.control.nodes import Node, NodeHealth
from baton.control.operation import Operation, RetryMove
from baton.control.paths import AUTO_PATHS, DataPaths, PathFailover
from baton.control.planned import PlannedMoves
from baton.control.recovery import LossStreak, Recovery
from baton.control.spares import SparePool
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
from baton.health.alerts import AlertBatch, reason_of, target_of
from baton.health.gpu import GpuReading, GpuThresholds
from baton.health.straggler import StragglerDetector
from baton.control.restore import job_record, restore
from baton.store.sqlite import SqliteStore

log = logging.getLogger("baton.orchestrator")
EXIT_PEER_LOST = 75  # a rank's exit code for "died of a lost peer" (baton.worker.job)
TICK_S = 0.25  # how often the host calls tick()


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
    spare_wait_s: float = 600.0  # a recovery waits this long for a spare, then the job fails
    verify_every: int = 0  # also check replicas agree every N steps (0: only after moves)
    redundancy: int = 2  # buddies holding each rank's own state (simultaneous losses survived)
    ranks_per_node: int = 0  # ranks r*k..r*k+k-1 share a node (0: all on one); buddies go to other nodes
    return_home: bool = False  # move ranks back to their first node once it is healthy again
    pre_copy: bool = False  # a planned move's joiner copies the replicated state while training goes on
    hot_spares: bool = False  # spares mirror the replicated state at every step (hot.py)
    straggler_factor: float = 0.0  # taint a rank's slot when its busy time stays above this x median (0: off)
    straggler_steps: int = 20  # ... for this many consecutive steps
    borrow_spares: bool = False  # with no dedicated spare left, borrow a node from a lower-priority job
    gpu_limits: GpuThresholds = GpuThresholds()  # NVML readings past these taint the slot
    control_grace_s: float = 10.0  # workers keep retrying an unreachable control plane this long
    mode: str = "model-aware"  # or "no-code": the script does not import baton (baton.transparent)
    data_paths: tuple[str, ...] = ()  # the interfaces the groups run over (baton run --data-paths); none: the default
    path_hold_down_s: float = 5.0  # a data path back is used again once up this long on every node
    path_grace_s: float = 60.0  # a node holding ranks with a data path down this long is tainted (they move)


class Orchestrator(PlannedMoves, Recovery, SparePool, NodeHealth, Homing, PathFailover, HotSpareFeeds):
    def __init__(self, config: Config, store: SqliteStore, scheduler: Scheduler | None = None):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.mail = Mailboxes()
        self._lock = DecisionLock(self._apply)
        self._last_tick = 0.0
        self._retry_moves: list[RetryMove] = []  # interrupted planned moves, run again after a recovery
        self._losses_in_place: dict[int, LossStreak] = {}  # rank -> its losses since the job last advanced
        self._spares_lost_moving: dict[int, int] = {}  # rank -> spares lost in a row taking it over in planned moves
        self.slots: dict[str, Slot] = {}
        self.nodes: dict[str, Node] = {}
        self.home: dict[int, str] = {}  # rank -> the slot it started on
        self._targeted: dict[int, str] = {}  # rank -> slot or node it moves to once a spare is ready there
        self.stragglers = StragglerDetector(config.straggler_factor, config.straggler_steps)
        self._borrowing = False  # a request for a borrowed node is out
        self.workers: dict[str, Worker] = {}
        self.ranks: dict[int, RankInfo] = {r: RankInfo(rank=r) for r in range(config.world_size)}
        self.events: list[Event] = []
        self._moved_in: dict[int, list[int]] = {}  # generation -> the ids of the moves that formed it
        self.generation = 0
        self.op: Operation | None = None
        self._op_ids = 0
        self._worker_ids = 0
        self.exit_code: int | None = None  # set when the job is over
        self._final_code = 0  # a nonzero exit of a rank's code after job.finish()
        self._training_done = False  # every rank reported finished
        self.failure: str | None = None  # user error text that ended the job
        self.done = threading.Event()
        self._last_persist = 0.0
        self.loop: m.LoopInfo | None = None  # the loop every rank agreed on
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._script_failed = False  # the job ends on the script's own error (not a failure for the ledger)
        # each rank's record of its setup's collectives: rank 0's, and another's where it differs
        self.setup_records: dict[int, m.BundleText] = {}
        self.training_since: float | None = None  # when every rank had entered the step loop
        self.setup_files: dict[str, float] = {}  # what successors' setups wrote (m.SetupWritten)
        self.lives = 0  # earlier lives of this job's control plane (restarts from its store)
        self.helper_cpu: Callable[[], float] = lambda: 0.0  # CPU of its helper processes (the store)
        self.imports_cpu: Callable[[], float] = lambda: 0.0  # the workers' imports, done once in the zygote
        # --data-paths auto: no names until the first generation's nodes said theirs (paths.py)
        self.discover_paths = list(config.data_paths) == [AUTO_PATHS]
        self._found_detail: dict[str, str] = {}  # node -> what its discovery left out, and why
        self.data_paths = DataPaths([] if self.discover_paths else list(config.data_paths))
        self.generation_paths: list[str] = list(self.data_paths.names)  # the paths of the newest generation formed
        self._network_taints: dict[str, float] = {}  # node tainted for its links -> when they were last read
        self._paths_of: tuple[int, list[str]] = (-1, [])  # the generation the paths were chosen for, and them
        self._gen0_posted = False  # the first generation's Assign and Form went out
        self._init_hot()
        self.receive_mb = 0.0  # the receive memory a spare maps ahead: the replicated state the ranks report, and room

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Create slots and launch the initial ranks and spares."""
        assert self.scheduler is not None
        with self._lock:
            for name in self.scheduler.slots():
                self.slots[name] = Slot(name=name)
                self._node(name)
            names = list(self.slots)
            need = self.config.world_size + self.config.spares
            if len(names) < need:
                raise RequestError(f"{need} slots needed (ranks + spares), scheduler has {len(names)}")
            for r in range(self.config.world_size):
                self._launch(names[r], intended_rank=r)
                self.home[r] = names[r]
            for i in range(self.config.spares):
                self._launch(names[self.config.world_size + i])
            self._persist(force=True)

    def restore(self) -> bool:
        """Pick the job up from the store (a restarted control plane); False if it holds none."""
        with self._lock:
            found = restore(self, self.store)
            if found:
                self._persist(force=True)
            return found

    def _on_agent_sync(self, ev: m.AgentSync) -> None:
        """The job's agent reached us after an outage (ours or its): reconcile the workers it
        runs with the ones we think exist. Exits we missed are handled now; a start we decided
        but that never reached it is sent again; a process we do not know (started by a life
        that ended before it wrote it down) is stopped."""
        live = set(ev.live)
        for wid, code in ev.exited.items():
            w = self.workers.get(wid)
            if w is not None and w.role != WorkerRole.GONE:
                self._emit("note", {"message": f"{wid} on {w.slot} exited ({code}) while the control plane "
                                               "was away"})
                self._on_worker_exited(m.WorkerExited(worker_id=wid, returncode=code))
        for w in self.workers.values():
            if w.id in live or w.id in ev.exited:
                continue
            if w.role == WorkerRole.STARTING:
                self._lock.add(fx.StartWorker(w.id, w.slot))
            elif w.role != WorkerRole.GONE:
                self._emit("note", {"message": f"{w.id} on {w.slot} is gone: its agent does not run it"})
                self._on_worker_exited(m.WorkerExited(worker_id=w.id, returncode=-9))
        for wid in live - set(self.workers):
            self._emit("note", {"message": f"stopping {wid}: started by a control plane that did not record it"})
            self._kill(wid)
            if wid[1:].isdigit():
                self._worker_ids = max(self._worker_ids, int(wid[1:]) + 1)
        for w in self.workers.values():
            if w.role == WorkerRole.GONE and w.id in live:
                self._kill(w.id)  # a kill decided by the last life that did not land

    def _launch(self, slot: str, intended_rank: int | None = None) -> Worker:
        wid = f"w{self._worker_ids}"
        self._worker_ids += 1
        worker = Worker(id=wid, slot=slot, intended_rank=intended_rank)
        self.workers[wid] = worker
        self._lock.add(fx.StartWorker(wid, slot))
        return worker

    def _kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        self._lock.add(fx.KillWorker(worker_id, dump_stacks))

    def _apply(self, effect: fx.Effect) -> None:
        """Carry out one decided effect, outside the decision lock."""
        if isinstance(effect, fx.StartWorker):
            assert self.scheduler is not None
            try:
                pid = self.scheduler.start(effect.worker_id, effect.slot)
            except OSError as exc:
                log.error("could not start %s on %s: %s", effect.worker_id, effect.slot, exc)
                self.handle(m.WorkerExited(worker_id=effect.worker_id, returncode=127))
                return
            with self._lock:
                self.workers[effect.worker_id].pid = self.workers[effect.worker_id].pid or pid
        elif isinstance(effect, fx.KillWorker):
            if self.scheduler is not None:
                self.scheduler.kill(effect.worker_id, dump_stacks=effect.dump_stacks)
        elif isinstance(effect, fx.Emit):
            for fn in self.listeners:
                try:
                    fn(effect.kind, effect.data)
                except Exception:  # a listener must never break the brain
                    log.exception("listener failed")
        elif isinstance(effect, fx.WriteEvent):
            self.store.put_event(effect.event_id, effect.body)
            for fn in self.listeners:  # events.jsonl keeps the ledger too: read when state.db is not
                try:
                    fn("ledger", effect.body)
                except Exception:
                    log.exception("listener failed")
        elif isinstance(effect, fx.WriteRows):
            self.store.put_many(effect.rows)
        elif isinstance(effect, fx.ProbeNode):
            node = effect.node
            self.scheduler.probe_node(  # type: ignore[union-attr]
                node, lambda ok, detail: self.handle(m.NodeProbed(node=node, ok=ok, detail=detail[:500])))
        elif isinstance(effect, fx.ProbeLinks):
            node = effect.node
            self.scheduler.probe_links(  # type: ignore[union-attr]
                node, list(effect.names),
                lambda up, detail: self.handle(m.NodeLinks(node=node, up=up, detail=detail[:500])))
        elif isinstance(effect, fx.BorrowNode):
            self.scheduler.borrow(  # type: ignore[union-attr]
                lambda node, text, slots=(): self.handle(m.NodeBorrowed(
                    node=node, lender=text if node else "", detail="" if node else text[:500], slots=list(slots))))
        elif isinstance(effect, fx.ReleaseNode):
            self.scheduler.release(effect.node)  # type: ignore[union-attr]
        elif isinstance(effect, (fx.DrainNode, fx.ResumeNode)):
            fn = getattr(self.scheduler, "drain" if isinstance(effect, fx.DrainNode) else "resume", None)
            if fn is not None:
                fn(*([effect.node, effect.reason] if isinstance(effect, fx.DrainNode) else [effect.node]))

    # ------------------------------------------------------------------ inputs
    def handle(self, event: m.Input) -> dict[str, Any]:
        """Decide one input (a request, a process exit, a tick) under the lock; the effects it
        queued are applied once the lock is released. A refused request raises RequestError
        before it changes anything."""
        with self._lock:
            result = getattr(self, f"_on_{event.type}")(event) or {}
            if not isinstance(event, m.StoreFailed):  # writing again now would only fail again
                self._persist(force=not isinstance(event, m.Tick))
            return result

    def _on_tick(self, ev: m.Tick) -> None:
        """Periodic checks: hung workers, phase deadlines, spare replenishment."""
        now = ev.now
        if self.exit_code is not None:
            return
        self._forgive_own_stall(now)
        training = self._training()
        for w in list(self.workers.values()):
            if w.role not in (WorkerRole.RANK, WorkerRole.SPARE, WorkerRole.LEAVING):
                continue
            # Ranks that are stepping get the tight timeout; a worker still importing or
            # warming up (or an idle spare), or a rank past its last step (running the script's
            # closing code, exiting), may legitimately starve its heartbeat thread.
            finished = w.role == WorkerRole.RANK and w.rank is not None and \
                self.ranks[w.rank].worker == w.id and self.ranks[w.rank].state == RankState.FINISHED
            limit = self.config.heartbeat_timeout_s if training and w.role == WorkerRole.RANK and not finished \
                else max(30.0, 10 * self.config.heartbeat_timeout_s)
            if now - w.last_seen > limit:
                if finished:  # nothing left to recover: its exit (or the user's Ctrl-C) ends the job
                    if not w.unheard:
                        w.unheard = True
                        self._emit("note", {"message": f"rank {w.rank} finished training and has not been heard "
                                                       f"from for {now - w.last_seen:.0f}s: waiting for its "
                                                       "process to exit"})
                    continue
                if training and self._steps_without(w):
                    self._unheard(w, now)
                    continue
                self._worker_lost(w, f"no heartbeat for {now - w.last_seen:.1f}s (hung)")
        op = self.op
        if op is not None and now > op.deadline:
            self._expired(op)
        self._restore_paths(now)
        self._path_grace(now)
        self._probe_network_taints(now)
        self._replenish()

    def _steps_without(self, w: Worker) -> bool:
        """A silent rank the others keep training with: some rank has reached two steps past
        the last one it reported. Every step needs every rank's collectives, and a hung rank
        lets the others finish at most the step after its last: this one is alive, and only
        what it says is not getting here (its node's control path is down, say)."""
        if w.role != WorkerRole.RANK or w.rank is None or self.ranks[w.rank].worker != w.id:
            return False
        last = self.ranks[w.rank].step
        return any(i.step >= last + 2 for r, i in self.ranks.items() if r != w.rank)

    def _unheard(self, w: Worker, now: float) -> None:
        if not w.unheard:
            w.unheard = True
            self._emit("note", {"message": f"rank {w.rank} ({w.slot}) has not been heard from for "
                                           f"{now - w.last_seen:.1f}s, but the others keep training with it: its "
                                           "control path is down, not the rank; nothing moves"})

    def _expired(self, op: Operation) -> None:
        """The current phase ran out of time: each phase's fallback (see planned.py, recovery.py)."""
        log.warning("op %d: %s phase expired", op.id, op.phase)
        {"prepare": self._expired_prepare, "pre-copy": self._expired_pre_copy, "agree": self._expired_agree, "pausing": self._expired_pausing, "collect": self._expired_collect,
         "spares": self._expired_spares, "forming": self._expired_forming}[op.phase](op)

    def _forgive_own_stall(self, now: float) -> None:
        """Time this process itself did not run (paused, starved, a slow disk) is not a
        worker's silence: their heartbeats could not be read. Move every clock by it."""
        last, self._last_tick = self._last_tick, now
        gap = now - last - TICK_S if last else 0.0
        if gap < min(1.0, self.config.heartbeat_timeout_s / 2):
            return
        log.warning("the control plane did not run for %.1fs: heartbeat clocks moved by that much", gap)
        for w in self.workers.values():
            w.last_seen = min(now, w.last_seen + gap)
        if self.op is not None:
            self.op.deadline += gap

    # ------------------------------------------------------------------ worker API
    def _post(self, worker_id: str, cmd: BaseModel) -> None:
        if isinstance(cmd, m.Form):
            cmd = self._with_paths(cmd, worker_id)
        self.mail.post(worker_id, cmd.model_dump(mode="json"))

    def register(self, worker_id: str, req: m.Register) -> dict[str, Any]:
        with self._lock:
            w = self._worker(worker_id)
            if w.role == WorkerRole.GONE:
                raise RequestError(f"worker {worker_id} is no longer part of the job", 410)
            w.pid = req.pid
            w.last_seen = time.time()
            w.transfer_addr = req.transfer_addr
            w.role = WorkerRole.SPARE
            if w.intended_rank is not None and self.generation == 0 and self.op is None:
                w.role = WorkerRole.RANK
                w.rank = w.intended_rank
                w.held_rank = True
                self.ranks[w.rank].worker = w.id
                self._maybe_start_generation0()
            elif not self.slots[w.slot].healthy:
                # The slot was tainted while this spare was starting: keep nothing there.
                w.role = WorkerRole.GONE
                self._post(w.id, m.Stop(reason=f"slot {w.slot} is tainted"))
            else:
                self._emit("spare", {"worker": w.id, "slot": w.slot})
                self._on_spare_available()
            self._persist(force=True)
            return m.Registered(worker_id=w.id, world_size=self.config.world_size, role=w.role.value,
                                op_timeout_s=self.config.op_timeout_s,
                                formation_timeout_s=self.config.formation_timeout_s,
                                verify_every=self.config.verify_every,
                                redundancy=self._redundancy(), ranks_per_node=self._per_node(),
                                heartbeat_timeout_s=self.config.heartbeat_timeout_s,
                                control_grace_s=self.config.control_grace_s,
                                data_paths=list(self.data_paths.names),
                                discover_paths=self.discover_paths,
                                receive_mb=self.receive_mb if w.role == WorkerRole.SPARE else 0.0,
                                hot_spares=self.config.hot_spares).model_dump()

    def _maybe_start_generation0(self) -> None:
        if self._gen0_posted or not self._paths_decided():
            return
        probed = len(self.data_paths.names) > 1  # each rank's probe answerers known first (paths.py)
        if all(
            info.worker and self.workers[info.worker].role == WorkerRole.RANK
            and (not probed or self.workers[info.worker].paths_ready) for info in self.ranks.values()
        ):
            for r, info in self.ranks.items():
                info.state = RankState.RUNNING
                assert info.worker
                self._post(info.worker, m.Assign(rank=r, generation=0, world_size=self.config.world_size,
                                                 joiner=False))
                self._post(info.worker, m.Form(generation=0, pos=(0, 0), buddies=self._buddy_addr(r),
                                               wards=self._ward_addr(r), verify=False))
            self._gen0_posted = True
            self._emit("started", {"world_size": self.config.world_size})

    def commands(self, worker_id: str, after: int, timeout: float) -> list[dict[str, Any]]:
        with self._lock:
            self._worker(worker_id)
        return self.mail.wait(worker_id, after, timeout)

    def report(self, worker_id: str, report: BaseModel) -> dict[str, Any]:
        kind = report.type  # type: ignore[attr-defined]
        handler = getattr(self, f"_on_{kind}")
        with self._lock:
            w = self._worker(worker_id)
            w.last_seen = time.time()
            if w.unheard:
                w.unheard = False
                self._emit("note", {"message": f"{w.id} ({w.slot}) is heard from again"})
            result = handler(w, report) or {}
            self._persist(force=kind != "heartbeat")
            return result

    def _on_heartbeat(self, w: Worker, rep: m.Heartbeat) -> None:
        self._note_cpu(w, rep.cpu)
        if rep.gpu is not None:
            self._judge_gpu(w, rep.gpu)
        if w.role == WorkerRole.RANK and w.rank is not None:
            info = self.ranks[w.rank]
            if info.worker != w.id:
                return
            info.outside_steps = rep.outside_steps
            if rep.step is not None:
                if rep.step > info.step:
                    self._on_step_progress()
                info.step = rep.step
                info.step_at = time.time()
                info.step_age = rep.step_age
                info.reached = max(info.reached, rep.step)
            if rep.metrics:
                info.metrics = dict(rep.metrics)
            if rep.step_time is not None:
                info.metrics["step_time"] = rep.step_time
            if rep.step_period is not None:
                info.metrics["step_period"] = rep.step_period
            if rep.snapshot_mb is not None:
                info.metrics["snapshot_mb"] = rep.snapshot_mb
            if rep.state_mb is not None:
                self._note_state_size(rep.state_mb)
            if rep.unmovable and info.unmovable is None:
                info.unmovable = rep.unmovable
                self._emit("unmovable", {"rank": w.rank, "detail": rep.unmovable})
            if rep.busy_time is not None:
                info.metrics["busy_time"] = rep.busy_time
                if rep.step is not None and self.op is None:
                    why = self.stragglers.observe(w.rank, rep.step, rep.busy_time)
                    if why is not None and self.slots[w.slot].healthy:
                        self._emit("straggler", {"rank": w.rank, "slot": w.slot, "detail": why})
                        self._on_taint(m.TaintRequest(slot=w.slot, reason=why[:200]))

    def _judge_gpu(self, w: Worker, reading: GpuReading) -> None:
        """NVML readings from a rank or a spare: past a threshold, its slot is tainted (a rank
        there moves pre-emptively, a spare there is stopped)."""
        w.gpu = reading.model_dump(exclude_none=True)
        why = self.config.gpu_limits.judge(reading)
        if why is not None and w.slot in self.slots and self.slots[w.slot].healthy and self.exit_code is None:
            self._emit("gpu-health", {"worker": w.id, "slot": w.slot, "detail": why})
            self._on_taint(m.TaintRequest(slot=w.slot, reason=why[:200]))

    def _note_state_size(self, state_mb: float) -> None:
        """The state a joiner receives has grown (an optimizer's moments appear with its first
        step): every spare maps that much receive memory ahead, and a little room (the rank's
        own state, alignment)."""
        wanted = round(state_mb * 1.02 + 16, 1)
        if wanted <= self.receive_mb:
            return
        self.receive_mb = wanted
        for w in self.workers.values():
            if w.role == WorkerRole.SPARE:
                self._post(w.id, m.PrepareReceive(receive_mb=wanted))

    def _on_formed(self, w: Worker, rep: m.Formed) -> None:
        op = self.op
        if w.rank is None:
            return
        info = self.ranks[w.rank]
        info.state = RankState.RUNNING
        info.step = rep.pos[0]
        if rep.bytes and op:
            op.transfer_bytes = max(op.transfer_bytes, rep.bytes)
            op.transfer_s = max(op.transfer_s, rep.seconds)
            op.transfer_wait_s = max(op.transfer_wait_s, rep.fetch_wait_s)
        if rep.setup_s and op:
            op.joiner_setup_s = max(op.joiner_setup_s, rep.setup_s)
        if rep.setup_left_out_bytes and op:
            op.joiner_setup_left_out_bytes = max(op.joiner_setup_left_out_bytes, rep.setup_left_out_bytes)
        if rep.phases and op and sum(rep.phases.values()) >= sum(op.joiner_phases.values()):
            op.joiner_phases = dict(rep.phases)
        if rep.hot_spare is not None and op and w.rank in op.moves:
            self.events[op.moves[w.rank].event_id - 1].hot_spare = rep.hot_spare.model_dump()
        if rep.ran_again and op and w.rank in op.moves:
            ev = self.events[op.moves[w.rank].event_id - 1]
            ev.note = "; ".join(n for n in (ev.note, rep.ran_again) if n)
        if op is None or rep.generation != op.generation:
            return
        op.formed[w.rank] = time.time() - rep.queued_s
        if len(op.formed) == self.config.world_size:
            self._finish_op(op)

    def _on_ready(self, w: Worker, rep: m.Ready) -> None:
        """The rank entered its step loop with `rep.bundle` as its starting state."""
        if rep.joined:
            self._on_joiner_ready(w)
        if w.rank is None:
            return
        info = self.ranks[w.rank]
        if not rep.joined:
            assert rep.bundle is not None  # (validated)
            info.ready = True
            info.held = rep.bundle.model_dump()
            self._persist_held(w.rank)
        info.loop = rep.loop.model_dump()
        if not rep.joined and rep.setup is not None:  # handed to the rank's joiners with their assignment
            self.setup_records[w.rank] = rep.setup
            # kept, like held bundles, for a restarted control plane's joiners
            self._lock.add(fx.WriteRows([("setup", str(w.rank), rep.setup.model_dump())]))
        # A joiner skips the script's resume block, so only the loop's shape must agree.
        if self.loop is not None and rep.loop.model_copy(update={"start_step": self.loop.start_step}) != self.loop:
            self._fail(f"rank {w.rank} computed a different loop ({_loop_text(rep.loop)}) than the others "
                       f"({_loop_text(self.loop)}): every rank, joiners included, must run the same number "
                       "of steps (a resume-from-file block that runs only on some ranks? skip it with "
                       "`if not job.joined:`)")
            return
        loops = [i.loop for i in self.ranks.values() if i.loop is not None]
        if self.loop is None and len(loops) == self.config.world_size:
            if any(x != loops[0] for x in loops):  # initial ranks: the start too
                detail = ", ".join(f"rank {r}: {_loop_text(m.LoopInfo(**i.loop))}"
                                   for r, i in sorted(self.ranks.items()) if i.loop)
                self._fail(f"ranks disagree on the step loop ({detail})")
                return
            self.loop = m.LoopInfo(**loops[0])
            self.training_since = time.time()
            self._refresh_hot_spares()

    def _on_unit_done(self, w: Worker, rep: m.UnitDone) -> None:
        """A boundary function ended on this rank; its state there is now durable here."""
        if w.rank is not None and self.ranks[w.rank].worker == w.id:
            self.ranks[w.rank].held = rep.bundle.model_dump()
            self._persist_held(w.rank)
            self.ranks[w.rank].reached = max(self.ranks[w.rank].reached, rep.pos[0])

    def _on_verified(self, w: Worker, rep: m.Verified) -> None:
        if rep.ok and rep.after_resume_s is not None:
            self._note_check_after_resume(rep.generation, rep.after_resume_s)
        if rep.ok or w.role == WorkerRole.GONE:
            return  # a lost worker's word on its own state no longer counts: its rank is being rebuilt
        # A rank that stopped the job itself (the no-code mode's refusals, said as differing
        # "script") is not a state check: its detail says where; a joiner's position may still
        # be its own start there, so the ledger takes the step the rank had reached.
        stopped = rep.differing == ["script"]
        step = rep.pos[0] or (self.ranks[w.rank].reached if w.rank in self.ranks else 0)
        ev = self._new_event(EventKind.DIVERGENCE, f"{'stopped' if stopped else 'state check failed'}: {rep.detail}",
                             w.rank, w.slot)
        ev.status, ev.step = "failed", step
        ev.note = "differing: " + ", ".join(rep.differing[:50])
        ev.resolved_without_rollback = False
        self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))
        self._emit("divergence", {"rank": w.rank, "detail": rep.detail, "differing": rep.differing[:50]})
        if stopped:
            self._fail(f"rank {w.rank} stopped the job at step {step}: {rep.detail}")
        else:
            self._fail(f"state check failed at step {step} on rank {w.rank}: {rep.detail}; differing "
                       f"entries: {', '.join(rep.differing[:20])}")

    def _note_check_after_resume(self, generation: int, seconds: float) -> None:
        """The part of a move's state check its first step waited for, beside the pause's phases."""
        for event_id in self._moved_in.get(generation, []):
            ev = self.events[event_id - 1]
            if seconds > (ev.check_after_resume_s or -1.0):
                ev.check_after_resume_s = round(seconds, 4)
                self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))

    def _note_cpu(self, w: Worker, cpu: m.CpuReport | None) -> None:
        if cpu is not None:
            w.cpu_s, w.baton_cpu_s = cpu.process_s, cpu.baton_s

    def cpu_summary(self) -> dict[str, float]:
        """The job's CPU-seconds and baton's share, from what every worker (live or gone) last
        reported and this process's own clock: the overhead measured on the job itself."""
        ranks = [w for w in self.workers.values() if w.held_rank]
        spares = [w for w in self.workers.values() if not w.held_rank]
        out = {"ranks_s": sum(w.cpu_s for w in ranks), "ranks_baton_s": sum(w.baton_cpu_s for w in ranks),
               "spares_s": sum(w.cpu_s for w in spares),
               "control_plane_s": time.process_time() + self.helper_cpu(), "imports_s": self.imports_cpu()}
        out["baton_s"] = out["ranks_baton_s"] + out["spares_s"] + out["control_plane_s"]
        # Not baton's: each worker would import torch itself; forked, they share one import.
        out["total_s"] = out["ranks_s"] + out["spares_s"] + out["control_plane_s"] + out["imports_s"]
        return {k: round(v, 4) for k, v in out.items()}

    def _on_finished(self, w: Worker, rep: m.Finished) -> None:
        self._note_cpu(w, rep.cpu)
        # A joiner that took its rank over in the region after the step loop can run it to
        # the end before the others' Formed close the move: it holds the rank already.
        joining = self.op is not None and w.rank is not None and w.rank in self.op.moves and \
            self.op.moves[w.rank].to_worker == w.id and w.rank in self.op.formed
        if w.rank is not None and (self.ranks[w.rank].worker == w.id or joining):
            self.ranks[w.rank].state = RankState.FINISHED
            self.ranks[w.rank].step = rep.pos[0]
        self._maybe_done()

    def _maybe_done(self) -> None:
        """Every rank finished and nothing is moving: let them all return from finish()."""
        if self._training_done or not all(i.state == RankState.FINISHED for i in self.ranks.values()):
            return
        op = self.op
        if op is not None and op.kind != EventKind.UNPLANNED:
            # The job reached its last step before the agreed boundary: nothing to move.
            for move in op.moves.values():
                ev = self.events[move.event_id - 1]
                self._close(ev, "cancelled", "the job finished before the agreed step boundary")
                joiner = self.workers.get(move.to_worker or "")
                if joiner is not None and joiner.role == WorkerRole.RANK and joiner.id != self.ranks[move.rank].worker:
                    joiner.role = WorkerRole.GONE
                    if self.scheduler is not None:
                        self._kill(joiner.id)
            self._emit("cancelled", {"op": op.id, "reason": "job finished first"})
            self.op = None
        elif op is not None:
            return  # a recovery is still bringing a rank to the end: wait for it
        self._training_done = True
        for x in self._retry_moves:
            ev = self.events[x.event_id - 1]
            self._emit("note", {"message": f"the {ev.kind.value} move of rank {x.rank} ({ev.cause}) was still "
                                           "waiting to run again when training finished"})
        self._retry_moves = []
        self._emit("finished", {"cpu": self.cpu_summary()})
        for info in self.ranks.values():
            if info.worker:
                self._post(info.worker, m.Done())
        # Spares are no longer needed; ranks may still run code after job.finish()
        # (saving a checkpoint, say): the job ends when their processes exit.
        for spare in self.workers.values():
            if spare.role in (WorkerRole.SPARE, WorkerRole.STARTING):
                spare.role = WorkerRole.GONE
                self._post(spare.id, m.Stop(reason="training finished"))
                if self.scheduler is not None and spare.pid is None:
                    self._kill(spare.id)
        self._maybe_end_after_finish()

    def _maybe_end_after_finish(self) -> None:
        if not self._training_done:
            return
        rank_workers = {i.worker for i in self.ranks.values()}
        if all(self.workers[w].role == WorkerRole.GONE for w in rank_workers if w):
            self._end(self._final_code)

    def _on_user_error(self, w: Worker, rep: m.UserError) -> None:
        if w.role == WorkerRole.GONE:
            return  # a worker already replaced or stopped: what it says no longer matters
        text = rep.traceback[-20000:]
        self.failure = text
        self._script_failed = True
        if w.rank is not None:
            self.ranks[w.rank].state = RankState.FAILED
        self._emit("user-error", {"rank": w.rank, "phase": rep.phase, "traceback": text})
        self._end(rep.exit_code or 1, spare_worker=w.id)

    def _fail(self, message: str) -> None:
        self.failure = message
        self._emit("fatal", {"message": message})
        self._end(1)

    def _training(self) -> bool:
        return all(i.ready for i in self.ranks.values())

    def _finishing(self) -> bool:
        """A rank has run its last step: a move's boundary would never come (that rank never
        pauses), so none starts; the job ends as it would without one."""
        return any(i.state == RankState.FINISHED for i in self.ranks.values())

    def _may_start_move(self) -> bool:
        """Whether a move waiting for its turn (a taint's, a retry, a targeted or homeward
        one) may start now: nothing else moving, the job not ended, no rank finished."""
        return self.op is None and self.exit_code is None and not self._finishing()

    def _on_left(self, w: Worker, rep: m.Left) -> None:
        w.role = WorkerRole.GONE

    def _on_setup_written(self, w: Worker, rep: m.SetupWritten) -> None:
        """Kept for the next successors' fences; the newest 256 (a bound on what Assign carries)."""
        files = {**self.setup_files, **rep.files}
        self.setup_files = dict(list(files.items())[-256:])

    # ------------------------------------------------------------------ scheduler input
    def _on_worker_exited(self, ev: m.WorkerExited) -> None:
        w = self.workers.get(ev.worker_id)
        if w is None:
            return
        returncode = ev.returncode
        w.exit_code = returncode
        prev = w.role
        if prev in (WorkerRole.GONE, WorkerRole.LEAVING) or self.exit_code is not None:
            w.role = WorkerRole.GONE
            return
        if prev == WorkerRole.STARTING:
            self._exited_before_init(w, returncode)
        elif prev == WorkerRole.RANK and w.rank is not None and \
                self.ranks[w.rank].state == RankState.FINISHED:
            # After job.finish(): the script's own closing code decides its exit code.
            w.role = WorkerRole.GONE
            if returncode != 0 and not self._final_code:
                self._final_code = returncode if returncode > 0 else 128 - returncode
                self._emit("note", {"message": f"rank {w.rank} exited with code {returncode} after "
                                               "job.finish()"})
            self._maybe_end_after_finish()
        elif returncode == EXIT_PEER_LOST and prev == WorkerRole.RANK:
            # The script died of a lost peer where it could not absorb it: not its bug.
            self._worker_lost(w, "exited after a lost peer (the failure reached code outside a step)",
                              failed_at=time.time())
        elif returncode > 0 and prev == WorkerRole.RANK:
            # The script ended with an error of its own: a bug, not a hardware failure.
            self.failure = self.failure or f"rank {w.rank} exited with code {returncode}"
            self._script_failed = True
            self._emit("user-error", {"rank": w.rank, "exit_code": returncode})
            w.role = WorkerRole.GONE
            self._end(returncode)
        elif returncode == 0 and prev == WorkerRole.RANK:
            w.role = WorkerRole.GONE
            self._fail(f"rank {w.rank} exited with code 0 at step {self.ranks[w.rank].step}, before "
                       "job.finish(): the other ranks would wait for it forever. End the script with "
                       "job.finish() after the step loop (and do not sys.exit() inside it)")
        elif returncode == 0 and prev == WorkerRole.SPARE:
            w.role = WorkerRole.GONE  # a spare that finished its script without being used
        else:
            how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
            self._worker_lost(w, f"process {how}", failed_at=time.time())

    def _on_interrupted(self, ev: m.Interrupted) -> None:
        self._end(128 + ev.signum)

    def _on_store_failed(self, ev: m.StoreFailed) -> None:
        self._emit("store-error", {"message": ev.message + " (the job goes on; the ledger is kept in memory "
                                              "and written when it can be)"})

    def _exited_before_init(self, w: Worker, returncode: int, judged: bool = False) -> None:
        """A worker that ends before baton.init() registers it failed in the script's startup
        (a SyntaxError, argparse, a missing variable) or never calls baton.init(): starting
        another would fail the same way, so the job ends now with the script's code."""
        w.role = WorkerRole.GONE
        if w.intended_rank is None and returncode != 0 and not judged and self._spare_start_failed(w, returncode):
            return  # the node is probed first: a bad node is not a bug in the script
        if returncode < 0:
            self._emit("worker-lost", {"worker": w.id, "slot": w.slot, "rank": w.intended_rank,
                                       "cause": f"killed by signal {-returncode} while starting"})
            if w.intended_rank is not None:
                self._fail(f"rank {w.intended_rank} was killed (signal {-returncode}) while starting, "
                           "before training began: start the job again")
            return
        if returncode == 0:
            self._fail("the script ended (exit code 0) without calling baton.init(): a script run by "
                       "`baton run` must call `job = baton.init()` before it trains (see the README)")
            return
        self.failure = (f"worker {w.id} on {w.slot} exited with code {returncode} before baton.init(): "
                        "the script failed while starting (its traceback is above)")
        self._script_failed = True
        self._emit("user-error", {"rank": w.intended_rank, "exit_code": returncode, "phase": "startup"})
        self._end(returncode)

    def _lose_hung(self, ranks: list[int], cause: str) -> None:
        """The workers holding `ranks` are alive to the OS but not answering: lost."""
        for r in ranks:
            w = self.workers.get(self.ranks[r].worker or "")
            if w is not None:
                self._worker_lost(w, cause)

    def _worker_lost(self, w: Worker, cause: str, failed_at: float | None = None) -> None:
        """A worker is dead or hung: make sure it is gone and start recovery if it held a rank."""
        role, rank = w.role, w.rank
        w.role = WorkerRole.GONE
        if self.scheduler is not None:
            self._kill(w.id, dump_stacks="hung" in cause)
        self._emit("worker-lost", {"worker": w.id, "slot": w.slot, "rank": rank, "cause": cause})
        self._suspect_node(w)
        if rank is None or role not in (WorkerRole.RANK,):
            return
        if self.ranks[rank].worker != w.id:
            self._joiner_lost(w, rank, cause)
            return
        self.ranks[rank].state = RankState.FAILED
        self._drop_retries_of(w)
        if not self._training():
            # Before every rank reached its step loop there is no consistent state to hand
            # over (the initial broadcast may be half done): fail clearly instead of guessing.
            self.failure = (f"rank {rank} was lost during startup ({cause}), before training began; "
                            "nothing to migrate yet: start the job again")
            self._emit("fatal", {"message": self.failure})
            self._end(1)
            return
        streak = self._lost_in_place(rank, cause)
        if streak is not None:
            self._end_respawns(rank, streak)
            return
        self._open_recovery(cause=cause, dead_rank=rank, dead_worker=w,
                            failed_at=failed_at if failed_at is not None else w.last_seen)

    # ------------------------------------------------------------------ CLI / API requests
    def _on_migrate(self, req: m.MigrateRequest) -> dict[str, Any]:
        if req.rank not in self.ranks:
            raise RequestError(f"unknown rank {req.rank}: this job has ranks 0..{self.config.world_size - 1}", 404)
        self._check_running()
        if self.ranks[req.rank].unmovable:
            raise RequestError(f"rank {req.rank} cannot move bit for bit: {self.ranks[req.rank].unmovable}", 409)
        if self._finishing():
            raise RequestError("training is finishing (a rank has run its last step): nothing moves now", 409)
        if self.op is not None:
            raise RequestError(f"a {self.op.kind.value} migration is already in progress (op {self.op.id})", 409)
        if req.to is not None:
            return self._migrate_to(req.rank, req.to)
        if not self._ready_spares():
            raise RequestError("no spare available: wait for one to start, or untaint a slot", 409)
        op = self._start_planned([req.rank], EventKind.PLANNED, "requested")
        if req.pre_copy is not None:
            op.pre_copy = req.pre_copy
        return {"op": op.id, "events": [mv.event_id for mv in op.moves.values()]}

    def _on_taint(self, req: m.TaintRequest) -> dict[str, Any]:
        if req.slot not in self.slots and req.slot in self.nodes:
            return self._taint_node(req.slot, req.reason)
        s = self._slot(req.slot)
        s.taint, s.tainted_at = req.reason, time.time()
        self._emit("taint", {"slot": req.slot, "reason": req.reason})
        moved: list[int] = []
        for w in self.workers.values():
            if w.slot != req.slot:
                continue
            if w.role == WorkerRole.SPARE:
                w.role = WorkerRole.GONE
                self._post(w.id, m.Stop(reason=f"slot {req.slot} tainted"))
            elif w.role == WorkerRole.RANK and w.rank is not None:
                moved.append(w.rank)
        return self._move_off_taint({"slot": req.slot, "reason": req.reason}, moved, f"taint: {req.reason}")

    def _on_alerts(self, batch: AlertBatch) -> dict[str, Any]:
        """Alertmanager's webhook: firing taints the slot or node its labels name, resolved
        untaints it if that alert's taint is still the one in place (see health/alerts.py)."""
        results = []
        for alert in batch.alerts:
            target = target_of(alert, set(self.slots), set(self.nodes))
            reason = reason_of(alert)[:200]
            if target is None:
                results.append({"action": "ignored", "why": "names no slot or node of this job",
                                "labels": dict(list(alert.labels.items())[:10])})
                continue
            current = self.slots[target].taint if target in self.slots else self.nodes[target].reason
            if alert.status == "firing":
                if current is not None:
                    results.append({"target": target, "action": "ignored", "why": f"already tainted ({current})"})
                    continue
                out = self._on_taint(m.TaintRequest(slot=target, reason=reason))
                results.append({"target": target, "action": "tainted", "moving_ranks": out.get("moving_ranks", [])})
            elif current is not None and current.endswith(reason):
                self._on_untaint(m.UntaintRequest(slot=target))
                results.append({"target": target, "action": "untainted"})
            else:
                results.append({"target": target, "action": "ignored", "why": "not tainted by this alert"})
        return {"results": results}

    def _on_untaint(self, req: m.UntaintRequest) -> dict[str, Any]:
        if req.slot not in self.slots and req.slot in self.nodes:
            return self._untaint_node(req.slot)
        s = self._slot(req.slot)
        was = s.taint
        s.taint, s.tainted_at = None, None
        self._emit("untaint", {"slot": req.slot})
        self._replenish()
        return {"slot": req.slot, "was": was}

    # ------------------------------------------------------------------ planned / pre-emptive

    # ------------------------------------------------------------------ shared

    def _finish_op(self, op: Operation) -> None:
        now = time.time()
        # Training ran again once the last rank formed: as its report dates it (the time it
        # waited in that worker's outbox taken off), never later than now.
        resumed_at = min(now, max(op.formed.values(), default=now))
        first_stop = min(op.paused.values(), default=op.started_at)
        for rank, move in op.moves.items():
            self.stragglers.forget(rank)  # a new process: its own history starts now
            ev = self.events[move.event_id - 1]
            if move.from_worker:
                leaver = self.workers[move.from_worker]
                if op.kind != EventKind.UNPLANNED and leaver.role != WorkerRole.GONE:
                    leaver.role = WorkerRole.LEAVING
                    leaver.rank = None
                    self._post(leaver.id, m.Release())
            assert move.to_worker
            joiner = self.workers[move.to_worker]
            self.ranks[rank].worker = joiner.id
            ev.to_slot = joiner.slot
            ev.resumed_at = resumed_at
            if op.kind == EventKind.UNPLANNED and "(hung)" in ev.cause and op.stalled_at is not None:
                # its last heartbeat came before the hang: training stopped where the survivors blocked
                ev.detected_at = max(ev.detected_at, op.stalled_at)
            start = ev.detected_at if op.kind == EventKind.UNPLANNED else first_stop
            ev.downtime_s = round(max(0.0, resumed_at - start), 4)
            ev.step = op.target_step
            ev.state_bytes = op.transfer_bytes or None
            ev.transfer_s = round(op.transfer_s, 4) if op.transfer_s else None
            ev.joiner_setup_s = round(op.joiner_setup_s, 4) if op.joiner_setup_s else None
            ev.joiner_setup_left_out_mb = round(op.joiner_setup_left_out_bytes / 1e6, 6) \
                if op.joiner_setup_left_out_bytes else None
            ev.transfer_wait_s = round(op.transfer_wait_s, 4) if op.transfer_bytes else None
            joiner_caught_up = op.caught_up.get(move.to_worker or "")
            if joiner_caught_up is not None:
                ev.pre_copy = {**joiner_caught_up, **{f"leaver_{k}": v for k, v in
                                                       op.pre_copy_cost.get(rank, {}).items()}}
            if op.joiner_phases:  # where the downtime went: the joiner's part, the last rank's way to
                # the boundary after the first paused (a planned move's), the survivors' reports and
                # the plan (an unplanned one's), and the rest (messages, the survivors forming)
                parts = dict(op.joiner_phases)
                if op.kind == EventKind.UNPLANNED and op.planned_at is not None:
                    parts = {"collect": round(max(0.0, op.planned_at - start), 4), **parts}
                if op.kind != EventKind.UNPLANNED and len(op.paused) > 1:
                    # until the copy could begin: when the last rank paused, or the last leaver
                    # where the leavers served their joiners as they paused (planned._hand_over_early)
                    early = all(r in op.handed_early for r in op.moves)
                    began = max(op.paused[r] for r in op.moves) if early else max(op.paused.values())
                    parts["boundary"] = round(began - first_stop, 4)
                ev.phases = {**parts, "rest": round(max(0.0, ev.downtime_s - sum(parts.values())), 4)}
            # From what the ranks reported: a step every rank had completed that must run again
            # is lost progress; a step some rank abandoned half way is the in-flight step re-run.
            resumed = op.target_step or 0
            completed_everywhere = min(i.reached for i in self.ranks.values())
            ev.steps_lost = max(0, completed_everywhere - resumed)
            ev.steps_rerun = 1 if op.rerun else 0
            ev.resolved_without_rollback = ev.steps_lost == 0
            ev.status = "resolved"
            self._moved_in.setdefault(op.generation, []).append(ev.id)
            self._spares_lost_moving.pop(rank, None)
            self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))
            self._emit("resolved", ev.to_json())
        for event_id in op.path_events:  # routed around, or back: no rank moved
            ev = self.events[event_id - 1]
            ev.resumed_at, ev.step = resumed_at, op.target_step
            paused = first_stop if ev.kind == EventKind.PATH_RESTORED else ev.detected_at  # a restore: its pause
            ev.downtime_s = round(max(0.0, resumed_at - paused), 4)
            ev.steps_lost = max(0, min(i.reached for i in self.ranks.values()) - (op.target_step or 0))
            ev.steps_rerun = 1 if op.rerun else 0
            ev.resolved_without_rollback = ev.steps_lost == 0
            ev.status = "resolved"
            ev.note = f"re-formed over {', '.join(self.generation_paths)}"
            self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))
            self._emit("resolved", ev.to_json())
        self.op = None
        for info in self.ranks.values():
            info.reached = max(info.reached, op.target_step or 0)
            # Every rank resumes from the target now: older step reports would make the next
            # move's boundary estimate extrapolate across the time this move took.
            info.step, info.step_at = op.target_step or info.step, now
        # Planned moves whose joiner was lost run again; taints that arrived while this op
        # ran still need their ranks moved.
        self._retry_lost_moves()
        self._pending_taint_moves()
        self._pending_targeted()
        self._pending_return_home()
        self._release_idle_borrowed()
        self._replenish()
        self._hot_after_op()
        self._maybe_done()

    def _drop_retries_of(self, leaver: Worker) -> None:
        """The leaver of an interrupted move is lost: the recovery moves its rank to a spare,
        so running the move again would move the replacement for nothing. (A survivor's report
        can open that recovery before the leaver's exit is known, which is how such a move was
        first kept for a retry.)"""
        keep = []
        for x in self._retry_moves:
            if x.leaver != leaver.id:
                keep.append(x)
                continue
            ev = self.events[x.event_id - 1]
            self._close(ev, "failed", "superseded by the loss of its leaver: the recovery moves the rank to a spare")
            self._emit("note", {"message": f"the {ev.kind.value} move of rank {x.rank} will not run again: "
                                           f"its leaver {leaver.id} was lost and the recovery moves the rank"})
        self._retry_moves = keep

    def _close(self, ev: Event, status: str, note: str) -> None:
        ev.status, ev.note = status, note
        self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))

    def _new_event(self, kind: EventKind, cause: str, rank: int | None, from_slot: str | None) -> Event:
        ev = Event(id=len(self.events) + 1, kind=kind, cause=cause, rank=rank, from_slot=from_slot,
                   to_slot=None, detected_at=time.time())
        self.events.append(ev)
        self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))
        return ev

    def _end(self, code: int, spare_worker: str | None = None) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        if code != 0:  # a move under way when the job ends on an error did not happen: say so in the ledger
            why = (self.failure or f"exit code {code}").splitlines()[0][:500]
            for ev in self.events:
                if ev.status == "in-progress" and ev.kind != EventKind.DIVERGENCE:
                    self._close(ev, "failed", f"the job ended before this move completed: {why}")
            if not self._script_failed and not any(ev.status == "failed" for ev in self.events):
                # Nothing in the ledger says why the job ended (a rank lost while starting, one
                # that exited early): the end itself is the entry.
                self._close(self._new_event(EventKind.FATAL, why, None, None), "failed", "the job ended here")
        for w in self.workers.values():
            if w.role in (WorkerRole.SPARE, WorkerRole.STARTING, WorkerRole.LEAVING):
                self._post(w.id, m.Stop(reason="job ended"))
        if code != 0:
            for w in self.workers.values():
                # The worker that reported the error exits by itself, printing its traceback.
                if w.role != WorkerRole.GONE and self.scheduler is not None and w.id != spare_worker:
                    self._kill(w.id)
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
            raise RequestError(f"unknown slot or node {slot!r}; slots are: {known}; nodes: "
                               f"{', '.join(self.nodes) or 'none'}", 404)
        return s

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        log.info("%s %s", kind, data)
        self._lock.add(fx.Emit(kind, data))

    # ------------------------------------------------------------------ views
    def yoco_ratio(self) -> float | None:
        return yoco_ratio([e.to_json() for e in self.events])

    def status(self) -> dict[str, Any]:
        with self._lock:
            ranks = []
            for r, info in sorted(self.ranks.items()):
                w = self.workers.get(info.worker or "")
                ranks.append({"rank": r, "worker": w.id if w else None, "pid": w.pid if w else None,
                              "slot": w.slot if w else None,
                              "step": info.step, "state": info.state.value,
                              # CPU-seconds its process reported with that step, and baton's part
                              "cpu_s": round(w.cpu_s, 3) if w else None,
                              "baton_cpu_s": round(w.baton_cpu_s, 3) if w else None,
                              "metrics": info.metrics, **({"gpu": w.gpu} if w and w.gpu else {}),
                              **({"unmovable": info.unmovable} if info.unmovable else {}),
                              # in a boundary function or the region after its step loop
                              **({"outside_steps": True} if info.outside_steps else {}),
                              **({"unheard_s": round(time.time() - w.last_seen, 1)} if w and w.unheard else {})})
            spares = [{"worker": w.id, "slot": w.slot, "pid": w.pid, "state": w.role.value,
                       **self._spare_kind(w.slot), **self._hot_view(w)}
                      for w in self.workers.values()
                      if w.role in (WorkerRole.SPARE, WorkerRole.STARTING) and w.intended_rank is None]
            taints = [{"slot": s.name, "reason": s.taint, "since": s.tainted_at}
                      for s in self.slots.values() if s.taint]
            job = {
                "id": self.config.job_id,
                "mode": self.config.mode,
                "step_loop": self.loop.step_loop if self.loop is not None else None,
                "world_size": self.config.world_size,
                "generation": self.generation,
                "state": self._job_state(),
                "ranks": ranks,
                "spares": spares,
                "taints": taints,
                "slots": [{"slot": s.name, "taint": s.taint, **({"lent_to": s.lent_to} if s.lent_to else {})}
                          for s in self.slots.values()],
                "nodes": self._node_view(),
                "data_paths": {"configured": self.data_paths.names, "in_use": self.generation_paths,
                               "links": self.data_paths.view()},
                "yoco_ratio": self.yoco_ratio(),
                "cpu": self.cpu_summary(),
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
        # Held bundles are memory-only: rewriting them (base64) every second would be most of the I/O.
        rows += [("rank", str(r), {k: v for k, v in to_json(i).items() if k != "held"})
                 for r, i in self.ranks.items()]
        rows += [("node", n.name, to_json(n)) for n in self.nodes.values()]
        rows.append(("job", self.config.job_id, job_record(self)))
        self._lock.add(fx.WriteRows(rows))

    def _persist_held(self, rank: int) -> None:
        """A rank's own durable state changes only at its loop start and boundary functions:
        written then, so a restarted control plane can still rebuild that rank."""
        held = self.ranks[rank].held
        if held is not None:
            self._lock.add(fx.WriteRows([("held", str(rank), held)]))


def _loop_text(loop: m.LoopInfo) -> str:
    start = f" from step {loop.start_step}" if loop.start_step else ""
    if loop.style == "script":
        return f"the script's own loop at {loop.step_loop}"
    if loop.style == "epochs":
        return f"{loop.epochs} epochs of {loop.steps_per_epoch} steps{start}"
    return f"{loop.total_steps} steps{start}"
