"""The model-aware runtime, driven by the script's own loop instead of `job.steps()`.

The protocols are the same (the live group, DDP's comm hook, the bundle captured at the
syncing backward and pushed to the buddies, the hot-path boundary check, the planned
hand-over, finishing): what differs is who says where the boundaries are. Here the
controller does, from the instrumented loops: the step loop is known only at the first
`optimizer.step()`, which runs inside the first step; each later head of the step loop
whose previous iteration committed (an optimizer step ran) is a boundary; what runs
after the step loop (the evaluation, the checkpoint) is a region (`region`): its
collectives are the script's, recorded, and retried in place after a lost peer.

At a boundary where a move may happen, the rank's own state also holds `script`: where
each loop of the nest stands and what it carries (`controller.script_section`), which a
successor walks down to before it takes the rank over (`join_at_head`).

Before the step loop is found, DDP reduces gradients and the script's collectives run
like torchrun's: nothing is captured, and nothing can move yet.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from baton import selfcost
from baton.control import messages as m
from baton.transfer import FetchStats, TransferError
from baton.transfer.bundles import Bundle, encode_frame
from baton.transfer.server import FETCH, FETCH_OWN, FETCH_TAIL
from baton.worker.bundle import fetch_ward_bundle
from baton.transparent import tail
from baton.transparent.region import Region, catch_up, load_small_state, small_state
from baton.transparent.sites import SITES
from baton.transparent.tail import StepRecord
from baton.worker import discover, shards, verify
from baton.worker.collectives import Record, Recorded, same_everywhere
from baton.worker.group import CollectiveFailure, LiveGroup
from baton.worker.exit import exit_quietly
from baton.worker.job import EXIT_PEER_LOST, Step
from baton.worker.prefetch import Fetch
from baton.worker.capture import bundle_text
from baton.worker.runtime import Runtime
from baton.worker.verify import Divergence
from baton.worker.tracked import UsageError

log = logging.getLogger("baton.worker")

REGION = "region"  # scope between the step loop's exit and its next head
# A head's frame describes its boundary after any capture made for it in the step before; at
# one position the frames that follow (the step loop's exit, the next head after the region)
# count on from there, so the latest is the newest.
HEAD_SEQ = 1 << 30


@dataclass
class _Replay:
    """A successor running again the step its predecessor was lost after (tail), or a
    survivor the step it abandoned after the others completed it (`formed`)."""

    cmd: m.Form
    stats: FetchStats
    t0: float
    t_fetched: float
    replicated: dict[str, Any]  # the survivors' state after the step: what the optimizer steps give
    patched: list[Any] = field(default_factory=list)  # the optimizers whose step() takes it instead
    stepped: int = 0
    joined: bool = False  # where the survivors stood, in a collective after the step (`_join_replayed`)
    # The survivors' record of the region after the step loop, where they went on into it
    # from the next head (the step was the loop's last): the successor joins them there.
    region: dict[str, Any] | None = None
    formed: bool = False  # a survivor: in the generation already, it joins no one


@dataclass
class _Abandoned:
    """What a survivor fetched with the others' result of the step it abandoned after they
    completed it: their record of that step, to run it again from its head (`absorb`)."""

    cmd: m.Form
    tail: dict[str, Any] | None  # their StepRecord of the step, served (None: none kept)
    replicated: dict[str, Any]  # their state after the step: what its optimizer steps give
    region: dict[str, Any] | None  # their record of the region, where their step loop ended after that step


_FETCHING = "fetching"  # fetch_for_join's state: the replicas' part, still arriving (a prefetch.Fetch)


class PeerLost(BaseException):
    """Raised into the script when it goes on after a lost peer (its own `except Exception`
    took the collective's error): a BaseException, so that the loop's head takes it."""


class ScriptRuntime(Runtime):
    script_ran_before_discovery = False
    # A move's state check digests the large tensors on a thread while the next step runs, as
    # the model-aware runtime's; only where every rank of the generation stands at a head
    # (verify_state): its comparison then waits for the step's first optimizer step, or the
    # next head, the loop's exit, the script's end, which every rank reaches in that order.
    defer_checks = True

    def __init__(self, *args: Any, **kwargs: Any):
        # Before the runtime's own: its control thread may hand a Form to `_fetch_for` at once
        self.tail_copies = os.environ.get("BATON_TAIL_COPIES", "1") != "0"
        self._tail_fetch: Fetch | None = None  # a rebuild's fetch of the step it runs again (`_fetch_for`)
        super().__init__(*args, **kwargs)
        discover.listeners.append(self._created)
        self.current: Step | None = None
        self.shard_roots: list[Any] = []  # modules the script gave fully_shard(), in order (intercept)
        self.script_section: Callable[[], dict[str, Any]] = lambda: {}  # set by the controller
        self.settle_setup: Callable[[], Any] = lambda: None  # the controller's: a joiner's late setup check
        self.setup_left_out_bytes = 0  # a joiner's: its setup's initialisation left out (deferred_init)
        self.head_state: dict[str, Any] | None = None  # this rank's own state at the running step's head
        self.region: Region | None = None  # since the step loop's latest exit (kept through the next steps)
        # What this rank records of each step (tail): the running one's, and the one before,
        # kept until the running one commits (a rank lost after that one is rebuilt from it).
        self.step_record: StepRecord | None = None
        self.prev_record: StepRecord | None = None
        self.form_at = 0.0  # when a joiner's Form arrived (its part of the pause begins: `_walk_began`)
        self.walked_ahead: int | None = None  # a joiner: the step-loop iteration its setup walked ahead to
        self.copies = tail.CopyPool()  # the tensors of records dropped, for the next records' copies
        self.replay: _Replay | None = None  # a successor running again the step its predecessor was lost after
        self.in_tail = False  # recovering in a collective after a step's optimizer step
        self.exit_join: _Replay | None = None  # ran the step again; the survivors stand past the loop's exit
        self.abandoned: _Abandoned | None = None  # the others completed the step this rank abandoned
        self.exit_expected = False  # a new generation's others stand past the loop's exit at this head
        self._frame_at: tuple[Any, int] = ((-1, 0), HEAD_SEQ)  # the latest frame's position and sequence
        self._head_captured = True  # at_pos describes the head the loop stands at (at_head resets it)
        self.went_back = False  # this head's recovery took the rank back to the step before's (`_went_back`)

    # ---------------------------------------------------------------- the loop, as the script runs it
    def _prepare_loop(self, info: m.LoopInfo) -> None:
        """What enter_loop() sets up, for a loop found (or, in a joiner, reached) while running."""
        self.loop_started = True
        self._track_sharded_models()
        # The lost-peer refusal first: before baton's own wait for its buddies' snapshots.
        sharded = self._prepare_tracking("a script with no code change must create it after its process group",
                                         first_pre_hook=self._before_optimizer_step_script)
        self.loop = info.model_copy(update={"sharded": sharded})

    def start_script_loop(self, step_loop: str, nest: list[str]) -> None:
        """At the first optimizer.step(), inside the first step: from here on, the step loop's
        heads are boundaries."""
        self._prepare_loop(m.LoopInfo(style="script", total_steps=0, step_loop=step_loop, nest=nest))
        assert self.loop is not None
        start_bundle, start_rng = self._capture_at(self.pos)
        self.at_pos, self.at_pos_rng = start_bundle, start_rng
        self.ctl.report_now(m.Ready(loop=self.loop, bundle=bundle_text(start_bundle), setup=self.setup_text()))
        self.warned_no_capture = True  # the first step's backward ran before the loop was known
        self.small = self.tracked.snapshot_small()
        self.scope, self.committed, self.seq, self.capture = "step", False, 0, None
        self.tracked.scope = "step"
        self._step_t0 = time.perf_counter()
        self._busy_s = None
        self.current = Step(self, 0, None, 0)
        if self._snapshotting():  # the first step's start, for the buddies (its optimizer step waits for them)
            self._snapshot()

    def _track_sharded_models(self) -> None:
        """The roots among the modules fully_shard() was applied to: the script's sharded models,
        named in the order they were sharded, as every rank and a joiner shard them."""
        inside = {id(sub) for m_ in self.shard_roots for sub in m_.modules() if sub is not m_}
        roots = [m_ for m_ in dict.fromkeys(self.shard_roots) if id(m_) not in inside]
        for i, model in enumerate(roots):
            self.tracked.add("model" if i == 0 and "model" not in self.tracked.objects else f"sharded{i}", model)

    def at_head(self) -> bool:
        """A head of the step loop, before its next item is drawn. Whether a step begins here
        (not where a step accumulating gradients over several iterations goes on)."""
        if self.expecting_exit():
            self.not_at_the_exit()
        if self.replay is not None:  # a successor running its predecessor's last step again
            if not self.replay.stepped:  # accumulating, or GradScaler skipped the step: it goes on
                return False
            self._end_replay()
            self._start_step()
            return True
        if self.region is not None and self.region.active:
            self.region.active = False
            self._join_if_deferred()  # a successor that ran the region: the survivors stand here
        if self.scope == "step":
            if not self.committed:
                return False  # no optimizer step yet (gradient accumulation): the same step goes on
            self._complete_step()
        self._head_captured = False  # captured once a command is seen here (_on_attention)
        head = self.pos
        while not self._boundary():
            pass
        if self.pos[0] < head[0]:
            self._start_step(self._went_back(head, "at a head"))
            return True
        self._start_step()
        return True

    def _went_back(self, head: tuple[int, int], where: str) -> dict[str, Any]:
        """The recovery took this rank from `head` back to the head of the step before (a
        sharded rank was lost after its last collective of that step, its shards there only
        in its buddy's copy: every rank runs the step again, this one from its own copy,
        which the recovery loaded). Its own state there, where the script stood included: the
        controller hands the loop that step's items and variables again (`went_back`)."""
        state = self.at_pos.state() if self.at_pos is not None else {}
        if head[0] - self.pos[0] != 1 or "script" not in state:
            self.stop(f"rank {self.rank}: the recovery took this rank back from step {head[0]} to step "
                      f"{self.pos[0]}, where its place in the script is not known. The job stops here: restart it "
                      "from your own checkpoint.")
        self.went_back = True
        log.info("rank %d, %s: back from the head of step %d to the head of step %d (a sharded rank was lost after "
                 "its last collective of that step): running it again", self.rank, where, head[0], self.pos[0])
        return dict(state)

    def _start_step(self, state: dict[str, Any] | None = None) -> None:
        """Begin the step at this head: this rank's own state here, where the script stands
        included, becomes its record of the boundary and goes to its buddies, ahead of the
        step's own capture (a buddy holding that one holds this one: one ordered connection)."""
        if state is None:
            state = self._own_state(self.pos)
            state["script"] = self.script_section()
        self.head_state = state
        self._record_step()
        frame = encode_frame(self.rank, self.pos, self.group.generation, self._next_seq(), state)
        self.at_pos, self.at_pos_rng = frame, state["rng"]
        if self.wards and not self.joiner:  # a successor not yet joined has no generation to push in
            self.pusher.push(frame)
        self.current = self._begin_step(Step)

    def absorb(self, in_step_loop: bool, exc: BaseException) -> bool:
        """A lost peer reached the loop's head: recover, then run the same iteration again from
        its head's state (the controller hands the loop's variables back). False: not a lost
        peer, or not one this version can absorb there (the exception goes on)."""
        if not self.loop_started or isinstance(exc, (UsageError, KeyboardInterrupt, SystemExit, GeneratorExit)) or \
                not self.is_peer_failure(exc):
            return False
        if self.expecting_exit():
            self.not_at_the_exit()
        if not in_step_loop or self.scope != "step" or self.head_state is None:
            raise Divergence(f"rank {self.rank}: a peer was lost ({type(exc).__name__}: {exc}) outside a step of the "
                             "script's step loop (in its evaluation or checkpoint after the loop, say); this version "
                             "recovers from losses inside steps only. The job stops here: restart it from your own "
                             "checkpoint.")
        head, state = self.pos, self.head_state
        self.abandoned = None
        self.recover(in_step=True, error=f"{type(exc).__name__}: {exc}")
        if self.pos[0] < head[0]:
            self._start_step(self._went_back(head, "in a step"))
            return True
        if self.pos != head:
            self._run_abandoned_step_again(head, state)
            return True
        self._start_step(state)
        return True

    def _fetch_completed(self, cmd: m.Form, target: tuple[int, int]) -> dict[str, Any]:
        """As the model-aware runtime's, with the others' record of that step: what this
        rank's loop carried after it was never shared, so it runs the step again
        (`_run_abandoned_step_again`)."""
        completed = super()._fetch_completed(cmd, target)
        served = None
        try:
            fetched, _ = self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s,
                                           kind=FETCH_TAIL)
            served = fetched["tail"]
        except TransferError as exc:
            log.info("no record of step %d to run again: %s", target[0] - 1, exc)
        region = completed.get("region")
        ended = region is not None and tuple(region["pos"]) == tuple(target)
        self.abandoned = _Abandoned(cmd, served, completed["replicated"], region if ended else None)
        return completed

    def _run_abandoned_step_again(self, head: tuple[int, int], state: dict[str, Any]) -> None:
        """The others completed step N, which this rank abandoned after its last collective
        (the group failed before its optimizer step): recovery gave it their result, but what
        its loop carried after the step was never shared. It runs the step again from its
        head, already in the new generation, as a successor runs its predecessor's last step
        (`_replay_step`): the collectives answered from the others' record of the step, the
        optimizer steps replaced by their result. It goes on live at head N+1."""
        got, self.abandoned = self.abandoned, None
        served = got.tail if got is not None else None
        why = ("no other rank kept a record of it" if served is None or served["params"] is None or
               tuple(served["pos"]) != tuple(head) else
               f"it ran {served['not_replayable']}, whose result differs by rank" if served["not_replayable"] else "")
        if why or got is None or served is None:
            raise Divergence(f"rank {self.rank}: the others completed step {head[0]}, which this rank abandoned "
                             f"after its last collective, and it cannot run that step again ({why}): what its "
                             "loop carried after the step was never shared. The job stops here: restart it from "
                             "your own checkpoint.")
        now = time.perf_counter()
        # no join (rec.join): this rank is in the generation; past the record it runs live
        self._run_again(StepRecord.from_served(served), state,
                        _Replay(got.cmd, FetchStats(), now, now, got.replicated, region=got.region, formed=True))
        log.info("rank %d: the others completed step %d, which this rank abandoned after its last collective: "
                 "running it again from its head with their record of it", self.rank, head[0])

    def recover_in_place(self, exc: BaseException) -> None:
        """A survivor whose collective failed where its state cannot go back to a head (in a
        region, or after a step's optimizer step): recover where it stands; the collective is
        then issued again (collectives.RecordingGroup). After an optimizer step its
        parameters hold that step: it reports the next position, where a successor runs the
        step again up to here (tail), and completes the step at the next head as usual."""
        scope, n = self.scope, self.pos[0]
        in_tail = scope == "step"
        if in_tail:
            self.pos = (n + 1, 0)
        self.in_tail = in_tail
        try:
            self.recover(in_step=False, error=f"{type(exc).__name__}: {exc}")
        except Divergence as stop:
            self.stop(str(stop))
        finally:
            self.in_tail = False
        if in_tail:
            self.pos = (n, 0)
            self.committed = True
        self.scope = self.tracked.scope = scope

    def _refuse_after_failure(self, *_: Any) -> None:
        """No optimizer step after a lost peer: the script took the collective's error itself."""
        if self.loop_started and not self.loading and (self.group.failed.is_set() or
                                                       self.ctl.abort_generation is not None):
            raise PeerLost(f"a peer was lost before rank {self.rank}'s optimizer step ({self.group.last_error})")

    def at_exit(self, section: dict[str, Any]) -> None:
        """The step loop ended (its iterator ran out, or a break): the region after it begins.
        This rank's own state here, with where the script stands (`section`), goes to the
        buddies: a successor replaying the region starts from it."""
        failing = sys.exc_info()[1]
        if self.scope == "step" and self.committed:
            self._complete_step()
        if failing is None:
            self._finish_check_before("the region after the step loop")  # its evaluation, its checkpoint
        # A step begun at the last head, where the iterator then ran out, never ran.
        self.scope = self.tracked.scope = REGION
        self.ctl.outside_steps(True)
        self.current = None
        self.region = Region.at_exit(self.pos, self.tracked)
        if self.exit_join is not None and not self.exit_join.formed:
            self._join_at_exit(self.exit_join)
            return
        self.exit_join = None  # a survivor that ran its abandoned step again: it goes on as the others did
        self.exit_expected = False
        if failing is not None and self.is_peer_failure(failing):
            # Left by the exception of a lost generation (a peer lost, or this rank aborted or
            # being killed: a hung rank's DataLoader workers die first), not a way the script
            # ends its loop: no record of it goes to the buddies, so a successor takes over from
            # this rank's last head instead of refusing to leave the loop "the same way".
            return
        state = self._own_state(self.pos)
        state["script"] = section
        if self.wards:
            self.pusher.push(encode_frame(self.rank, self.pos, self.group.generation, self._next_seq(), state))

    def _finish_check_before(self, where: str) -> None:
        """A move's deferred state check ends here, outside any step (the loop's exit, the
        script's end): a peer lost in its comparison cannot be absorbed there."""
        if self.pending_check is None:
            return
        try:
            self.finish_pending_check()
        except (CollectiveFailure, dist.DistError) as exc:
            self.stop(f"rank {self.rank}: a peer was lost in the state check after a move, before {where} "
                      f"({type(exc).__name__}: {exc}): outside a step, this version cannot absorb it. The job "
                      "stops here: restart it from your own checkpoint.")

    def _record_step(self) -> None:
        """The record of the step beginning here (tail): a new position rotates the records;
        the same one again (a re-run after a recovery) starts its record afresh."""
        if not self.tail_copies or self.tracked.sharded:
            return
        if self.step_record is None or self.step_record.pos != self.pos:
            self.copies.give_back(self.prev_record)
            self.prev_record = self.step_record
        else:
            self.copies.give_back(self.step_record)
        self.step_record = StepRecord(pos=self.pos, small=small_state(self.tracked),
                                      forward_sync=[bool(d.require_forward_param_sync) for d in self.tracked.ddps])

    @selfcost.counted
    def _before_optimizer_step_script(self, *args: Any) -> None:
        """Before each optimizer step: none after a lost peer; the first one of a step copies
        the parameters as they were at its head (tail). The step before's record is then no
        longer needed: every rank reached this step's gradients, so none was lost after it.
        Its tensors take the copy (written a step ago, where the pool's others are two steps
        old: fewer of their lines have left the caches; 2M parameters, 0.65 ms against 0.8)."""
        self._refuse_after_failure(*args)
        rec = self.step_record
        if rec is not None and rec.params is None and self.scope == "step" and not self.loading:
            self.copies.give_back(self.prev_record)
            self.prev_record = None
            rec.params = tail.param_copies(self.tracked, self.copies)

    def _next_seq(self) -> int:
        pos, seq = self._frame_at
        self._frame_at = (self.pos, seq + 1 if pos == self.pos else HEAD_SEQ)
        return self._frame_at[1]

    def _complete_step(self) -> None:
        step = self.current
        assert step is not None
        step.completed = True
        self._end_step(step)
        self.current = None

    def _on_attention(self) -> None:
        """A move may stop at this head: the state it hands over is this head's, with where
        the script stands (the step's own capture, at its backward, holds no `script`). Taken
        here, under the boundary's decision, not in a look at `attention` before it: a pause
        for this very head accepted in between would have handed over the step's capture,
        and the joiner stopped the job ("its place in the script was never shared")."""
        if not self._head_captured:
            self.at_pos, self.at_pos_rng = self._capture_head()
            self._head_captured = True

    def _capture_head(self) -> tuple[Bundle, dict[str, Any]]:
        """This rank's own state at a head of the step loop, with where the script stands."""
        state = self._own_state(self.pos)
        state["script"] = self.script_section()
        return Bundle.of(self.rank, self.pos, self.group.generation, 0, state), state["rng"]

    @staticmethod
    def _local_digests(bundle_state: dict[str, Any]) -> dict[str, int]:
        """As the model-aware runtime's, without where the script stands: the successor's loop
        variables are handed back after its state is checked, when the loop head rebinds them."""
        return Runtime._local_digests({k: v for k, v in bundle_state.items() if k != "script"})

    def finish_script(self) -> None:
        """The script is done training (it destroyed its process group, or is exiting)."""
        if self.finished:
            return
        self._join_if_deferred()
        self.settle_setup()  # a joiner that made no record since it joined: its setup checked all the same
        if self.scope == "step" and self.committed:
            self._complete_step()
        self._finish_check_before("the script's end")  # nothing finishes unchecked
        self.loop_done = True
        self.scope = self.tracked.scope = None
        self.finish()

    # ---------------------------------------------------------------- a successor, at its rank's place
    def fetch_for_join(self) -> tuple[m.Form, dict[str, Any], FetchStats]:
        """A joiner: the Form naming its target and the state it takes over (blocks until both):
        its predecessor's own (a planned move), or the replicas' and its buddies' record of the
        lost rank at the target (a rebuild). In a rebuild only the rank's own record is here
        when this returns, which is what the walk to its place reads; the replicas' state
        arrives meanwhile, and `fetched_state` waits for it where the joiner loads it. (A
        rebuild's Form comes with its assignment, and its fetch begins then, while the
        script sets up: prefetch.py. At 8M parameters that took a kill's ledger downtime
        from 0.29-0.31 s to 0.18-0.22 s where the rank was lost at a head.)"""
        cmd = self.wait_for(m.Form)
        self.form_at = time.perf_counter()
        fetched = self.prefetch.take(cmd) if self.prefetch is not None else None
        if fetched is None and not (cmd.full_state or cmd.snapshot):
            state, stats = {_FETCHING: Fetch(cmd, self._fetch_for, f"baton-join-fetch-{cmd.generation}")}, FetchStats()
        elif fetched is None and cmd.full_state and not cmd.snapshot:
            # A planned move: the predecessor's own record now (the walk reads it), the rest
            # while the script walks to the rank's place (asked for first: its connection and
            # manifest then overlap this fetch, ~20 ms of the pause).
            rest = Fetch(cmd, self._fetch_for, f"baton-join-fetch-{cmd.generation}")
            try:
                state, stats = self._fetch_state(cmd.fetch_from, cmd.generation,  # type: ignore[arg-type]
                                                 tuple(cmd.pos), cmd.formation_timeout_s, kind=FETCH_OWN)
            except BaseException:
                rest.done.wait()  # not left fetching into this process while it leaves
                raise
            state[_FETCHING] = rest
        else:
            state, stats = fetched if fetched is not None else self._fetch_for(cmd)
        if not (cmd.full_state or cmd.snapshot):
            state["bundle"] = self._lost_bundle(cmd.lost, tuple(cmd.pos))  # type: ignore[arg-type]
            if "script" not in state["bundle"]:
                stats = self._tail_bundle(cmd, state, stats)
        if "script" not in state["bundle"]:
            raise Divergence(f"rank {self.rank}: the rank this process replaces was lost where its place in the "
                             f"script was never shared (step {cmd.pos[0]}: before its step loop's first boundary, or "
                             "after its last collective of a step and before the next): it cannot be rebuilt bit "
                             "for bit. The job stops here: restart it from your own checkpoint.")
        return cmd, state, stats

    def latest_record(self) -> dict[str, Any] | None:
        """A planned move's joiner: its rank's own record at its newest head, as its buddies
        hold it while it trains on (None where it has none to walk ahead to). A capture of a
        step's end carries no place in the script: the head before it does."""
        assert self.assignment is not None
        for addr in self.assignment.walk_from:
            limit: tuple[int, int] = (2**62, 0)
            try:
                for _ in range(3):
                    frame = fetch_ward_bundle(tuple(addr), self.token, self.rank, limit, timeout=5.0)
                    if frame is None:
                        break
                    state = frame.state()
                    if "script" in state:
                        return state
                    limit = (frame.pos[0] - 1, 2**30)
            except (OSError, TransferError) as exc:
                log.info("rank %d's newest record not read from %s (%s): walking in the pause", self.rank, addr, exc)
        return None

    @staticmethod
    def fetched_state(state: dict[str, Any], stats: FetchStats) -> tuple[dict[str, Any], FetchStats]:
        """The whole state to take over: what `fetch_for_join` still fetched, with what this
        process found meanwhile (the rank's own record, the step to run again)."""
        fetching = state.pop(_FETCHING, None)
        if fetching is None:
            return state, stats
        fetched, more = fetching.result()
        fetched.update(state)
        return fetched, more.plus(stats)

    def leave_to_another_spare(self, exc: BaseException) -> NoReturn:
        """A joiner whose state could not be fetched (its sources lost) before it took its
        rank's place: not the script's error. It exits as a process lost to a failure, and
        the orchestrator gives the rank to another spare."""
        print(f"[baton] rank {self.rank}: a joiner's state could not be fetched ({type(exc).__name__}: {exc}); "
              "this process leaves the rank to another spare", file=sys.__stderr__, flush=True)
        exit_quietly(EXIT_PEER_LOST)

    def setup_done(self) -> None:
        """The joiner's script reached its step loop (the first head of its walk to its rank's
        place): its setup ends here, before it waits for its target and state, which the
        ledger counts apart (a planned move's joiner waits for the ranks to reach it)."""
        if not self.setup_s:  # not taken yet (at the walk's first head, or at its place)
            self.setup_s = time.perf_counter() - self.assigned_at
            # A planned move pauses the ranks only now (a rebuild's orchestrator ignores it)
            self.ctl.report(m.SetupDone(setup_s=round(self.setup_s, 4), walked_ahead=self.walked_ahead))

    def _walk_began(self) -> float:
        """Where a joiner's part of the pause began: its Form, or the end of its setup (a
        rebuild's Form comes with its assignment, before the setup the ledger counts apart)."""
        return max(self.form_at, self.assigned_at + self.setup_s)

    def _setup_in_pause(self) -> dict[str, float]:
        """The joiner's first phase, where training waited for its script's setup (a rebuild's;
        a planned move's ranks pause once it is done): the ledger's `rest` is then messages only."""
        waited = self.setup_waited_for()
        return {"setup": waited} if waited else {}

    def _take_place(self) -> None:
        """A joiner at its rank's place in the script: its step loop's hooks set up, the
        orchestrator told (its setup time too), the prefetching of its state over."""
        assert self.assignment is not None and self.assignment.loop is not None
        self.setup_done()
        self._lift_fence()
        self._prepare_loop(self.assignment.loop)
        assert self.loop is not None
        self.ctl.report(m.Ready(loop=self.loop, joined=True))  # ahead of its Formed (one outbox)
        if self.prefetch is not None:
            self.prefetch.close()
            self.ctl.watch_forms(None)

    def _fetch_for(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats]:
        """As the model-aware runtime's; for a rebuild, the step to run again too, where the
        lost rank's own record says it was lost after that step's last collective: fetched
        beside the replicas' state, while the script sets up (prefetch), rather than once the
        joiner's walk found it missing (0.10-0.15 s of a kill's downtime at 8M parameters)."""
        if cmd.lost is not None and not (cmd.full_state or cmd.snapshot) and self.tail_copies and \
                (self._tail_fetch is None or self._tail_fetch.form != cmd):
            self._tail_fetch = Fetch(cmd, self._fetch_tail_if_lost_there, f"baton-tail-fetch-{cmd.generation}")
        return super()._fetch_for(cmd)

    def _fetch_tail_if_lost_there(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats]:
        """The survivors' record of the step before `cmd`'s target, where the lost rank's own
        record of the target holds no place in the script (lost after that step's last
        collective); ({}, no bytes) where it does. Raises TransferError as the fetch does."""
        try:
            if "script" in self._lost_record(cmd.lost, tuple(cmd.pos)):  # type: ignore[arg-type]
                return {}, FetchStats()
        except TransferError:
            pass  # fetch_for_join finds no record either, and says so
        # not into the memory mapped ahead, which the replicas' state, fetched meanwhile, is for
        return self._fetch_state(cmd.fetch_from, cmd.generation, tuple(cmd.pos),  # type: ignore[arg-type]
                                 cmd.formation_timeout_s, kind=FETCH_TAIL, pooled=False)

    def _tail_fetched(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats]:
        """The step to run again, as `_fetch_for` began fetching it for this very Form, or
        fetched now."""
        started, self._tail_fetch = self._tail_fetch, None
        if started is not None and started.form == cmd:
            fetched = started.result()
            if "tail" in fetched[0]:
                log.info("generation %s: the step to run again was fetched beside the state (%.3fs)",
                         cmd.generation, started.seconds)
                return fetched
        return self._fetch_state(cmd.fetch_from, cmd.generation, tuple(cmd.pos),  # type: ignore[arg-type]
                                 cmd.formation_timeout_s, kind=FETCH_TAIL)

    def _tail_bundle(self, cmd: m.Form, state: dict[str, Any], stats: FetchStats) -> FetchStats:
        """The rank was lost after its last collective of the step before the target: its
        head there, to run that step again from, where the survivors recorded it (tail),
        fetched beside the state (`_fetch_for`), or now. The fetch statistics, with its bytes."""
        target = tuple(cmd.pos)
        before = (target[0] - 1, 0)
        try:
            fetched, more = self._tail_fetched(cmd)
        except TransferError as exc:
            log.info("no record of step %d to run again: %s", before[0], exc)
            return stats
        stats = stats.plus(more)
        served = fetched["tail"]
        if served is None or tuple(served["pos"]) != before or served["params"] is None:
            return stats
        if served["not_replayable"]:
            raise Divergence(f"rank {self.rank} was lost after its last collective of step {before[0]}, which ran "
                             f"{served['not_replayable']} (its result differs by rank): that step cannot be run "
                             "again here. The job stops here: restart it from your own checkpoint.")
        try:
            head = self._lost_bundle(cmd.lost, before)  # type: ignore[arg-type]
        except TransferError:
            return stats
        if "script" in head:
            state["bundle"], state["replay_tail"], state["tail"] = head, True, served
            log.info("rank %d was lost after its last collective of step %d: running that step again",
                     self.rank, before[0])
        return stats

    def join_at_head(self, cmd: m.Form, state: dict[str, Any], stats: FetchStats, t0: float) -> None:
        """The joiner reached its rank's step loop head (the controller walked it there): take
        the state over, form the generation with the others, check, and report (as _join())."""
        if state.get("replay_tail"):
            self._replay_step(cmd, state, stats, t0)
            return
        t_arrived = time.perf_counter()
        self._take_place()
        if self.tracked.sharded:
            shards.prepare(self.tracked)
        gen, target = cmd.generation, tuple(cmd.pos)
        t_fetched = time.perf_counter()
        try:
            # Copied, not adopted (adopt.py): a no-code joiner whose parameters took the arrived
            # memory ran its steps ~10x slower (status step_time, test_data_paths; cause not found).
            # What it copied from goes back to the kernel (it held a second copy for good).
            self._load_replicated(state)
            self._release_received(state)
            sharded_expected = state.get("sharded_digest")
            if cmd.snapshot:
                sharded_expected = verify.combined(shards.digests(state["sharded"]))
            self._load_sharded(state)
            self.loop = self.loop.model_copy(update={"start_step": int(state["loop_start"])})
            bundle_state = state["bundle"]
            expected = state.get("digest")
            self._stand_at(target, gen, bundle_state)  # type: ignore[arg-type]
            self.params_step = target[0]
            self._clear_abort(gen)
            t_loaded = time.perf_counter()
            self.form(cmd)
            t_formed = time.perf_counter()
            self.verify_state(gen, expected, bundle_state=bundle_state, sharded_expected=sharded_expected,
                              defer=self.defer_checks)
        except (CollectiveFailure, dist.DistError, TransferError, OSError) as exc:
            # The target cannot move under a successor that has already walked to it: stop loudly.
            raise Divergence(f"rank {self.rank}: joining generation {gen} failed after catching up to "
                             f"{target} ({exc}); the job cannot go on bit for bit") from exc
        t_verified = time.perf_counter()
        log.info("joined generation %s at %s: fetch and walk %.3fs (%d bytes), place %.3fs, load %.3fs, form %.3fs, "
                 "verify %.3fs", gen, self.pos, t_arrived - t0, stats.bytes, t_fetched - t_arrived,
                 t_loaded - t_fetched, t_formed - t_loaded, t_verified - t_formed)
        phases = {**self._setup_in_pause(), "walk_and_fetch": t_arrived - self._walk_began(),
                  "place": t_fetched - t_arrived, "load": t_loaded - t_fetched, "form": t_formed - t_loaded,
                  "verify": t_verified - t_formed}
        self.ctl.report(m.Formed(generation=gen, pos=self.pos, bytes=stats.bytes, seconds=round(stats.seconds, 4),
                                 setup_s=round(self.setup_s, 4), setup_left_out_bytes=self.setup_left_out_bytes,
                                 fetch_wait_s=round(t_fetched - t0, 4),
                                 phases=_rounded(phases)))
        self.joiner = False
        self._start_step(dict(bundle_state))

    def _replay_step(self, cmd: m.Form, state: dict[str, Any], stats: FetchStats, t0: float) -> None:
        """At the lost rank's head N (target N+1): its state there, the step's collectives
        answered from the survivors' record, its optimizer steps replaced by the survivors'
        result; it joins at head N+1 (`_end_replay`)."""
        self._take_place()
        t_fetched = time.perf_counter()
        rec = StepRecord.from_served(state["tail"])
        self._load_replicated(state)
        self.loop = self.loop.model_copy(update={"start_step": int(state["loop_start"])})
        region = state.get("region")
        rec.join = self._join_replayed
        self._run_again(rec, state["bundle"], _Replay(
            cmd, stats, t0, t_fetched, state["replicated"],
            region=region if region is not None and tuple(region["pos"]) == tuple(cmd.pos) else None))

    def _run_again(self, rec: StepRecord, bundle: dict[str, Any], replay: _Replay) -> None:
        """Stand at the head of `rec`'s step (this rank's own state from `bundle`, the models'
        parameters and small state as the record has them there) and run that step again:
        its collectives answered from the record, its optimizer steps replaced by `replay`'s
        result (`_stepped_instead`), until the next head (`_end_replay`)."""
        tail.load_params(self.tracked, rec.params or {})
        load_small_state(self.tracked, rec.small or {})
        for ddp, sync in zip(self.tracked.ddps, rec.forward_sync or []):
            ddp.require_forward_param_sync = sync
        self._apply_bundle(bundle)
        self.pos = tuple(rec.pos)  # type: ignore[assignment]
        self.params_step = self.pos[0]
        self.replay = replay
        for opt in self.tracked.optimizers():
            replay.patched.append((opt, opt.__dict__.get("step")))
            opt.step = self._stepped_instead(opt)  # type: ignore[method-assign]
        self.step_record = rec
        self.scope = self.tracked.scope = "step"
        self.committed, self.current = False, None

    def _stepped_instead(self, opt: torch.optim.Optimizer) -> Callable[..., None]:
        def step(*_: Any, **__: Any) -> None:
            assert self.replay is not None
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            tail.load_stepped(self.tracked, opt, self.replay.replicated, groups)
            self.replay.stepped += 1
        return step

    def _end_replay(self) -> None:
        """Head N+1 after running step N again: join the survivors there."""
        replay, rec = self.replay, self.step_record
        assert replay is not None and rec is not None
        for opt, previous in replay.patched:
            if previous is None:
                del opt.step
            else:
                opt.step = previous
        if rec.answering() or rec.grads.answering() or not replay.stepped:
            self.stop(f"rank {self.rank}: running step {rec.pos[0]} again, the script took another way than the "
                      f"ranks that completed it (collectives answered "
                      f"{len(rec.ops)} of {len(rec.replay)}, gradient buckets {len(rec.grads.ops)} of "
                      f"{len(rec.grads.replay)}, optimizer steps {replay.stepped}). The job stops here: restart "
                      "it from your own checkpoint.")
        self.replay = None
        self.step_record = None
        self._release_received({"replicated": replay.replicated})  # its optimizer steps' result is in
        self.pos = (rec.pos[0] + 1, 0)
        self.params_step = self.pos[0]
        if replay.joined:
            return
        if replay.region is not None:  # the survivors' loop ended here: this one must too (at_exit)
            self.exit_join = replay
            return
        if not replay.formed:
            self._join_replayed(replay)

    def _join_at_exit(self, replay: _Replay) -> None:
        """The successor that ran its predecessor's last step again left the step loop there,
        as the survivors did: it runs the region with their record of it (as `join_in_region`)
        and forms the generation where the record runs out."""
        self.exit_join = None
        served = replay.region
        assert served is not None and self.region is not None
        if served["not_replayable"]:
            self.stop(f"rank {self.rank} was lost after the last step of its step loop (step {self.pos[0] - 1}), "
                      f"and the survivors' region after the loop runs {served['not_replayable']}, whose result "
                      "differs by rank: it cannot be run again here. The job stops here: restart it from your "
                      "own checkpoint.")
        self.region.replay = Record.replay_of(served)
        ran = f"step {self.pos[0] - 1} again, which its predecessor was lost after, and the region after it"
        self.region.join = lambda: self._form_late(replay.cmd, replay.stats, replay.t0, replay.t_fetched, ran)
        log.info("ran step %d again and left the step loop as the survivors did: %d collectives of the region "
                 "to answer", self.pos[0] - 1, len(self.region.replay))

    def expecting_exit(self) -> bool:
        """The others' step loop ended at this head (they stand in the region after it): this
        rank's must end at its next draw, as theirs did."""
        return self.exit_join is not None or self.exit_expected

    def not_at_the_exit(self) -> None:
        """The others left the step loop after the step this rank ran again, and this one
        drew another item (or came to another head): it took another way."""
        self.stop(f"rank {self.rank}: the script went on in its step loop at step {self.pos[0]}, where the "
                  "others' loop ended (they stand in the region after it): it took another way. The job stops "
                  "here: restart it from your own checkpoint.")

    def _join_replayed(self, replay: "_Replay | None" = None) -> None:
        """Form the generation with the survivors: at the next head, or where they stood in a
        collective after the step's optimizer step (its record ran out there)."""
        mid_step = replay is None  # in the step, after its optimizer step: its parameters hold it
        replay = replay or self.replay
        assert replay is not None
        replay.joined = True
        here = self.pos
        if mid_step:
            self.pos = (here[0] + 1, 0)  # where the survivors report themselves (recover_in_place)
        n = here[0] if mid_step else here[0] - 1
        self._form_late(replay.cmd, replay.stats, replay.t0, replay.t_fetched,
                        f"step {n} again, which its predecessor was lost after")
        self.pos = here

    def join_in_region(self, cmd: m.Form, state: dict[str, Any], stats: FetchStats, t0: float) -> None:
        """The joiner reached the exit of its rank's step loop (its predecessor was lost in the
        region after it): take the rank's state there over, then run the region, its
        collectives answered from a survivor's record; the group forms where they run out."""
        self._take_place()
        served = state.get("region")
        target = tuple(cmd.pos)
        at_head = state.get("exit_at_head")
        if (served is None or tuple(served["pos"]) != target) and at_head is not None and \
                tuple(at_head["pos"]) == target:
            # The survivors learnt of the loss at that head, their loops not yet left: none of
            # the region ran there, and what the exit holds (schedulers, optimizers' settings)
            # is as at the head. They leave their loops at their next draws (`_agree_on_place`).
            log.info("the survivors stand at the head rank %d's loop ended at (step %d): it runs the region "
                     "from its start", self.rank, target[0])
            served = at_head
        if self.tracked.sharded or served is None or tuple(served["pos"]) != target or served["not_replayable"]:
            why = ("its models are sharded (FSDP2): this version replays regions of replicated models only"
                   if self.tracked.sharded else
                   f"the region runs {served['not_replayable']}, whose result differs by rank"
                   if served is not None and served["not_replayable"] else
                   "the survivors hold no record of the region it was lost in")
            self.stop(f"rank {self.rank} was lost in the region after its step loop (at step {target[0]}) and "
                      f"cannot be rebuilt bit for bit there: {why}. The job stops here: restart it from your own "
                      "checkpoint.")
        t_fetched = time.perf_counter()
        self._load_replicated(state)
        self._release_received(state)
        region = Region.from_served(served)
        load_small_state(self.tracked, region.small)
        for ddp, sync in zip(self.tracked.ddps, region.forward_sync):
            ddp.require_forward_param_sync = sync
        self._stand_at(target, cmd.generation, state["bundle"])  # type: ignore[arg-type]
        self.loop = self.loop.model_copy(update={"start_step": int(state["loop_start"])})
        self.params_step = target[0]
        self.scope = self.tracked.scope = REGION
        self.ctl.outside_steps(True)  # as its predecessor was: a planned target is not extrapolated here
        self.current = None
        region.join = lambda: self._form_late(cmd, stats, t0, t_fetched, "the region to where the survivors stand")
        self.region = region
        log.info("took rank %d over at its step loop's exit (step %d): %d collectives of the region to answer",
                 self.rank, target[0], len(region.replay))

    def _join_if_deferred(self) -> None:
        if self.region is not None and self.region.join is not None:
            join, self.region.join = self.region.join, None
            join()

    def _form_late(self, cmd: m.Form, stats: FetchStats, t0: float, t_fetched: float, ran: str) -> None:
        """A successor that ran code of its rank again (`ran`: what) forms the generation with
        the survivors where it caught up with them, checks, and reports (as _join())."""
        gen = cmd.generation
        t_ran = time.perf_counter()
        try:
            self._clear_abort(gen)
            self.form(cmd)
            t_formed = time.perf_counter()
            self.verify_state(gen, None, defer=self.defer_checks)
        except (CollectiveFailure, dist.DistError, TransferError, OSError, Divergence) as exc:
            self.stop(f"rank {self.rank}: joining generation {gen} failed after running {ran} ({exc}); the job "
                      "cannot go on bit for bit")
        t_verified = time.perf_counter()
        log.info("joined generation %s at %s after running %s", gen, self.pos, ran)
        phases = {**self._setup_in_pause(), "walk_and_fetch": t_fetched - self._walk_began(),
                  "run_again": t_ran - t_fetched, "form": t_formed - t_ran, "verify": t_verified - t_formed}
        self.ctl.report(m.Formed(generation=gen, pos=self.pos, bytes=stats.bytes, seconds=round(stats.seconds, 4),
                                 setup_s=round(self.setup_s, 4), setup_left_out_bytes=self.setup_left_out_bytes,
                                 fetch_wait_s=round(t_fetched - t0, 4),
                                 ran_again=f"ran {ran} ({t_ran - t_fetched:.3f}s)",
                                 phases=_rounded(phases)))
        self.joiner = False

    def _served_parts(self, state: dict[str, Any]) -> dict[bytes, dict[str, Any]]:
        """The record of the step before (tail) apart, and first: a successor fetches it only
        when its predecessor was lost after that step's last collective (`_tail_bundle`),
        and its bytes (the parameters at that step's head, its gradient buckets) are as
        many again as the replicated state's. A planned move's leaver serves its own record
        apart instead (it has no tail), so that its successor walks while the rest arrives."""
        tail = state.pop("tail", None)
        if "bundle" in state:  # a planned move's leaver: its own record apart, first (`fetch_for_join`)
            return {FETCH_OWN: {"pos": state["pos"], "bundle": state.pop("bundle")}, FETCH: state}
        return {FETCH_TAIL: {"pos": state["pos"], "tail": tail}, FETCH: state}

    def _state(self, full: bool, digest: bool = True, encoded: bool = False) -> dict[str, Any]:
        """As the model-aware runtime's, with the record of the latest region: a successor
        of a rank lost there runs it again."""
        state = super()._state(full, digest, encoded)
        if self.region is not None:
            state["region"] = self.region.served()
        if not full and not encoded:
            if self.loop_started and not self.tracked.sharded and (self.region is None or not self.region.active):
                # At a head of its loop: where a rank whose loop ended at this head stood at
                # its exit, none of the region run (a successor of a rank lost there, where
                # this survivor learnt of it before its own loop ended: `join_in_region`).
                state["exit_at_head"] = Region.at_exit(self.pos, self.tracked).served()
            for rec in (self.prev_record, self.step_record):
                if rec is not None and rec.params is not None and tuple(rec.pos) == (self.pos[0] - 1, 0):
                    state["tail"] = rec.served()  # a rank lost after that step runs it again from this
        return state

    def verify_state(self, generation: int, expected: int | None, periodic: bool = False,
                     bundle_state: dict[str, Any] | None = None, sharded_expected: int | None = None,
                     defer: bool = False) -> None:
        if not periodic:
            defer = self._agree_on_place(generation) and defer
        super().verify_state(generation, expected, periodic, bundle_state, sharded_expected, defer)

    def _agree_on_place(self, generation: int) -> bool:
        """Every rank of a new generation stands at the same place: all at a head, or all in a
        region after the same number of its collectives (a successor replaying a region
        stops answering where its record ends: a survivor elsewhere would pair other
        collectives with its). Whether all stand at a head (every rank says the same)."""
        ran_again = self.abandoned
        if self.in_tail or (self.replay is not None and self.replay.stepped):
            assert self.step_record is not None
            here = (2, len(self.step_record.ops))  # after a step's optimizer step, so many collectives in
        elif ran_again is not None and ran_again.cmd.generation == generation and ran_again.region is not None:
            here = (1, 0)  # the step it runs again is the loop's last: it goes on into the region from there
        else:
            here = self.region.place() if self.region is not None else (0, 0)
        live = bool(self.region is not None and self.region.not_replayable)  # a collective there not recorded
        tail_record = self._tail_record(here)
        t = torch.tensor([*here, live, *((tail_record.pos[0], len(tail_record.ops), bool(tail_record.not_replayable))
                                         if tail_record is not None else (-1, 0, 1))], dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self.group.internal():
            self._wait_internal(self.group.allgather([out], [t]), "the place check")
        gathered = [x.tolist() for x in out]
        places = [tuple(g[:2]) for g in gathered]
        self.exit_expected = False
        apart = self._apart_by_completed_collectives(places, gathered, tail_record)
        if apart is not None:
            record, counts, where, ahead = apart
            with self.group.internal():
                catch_up(record, counts, self.rank, self._broadcast_internal)
            if here[0] == 2:  # the others stand at the next head: past the record is another way
                record.join = lambda: self.stop(
                    f"rank {self.rank}: after the optimizer step of step {record.pos[0]}, the script runs more "
                    "collectives than the ranks that completed that step did: it took another way. The job stops "
                    "here: restart it from your own checkpoint.")
            log.info("generation %s: ranks %s (%s collectives recorded): those behind answer the rest from the "
                     "record of a rank %s", generation, where, counts, ahead)
            return False
        if set(places) == {(0, 0), (1, 0)} and not self.tracked.sharded:
            # Some stand at a head of the step loop, the others in the region after it before any
            # of its collectives (a rank lost between its head's record and its loop's exit: its
            # successor takes over at that head). A rank at the head goes on: its loop ends at
            # its next draw, as theirs did, and it runs the region with them; where it runs a
            # step instead, it stops the job (`not_at_the_exit`).
            self.exit_expected = here == (0, 0)
            log.info("generation %s: ranks at the step loop's head and in the region after it (%s): this one %s",
                     generation, places, "ends its loop at its next draw" if self.exit_expected else "goes on")
            return False
        if len(set(places)) > 1:
            where = ", ".join(f"rank {r}: " + {0: "at a head", 1: f"{n} collectives into the region",
                                               2: f"{n} collectives into a step"}[a] for r, (a, n) in enumerate(places))
            detail = (f"the ranks of generation {generation} stand at different places ({where}): they cannot go "
                      "on together bit for bit. The job stops here: restart it from your own checkpoint.")
            self.ctl.report_now(m.Verified(generation=generation, pos=self.pos, ok=False, differing=["place"],
                                           detail=detail))
            raise Divergence(detail)
        return places[0] == (0, 0)

    def _apart_by_completed_collectives(self, places: list[tuple[int, int]], gathered: list[list[int]],
                                        tail_record: StepRecord | None) -> tuple[Any, list[int], str, str] | None:
        """Where the ranks stand apart only by recorded collectives that completed on some of
        them and failed on the others (a data path failing inside one): all in the region
        after the step loop, or some at the head after step S and the others in S's lines
        after its optimizer step. The record the ranks behind answer the rest from, each
        rank's count in it, and what to say; None where they stand apart otherwise, or where
        a rank ran a collective that is not recorded. `gathered`: each rank's place, whether
        its region ran an unrecorded collective, and its tail record's step, count and the same."""
        if self.tracked.sharded or len(set(places)) == 1:
            return None
        kinds = {a for a, _ in places}
        if kinds == {1} and not any(g[2] for g in gathered):
            return self.region, [n for _, n in places], "in the region after the step loop", "ahead"
        tails = [g[3:] for g in gathered]
        if kinds != {0, 2} or len({step for step, _, _ in tails}) != 1 or tails[0][0] < 0 or \
                any(live for _, _, live in tails):
            return None
        behind = [n for (a, _), (_, n, _) in zip(places, tails) if a == 2]
        at_head = [n for (a, _), (_, n, _) in zip(places, tails) if a == 0]
        if max(behind) >= min(at_head):
            return None
        return (tail_record, [n for _, n, _ in tails],
                f"at the head after step {tails[0][0]} and in its lines after the optimizer step", "at the head")

    def _tail_record(self, here: tuple[int, int]) -> StepRecord | None:
        """The record of the step a rank stands after: its own step's, in its lines after the
        optimizer step; the step before's, at a head (kept until the next optimizer step)."""
        if here[0] == 2:
            return self.step_record
        prev = self.prev_record
        if here == (0, 0) and prev is not None and tuple(prev.pos) == (self.pos[0] - 1, 0):
            return prev
        return None

    def _broadcast_internal(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait_internal(self.group.broadcast([t], opts), "the region's catch-up")

    # ---------------------------------------------------------------- the runtime's checks, for a script's loop
    def on_sync_backward(self, first: bool, last: bool) -> None:
        if self.loop_started and self.scope == "step" and self.replay is None:
            super().on_sync_backward(first, last)

    def watch_backward_start(self, out: Any) -> None:
        if self.loop_started and self.replay is None:
            super().watch_backward_start(out)

    def check_forward_placement(self) -> None:
        """A forward may run anywhere: the script's evaluation is a region, not a boundary function."""

    def _guard(self, op: str, live: LiveGroup) -> dist.ProcessGroup | None:
        if self.loop_started and self.scope == REGION and self.region is not None:
            return self._region_collective(op, live)
        if not self.loop_started:
            return super()._guard(op, live)  # its setup's: recorded, or answered in a joiner
        if self.scope != "step":
            return None
        if self.expecting_exit():
            self.not_at_the_exit()
        rec = self.step_record
        same = same_everywhere(op, live)  # answerable from a survivor's record
        if self.replay is not None:
            assert rec is not None
            if same and not rec.answering() and self.replay.stepped:
                return self.recording_group(live)  # after the step, where the survivors stand: it joins them here
            if not live.whole:
                self.stop(f"rank {self.rank}: running again the step its predecessor was lost after, the script "
                          f"calls {_unanswerable(op, live)}, whose result the survivors' record of that step "
                          "does not hold for this rank. The job stops here: restart it from your own checkpoint.")
            if not same or not rec.answering():
                self.stop(f"rank {self.rank}: running again the step its predecessor was lost after, the script "
                          f"calls {op} where the survivors' record of that step has "
                          f"{'nothing more' if not rec.answering() else rec.replay[len(rec.ops)].op}: it took "
                          "another way. The job stops here: restart it from your own checkpoint.")
            return self.recording_group(live)
        if self.committed:  # after the optimizer step (a loss logged, say)
            if rec is not None and same:
                return self.recording_group(live)  # recorded, retried in place
            if rec is not None:
                rec.not_replayable = rec.not_replayable or _unanswerable(op, live)
            return None  # live (the loop's first step, or no copies): a loss here stops the job at the head
        group = super()._guard(op, live)
        if rec is None:
            return group
        if same:
            return self.recording_group(live)
        rec.not_replayable = rec.not_replayable or _unanswerable(op, live)
        return group

    def collective_record(self) -> tuple[Record, bool]:
        """The record the script's collective goes to, and whether a lost peer is retried in
        place (in a region) rather than taken at the loop's head (in a step)."""
        if not self.loop_started:
            return super().collective_record()
        if self.scope == REGION:
            assert self.region is not None
            return self.region, True
        assert self.step_record is not None
        after_step = self.committed or (self.replay is not None and self.replay.stepped > 0)
        return self.step_record, after_step

    def sync_buffers(self, tensors: list[torch.Tensor], buffer_size: int, authoritative_rank: int) -> None:
        """DDP's buffer broadcast: the script's in a region (recorded, retried); recorded in a
        step, or answered where this process runs its predecessor's last step again."""
        if self.loop_started and self.scope == REGION:
            dist._broadcast_coalesced(self.group, tensors, buffer_size, authoritative_rank)
            return
        rec = self.step_record if self.scope == "step" else None
        if rec is not None and self.expecting_exit():
            self.not_at_the_exit()
        if self.replay is not None and rec is not None:
            rec.answer(self, "buffers", tensors)
            return
        super().sync_buffers(tensors, buffer_size, authoritative_rank)
        if rec is not None:
            rec.ops.append(Recorded("buffers", [self.copies.copy(t) for t in tensors]))

    def average_bucket(self, buffer: torch.Tensor,
                       into: torch.Tensor | None = None) -> torch.futures.Future[torch.Tensor]:
        """In a step, averaged into a tensor of the step's record, not in place: DDP copies
        the result into the gradients either way, and the record keeps it without a copy of
        its own (tail). Answered where this process runs its predecessor's last step again."""
        rec = self.step_record if self.scope == "step" else None
        if rec is None:
            return super().average_bucket(buffer, into)
        if self.expecting_exit():
            self.not_at_the_exit()
        if self.replay is not None:
            rec.grads.answer(self, "bucket", [buffer])
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        out = self.copies.empty_like(buffer)
        slot = rec.grads.reserve()

        def record(f: torch.futures.Future) -> torch.Tensor:  # on gloo's thread, as the bucket completes
            rec.grads.ops[slot] = Recorded("bucket", [out])
            return f.value()
        return super().average_bucket(buffer, into=out).then(record)

    def _region_collective(self, op: str, live: LiveGroup) -> dist.ProcessGroup | None:
        """Where a collective of the region runs: recorded (collectives.RecordingGroup), or
        live only, when its result differs by rank (a loss after it cannot be replayed)."""
        region = self.region
        assert region is not None
        if self.tracked.sharded:  # FSDP2 gathers whole models here: not kept (a region of sharded models is not replayed)
            region.not_replayable = region.not_replayable or "collectives of sharded models"
            return None
        if same_everywhere(op, live):
            return self.recording_group(live)
        if len(region.ops) < len(region.replay):
            self.stop(f"rank {self.rank}: the region after the step loop runs {op} here where the survivors ran "
                      f"{region.replay[len(region.ops)].op}: it took another way. The job stops here: restart it "
                      "from your own checkpoint.")
        self._join_if_deferred()
        region.not_replayable = region.not_replayable or _unanswerable(op, live)
        return None

    def _check_no_stray_draws(self, where: str) -> None:
        """The script may draw between steps (a loader's iterator, its evaluation): not a rule here."""

    def _backward_after_step(self) -> str:
        return (f"{_script_line()}a backward of a DistributedDataParallel model ran after optimizer.step() in the same "
                "iteration of the step loop (two models trained in turn, as a GAN's discriminator and generator): "
                "a script with no code change may run one backward-and-step phase per iteration, because each "
                "step's state is captured at its gradient all-reduce and committed at its optimizer step, and a "
                "rank lost between two phases could not be rebuilt bit for bit. This version does not move such "
                "a script: run it with `baton run --no-migration` (a failure then ends the job promptly, and you "
                "restart from your own checkpoint)")

    def _created(self, _kind: str, obj: Any) -> None:
        """An optimizer, LR scheduler or GradScaler the script made: after its step loop began,
        one that would not move with the rank (a successor does not run earlier iterations)."""
        if not self.loop_started or self.loading:
            return
        raise UsageError(
            f"{_script_line()}a {type(obj).__name__} was created after the step loop began (a new phase's optimizer or "
            "schedule, say): with no code change, baton moves with each rank the optimizers, LR schedulers and "
            "GradScalers that exist at the script's first optimizer step, and a successor does not run the "
            "iterations before its own, so it would not have this one. Create it before the loop (SequentialLR chains "
            "schedules; two optimizers can both be made up front), or run with `baton run --no-migration` (a "
            "failure then ends the job promptly, and you restart from your own checkpoint)")

    def _stepped_outside_steps(self) -> str:
        where = f" ({self.loop.step_loop})" if self.loop is not None and self.loop.step_loop else ""
        return (f"optimizer.step() ran outside the step loop baton found at the first optimizer step{where}: a "
                "script with no code change may step its optimizers in one loop only, since a move can stop only "
                "at that loop's heads. Train every phase in that one loop, or port the script to the model-aware "
                "API (a `with step:` block in each loop)")


def _script_line() -> str:
    """"file:line: " of the innermost frame of the script's own code on this stack ("" if none)."""
    own = next((f for f in _stack() if f.f_code.co_filename in SITES.files), None)
    return f"{own.f_code.co_filename}:{own.f_lineno}: " if own is not None else ""


def _stack() -> Iterator[Any]:
    """The calling thread's frames, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _unanswerable(op: str, live: LiveGroup) -> str:
    """A collective a successor cannot be answered from a survivor's record, as a message names it."""
    return op if live.whole else f"{op} on a group of some ranks (dist.new_group)"


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    """A joiner's phases as the ledger takes them (Formed.phases: non-negative, to 0.1 ms)."""
    return {k: round(max(0.0, v), 4) for k, v in phases.items()}
