"""The spare pool: warm spares on healthy slots, refilled after every move, and the
freshest one chosen when a rank needs a new home (a stopped spare is not ready)."""

from __future__ import annotations

import logging
import time

from baton.control import messages as m
from baton.control.operation import Operation
from baton.control.state import EventKind, Slot, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


class SparePool:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _assign_joiner(self, spare: Worker, rank: int, op: Operation) -> None:
        spare.role = WorkerRole.RANK
        spare.rank = rank
        spare.held_rank = True
        if self._hot_current(spare):
            op.hot_joiners.add(spare.id)
        self._hot.pop(spare.id, None)
        self._post(spare.id, m.Assign(rank=rank, generation=op.generation, world_size=self.config.world_size,
                                      joiner=True, loop=self.loop,
                                      setup=self.setup_records.get(rank, self.setup_records.get(0)),
                                      training_since=self.training_since, setup_files=self.setup_files,
                                      walk_from=self._walk_from(rank, op)))

    def _walk_from(self, rank: int, op: Operation) -> list[tuple[str, int]]:
        """A no-code joiner of a planned move may walk ahead, while the ranks train on, to its
        rank's place as its buddies last recorded it (a rebuild's Form comes at once). Once
        per move: where its joiner was lost (or left, having walked past where it could go
        on), the next one walks in the pause, so a fast epoch cannot use up the spares."""
        planned = op.kind in (EventKind.PLANNED, EventKind.PREEMPTIVE)
        if not planned or self.loop is None or self.loop.style != "script" or op.moves.get(rank) is None:
            return []
        if self._spares_lost_moving.get(rank):  # a joiner left this move (it may have walked too far): not again
            return []
        return self._buddy_addr(rank)

    def _on_spare_available(self) -> None:
        op = self.op
        if op is not None and op.phase == "spares":
            self._advance_collect()
        elif op is None:
            self._retry_lost_moves()
            self._pending_taint_moves()
            self._pending_targeted()
            self._pending_return_home()
            self._refresh_hot_spares()

    def _replenish(self) -> None:
        """Keep `spares` warm spares, each on a healthy slot nobody else uses."""
        if self.scheduler is None or self.exit_code is not None or self._training_done:
            return
        if self.op is not None and self.op.phase != "spares":
            return  # a move is running: do not steal CPU/IO from it; refill right after
        live = [w for w in self.workers.values() if w.role != WorkerRole.GONE]
        spares = [w for w in live if w.role in (WorkerRole.SPARE, WorkerRole.STARTING) and w.intended_rank is None]
        missing = self.config.spares - len(spares)
        if missing <= 0:
            return
        for slot in self._free_slots()[:missing]:
            w = self._launch(slot.name)
            self._emit("spare-starting", {"worker": w.id, "slot": slot.name})

    def _free_slots(self, among: list[str] | None = None) -> list[Slot]:
        """Healthy slots of our own with no live worker (a borrowed node holds only what it
        was borrowed for; a lent slot is another job's until it comes back)."""
        used = {w.slot for w in self.workers.values() if w.role != WorkerRole.GONE}
        return [s for s in self.slots.values() if (among is None or s.name in among) and s.healthy
                and s.lent_to is None and s.name not in used and self._node(s.name).usable
                and self._node(s.name).lender is None]

    # ---------------------------------------------------------------- lending (baton serve)
    @property
    def wants_spare(self) -> bool:
        """A recovery is paused for want of a spare."""
        op = self.op
        return self.exit_code is None and op is not None and op.phase == "spares" and \
            any(mv.to_worker is None for mv in op.moves.values())

    def _lendable(self) -> list[Worker]:
        if self.exit_code is not None or self._training_done or self.op is not None or self._targeted:
            return []
        return [w for w in self._ready_spares() if w.intended_rank is None and self._node(w.slot).usable
                and self._node(w.slot).lender is None]

    def lendable_spares(self) -> int:
        with self._lock:
            return len(self._lendable())

    def lent_slots(self) -> list[Slot]:
        with self._lock:
            return [s for s in self.slots.values() if s.lent_to is not None]

    def slot_idle(self, slot: str) -> bool:
        """No process of ours runs on `slot` any more (every worker there has exited)."""
        with self._lock:
            return all(w.role == WorkerRole.GONE and w.exit_code is not None
                       for w in self.workers.values() if w.slot == slot)

    def _on_lend_spare(self, ev: m.LendSpare) -> dict[str, str]:
        spares = self._lendable()
        if not spares:
            return {}
        w = spares[-1]  # the least fresh: the others stay as they were
        self.slots[w.slot].lent_to = ev.borrower
        w.role = WorkerRole.GONE
        reason = f"lent to job {ev.borrower} (priority {ev.borrower_priority})"
        self._post(w.id, m.Stop(reason=reason))
        self._kill(w.id)
        self._emit("lent", {"slot": w.slot, "worker": w.id, "to": ev.borrower,
                            "message": f"spare {w.id} on {w.slot} stopped: its slot is {reason}"})
        return {"slot": w.slot, "worker": w.id}

    def _on_take_back(self, ev: m.TakeBack) -> None:
        slot = self.slots.get(ev.slot)
        if slot is None or slot.lent_to is None:
            return
        slot.lent_to = None
        self._emit("returned", {"slot": ev.slot, "from": ev.borrower})
        self._replenish()

    def _ready_spares(self) -> list[Worker]:
        """Spares on healthy slots that were heard from lately (a stopped one is not ready)."""
        fresh = time.time() - 2 * self.config.heartbeat_timeout_s
        ready = [w for w in self.workers.values()
                 if w.role == WorkerRole.SPARE and self.slots[w.slot].healthy and w.last_seen >= fresh]
        # A spare on a node being probed after a loss there is the last choice.
        return sorted(ready, key=lambda w: (not self._node(w.slot).usable, -w.last_seen))
