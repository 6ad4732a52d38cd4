"""The spare pool: warm spares on healthy slots, refilled after every move, and the
freshest one chosen when a rank needs a new home (a stopped spare is not ready)."""

from __future__ import annotations

import logging
import time

from baton.control import messages as m
from baton.control.operation import Operation
from baton.control.state import Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


class SparePool:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _assign_joiner(self, spare: Worker, rank: int, op: Operation) -> None:
        spare.role = WorkerRole.RANK
        spare.rank = rank
        spare.held_rank = True
        self._post(spare.id, m.Assign(rank=rank, generation=op.generation, world_size=self.config.world_size,
                                      joiner=True))

    def _on_spare_available(self) -> None:
        op = self.op
        if op is not None and op.phase == "spares":
            self._advance_collect()
        elif op is None:
            self._retry_lost_moves()
            self._pending_taint_moves()
            self._pending_targeted()
            self._pending_return_home()

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
        used = {w.slot for w in live}
        free = [s for s in self.slots.values() if s.healthy and s.name not in used and self._node(s.name).usable
                and self._node(s.name).lender is None]  # a borrowed node holds only what it was borrowed for
        for slot in free[:missing]:
            w = self._launch(slot.name)
            self._emit("spare-starting", {"worker": w.id, "slot": slot.name})

    def _ready_spares(self) -> list[Worker]:
        """Spares on healthy slots that were heard from lately (a stopped one is not ready)."""
        fresh = time.time() - 2 * self.config.heartbeat_timeout_s
        ready = [w for w in self.workers.values()
                 if w.role == WorkerRole.SPARE and self.slots[w.slot].healthy and w.last_seen >= fresh]
        # A spare on a node being probed after a loss there is the last choice.
        return sorted(ready, key=lambda w: (not self._node(w.slot).usable, -w.last_seen))
