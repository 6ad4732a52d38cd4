"""Data paths: the links (NICs, rails) the job's process groups run over, and what happens
when one fails.

With `baton run --data-paths rail1,rail2`, every generation's groups use the paths that
every node of that generation can use now (gloo runs each collective over one of them in
turn). Each worker watches its node's links (baton.net.links) and reports a change as it
sees it. A path that goes down on a node that holds ranks, while the generation uses it, is
routed around inside the job: the generation is aborted (a collective stuck on the dead
link fails at once), every rank goes back to where its state is, and the next generation
forms over the remaining paths, with no rank replaced and no spare used. The interrupted
step runs again: the state is bit for bit what it would have been. The ledger records a
`path-failover` (node, interface, downtime from the moment the link was seen down).

Not yet: a path that comes back is not used again before the job re-forms for another
reason; a flapping path is not damped; a node that keeps a path down past a grace, or
loses every path, is not moved; a link that drops everything with its carrier up is found
only as a collective timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from baton.control import messages as m
from baton.control.nodes import node_of
from baton.control.operation import Operation
from baton.control.state import EventKind, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


@dataclass
class PathState:
    up: bool = True
    since: float = 0.0  # when it last changed (the orchestrator's clock, as the report dates it)
    downs: int = 0  # how many times it went down


class DataPaths:
    """The job's data paths and their state on each node (a path never reported is up)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.state: dict[str, dict[str, PathState]] = {}  # node -> interface -> state

    def note(self, node: str, interface: str, up: bool, at: float) -> bool:
        """Record a change; False when it changes nothing (a report repeated)."""
        st = self.state.setdefault(node, {}).setdefault(interface, PathState())
        if st.up == up:
            return False
        st.up, st.since = up, at
        st.downs += 0 if up else 1
        return True

    def usable(self, nodes: set[str]) -> list[str]:
        """The paths every one of `nodes` has up, in the configured order."""
        return [p for p in self.names if all(self.state.get(n, {}).get(p, PathState()).up for n in nodes)]

    def view(self) -> list[dict[str, object]]:
        """Each node's paths, for `baton status` and /metrics."""
        return [{"node": node, "interface": name, "up": st.up, "since": st.since, "downs": st.downs}
                for node, paths in sorted(self.state.items()) for name, st in sorted(paths.items())]


class PathFailover:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _generation_nodes(self, op: Operation | None) -> set[str]:
        """The nodes holding the ranks of the generation being formed (joiners' included)."""
        nodes = set()
        for rank, info in self.ranks.items():
            move = op.moves.get(rank) if op is not None else None
            wid = move.to_worker if move is not None and move.to_worker else info.worker
            w = self.workers.get(wid or "")
            if w is not None:
                nodes.add(node_of(w.slot))
        return nodes

    def _with_paths(self, cmd: m.Form) -> m.Form:
        """A Form over the paths every node of its generation can use now."""
        if not self.data_paths.names:
            return cmd
        paths = self.data_paths.usable(self._generation_nodes(self.op))
        if not paths:  # no path every node has: the first configured, and the collectives say the rest
            paths = self.data_paths.names[:1]
        self.generation_paths = list(paths)
        return cmd.model_copy(update={"paths": paths})

    def _on_path(self, w: Worker, rep: m.PathChanged) -> None:
        if rep.interface not in self.data_paths.names:
            return
        node = node_of(w.slot)
        at = time.time() - rep.queued_s
        if not self.data_paths.note(node, rep.interface, rep.up, at):
            return
        self._emit("path", {"node": node, "interface": rep.interface, "up": rep.up})
        if rep.up or self.exit_code is not None or rep.interface not in self.generation_paths:
            return
        holds_ranks = any(self.workers[i.worker].role == WorkerRole.RANK and node_of(self.workers[i.worker].slot) == node
                          for i in self.ranks.values() if i.worker in self.workers)
        if not holds_ranks or self.loop is None:
            return  # a spare's node, or the job still starting (its first generation forms over what is left)
        others = [p for p in self.generation_paths if p != rep.interface]
        if not others:
            self._emit("note", {"message": f"data path {rep.interface} down on {node}, and the job has no other: "
                                           "its collectives fail over to a recovery (--op-timeout)"})
            return
        cause = f"data path {rep.interface} down on {node}"
        ev = self._new_event(EventKind.PATH_FAILOVER, cause, None, None)
        ev.node, ev.interface, ev.detected_at = node, rep.interface, at
        log.info("%s: re-forming over %s", cause, ", ".join(others))
        self._open_recovery(cause=cause, failed_at=at)
        if self.op is not None:
            self.op.path_events.append(ev.id)
