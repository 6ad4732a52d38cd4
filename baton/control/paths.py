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

A path that comes back and stays up for `--path-hold-down` seconds on every node is used
again from the next boundary: a planned re-form (every rank pauses at an agreed step, no
state moves, nothing runs again), recorded as `path-restored`. A path that flaps is damped
as routing protocols damp a flapping route: each time it goes down it earns a penalty that
halves every `HALF_LIFE_S`; above `SUPPRESS` it is not used again until the penalty has
decayed below `REUSE`, which the ledger says (`path-damped`). So a link going down and up
every few seconds costs one failover, not one re-form per flap.

A path that drops everything with its link up is found after a collective fails (at
--op-timeout): every rank probes its peers over each path before it reports where it stands
(baton.net.probe), and one silent where another answered is reported down the same way,
then re-probed until it answers again (reported up, then the hold-down).

A fault that stays becomes a move: a node holding ranks that has run with a path down for
`--path-grace` seconds is tainted `network: <path> down` and its ranks move pre-emptively
(one move, over the paths still working) to spares elsewhere, after which the job runs over
every path again. A node that loses every data path cannot take part in a collective: it is
tainted and its ranks are lost at once (rebuilt on spares from the survivors' state and
their buddies'), not left for --op-timeout. Where the scheduler can read a node's links
(Slurm: a job step runs `ip link` there), a node tainted by its links is read again every
hold-down, and untainted once they are all up (`--return-home` then moves its ranks back);
one tainted for a path its probes found silent, with its links up, stays tainted until
`baton untaint`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from baton.control import effects as fx
from baton.control import messages as m
from baton.control.nodes import node_of
from baton.control.operation import Operation
from baton.control.state import EventKind, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


AUTO_PATHS = "auto"  # --data-paths auto: found on the nodes (baton.net.discover)
PENALTY = 1000.0  # earned each time a path goes down
HALF_LIFE_S = 30.0
SUPPRESS = 2500.0  # damped above this (a third down within about half a minute)
REUSE = 750.0  # no longer damped below this


@dataclass
class PathState:
    up: bool = True
    since: float = 0.0  # when it last changed (the orchestrator's clock, as the report dates it)
    downs: int = 0  # how many times it went down
    silent: bool = False  # down because probes found it silent (its link looked up)
    penalty: float = 0.0  # flap penalty as of `penalty_at`
    penalty_at: float = 0.0
    damped: bool = False

    def penalty_now(self, now: float) -> float:
        return self.penalty * math.pow(0.5, max(0.0, now - self.penalty_at) / HALF_LIFE_S)

    def went_down(self, at: float) -> bool:
        """Add its penalty; True when that makes it damped."""
        self.penalty, self.penalty_at = self.penalty_now(at) + PENALTY, at
        if not self.damped and self.penalty > SUPPRESS:
            self.damped = True
            return True
        return False

    def still_damped(self, now: float) -> bool:
        if self.damped and self.penalty_now(now) < REUSE:
            self.damped = False
        return self.damped


class DataPaths:
    """The job's data paths and their state on each node (a path never reported is up)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.state: dict[str, dict[str, PathState]] = {}  # node -> interface -> state

    def note(self, node: str, interface: str, up: bool, at: float) -> bool:
        """Record a change; False when it changes nothing (a report repeated)."""
        st = self.get(node, interface)
        if st.up == up:
            return False
        st.up, st.since, st.silent = up, at, False
        st.downs += 0 if up else 1
        return True

    def get(self, node: str, interface: str) -> PathState:
        return self.state.setdefault(node, {}).setdefault(interface, PathState())

    def ready_again(self, name: str, nodes: set[str], now: float, hold_down_s: float) -> bool:
        """Up on every one of `nodes` for the hold-down, and damped on none."""
        return all(st.up and now - st.since >= hold_down_s and not st.still_damped(now)
                   for st in (self.state.get(n, {}).get(name, PathState()) for n in nodes))

    def usable(self, nodes: set[str], in_use: list[str], now: float, hold_down_s: float) -> list[str]:
        """The paths a generation of `nodes` may run over, in the configured order: those in
        use that every node still has up, and those back on every node for the hold-down
        and not damped (a re-form for another reason takes them too)."""
        return [p for p in self.names
                if (p in in_use and all(self.state.get(n, {}).get(p, PathState()).up for n in nodes))
                or self.ready_again(p, nodes, now, hold_down_s)]

    def view(self) -> list[dict[str, object]]:
        """Each node's paths, for `baton status` and /metrics."""
        now = time.time()
        return [{"node": node, "interface": name, "up": st.up, "since": st.since, "downs": st.downs,
                 "damped": st.still_damped(now), "penalty": round(st.penalty_now(now))}
                for node, paths in sorted(self.state.items()) for name, st in sorted(paths.items())]


class PathFailover:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _generation_members(self, op: Operation | None) -> list[Worker]:
        """The workers holding the ranks of the generation being formed (joiners included)."""
        members = []
        for rank, info in self.ranks.items():
            move = op.moves.get(rank) if op is not None else None
            wid = move.to_worker if move is not None and move.to_worker else info.worker
            w = self.workers.get(wid or "")
            if w is not None:
                members.append(w)
        return members

    def _generation_nodes(self, op: Operation | None) -> set[str]:
        return {node_of(w.slot) for w in self._generation_members(op)}

    def _with_paths(self, cmd: m.Form, worker_id: str) -> m.Form:
        """A Form over the paths every node of its generation can use now, with where the
        other members answer probes on them."""
        if not self.data_paths.names:
            return cmd
        if self._paths_of[0] == cmd.generation:  # one choice per generation: every member the same devices
            paths = self._paths_of[1]
        else:
            paths = self.data_paths.usable(self._generation_nodes(self.op), self.generation_paths, time.time(),
                                           self.config.path_hold_down_s)
            if not paths:  # no path every node has: the first configured, and the collectives say the rest
                paths = self.data_paths.names[:1]
            self._paths_of = (cmd.generation, list(paths))
        self.generation_paths = list(paths)
        peers = [{p: w.path_addrs[p] for p in paths if p in w.path_addrs}
                 for w in self._generation_members(self.op) if w.id != worker_id and w.path_addrs]
        return cmd.model_copy(update={"paths": paths, "path_peers": peers})

    def _note_path(self, node: str, interface: str, up: bool, at: float, detail: str) -> bool:
        """Record a path's change on a node (False: no change), and damp it if it flaps."""
        if not self.data_paths.note(node, interface, up, at):
            return False
        self.data_paths.get(node, interface).silent = not up and bool(detail)
        self._emit("path", {"node": node, "interface": interface, "up": up})
        if not up and self.data_paths.get(node, interface).went_down(at):
            self._damped(node, interface)
        return True

    # ------------------------------------------------------------ --data-paths auto
    def _on_paths_found(self, w: Worker, rep: m.PathsFound) -> None:
        w.found_paths = list(rep.interfaces)
        log.info("%s (%s) can run data paths over %s%s", w.id, w.slot, ", ".join(rep.interfaces) or "nothing",
                 f"; {rep.detail}" if rep.detail else "")
        self._found_detail[node_of(w.slot)] = rep.detail
        if self.discover_paths and not self._gen0_posted:
            self._maybe_start_generation0()

    def _paths_decided(self) -> bool:
        """Whether the job's data paths are known; with `--data-paths auto`, they are decided
        here once every rank of the first generation said its node's candidates: the names
        every one of those nodes has, in name order. Workers registered before then are told
        to watch them."""
        if not self.discover_paths:
            return True
        found: dict[str, list[str]] = {}
        for info in self.ranks.values():
            w = self.workers.get(info.worker or "")
            if w is None or w.found_paths is None:
                return False
            found.setdefault(node_of(w.slot), w.found_paths)
        common = sorted(set.intersection(*(set(f) for f in found.values()))) if found else []
        self.discover_paths = False
        self.data_paths = DataPaths(common)
        self.generation_paths = list(common)
        each = "; ".join(f"{n}: {', '.join(f) or 'none'}" for n, f in sorted(found.items()))
        if common:
            self._emit("note", {"message": f"data paths found on every node: {', '.join(common)} ({each})"})
        else:
            why = "; ".join(f"{n}: {d}" for n, d in sorted(self._found_detail.items()) if d and n in found)
            self._emit("note", {"message": f"--data-paths auto: no interface is a data path on every node ({each}"
                                           f"{'; ' + why if why else ''}): the groups run over the default device"})
        for w in self.workers.values():
            if common and w.role in (WorkerRole.RANK, WorkerRole.SPARE):
                self._post(w.id, m.WatchPaths(names=common))
        self._persist(force=True)
        return True

    def _on_paths_ready(self, w: Worker, rep: m.PathsReady) -> None:
        w.path_addrs = {name: tuple(addr) for name, addr in rep.addrs.items()}  # type: ignore[misc]
        w.paths_ready = True
        if w.role == WorkerRole.RANK and self.loop is None and self.generation == 0:
            self._maybe_start_generation0()

    def _on_path(self, w: Worker, rep: m.PathChanged) -> None:
        if rep.interface not in self.data_paths.names:
            return
        node = node_of(w.slot)
        at = time.time() - rep.queued_s
        if not rep.up and rep.detail and any(
                not st.up and not st.silent for n, paths in self.data_paths.state.items() if n != node
                for p, st in paths.items() if p == rep.interface):
            return  # silent towards a node whose own link on it is down: explained there, not here
        for other in rep.down_now:  # lost together with it: decided together
            if other != rep.interface and other in self.data_paths.names:
                self._note_path(node, other, False, at, "")
        if not self._note_path(node, rep.interface, rep.up, at, rep.detail):
            return
        if rep.up or self.exit_code is not None or rep.interface not in self.generation_paths:
            return
        holds_ranks = any(self.workers[i.worker].role == WorkerRole.RANK and node_of(self.workers[i.worker].slot) == node
                          for i in self.ranks.values() if i.worker in self.workers)
        if not holds_ranks or self.loop is None:
            return  # a spare's node, or the job still starting (its first generation forms over what is left)
        if not self.data_paths.usable({node}, self.data_paths.names, at, float("inf")):
            self._isolated(node, f"every data path down ({', '.join(self.data_paths.names)})",
                           f"node {node} lost every data path")
            return
        apart = self._unreachable_from(node, at)
        if apart:  # its paths left and its peers' share none: no collective can include both
            self._isolated(node, f"no data path shared with {', '.join(apart)}",
                           f"node {node} shares no working data path with {', '.join(apart)}")
            return
        others = [p for p in self.generation_paths if p != rep.interface]
        if not others:
            self._emit("note", {"message": f"data path {rep.interface} down on {node}, and the job has no other: "
                                           "its collectives fail over to a recovery (--op-timeout)"})
            return
        if self.op is not None and any(self.events[i - 1].interface == rep.interface for i in self.op.path_events):
            return  # the same path, seen from another node: one failover
        cause = f"data path {rep.interface} down on {node}" + (f" ({rep.detail})" if rep.detail else "")
        ev = self._new_event(EventKind.PATH_FAILOVER, cause, None, None)
        ev.node, ev.interface, ev.detected_at = node, rep.interface, at
        log.info("%s: re-forming over %s", cause, ", ".join(others))
        forming = self.op is not None and self.op.kind == EventKind.UNPLANNED and self.op.phase == "forming"
        self._open_recovery(cause=cause, failed_at=at)
        if self.op is not None:
            self.op.path_events.append(ev.id)
            if forming:  # the generation being formed uses it (found silent as it failed to connect): plan again
                self._restart_collect(self.op)

    def _damped(self, node: str, interface: str) -> None:
        st = self.data_paths.get(node, interface)
        cause = (f"data path {interface} on {node} is flapping (down {st.downs} times, penalty "
                 f"{st.penalty:.0f} over {SUPPRESS:.0f}): damped, not used again until it has stayed up about "
                 f"{HALF_LIFE_S * math.log2(st.penalty / REUSE):.0f}s")
        ev = self._new_event(EventKind.PATH_DAMPED, cause, None, None)
        ev.node, ev.interface, ev.status = node, interface, "resolved"
        self._lock.add(fx.WriteEvent(ev.id, ev.to_json()))
        self._emit("note", {"message": cause})

    def _restore_paths(self, now: float) -> None:
        """Paths back (up for the hold-down on every node of the job, not damped) are used
        again from the next boundary: a planned re-form with no rank moving."""
        if not self.data_paths.names or self.loop is None or not self._may_start_move():
            return
        nodes = self._generation_nodes(None)
        back = [p for p in self.data_paths.names if p not in self.generation_paths
                and self.data_paths.ready_again(p, nodes, now, self.config.path_hold_down_s)]
        if not back:
            return
        cause = f"data path{'s' if len(back) > 1 else ''} {', '.join(back)} back on every node"
        ev = self._new_event(EventKind.PATH_RESTORED, cause, None, None)
        ev.interface = ",".join(back)
        op = self._start_planned([], EventKind.PATH_RESTORED, cause, joiners=[])
        op.path_events.append(ev.id)

    # ---------------------------------------------------------------- faults that stay
    def _network_reason(self, node: str, down: list[str], now: float) -> str:
        since = min(self.data_paths.get(node, p).since for p in down)
        return f"network: {', '.join(down)} down for {now - since:.0f}s"

    def _unreachable_from(self, node: str, at: float) -> list[str]:
        """The other nodes of the generation with which `node` shares no data path up."""
        mine = set(self.data_paths.usable({node}, self.data_paths.names, at, float("inf")))
        return sorted(n for n in self._generation_nodes(None) if n != node
                      and not mine & set(self.data_paths.usable({n}, self.data_paths.names, at, float("inf"))))

    def _isolated(self, node: str, why: str, cause: str) -> None:
        """`node`'s ranks can take part in no collective (every data path of it down, or none
        shared with a peer's): taint it and lose them now (their state is rebuilt on spares
        elsewhere), rather than wait for --op-timeout."""
        known = self.nodes.get(node)
        if known is not None and known.state == "healthy":
            self._taint_node(node, f"network: {why}", move=False)
            self._network_taints[node] = time.time()
        for w in list(self.workers.values()):
            if w.role == WorkerRole.RANK and node_of(w.slot) == node:
                self._worker_lost(w, cause)

    def _path_grace(self, now: float) -> None:
        """A node holding ranks with a path down past --path-grace: taint it; its ranks move."""
        if not self.data_paths.names or self.loop is None or self.exit_code is not None or self._finishing():
            return
        for node in sorted(self._generation_nodes(None)):
            if node not in self.nodes or self.nodes[node].state != "healthy":
                continue
            down = [p for p in self.data_paths.names if node in self.data_paths.state
                    and not self.data_paths.get(node, p).up
                    and now - self.data_paths.get(node, p).since >= self.config.path_grace_s]
            if not down or not any(node_of(w.slot) != node for w in self._ready_spares()):
                continue
            self._taint_node(node, self._network_reason(node, down, now))
            self._network_taints[node] = now

    def _probe_network_taints(self, now: float) -> None:
        """Read the links of nodes tainted for them (no worker of the job runs there now)."""
        if not callable(getattr(self.scheduler, "probe_links", None)):
            return
        for node, last in list(self._network_taints.items()):
            if self.nodes.get(node) is None or self.nodes[node].state != "tainted":
                self._network_taints.pop(node)
                continue
            if now - last >= self.config.path_hold_down_s:
                self._network_taints[node] = now
                self._lock.add(fx.ProbeLinks(node, tuple(self.data_paths.names)))

    def _on_node_links(self, ev: m.NodeLinks) -> None:
        """A tainted node's links as read there: each change is noted (dated now); once all
        are up for the hold-down, none found silent by probes, the node is untainted."""
        if ev.node not in self._network_taints:
            return
        now = time.time()
        for name, up in ev.up.items():
            if self.data_paths.get(ev.node, name).silent:
                continue  # its link looked up while probes found it silent: the link cannot vouch for it
            if self.data_paths.note(ev.node, name, up, now):
                self._emit("path", {"node": ev.node, "interface": name, "up": up})
        if len(ev.up) == len(self.data_paths.names) and \
                all(self.data_paths.ready_again(p, {ev.node}, now, self.config.path_hold_down_s)
                    for p in self.data_paths.names):
            self._network_taints.pop(ev.node)
            self._emit("note", {"message": f"node {ev.node}'s data paths are all up again: untainted"})
            self._untaint_node(ev.node)
