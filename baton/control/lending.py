"""Spares shared between the jobs of one `baton serve`, by priority.

A job that lost a rank and has no spare ready asks for one. The server answers with an idle
warm spare of a job of *lower* priority: that job stops its spare and lends the slot; the
asking job starts a worker there, which takes the rank. When several jobs wait at once, the
highest priority is served first (the oldest request among equals), and each takes from the
lowest-priority lender. A job never takes from one of equal or higher priority, and a spare
that its own job has already picked is never taken. The slot goes back to its owner once the
borrower's rank has moved off it (`--return-home` does that by itself).

Lending needs both jobs' agents on one host with the local scheduler (the slot is a process
on that host). Under Slurm a job borrows through Slurm's preemption instead (`--borrow-spares`).

`match` is the decision, pure and tested on its own; `SpareBroker` carries it out from the
server's tick, the only thread that touches two jobs at once, in three steps so a GPU is
never shared: the lender stops its spare, the lender sees that process exit, and only then
the borrower starts its own there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from baton.control import messages as m
from baton.control.nodes import node_of

if TYPE_CHECKING:
    from baton.control.orchestrator import Orchestrator

log = logging.getLogger("baton.serve")

HANDOVER_TIMEOUT_S = 30.0  # a lent spare that has not exited by then is given up on (its lender keeps the slot)


@dataclass(frozen=True)
class Want:
    job: str
    priority: int
    since: float


@dataclass(frozen=True)
class Idle:
    job: str
    priority: int
    spares: int


def match(wants: list[Want], idle: list[Idle]) -> list[tuple[str, str]]:
    """(borrower, lender) pairs: the highest-priority wants first, each from the
    lowest-priority job with an idle spare and a priority strictly below its own."""
    left = {i.job: i.spares for i in idle}
    lenders = sorted(idle, key=lambda i: (i.priority, i.job))
    out = []
    for want in sorted(wants, key=lambda w: (-w.priority, w.since, w.job)):
        lender = next((i for i in lenders if i.priority < want.priority and left[i.job] > 0 and i.job != want.job),
                      None)
        if lender is not None:
            left[lender.job] -= 1
            out.append((want.job, lender.job))
    return out


def lent_slot(lender: str, slot: str) -> str:
    """The borrower's name for a lent slot: says whose it is, keeps its index (its GPU), and
    its node (`node_of`) is the lender's node, so a borrower holds each lender node once."""
    return f"{lender}:{slot}"


@dataclass
class Party:
    """What the broker needs of a hosted job."""

    job_id: str
    priority: int
    host: str
    can_lend: bool  # local scheduler: a slot is a process on `host`
    orch: "Orchestrator"


@dataclass
class _Handover:
    borrower: str
    lender: str
    slot: str
    worker: str
    started: float = field(default_factory=time.time)


Answer = Callable[..., None]  # answer(node, lender_text, slots=[...]) or answer(None, why)


class SpareBroker:
    def __init__(self, parties: Callable[[], dict[str, Party]]):
        self._parties = parties
        self._requests: dict[str, tuple[float, Answer]] = {}
        self._handovers: list[_Handover] = []
        self._returns: list[tuple[str, str]] = []  # (borrower, node) given back
        self._mu = threading.Lock()  # requests and returns arrive from the jobs' threads

    # Called from a job's effects (any thread); carried out in step().
    def request(self, job_id: str, answer: Answer) -> None:
        with self._mu:
            self._requests.setdefault(job_id, (time.time(), answer))

    def give_back(self, job_id: str, node: str) -> bool:
        """True when `node` is a slot lent by another job of this server."""
        if ":" not in node or node.split(":", 1)[0] not in self._parties():
            return False
        with self._mu:
            self._returns.append((job_id, node))
        return True

    def reconcile(self) -> None:
        """After a restart: a slot lent to a job that never got it (the server died in the
        handover) goes back to its owner; the borrower asks again if it still needs one."""
        parties = self._parties()
        for lender in parties.values():
            for slot in lender.orch.lent_slots():
                borrower = parties.get(slot.lent_to or "")
                node = borrower.orch.nodes.get(node_of(lent_slot(lender.job_id, slot.name))) if borrower else None
                if node is None or node.state != "healthy":
                    lender.orch.handle(m.TakeBack(slot=slot.name, borrower=slot.lent_to or ""))

    def step(self) -> None:
        """One round, from the server's tick: returns, handovers, then new loans."""
        parties = self._parties()
        self._step_returns(parties)
        self._step_handovers(parties)
        self._step_requests(parties)

    def _step_returns(self, parties: dict[str, Party]) -> None:
        with self._mu:
            returns, self._returns = self._returns, []
        keep = []
        for borrower, node in returns:
            lender, lender_node = node.split(":", 1)
            b = parties.get(borrower)
            if b is not None and b.orch.exit_code is None and \
                    not all(b.orch.slot_idle(s) for s in list(b.orch.slots) if node_of(s) == node):
                keep.append((borrower, node))  # a worker of its there has not exited yet
                continue
            if lender in parties:
                for slot in parties[lender].orch.lent_slots():
                    if slot.lent_to == borrower and node_of(slot.name) == lender_node:
                        parties[lender].orch.handle(m.TakeBack(slot=slot.name, borrower=borrower))
        with self._mu:
            self._returns += keep

    def _step_handovers(self, parties: dict[str, Party]) -> None:
        keep = []
        for h in self._handovers:
            lender, borrower = parties.get(h.lender), parties.get(h.borrower)
            if lender is None or borrower is None:
                continue
            if not lender.orch.slot_idle(h.slot):
                if time.time() - h.started < HANDOVER_TIMEOUT_S:
                    keep.append(h)
                    continue
                log.error("%s: its spare on %s did not exit in %gs: the loan to %s is off",
                          h.lender, h.slot, HANDOVER_TIMEOUT_S, h.borrower)
                lender.orch.handle(m.TakeBack(slot=h.slot, borrower=h.borrower))
                self._answer(h.borrower, None, f"{h.lender}'s spare did not stop")
                continue
            slot = lent_slot(h.lender, h.slot)
            self._answer(h.borrower, node_of(slot), f"baton job {h.lender} (priority {lender.priority})",
                         slots=[slot])
        self._handovers = keep

    def _step_requests(self, parties: dict[str, Party]) -> None:
        with self._mu:
            requests = dict(self._requests)
        if not requests:
            return
        for job_id in requests:
            p = parties.get(job_id)
            if p is None or not p.orch.wants_spare:
                self._answer(job_id, None, "no longer needed")
        if self._handovers:
            return  # one loan at a time: a want served by it may be gone once it lands
        for host in sorted({p.host for p in parties.values() if p.can_lend}):
            here = {j: p for j, p in parties.items() if p.can_lend and p.host == host and p.orch.exit_code is None}
            wants = [Want(j, here[j].priority, since) for j, (since, _) in requests.items()
                     if j in here and j in self._requests]
            idle = [Idle(j, p.priority, n) for j, p in here.items() if (n := p.orch.lendable_spares())]
            for borrower, lender in match(wants, idle):
                got = here[lender].orch.handle(m.LendSpare(borrower=borrower, borrower_priority=here[borrower].priority))
                if got.get("slot"):
                    self._handovers.append(_Handover(borrower, lender, got["slot"], got["worker"]))
                    return

    def _answer(self, job_id: str, node: str | None, text: str, slots: list[str] | None = None) -> None:
        with self._mu:
            req = self._requests.pop(job_id, None)
        if req is None:
            return
        try:
            req[1](node, text, slots=slots or [])
        except Exception:  # noqa: BLE001 - one job's failure must not stop the server's tick
            log.exception("%s: handing over a spare failed", job_id)
