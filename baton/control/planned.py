"""Planned and pre-emptive moves: the joiners run the script's setup while training goes
on, then every rank agrees on a boundary just ahead, pauses there, the leaver serves its
full state to the joiner, and everyone forms the next generation.

Pausing before the joiners are at their step loop would make the ranks wait for the
joiners' setup (building and placing the model: seconds for a large one) inside the move's
downtime; so a planned move of a model-aware job first prepares (phase `prepare`, until
every joiner said Ready, or --formation-timeout, after which the ranks pause for them
anyway). A no-code joiner is ready once its setup reached the outermost loop around its
step loop (SetupDone): it walks down from there to the rank's place, which the pause decides.

A rank already past the proposed boundary says so and the boundary moves; a move whose
joiner is lost runs again with another spare once the job has re-formed without it.
A rank that does not answer the pause request (asked twice), or stops making progress
short of the boundary while the others wait, is hung: the move becomes a recovery.
"""

from __future__ import annotations

import logging
import math
import time

from baton.control import messages as m
from baton.control.operation import Move, Operation, RetryMove
from baton.control.state import EventKind, RankState, Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")


class PlannedMoves:
    """Mixed into the Orchestrator; runs under its decision lock."""

    def _on_pause_ack(self, w: Worker, rep: m.PauseAck) -> None:
        op = self.op
        if op is None or rep.op != op.id or w.rank is None or op.phase != "agree":
            return
        op.acks[w.rank] = {"ok": rep.ok, "next_step": rep.next_step}
        self._advance_agree()

    def _on_paused(self, w: Worker, rep: m.Paused) -> None:
        op = self.op
        if op is None or rep.op != op.id or w.rank is None:
            return
        op.paused[w.rank] = time.time() - rep.queued_s
        op.target = max(op.target or tuple(rep.pos), tuple(rep.pos))  # type: ignore[assignment]
        self.ranks[w.rank].state = RankState.PAUSED
        self.ranks[w.rank].step = rep.pos[0]
        if op.phase == "pausing":
            op.enter("pausing", self._pause_window())  # progress: the others get a full window again
            self._hand_over_early(op, w.rank, tuple(rep.pos))  # type: ignore[arg-type]
        self._advance_pausing()

    def _hand_over_early(self, op: Operation, rank: int, pos: tuple[int, int]) -> None:
        """A leaver paused at the agreed boundary serves its joiner at once: the copy runs while
        the other ranks finish their last step, where it used to wait for the last of them (the
        ranks' skew after a step's all-reduce: 0.39 s of a 1 GB move's pause on 2 cores). Only
        where it paused at that very boundary, where every rank pauses (a no-code job's too: its
        ranks pause at heads of the step loop, and its joiner walks to the leaver's, which is all
        the walk reads). A failure before the rest pause calls the move off as before: the
        leaver, not yet released, stays as a survivor, and its joiner is stopped."""
        move = op.moves.get(rank)
        if move is None or rank in op.handed_early or pos != (op.target_step, 0):
            return
        op.handed_early[rank] = pos
        self._hand_over(op, rank, move, pos)

    def _hand_over(self, op: Operation, rank: int, move: Move, pos: tuple[int, int]) -> None:
        """The leaver serves its state at `pos`; the joiner fetches it and forms the generation."""
        leaver = self.workers[move.from_worker or ""]
        self._post(leaver.id, m.Publish(generation=op.generation, pos=pos, leave=True))
        assert move.to_worker and leaver.transfer_addr
        self._post(move.to_worker, m.Form(generation=op.generation, pos=pos, fetch_from=[leaver.transfer_addr],
                                          full_state=True, buddies=self._buddy_addr(rank, op),
                                          wards=self._ward_addr(rank, op),
                                          formation_timeout_s=self._formation_timeout(op)))

    def _pause_window(self) -> float:
        """How long ranks may take to reach the agreed step after the last sign of progress.

        A rank that lags the others by more than --op-timeout would already be declared
        hung by their next collective; two of the slowest step times cover a rank that was
        mid-step when it agreed."""
        step = max((i.metrics.get("step_time", 0.0) for i in self.ranks.values()), default=0.0)
        return self._report_window() + 2 * step

    def _expired_agree(self, op: Operation) -> None:
        """Ranks that did not answer the pause request: ask once more, then they are hung."""
        silent = [r for r in self.ranks if r not in op.acks]
        if op.agree_tries == 0:
            op.agree_tries += 1
            op.enter("agree", self._report_window())
            for r in silent:
                self._post(self.ranks[r].worker or "", self._pause(op, r, op.target_step or 0))
            return
        self._lose_hung(silent, f"did not answer the pause request of {op.kind.value} move {op.id} (hung)")

    def _expired_pausing(self, op: Operation) -> None:
        """Ranks that stopped making progress short of the agreed step are hung."""
        self._lose_hung([r for r in self.ranks if r not in op.paused],
                        f"did not reach the agreed step {op.target_step} of {op.kind.value} move {op.id} "
                        "while the others waited (hung)")

    def _on_step_progress(self) -> None:
        """A rank reported a new step: while pausing, that is progress toward the boundary."""
        op = self.op
        if op is not None and op.phase == "pausing":
            op.enter("pausing", self._pause_window())

    def _start_planned(self, ranks: list[int], kind: EventKind, cause: str,
                       joiners: list[Worker] | None = None) -> Operation:
        """Move `ranks` to `joiners` (default: the freshest ready spares), as many as there are."""
        spares = joiners if joiners is not None else self._hot_first(self._ready_spares())
        ranks = ranks[: len(spares)]
        self.generation += 1
        self._op_ids += 1
        op = Operation(id=self._op_ids, kind=kind, generation=self.generation, moves={}, phase="prepare")
        op.enter("prepare", self.config.formation_timeout_s)
        for rank, spare in zip(ranks, spares):
            leaver = self.workers[self.ranks[rank].worker or ""]
            ev = self._new_event(kind, cause, rank, leaver.slot)
            move = Move(rank=rank, event_id=ev.id, from_worker=leaver.id, to_worker=spare.id)
            op.moves[rank] = move
            self._assign_joiner(spare, rank, op)
            self.ranks[rank].state = RankState.MIGRATING
        self.op = op
        if op.moves:
            self._emit("migration-prepare", {"kind": kind.value, "ranks": ranks, "cause": cause})
        else:  # nobody joins (a data path back)
            self._begin_agree(op)
        return op

    def _on_setup_done(self, w: Worker, rep: m.SetupDone) -> None:
        """A no-code joiner's setup is over: it is as ready as it can be before the pause (it
        reaches its step loop only by walking to the rank's place, which its Form names)."""
        if rep.walked_ahead is not None:
            op = self.op
            if op is not None:
                op.walked_ahead[w.id] = rep.walked_ahead
        self._on_joiner_ready(w, rep.setup_s)

    def _on_joiner_ready(self, w: Worker, setup_s: float | None = None) -> None:
        """A joiner reached its step loop: once all of the move's have, the ranks pause (the
        event says so, with the slowest no-code joiner's setup: a model built for minutes shows
        as the wait between `migration-prepare` and `migration`)."""
        op = self.op
        if op is None or op.phase != "prepare" or not any(mv.to_worker == w.id for mv in op.moves.values()):
            return
        op.ready_joiners.add(w.id)
        if setup_s is not None:
            op.joiner_setup_s = max(op.joiner_setup_s, setup_s)
        if all(mv.to_worker in op.ready_joiners for mv in op.moves.values()):
            self._emit("joiners-ready", {"op": op.id, "joiners": sorted(op.ready_joiners),
                                         **({"setup_s": round(op.joiner_setup_s, 3)} if op.joiner_setup_s else {}),
                                         **({"walked_ahead": dict(sorted(op.walked_ahead.items()))}
                                            if op.walked_ahead else {})})
            if self._pre_copies(op):
                self._begin_pre_copy(op)
            else:
                self._begin_agree(op)

    def _pre_copies(self, op: Operation) -> bool:
        """Whether a planned move's joiners follow their leavers before the pause: a model-aware
        job whose replicated state is whole on every rank (DDP), with a replica to check the
        joiner against after the move; not FSDP2's shards."""
        wanted = self.config.pre_copy if op.pre_copy is None else op.pre_copy
        hot = all(mv.to_worker in op.hot_joiners for mv in op.moves.values())  # their mirrors do it already
        return wanted and not hot and self.config.world_size > 1 and self.loop is not None \
            and self.loop.style != "script" and not self.loop.sharded

    def _begin_pre_copy(self, op: Operation) -> None:
        """Each leaver serves its replicated state and then its optimizer steps; each joiner
        takes them while training goes on, and says when it follows within a step (CaughtUp)."""
        op.enter("pre-copy", self.config.formation_timeout_s)
        self._emit("pre-copy", {"op": op.id, "ranks": sorted(op.moves)})
        for move in op.moves.values():
            leaver = self.workers[move.from_worker or ""]
            assert move.to_worker and leaver.transfer_addr
            self._post(leaver.id, m.PreCopy(op=op.id))
            self._post(move.to_worker, m.CatchUp(op=op.id, source=leaver.transfer_addr))

    def _on_caught_up(self, w: Worker, rep: m.CaughtUp) -> None:
        op = self.op
        if op is None or rep.op != op.id or not any(mv.to_worker == w.id for mv in op.moves.values()):
            return
        op.caught_up[w.id] = rep.model_dump(exclude={"type", "op"})
        if not rep.ok:
            self._emit("note", {"message": f"joiner {w.id} cannot follow its leaver ({rep.detail}): the move takes "
                                           "the whole state in its pause"})
        if op.phase == "pre-copy" and all(mv.to_worker in op.caught_up for mv in op.moves.values()):
            self._begin_agree(op)

    def _on_pre_copy_cost(self, w: Worker, rep: m.PreCopyCost) -> None:
        op = self.op
        if op is not None and rep.op == op.id and w.rank in op.moves:
            op.pre_copy_cost[w.rank] = rep.model_dump(exclude={"type", "op"})

    def _expired_pre_copy(self, op: Operation) -> None:
        behind = sorted(str(mv.to_worker) for mv in op.moves.values() if mv.to_worker not in op.caught_up)
        self._emit("note", {"message": f"joiner(s) {', '.join(behind)} did not catch up with their leavers in "
                                       f"{self.config.formation_timeout_s:g}s: the ranks pause for them"})
        self._begin_agree(op)

    def _expired_prepare(self, op: Operation) -> None:
        slow = sorted(mv.to_worker for mv in op.moves.values() if mv.to_worker not in op.ready_joiners)
        self._emit("note", {"message": f"joiner(s) {', '.join(map(str, slow))} still in the script's setup after "
                                       f"{self.config.formation_timeout_s:g}s: the ranks pause for them"})
        self._begin_agree(op)

    def _begin_agree(self, op: Operation) -> None:
        op.enter("agree", self._report_window())
        op.target_step = self._estimate_target()
        causes = sorted({self.events[mv.event_id - 1].cause for mv in op.moves.values()})
        self._emit("migration", {"kind": op.kind.value, "ranks": sorted(op.moves), "cause": "; ".join(causes),
                                 "at_step": op.target_step})
        for r, info in self.ranks.items():
            assert info.worker
            self._post(info.worker, self._pause(op, r, op.target_step))

    @staticmethod
    def _pause(op: Operation, rank: int, at_step: int) -> m.Pause:
        return m.Pause(op=op.id, at_step=at_step, leave=rank in op.moves)

    def _estimate_target(self) -> int:
        """Pick a boundary just ahead of where the fastest rank is now.

        Step reports arrive with heartbeats, so each is extrapolated by its age at the
        rank's step rate (its step period: the step and what the script does between steps),
        plus ~50 ms for the pause to reach the ranks. Aiming short is safe (a rank already
        past answers so and the target moves); aiming long costs steps of waiting for the
        move to start, or the move itself where the job ends first. A rank that had been at
        its step for more than a few periods when it last said so stands at a boundary (an
        evaluation, a checkpoint, a wait), or that said it left its steps (it says so the
        moment it does: Heartbeat.outside_steps), is not extrapolated onward, and the target
        is the boundary after it.
        """
        now = time.time()
        best = 0.0
        for info in self.ranks.values():
            period = info.metrics.get("step_period") or info.metrics.get("step_time", 0.0)
            guess = float(info.step)
            held = info.outside_steps or (info.step_age is not None and period > 0 and info.step_age > 3 * period)
            if period > 0 and info.step_at and not held:
                guess += (now - info.step_at + (info.step_age or 0.0) + 0.05) / period
            best = max(best, guess)
        target = int(math.ceil(best)) + 1
        if self.loop is not None and self.loop.total_steps:  # a stalled rank's guess runs on: never past
            target = min(target, self.loop.total_steps - 1)   # the last boundary a step follows
        return target

    def _advance_agree(self) -> None:
        op = self.op
        assert op is not None
        if len(op.acks) < len(self.ranks):
            return
        late = [a for a in op.acks.values() if not a.get("ok")]
        if late:
            new_target = max(int(a.get("next_step", 0)) for a in op.acks.values()) + 2
            op.target_step = new_target
            op.acks = {}
            op.enter("agree", self._report_window())
            self._emit("retarget", {"op": op.id, "at_step": new_target})
            for r, info in self.ranks.items():
                assert info.worker
                self._post(info.worker, self._pause(op, r, new_target))
            return
        op.enter("pausing", self._pause_window())
        self._advance_pausing()

    def _advance_pausing(self) -> None:
        op = self.op
        assert op is not None
        if op.phase != "pausing" or len(op.paused) < len(self.ranks):
            return
        self._enter_forming(op)
        pos = op.target or (op.target_step or 0, 0)
        op.target_step = pos[0]
        ft = self._formation_timeout(op)
        for r, info in self.ranks.items():
            assert info.worker
            move = op.moves.get(r)
            if move is None:
                self._post(info.worker, m.Form(generation=op.generation, pos=pos, buddies=self._buddy_addr(r, op),
                                               wards=self._ward_addr(r, op),
                                               formation_timeout_s=ft))
                continue
            if op.handed_early.get(r) == pos:
                continue
            if r in op.handed_early:  # cannot happen where it is done (see _hand_over_early); said if it does
                log.warning("rank %s was handed over at %s, but the ranks paused at %s: handing over again",
                            r, op.handed_early[r], pos)
            self._hand_over(op, r, move, pos)

    def _retry_lost_moves(self) -> None:
        if not self._may_start_move() or not self._retry_moves:
            return
        if not self._ready_spares():
            return  # _on_spare_available calls again
        retry, self._retry_moves = self._retry_moves, []

        def kind_and_cause(x: RetryMove) -> tuple[EventKind, str]:
            ev = self.events[x.event_id - 1]
            return ev.kind, ev.cause

        kind, cause = kind_and_cause(retry[0])  # one move at a time: those sharing the first one's
        started = self._start_planned([x.rank for x in retry if kind_and_cause(x) == (kind, cause)],
                                      kind, cause).moves
        self._retry_moves = [x for x in retry if x.rank not in started]

    def _move_off_taint(self, result: dict, ranks: list[int], cause: str) -> dict:
        """A taint's ranks move now in one pre-emptive move when a spare is ready for each and
        nothing else is moving; else later (_pending_taint_moves). `result` is the answer."""
        stuck = {r: self.ranks[r].unmovable for r in ranks if self.ranks[r].unmovable}
        if stuck:  # it stays on the tainted slot: moving it would change the run's numbers
            ranks = [r for r in ranks if r not in stuck]
            result["unmovable"] = stuck
            for r, why in stuck.items():
                self._emit("move-refused", {"rank": r, "cause": cause, "detail": why})
        if ranks and self._finishing():
            ranks, result["note"] = [], "training is finishing (a rank has run its last step): nothing moves"
        result["moving_ranks"] = ranks
        if ranks and self.exit_code is None:
            if self.op is None and len(self._ready_spares()) >= len(ranks):
                result["op"] = self._start_planned(ranks, EventKind.PREEMPTIVE, cause).id
            elif len(ranks) == 1:
                result["note"] = "rank will move when a spare is free and no other migration runs"
            else:
                result["note"] = (f"{len(ranks)} rank(s) will move when enough spares are free and no other "
                                  "migration runs")
        return result

    def _pending_taint_moves(self) -> None:
        """Ranks on tainted slots move, those sharing a reason (a node's slots) in one move."""
        if not self._may_start_move() or not self._ready_spares():
            return
        held = {w.rank: w.slot for w in self.workers.values()
                if w.role == WorkerRole.RANK and w.rank is not None and self.ranks[w.rank].worker == w.id
                and not self.slots[w.slot].healthy and not self.ranks[w.rank].unmovable}
        if held:
            reason = self.slots[held[min(held)]].taint
            ranks = sorted(r for r, slot in held.items() if self.slots[slot].taint == reason)
            self._start_planned(ranks, EventKind.PREEMPTIVE, f"taint: {reason}")
