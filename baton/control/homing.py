"""Moving ranks to named places: `baton migrate --rank R --to SLOT|NODE` (for instance back
to the node a rank started on, once it is untainted), and the `--return-home` policy, which
moves ranks back to their first node by itself once that node is healthy again and has
warm spares, at a planned boundary like any planned move.

A targeted move needs a warm spare on the target. Where there is none but a slot is free,
one is started there and the move runs once it is ready.
"""

from __future__ import annotations

from typing import Any

from baton.control.errors import RequestError
from baton.control.nodes import node_of
from baton.control.state import EventKind, Worker, WorkerRole


class Homing:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _target_slots(self, to: str) -> list[str]:
        if to in self.slots:
            return [to]
        if to in self.nodes:
            return [s for s in self.slots if node_of(s) == to]
        return [self._slot(to).name]  # refuses an unknown name, listing the slots and nodes

    def _spare_on(self, slots: list[str]) -> Worker | None:
        return next((w for w in self._ready_spares() if w.slot in slots), None)

    def _migrate_to(self, rank: int, to: str) -> dict[str, Any]:
        slots = self._target_slots(to)
        here = self.workers[self.ranks[rank].worker or ""].slot
        if here in slots:
            raise RequestError(f"rank {rank} is already on {to} ({here})", 409)
        if not any(self.slots[s].healthy for s in slots) or not self.nodes[node_of(slots[0])].usable:
            raise RequestError(f"{to} is tainted or its node is not healthy: untaint it first", 409)
        spare = self._spare_on(slots)
        if spare is not None:
            op = self._start_planned([rank], EventKind.PLANNED, f"requested: to {to}", joiners=[spare])
            return {"op": op.id, "to": spare.slot, "events": [mv.event_id for mv in op.moves.values()]}
        live = {w.slot for w in self.workers.values() if w.role != WorkerRole.GONE}
        free = [s for s in slots if self.slots[s].healthy and s not in live]
        if not free:
            raise RequestError(f"no warm spare on {to} and no free slot there to start one", 409)
        w = self._launch(free[0])
        self._emit("spare-starting", {"worker": w.id, "slot": free[0]})
        self._targeted[rank] = to
        return {"queued": True, "to": free[0],
                "note": f"starting a spare on {free[0]}: rank {rank} moves there once it is ready"}

    def _pending_targeted(self) -> None:
        if not self._may_start_move():
            return
        for rank, to in list(self._targeted.items()):
            spare = self._spare_on(self._target_slots(to))
            if spare is not None:
                del self._targeted[rank]
                self._start_planned([rank], EventKind.PLANNED, f"requested: to {to}", joiners=[spare])
                return

    def _pending_return_home(self) -> None:
        """--return-home: ranks away from a healthy home node go back to its spares, all of a
        node's ranks in one move (it waits while spares there are still starting)."""
        if not self.config.return_home or not self._may_start_move():
            return
        away: dict[str, list[int]] = {}
        for r, info in sorted(self.ranks.items()):
            w = self.workers.get(info.worker or "")
            home = self.home.get(r)
            if w is None or home is None or node_of(w.slot) == node_of(home) or r in self._targeted:
                continue
            if self.nodes[node_of(home)].usable:
                away.setdefault(node_of(home), []).append(r)
        ranks: list[int] = []
        joiners: list[Worker] = []
        for node, waiting in away.items():
            slots = self._target_slots(node)
            ready = [w for w in self._ready_spares() if w.slot in slots][: len(waiting)]
            starting = any(w.role == WorkerRole.STARTING and w.slot in slots for w in self.workers.values())
            if len(ready) < len(waiting) and starting:
                continue  # the rest of its spares are on their way: move the node's ranks together
            if len(ready) < len(waiting) and self._start_home_spares(waiting, len(ready), slots):
                continue
            ranks += waiting[: len(ready)]
            joiners += ready
        if ranks:
            self._start_planned(ranks, EventKind.PLANNED, "return home: its node is healthy again", joiners=joiners)

    def _start_home_spares(self, waiting: list[int], ready: int, slots: list[str]) -> bool:
        """Ranks on a borrowed node go home even where the job keeps no spare there (their
        lender wants the node back): start spares on their free home slots, their own first."""
        on_loan = [r for r in waiting if self._node(self.workers[self.ranks[r].worker or ""].slot).lender]
        need = len(on_loan) - ready
        free = sorted(self._free_slots(slots), key=lambda s: s.name not in {self.home[r] for r in on_loan})
        for slot in free[:max(0, need)]:
            w = self._launch(slot.name)
            self._emit("spare-starting", {"worker": w.id, "slot": slot.name,
                                          "message": "to take a rank home from a borrowed node"})
        return need > 0 and bool(free)
