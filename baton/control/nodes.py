"""Nodes: the machines slots live on (slot `n2/1` is on node `n2`).

A worker lost on a scheduler that can probe nodes (Slurm) makes its node *suspect*: no new
spare goes there, and a spare there is chosen last, until the scheduler has probed it. A
node that fails the probe is *lost*: every slot on it is tainted, it is drained in the
scheduler with the reason (Slurm's view stays honest), and any rank still running there is
moved. `baton taint NODE` taints every slot on a node, drains it and moves all its ranks in
one move; `baton untaint NODE` returns the slots and resumes the node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from baton.control import effects as fx
from baton.control import messages as m
from baton.control.state import Slot, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


def node_of(slot: str) -> str:
    return slot.rsplit("/", 1)[0]


@dataclass
class Node:
    name: str
    state: str = "healthy"  # healthy | suspect (being probed) | lost | tainted
    reason: str | None = None
    failed_start: tuple[str, int] | None = None  # a spare that exited while starting here: decided by the probe
    lender: str | None = None  # borrowed: who Slurm preempted for it
    held_rank: bool = False  # a borrowed node that took a rank is given back once it holds none

    @property
    def usable(self) -> bool:
        return self.state == "healthy"


class NodeHealth:
    """Mixed into the Orchestrator; runs under its decision lock."""

    @property
    def can_probe_nodes(self) -> bool:
        return callable(getattr(self.scheduler, "probe_node", None))

    def _node(self, slot: str) -> Node:
        name = node_of(slot)
        return self.nodes.setdefault(name, Node(name))

    def _suspect_node(self, w: Worker) -> None:
        """`w` was lost: if its node may be gone too, probe it before using it again."""
        if not self.can_probe_nodes or self.exit_code is not None:
            return
        node = self._node(w.slot)
        if node.state != "healthy":
            return
        node.state, node.reason = "suspect", f"{w.id} lost"
        self._lock.add(fx.ProbeNode(node.name))

    def _spare_start_failed(self, w: Worker, returncode: int) -> bool:
        """A spare exited before baton.init(): on a node that may be failing, that is the
        node's doing until a probe says the node is fine. True: the node decides (probed now,
        or already known bad); False: judge the exit as the script's own."""
        node = self._node(w.slot)
        if node.state != "healthy":
            self._emit("worker-lost", {"worker": w.id, "slot": w.slot, "rank": None,
                                       "cause": f"exited with code {returncode} while starting on node "
                                                f"{node.name} ({node.state})"})
            if node.state == "suspect":
                node.failed_start = node.failed_start or (w.id, returncode)
            return True
        if not self.can_probe_nodes:
            return False
        node.state, node.reason, node.failed_start = "suspect", f"{w.id} exited while starting", (w.id, returncode)
        self._lock.add(fx.ProbeNode(node.name))
        return True

    def _on_node_probed(self, ev: m.NodeProbed) -> None:
        node = self.nodes.get(ev.node)
        if node is None or node.state != "suspect":
            return
        failed_start, node.failed_start = node.failed_start, None
        if ev.ok:
            node.state, node.reason = "healthy", None
            if failed_start is not None:  # the node is fine: the script itself failed to start
                w = self.workers[failed_start[0]]
                self._exited_before_init(w, failed_start[1], judged=True)
                return
            self._replenish()
            return
        self._node_lost(node, ev.detail or "it did not answer")

    def _node_lost(self, node: Node, detail: str) -> None:
        node.state, node.reason = "lost", detail
        self._emit("node-lost", {"node": node.name, "detail": detail})
        self._taint_slots(node, f"node {node.name} lost: {detail}")
        self._lock.add(fx.DrainNode(node.name, f"baton: node lost: {detail}"[:200]))
        self._pending_taint_moves()

    def _taint_slots(self, node: Node, reason: str) -> list[int]:
        """Taint every slot on `node`, stop its spares; returns the ranks still on it."""
        ranks = []
        for s in self.slots.values():
            if node_of(s.name) == node.name and s.taint is None:
                s.taint, s.tainted_at = reason, time.time()
        for w in self.workers.values():
            if node_of(w.slot) != node.name:
                continue
            if w.role in (WorkerRole.SPARE, WorkerRole.STARTING) and w.intended_rank is None:
                w.role = WorkerRole.GONE
                self._post(w.id, m.Stop(reason=reason))
                self._kill(w.id)
            elif w.role == WorkerRole.RANK and w.rank is not None and self.ranks[w.rank].worker == w.id:
                ranks.append(w.rank)
        return ranks

    def _taint_node(self, name: str, reason: str, move: bool = True) -> dict[str, Any]:
        """Taint every slot of a node and drain it; its ranks move (`move`), or are left to
        whoever taints it (a node whose ranks are lost anyway)."""
        node = self.nodes[name]
        node.state, node.reason = "tainted", reason
        self._emit("taint", {"node": name, "reason": reason})
        moved = self._taint_slots(node, f"node {name}: {reason}")
        self._lock.add(fx.DrainNode(name, f"baton: {reason}"[:200]))
        if not move:
            return {"node": name, "reason": reason}
        return self._move_off_taint({"node": name, "reason": reason}, sorted(moved), f"taint: node {name}: {reason}")

    def _untaint_node(self, name: str) -> dict[str, Any]:
        node = self.nodes[name]
        was = node.reason
        node.state, node.reason = "healthy", None
        for s in self.slots.values():
            if node_of(s.name) == name:
                s.taint, s.tainted_at = None, None
        self._emit("untaint", {"node": name})
        self._lock.add(fx.ResumeNode(name))
        self._replenish()
        return {"node": name, "was": was}

    # ---------------------------------------------------------------- floating spares
    @property
    def can_borrow(self) -> bool:
        return self.config.borrow_spares and callable(getattr(self.scheduler, "borrow", None))

    def _maybe_borrow(self) -> None:
        """No dedicated spare is left: ask the scheduler for a node (once at a time)."""
        if not self.can_borrow or self._borrowing or self.exit_code is not None:
            return
        self._borrowing = True
        source = getattr(self.scheduler, "borrows_from", "Slurm for a node")
        self._emit("borrowing", {"message": f"no dedicated spare left: asking {source} from a "
                                            "lower-priority job"})
        self._lock.add(fx.BorrowNode())

    def _on_node_borrowed(self, ev: m.NodeBorrowed) -> None:
        self._borrowing = False
        if ev.node is None:
            self._emit("note", {"message": f"could not borrow a node: {ev.detail}"})
            return
        node = self.nodes.setdefault(ev.node, Node(ev.node))
        node.state, node.reason, node.lender, node.held_rank = "healthy", None, ev.lender, False
        slots = ev.slots or [f"{ev.node}/{i}" for i in range(max(1, self.config.ranks_per_node))]
        for name in slots:
            self.slots.setdefault(name, Slot(name=name))
            self.slots[name].taint = self.slots[name].tainted_at = None
        self._emit("borrowed", {"node": ev.node, "from": ev.lender})
        if self.exit_code is not None:
            self._release(node)
            return
        waiting = sum(1 for mv in self.op.moves.values() if mv.to_worker is None) if self.op is not None else 0
        if ev.slots and not waiting:  # a slot lent by another job, no longer needed: straight back
            self._release(node)
            return
        for name in slots[: max(1, waiting)]:
            w = self._launch(name)
            self._emit("spare-starting", {"worker": w.id, "slot": name, "borrowed_from": ev.lender})

    def _release_idle_borrowed(self) -> None:
        """A borrowed node that no longer holds a rank goes back to its lender."""
        for node in self.nodes.values():
            if node.lender is None or node.state != "healthy":
                continue
            ranks = [w for w in self.workers.values() if w.role == WorkerRole.RANK and node_of(w.slot) == node.name]
            if ranks:
                node.held_rank = True
            elif node.held_rank:
                self._release(node)

    def _release(self, node: Node) -> None:
        self._taint_slots(node, f"returned to its lender ({node.lender})")
        node.state, node.reason = "released", f"returned to {node.lender}"
        self._emit("released", {"node": node.name, "to": node.lender})
        self._lock.add(fx.ReleaseNode(node.name))

    def _spare_kind(self, slot: str) -> dict[str, Any]:
        node = self._node(slot)
        return {"kind": "borrowed", "from": node.lender} if node.lender else {"kind": "dedicated"}

    def _node_view(self) -> list[dict[str, Any]]:
        out = []
        for name, node in self.nodes.items():
            slots = [s for s in self.slots if node_of(s) == name]
            ranks = sorted(w.rank for w in self.workers.values()
                           if w.role == WorkerRole.RANK and w.rank is not None and node_of(w.slot) == name
                           and self.ranks[w.rank].worker == w.id)
            spares = sum(1 for w in self.workers.values() if w.role == WorkerRole.SPARE and node_of(w.slot) == name)
            out.append({"node": name, "state": node.state, "reason": node.reason, "slots": len(slots),
                        "ranks": ranks, "spares": spares, "borrowed_from": node.lender})
        return out
