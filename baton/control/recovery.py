"""Unplanned recovery: survivors absorb the failure and report where their state is; the
most advanced boundary wins; joiners fetch replicated state from every survivor there
and their own rank-local state from the lost rank's buddies.

Every phase has a deadline: survivors that do not report in time are lost too; with no
spare in --spare-wait the job fails; a generation that does not form in time is tried
again with twice the time, then the job fails with a clear message; a joiner lost on the
way is replaced by another spare.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from baton.control import messages as m
from baton.control.buddies import buddies_of
from baton.control.operation import Move, Operation, RetryMove
from baton.control.state import EventKind, RankState, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")

# A rank lost this many times while the job stood at one step ends the job: each new process
# died where its predecessor did, which another spare will not change. A planned move whose
# spares are lost this many times in a row is given up (its leaver still holds the rank).
LOSSES_IN_PLACE = 3


@dataclass
class LossStreak:
    """A rank's losses (its processes, and spares taking it over) since the job last advanced."""

    step: int  # the newest boundary every rank had reached at the first of them
    causes: list[str] = field(default_factory=list)


class Recovery:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _on_recover(self, w: Worker, rep: m.Recover) -> None:
        """A survivor absorbed a lost peer; its state is at position `rep.pos`."""
        if w.rank is None or w.role != WorkerRole.RANK:
            return
        info = self.ranks[w.rank]
        info.state = RankState.RECOVERING
        info.step = rep.pos[0]
        op = self.op
        if op is None or op.kind != EventKind.UNPLANNED:
            # The survivor saw the failure first (e.g. a hung peer): open the recovery now;
            # the culprit is found by heartbeats or by not reporting.
            # Its error names the symptom (gloo's "Connection closed by peer", a timeout), not
            # which rank was lost: that follows (worker-lost), from heartbeats or a missing report.
            self._open_recovery(cause=f"rank {w.rank}'s collective failed, the lost rank not known yet "
                                      f"({rep.error[:200]})")
            op = self.op
        if op is None:
            return  # the job has ended (a fatal error): a survivor's late report changes nothing
        if rep.generation < op.generation:
            # Sent before this rank heard of the current generation (its Abort is on the way):
            # its state may change before that Abort reaches it, so wait for the next report.
            self._advance_collect()
            return
        if w.rank not in op.moves:
            pos = tuple(rep.pos)
            if rep.unit_reported and self._unit_durable_everywhere((pos[0], pos[1] + 1)):
                pos = (pos[0], pos[1] + 1)  # every rank finished that boundary function
            op.boundaries[w.rank] = pos  # type: ignore[assignment]
            op.snapshots[w.rank] = {tuple(p) for p in rep.snapshots}  # type: ignore[misc]
            op.held[w.rank] = {int(r): {tuple(p) for p in ps} for r, ps in rep.held.items()}  # type: ignore[misc]
            op.replicas[w.rank] = set(rep.replicas)
            op.rerun = op.rerun or rep.in_step
            if rep.blocked_s is not None:
                stalled = time.time() - rep.blocked_s
                op.stalled_at = min(op.stalled_at or stalled, stalled)
        self._advance_collect()

    def _unit_durable_everywhere(self, pos: tuple[int, int]) -> bool:
        return all(i.held is not None and tuple(i.held["pos"]) >= pos for i in self.ranks.values())

    def _redundancy(self) -> int:
        return max(0, min(self.config.redundancy, self.config.world_size - 1))

    def _per_node(self) -> int:
        return self.config.ranks_per_node or self.config.world_size

    def _buddies(self, rank: int) -> list[int]:
        return buddies_of(rank, self.config.world_size, self._per_node(), self._redundancy())

    def _buddy_addr(self, rank: int, op: Operation | None = None) -> list[tuple[str, int]]:
        """Where `rank` pushes its bundles: the workers holding its buddies in the new generation."""
        out = []
        for b in self._buddies(rank):
            move = op.moves.get(b) if op is not None else None
            wid = move.to_worker if move is not None and move.to_worker else self.ranks[b].worker
            w = self.workers.get(wid or "")
            if w is not None and w.transfer_addr:
                out.append(tuple(w.transfer_addr))
        return out  # type: ignore[return-value]

    def _ward_addr(self, rank: int, op: Operation | None = None) -> dict[int, tuple[str, int]]:
        """Where `rank`'s wards are in the new generation (in a sharded job it pulls their
        shard snapshots; the job's state may not be known to be sharded yet)."""
        out = {}
        for ward in range(self.config.world_size):
            if rank not in self._buddies(ward):
                continue
            move = op.moves.get(ward) if op is not None else None
            wid = move.to_worker if move is not None and move.to_worker else self.ranks[ward].worker
            w = self.workers.get(wid or "")
            if w is not None and w.transfer_addr:
                out[ward] = tuple(w.transfer_addr)
        return out  # type: ignore[return-value]

    def _open_recovery(self, cause: str, dead_rank: int | None = None, dead_worker: Worker | None = None,
                       failed_at: float | None = None) -> None:
        if self.exit_code is not None:
            return  # the job has ended: its ranks' failing collectives are its own end
        block = self._sharded_block()
        # Only a rank known lost ends the job: a survivor's failed collective often arrives
        # before its peer's death is seen, and may be a glitch that lost no rank (then every
        # rank re-forms where it stands, which loses no shard).
        if block is not None and self._redundancy() == 0 and dead_rank is not None:
            self._stop_sharded(cause, dead_rank, dead_worker, block)
            return
        op = self.op
        carried: dict[int, str] = {}  # rank -> joiner that can take it over in the recovery
        path_events: list[int] = []  # a data path's failover or restore: resolved by the recovery's generation
        if op is not None and op.kind != EventKind.UNPLANNED:
            path_events = op.path_events
            # A failure in the middle of a planned move: fold everything into one recovery.
            self._emit("note", {"message": f"failure during {op.kind.value} migration: recovering instead"})
            for rank, move in op.moves.items():
                ev = self.events[move.event_id - 1]
                leaver_died = move.from_worker == (dead_worker.id if dead_worker else None)
                if leaver_died:
                    note = "superseded by the loss of its leaver: the joiner takes the rank over"
                elif any(x.rank == rank for x in self._retry_moves):
                    note = "its joiner was lost; the move runs again with another spare"
                else:  # a bystander failed: the move is still wanted once the job has re-formed
                    self._retry_moves.append(RetryMove(rank, ev.id, move.from_worker))
                    note = "superseded by an unplanned failure during the move; it runs again after it"
                self._close(ev, "failed", note)
                joiner = self.workers.get(move.to_worker or "")
                if joiner is None or joiner.role != WorkerRole.RANK:
                    continue
                if leaver_died:
                    carried[rank] = joiner.id  # the leaver died: its joiner takes the rank over
                else:
                    # The leaver lives on as a survivor; the joiner (already running the
                    # script as that rank) cannot serve another rank: stop it, free the slot.
                    joiner.role = WorkerRole.GONE
                    if self.scheduler is not None:
                        self._kill(joiner.id)
            op = None
            self.op = None
        if op is None:
            self.generation += 1
            self._op_ids += 1
            op = Operation(id=self._op_ids, kind=EventKind.UNPLANNED, generation=self.generation,
                           moves={}, phase="collect", failed_at=failed_at or time.time())
            op.enter("collect", self._report_window())
            op.path_events.extend(path_events)
            self.op = op
            for info in self.ranks.values():
                if info.worker and self.workers[info.worker].role == WorkerRole.RANK and info.rank != dead_rank:
                    self._post(info.worker, m.Abort(op=op.id, generation=op.generation))
            self._emit("recovery", {"op": op.id, "cause": cause})
        if dead_rank is not None and dead_rank not in op.moves:
            ev = self._new_event(EventKind.UNPLANNED, cause, dead_rank, dead_worker.slot if dead_worker else None)
            if failed_at is not None:
                ev.detected_at = min(ev.detected_at, failed_at)  # downtime counts from the failure
                op.failed_at = min(op.failed_at or failed_at, failed_at)
            op.moves[dead_rank] = Move(rank=dead_rank, event_id=ev.id,
                                       from_worker=dead_worker.id if dead_worker else None,
                                       to_worker=carried.get(dead_rank))
            op.boundaries.pop(dead_rank, None)
            if op.phase in ("forming", "spares"):
                self._restart_collect(op)
        self._advance_collect()

    FORM_TRIES = 4

    def _formation_timeout(self, op: Operation) -> float:
        """The configured formation timeout, doubled for every attempt that ran out of it."""
        return self.config.formation_timeout_s * (2 ** op.form_tries)

    def _report_window(self) -> float:
        """How long a live rank may take to answer: its collectives time out after
        --op-timeout, and its report needs a moment to arrive."""
        return self.config.op_timeout_s + self.config.collect_grace_s

    def _enter_forming(self, op: Operation) -> None:
        op.enter("forming", self._formation_timeout(op) + self._report_window())

    def _expired_collect(self, op: Operation) -> None:
        """Survivors that neither reported nor were declared dead are hung: lost too."""
        self._lose_hung([r for r in self.ranks if r not in op.moves and r not in op.boundaries],
                        "did not report after the failed step (hung)")
        if self.op is op and op.phase == "collect":
            op.enter("collect", self._report_window())  # what the lost ranks' joiners need
        self._advance_collect()

    def _expired_spares(self, op: Operation) -> None:
        """No spare came up in --spare-wait: the job cannot go on at its world size."""
        missing = sorted(r for r, mv in op.moves.items() if mv.to_worker is None)
        self._lost_everything(op, f"no spare became ready for rank(s) {missing} within "
                                  f"{self.config.spare_wait_s:g}s (--spare-wait): free or untaint a slot, "
                                  "or raise --spare-wait")

    def _expired_forming(self, op: Operation) -> None:
        """The forming phase's deadline: try again with twice the time, then fail clearly."""
        waited = self._formation_timeout(op)
        op.form_tries += 1
        if op.form_tries >= self.FORM_TRIES:
            self._lost_everything(op, f"generation {op.generation} did not form after {op.form_tries} attempts "
                                      f"(the last allowed {waited:.1f}s); raise --formation-timeout (now "
                                      f"{self.config.formation_timeout_s}s) if ranks are slow to start or fetch "
                                      "state")
            return
        self._emit("note", {"message": f"generation {op.generation} did not form within {waited:.1f}s; "
                                       f"trying again with {2 * waited:.1f}s"})
        if op.kind == EventKind.UNPLANNED:
            self._restart_collect(op)
            self._advance_collect()
            return
        for rank, move in op.moves.items():
            self._retry_moves.append(RetryMove(rank, move.event_id, move.from_worker))
        self._open_recovery(cause=f"generation {op.generation} of a {op.kind.value} move did not form in time")

    def _restart_collect(self, op: Operation) -> None:
        """Lost someone while forming: a new generation, and everyone goes back to collecting.
        A survivor may be inside gloo's connect to the lost rank (a node whose every data path
        went down): that ends only at --op-timeout, and only then can it take the Abort and
        report, so it gets that long on top of the usual report window."""
        forming = op.phase == "forming"
        op.enter("collect", self._report_window() + (self.config.op_timeout_s if forming else 0.0))
        op.formed.clear()
        # Reports from before are stale: a survivor may have taken a completed step's state
        # since. Every survivor reports again after the Abort below.
        op.boundaries.clear()
        self.generation += 1
        op.generation = self.generation
        for info in self.ranks.values():
            if info.worker and self.workers[info.worker].role == WorkerRole.RANK and info.rank not in op.moves:
                self._post(info.worker, m.Abort(op=op.id, generation=op.generation))

    def _joiner_lost(self, w: Worker, rank: int, cause: str) -> None:
        """A spare taking over `rank` died or hung before it did: another spare takes its place."""
        op = self.op
        move = op.moves.get(rank) if op is not None else None
        if op is None or move is None or move.to_worker != w.id:
            return  # a joiner from a move that is already over
        planned = op.kind != EventKind.UNPLANNED
        if not planned:
            streak = self._lost_in_place(rank, f"the spare taking it over was lost: {cause}")
            if streak is not None:
                self._end_respawns(rank, streak)
                return
        else:
            tries = self._spares_lost_moving[rank] = self._spares_lost_moving.get(rank, 0) + 1
            if op.phase in ("prepare", "pre-copy"):  # no rank has paused: nothing to re-form
                self._joiner_lost_preparing(op, rank, w, cause, tries)
                return
            if tries >= LOSSES_IN_PLACE:
                # The leaver still holds the rank: the move is given up (taken out of the op, so
                # the recovery below does not queue it again) and the job goes on where it stands.
                del op.moves[rank]
                self._give_up_move(rank, move, tries, cause)
                self._open_recovery(cause=f"the spare taking over rank {rank} was lost: {cause}")
                return
        self._emit("note", {"message": f"the spare taking over rank {rank} ({w.id} on {w.slot}) was lost "
                                       f"({cause}); another spare takes its place"})
        if not planned:
            move.to_worker = None
            self._restart_collect(op)
            self._advance_collect()
            return
        # A planned move: its leaver still holds the rank. Every rank re-forms where it stands
        # (a recovery that moves nobody), then the move starts again with another spare.
        ev = self.events[move.event_id - 1]
        self._retry_moves.append(RetryMove(rank, ev.id, move.from_worker))
        self._open_recovery(cause=f"the spare taking over rank {rank} was lost: {cause}")

    def _give_up_move(self, rank: int, move: Move, tries: int, cause: str) -> None:
        """A planned move whose spares were lost LOSSES_IN_PLACE times in a row: the rank stays."""
        self._spares_lost_moving.pop(rank)
        self._emit("note", {"message": f"the move of rank {rank} is given up: {tries} spares in a row were "
                                       f"lost taking it over (the last: {cause}); the rank stays where it is"})
        self._close(self.events[move.event_id - 1], "failed",
                    f"given up: {tries} spares in a row were lost taking the rank over")

    def _joiner_lost_preparing(self, op: Operation, rank: int, w: Worker, cause: str, tries: int) -> None:
        """A planned move's joiner lost in the script's setup, before any rank paused: the move
        is called off (its other joiners stopped) and starts again with other spares, or is
        given up after LOSSES_IN_PLACE spares in a row; training never stopped."""
        if tries < LOSSES_IN_PLACE:
            self._emit("note", {"message": f"the spare taking over rank {rank} ({w.id} on {w.slot}) was lost in "
                                           f"its setup ({cause}); another spare takes its place"})
        for r, move in op.moves.items():
            ev = self.events[move.event_id - 1]
            if op.phase == "pre-copy" and move.from_worker:
                self._post(move.from_worker, m.PreCopy(op=op.id, stop=True))
            if r == rank and tries >= LOSSES_IN_PLACE:
                self._give_up_move(rank, move, tries, cause)
            else:
                self._close(ev, "failed", "its joiner was lost before the ranks paused; the move runs again"
                            if r == rank else "another joiner of the move was lost; the move runs again")
                self._retry_moves.append(RetryMove(r, ev.id, move.from_worker))
            self.ranks[r].state = RankState.RUNNING
            joiner = self.workers.get(move.to_worker or "")
            if joiner is not None and joiner.id != w.id and joiner.role == WorkerRole.RANK:
                joiner.role, joiner.rank = WorkerRole.GONE, None
                if self.scheduler is not None:
                    self._kill(joiner.id)
        self.op = None
        self._retry_lost_moves()

    def _lost_in_place(self, rank: int, cause: str) -> LossStreak | None:
        """Count a loss of `rank`; its streak once it has LOSSES_IN_PLACE losses while the job
        has not advanced a step (a respawn loop helps no one: a crash in native code at the
        same point, a collective whose sizes differ because the ranks' models do), else None."""
        # Where the job stands is where the other ranks stand: the lost rank's own count may be
        # its dead process's (a joiner lost taking it over) or the new one's (lost in its first
        # step), and the streak must not start over between the two.
        others = [i.reached for r, i in self.ranks.items() if r != rank]
        step = min(others or [i.reached for i in self.ranks.values()])
        streak = self._losses_in_place.get(rank)
        if streak is None or streak.step != step:
            streak = self._losses_in_place[rank] = LossStreak(step)
        streak.causes.append(cause[:300])
        return streak if len(streak.causes) >= LOSSES_IN_PLACE else None

    def _end_respawns(self, rank: int, streak: LossStreak) -> None:
        causes = "; ".join(f"{i + 1}. {c}" for i, c in enumerate(streak.causes))
        self._fail(f"rank {rank} was lost {len(streak.causes)} times in a row while the job stood at step "
                   f"{streak.step} ({causes}): each new process failed where the one before it did, which "
                   "another spare will not change. This is the script or its state, not the machine: a "
                   "crash in native code at that point, or a collective whose sizes differ across ranks "
                   "(e.g. a buffer the model registers on its first forward, which a joiner lacks when "
                   "DDP broadcasts buffers: register it in __init__). The rank's output is above.")

    def _advance_collect(self) -> None:
        op = self.op
        if op is None or op.kind != EventKind.UNPLANNED or op.phase not in ("collect", "spares"):
            return
        survivors = [r for r in self.ranks if r not in op.moves]
        if any(r not in op.boundaries for r in survivors):
            return
        if not survivors:
            causes = "; ".join(f"rank {r}: {self.events[mv.event_id - 1].cause}" for r, mv in sorted(op.moves.items()))
            self._lost_everything(op, f"every rank failed at once ({causes}): no copy of the training state survived")
            return
        sharded = self.loop is not None and bool(self.loop.sharded)
        if sharded:
            found = self._snapshot_target(op, survivors)
            if isinstance(found, str):
                self._lost_everything(op, found)
                return
            target = found
        else:
            target = max(op.boundaries[r] for r in survivors)  # type: ignore[assignment]
        op.target, op.target_step = target, target[0]
        # Spares for the dead ranks.
        for rank, move in sorted(op.moves.items()):
            if move.to_worker is None:
                spares = self._hot_first(self._ready_spares())
                if not spares:
                    self._maybe_borrow()
                    if op.phase != "spares":
                        op.enter("spares", self.config.spare_wait_s)
                    msg = (f"rank {rank} lost and no spare is available: the job is paused until a "
                           f"spare starts (free a slot or untaint one), for at most "
                           f"{self.config.spare_wait_s:g}s (--spare-wait)")
                    if op.waiting_message != msg:
                        op.waiting_message = msg
                        self.ranks[rank].state = RankState.WAITING_SPARE
                        self._emit("waiting-for-spare", {"rank": rank, "message": msg})
                    return
                move.to_worker = spares[0].id
                self._assign_joiner(spares[0], rank, op)
        self._enter_forming(op)
        op.waiting_message = None
        op.planned_at = time.time()
        ft = self._formation_timeout(op)
        if sharded:
            self._form_from_snapshots(op, survivors, target, ft)
            return
        sources = [r for r in survivors if op.boundaries[r] == target]
        addrs = [self.workers[self.ranks[r].worker or ""].transfer_addr for r in sources]
        for r in survivors:
            wid = self.ranks[r].worker
            assert wid
            if op.boundaries[r] == target:
                self._post(wid, m.Form(generation=op.generation, pos=target, publish=True,
                                       buddies=self._buddy_addr(r, op), wards=self._ward_addr(r, op),
                                       formation_timeout_s=ft))
            else:
                self._post(wid, m.Form(generation=op.generation, pos=target, fetch_from=addrs,
                                       buddies=self._buddy_addr(r, op), wards=self._ward_addr(r, op),
                                       formation_timeout_s=ft))
        for rank, move in op.moves.items():
            assert move.to_worker
            self._post(move.to_worker, m.Form(generation=op.generation, pos=target, fetch_from=addrs,
                                              lost=self._lost_rank(rank, op), buddies=self._buddy_addr(rank, op),
                                              wards=self._ward_addr(rank, op),
                                              formation_timeout_s=ft))

    def _snapshot_target(self, op: Operation, survivors: list[int]) -> tuple[int, int] | str:
        """The newest boundary every survivor can reach (its state is there, or its own
        snapshot of it) and every lost rank can be rebuilt at: its buddy holds a snapshot of
        it, and for HSDP a rank of another replica group holds its shards there; or why none is."""
        candidates = {op.boundaries[r] for r in survivors}.union(*(op.snapshots.get(r, set()) for r in survivors))
        for pos in sorted(candidates, reverse=True):
            if all(op.boundaries[r] == pos or pos in op.snapshots.get(r, set()) for r in survivors) and \
                    all(self._snapshot_holder(op, survivors, lost, pos) is not None and
                        (not self._hsdp(op, survivors) or self._shard_replicas(op, survivors, lost, pos))
                        for lost in op.moves):
                return pos
        lost = sorted(op.moves)
        if not lost:
            where = ", ".join(f"rank {r} at step {op.boundaries[r][0]}" for r in survivors)
            return (f"after a failed collective the ranks stand at different step boundaries ({where}) and "
                    f"hold no snapshot of a common one (--redundancy {self.config.redundancy}): their sharded "
                    "state cannot be brought together")
        copies = "; ".join(self._copies_text(op, survivors, r) for r in lost)
        if self._hsdp(op, survivors):
            orphaned = [r for r in lost if not any(r in op.replicas.get(s, set()) for s in survivors)]
            if orphaned:
                return (f"rank(s) {', '.join(map(str, orphaned))} lost together with every other replica group's "
                        "copy of their HSDP shards: no boundary can be rebuilt")
            return (f"rank(s) {', '.join(map(str, lost))} lost together with every copy of their rank-local "
                    f"state (random streams, data position; {copies}; --redundancy {self.config.redundancy}): "
                    "no boundary can be rebuilt. Raise --redundancy to survive this many adjacent losses")
        return (f"rank(s) {', '.join(map(str, lost))} lost together with every copy of their FSDP2 shards "
                f"({copies}; --redundancy {self.config.redundancy}): no boundary can be rebuilt. Raise "
                "--redundancy to survive this many adjacent losses")

    def _copies_text(self, op: Operation, survivors: list[int], lost: int) -> str:
        """Where `lost`'s copies were, and why a holder that survived has none: a buddy holds
        its ward's copies only from the first boundary after it took its place (a move's
        joiner) or after the job began."""
        holders = self._buddies(lost)
        text = f"rank {lost}'s copy was on rank(s) {', '.join(map(str, holders)) or 'none'}"
        empty = [b for b in holders if b in survivors and not op.held.get(b, {}).get(lost)]
        if empty:
            text += (f" (rank(s) {', '.join(map(str, empty))} survived but held no copy of it yet: a buddy "
                     "holds its wards' copies only from the first boundary after it took its place in a move, "
                     "or after the job began, and the first had not arrived)")
        return text

    @staticmethod
    def _snapshot_holder(op: Operation, survivors: list[int], lost: int, pos: tuple[int, int]) -> int | None:
        return next((r for r in survivors if pos in op.held.get(r, {}).get(lost, set())), None)

    @staticmethod
    def _hsdp(op: Operation, survivors: list[int]) -> bool:
        """Whether the job's shards are replicated across groups (its buddies hold no shards)."""
        return any(op.replicas.get(r) for r in survivors)

    @staticmethod
    def _shard_replicas(op: Operation, survivors: list[int], lost: int, pos: tuple[int, int]) -> list[int]:
        """Survivors holding `lost`'s very shards, with their own snapshot at `pos`."""
        return [r for r in survivors if lost in op.replicas.get(r, set()) and pos in op.snapshots.get(r, set())]

    def _form_from_snapshots(self, op: Operation, survivors: list[int], target: tuple[int, int], ft: float) -> None:
        """Survivors go back to `target` where they are past it; each joiner fetches its rank's
        snapshot from the buddy holding it."""
        for r in survivors:
            wid = self.ranks[r].worker
            assert wid
            behind = op.boundaries[r] != target
            op.rerun = op.rerun or behind
            self._post(wid, m.Form(generation=op.generation, pos=target, rewind=behind,
                                   buddies=self._buddy_addr(r, op), wards=self._ward_addr(r, op),
                                   formation_timeout_s=ft))
        for rank, move in op.moves.items():
            assert move.to_worker
            holder = self._snapshot_holder(op, survivors, rank, target)
            assert holder is not None
            addr = self.workers[self.ranks[holder].worker or ""].transfer_addr
            shards_from = {r: self.workers[self.ranks[r].worker or ""].transfer_addr
                           for r in self._shard_replicas(op, survivors, rank, target)} \
                if self._hsdp(op, survivors) else {}
            self._emit("rebuilding", {"rank": rank, "step": target[0], "state_from": holder,
                                      **({"shards_from": sorted(shards_from)} if shards_from else {})})
            self._post(move.to_worker, m.Form(generation=op.generation, pos=target, fetch_from=[addr],
                                              snapshot=True, shards_from=shards_from,
                                              buddies=self._buddy_addr(rank, op),
                                              wards=self._ward_addr(rank, op), formation_timeout_s=ft))

    def _lost_rank(self, rank: int, op: Operation) -> m.LostRank:
        """Where the rank-local state of a lost rank lives: its old buddy, and what is held here."""
        buddies = []
        for b in self._buddies(rank):
            if b not in op.moves:
                w = self.workers.get(self.ranks[b].worker or "")
                if w is not None and w.transfer_addr and w.role == WorkerRole.RANK:
                    buddies.append(tuple(w.transfer_addr))
        held = self.ranks[rank].held
        return m.LostRank(buddies=buddies, held=m.BundleText(**held) if held else None)

    def _sharded_block(self) -> str | None:
        """What a lost rank of this job's state is (sharded), or None: with --redundancy 0 it
        cannot be rebuilt.
        Planned and pre-emptive moves are not blocked: the leaver serves its own shards."""
        if self.loop is None or not self.loop.sharded:
            return None
        return (f"this job's {' and '.join(self.loop.sharded)} hold FSDP2/DTensor shards, which exist "
                "on their own rank only, and it runs with --redundancy 0 (no buddy holds a copy)")

    def _stop_sharded(self, cause: str, rank: int | None, worker: Worker | None, block: str) -> None:
        """A sharded rank was lost: end the job loudly, with the loss in the ledger."""
        reached = min((i.reached for i in self.ranks.values()), default=0)
        if rank is not None:
            ev = self._new_event(EventKind.UNPLANNED, cause, rank, worker.slot if worker else "")
            ev.resolved_without_rollback = False
            ev.steps_lost = reached
            self._close(ev, "failed", block)
        if self.op is not None:
            for move in self.op.moves.values():
                self._close(self.events[move.event_id - 1], "failed", block)
            self.op = None
        what = f"rank {rank} was lost ({cause})" if rank is not None else cause
        self._fail(f"{what}: {block}. The job stops here rather than go on without that shard "
                   f"(it had reached step {reached}; restart it from your last checkpoint)")

    def _lost_everything(self, op: Operation, message: str) -> None:
        """No recovery is possible: the events say what was lost, and the job ends now."""
        reached = min((i.reached for i in self.ranks.values()), default=0)
        for move in op.moves.values():
            ev = self.events[move.event_id - 1]
            ev.resolved_without_rollback = False
            ev.steps_lost = reached
            self._close(ev, "failed", message)
        self.op = None
        self._fail(message + f" (the job had reached step {reached}; restart it from your last checkpoint)")
