"""The orchestrator's scheduler when it runs inside `baton serve`: a job's agent.

The agent (`baton run --server`, in the job's allocation) owns the processes: it starts
and kills workers through its own scheduler (local or Slurm) and reports exits. So the
server's side of a scheduler is a mailbox of typed commands the agent long-polls; the
agent's answers (exits, probe results, borrowed nodes) come back as orchestrator inputs.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from pydantic import BaseModel

from baton.control import messages as m
from baton.control.lending import SpareBroker
from baton.control.mailbox import Mailboxes

AGENT = "agent"


class AgentLink:
    def __init__(self, slots: list[str], features: list[str], job_id: str = "", broker: SpareBroker | None = None):
        self._slots = list(slots)
        self.mail = Mailboxes()
        self.last_seen = time.time()
        self.job_id = job_id
        # A local agent borrows idle spares of lower-priority jobs on its host (the server's
        # broker); a Slurm agent borrows nodes through Slurm's preemption.
        self._broker = broker if "nodes" not in features else None
        self.borrows_from = "the server for an idle spare" if self._broker else "Slurm for a node"
        # Offered only where the agent's scheduler can (Slurm): the orchestrator asks for them
        # by looking for these callables, as it does of an embedded scheduler.
        self.probe_node: Callable[..., None] | None = self._probe if "nodes" in features else None
        self.probe_links: Callable[..., None] | None = self._read_links if "nodes" in features else None
        self.drain: Callable[..., None] | None = self._drain if "nodes" in features else None
        self.resume: Callable[..., None] | None = self._resume if "nodes" in features else None
        can_borrow = "borrow" in features or self._broker is not None
        self.borrow: Callable[..., None] | None = self._borrow if can_borrow else None
        self.release: Callable[..., None] | None = self._release if can_borrow else None

    def _send(self, cmd: BaseModel) -> None:
        self.mail.post(AGENT, cmd.model_dump(mode="json"))

    def slots(self) -> list[str]:
        return list(self._slots)

    def start(self, worker_id: str, slot: str) -> int:
        self._send(m.StartWorker(worker_id=worker_id, slot=slot))
        return 0  # the pid arrives with the worker's registration

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        self._send(m.KillWorker(worker_id=worker_id, dump_stacks=dump_stacks))

    def end(self, exit_code: int, failure: str | None) -> None:
        self._send(m.EndJob(exit_code=exit_code, failure=failure))

    # The answers to these come back from the agent as NodeProbed / NodeLinks / NodeBorrowed inputs.
    def _probe(self, node: str, _answer: Any) -> None:
        self._send(m.ProbeNode(node=node))

    def _read_links(self, node: str, names: list[str], _answer: Any) -> None:
        self._send(m.ReadLinks(node=node, names=list(names)))

    def _borrow(self, answer: Any) -> None:
        if self._broker is not None:
            self._broker.request(self.job_id, answer)
        else:
            self._send(m.BorrowNode())

    def _drain(self, node: str, reason: str) -> None:
        self._send(m.DrainNode(node=node, reason=reason))

    def _resume(self, node: str) -> None:
        self._send(m.ResumeNode(node=node))

    def _release(self, node: str) -> None:
        if self._broker is None or not self._broker.give_back(self.job_id, node):
            self._send(m.ReleaseNode(node=node))

    def commands(self, after: int, timeout: float) -> list[dict[str, Any]]:
        self.last_seen = time.time()
        return self.mail.wait(AGENT, after, timeout)
