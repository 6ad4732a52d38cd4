"""Captures and the gate: what a rank records of its state as it runs, and the checks
its collectives pass through.

A step's bundle (random streams, data position, the script's small state) is captured
at its first collective and pushed to the rank's buddies, so that a rank lost later in
the step can be rebuilt from them; the gate makes sure every collective belongs to a
step or boundary function, where a failure can be absorbed, and that setup collectives
are answered from the record a joiner brings instead of reaching the live ranks.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from baton import selfcost
from baton.control import messages as m
from baton.transfer.bundles import Bundle, Pos, encode_frame
from baton.worker import rng
from baton.worker.bundle import StepCapture
from baton.worker.collectives import BY_RANK, SAME_EVERYWHERE, Record, RecordingGroup, same_everywhere
from baton.worker.exit import exit_quietly
from baton.worker.group import CollectiveFailure, LiveGroup, solo_group
from baton.worker.tracked import UsageError

log = logging.getLogger("baton.worker")

def _output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a model's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _output_tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _output_tensors(x)]
    return []


SETUP_RECORD_MAX = 4 << 20  # bytes of setup collectives' results a joiner gets with its assignment


class Captures:
    """Mixed into Runtime: the capture and gate protocol."""

    def _own_state(self, pos: Pos, clone: bool = True) -> dict[str, Any]:
        """This rank's own state for `pos`: streams, local buffers, local values, data position."""
        buffers = self.tracked.local_buffers()
        return {
            "rng": rng.capture(self.tracked.generators),
            "buffers": {name: b.detach().clone() for name, b in buffers.items()} if clone else buffers,
            "local": self.tracked.local.as_dict() if self.tracked.local is not None else {},
            "data": self.feed.position_at(pos[0]),
            "modes": self.tracked.modes(),
            "volatile": self.tracked.volatile_buffers(),
            "late": self.tracked.late_buffer_keys(),
            "setup": self.setup,
        }

    def _capture_at(self, pos: Pos, seq: int = 0) -> tuple[Bundle, dict[str, Any]]:
        """This rank's bundle for `pos` in the current generation, and the streams in it."""
        state = self._own_state(pos)
        return Bundle.of(self.rank, pos, self.group.generation, seq, state), state["rng"]

    def _capture_point(self, push: bool = True) -> None:
        """Inside a step: capture what the next boundary will hold and send it to the buddies.
        Written straight to its wire frame (the buffers' bytes copied once, into it), which
        stands in for the bundle: it is decoded only if a failure needs it."""
        pos = (self.pos[0] + 1, 0)
        state = self._own_state(pos, clone=False)
        frame = encode_frame(self.rank, pos, self.group.generation, self.seq, state)
        self.capture = StepCapture(state["rng"], frame)
        self.seq += 1
        if self.wards and push:
            self.pusher.push(frame)

    def _gate(self) -> None:
        """Contribute to this step's completion only once the ward's bundle is held here."""
        if not self.wards or self.capture is None:
            return
        cap = self.capture.bundle

        def cancelled() -> bool:
            return self.group.failed.is_set() or self.ctl.abort_generation is not None

        for ward in self.wards:
            if not self.server.wards.wait(ward, cap.generation, cap.pos, cap.seq, self.op_timeout, cancelled):
                err = CollectiveFailure(f"rank {ward}'s state for step {cap.pos[0] - 1} did not arrive "
                                        f"within {self.op_timeout:.0f}s (peer lost)")
                self.group.note_failure(err)
                raise err

    @selfcost.counted
    def watch_backward_start(self, out: Any) -> None:
        """After a syncing forward: capture when its backward starts, the last moment before
        the gradient collectives by which the step has drawn everything it draws. Hooks the
        autograd nodes of the output's tensors; the first one the backward reaches captures."""
        if self.scope != "step" or self.committed:
            return  # on_sync_backward refuses such a backward with a clear error
        token = object()
        self.backward_token = token

        def started(_grad_outputs: Any) -> None:
            self._backward_started(token)

        for t in _output_tensors(out):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(started)

    @selfcost.counted
    def _backward_started(self, token: object) -> None:
        if self.backward_token is token and not self.backward_captured and self.scope == "step" \
                and not self.committed:
            self.backward_captured = True
            self._capture_point()

    def on_sync_backward(self, first: bool, last: bool) -> None:
        """From the DDP comm hook: the syncing backward's first/last gradient bucket."""
        if self.scope != "step":
            raise UsageError("a gradient all-reduce (loss.backward() of a wrapped model) ran outside "
                             "`with step:`")
        if self.committed:
            raise UsageError(self._backward_after_step())
        if first and not self.backward_captured:
            self._capture_point()  # the output's nodes were not reached (or not hooked)
        if last:
            self.backward_captured = False
            self.backward_token = None
            # This rank's own work in the step: until its last gradient bucket is ready, before
            # it waits for anyone. Wall step time cannot tell a straggler (every rank waits for it).
            self._busy_s = time.perf_counter() - self._step_t0
            self._gate()

    @selfcost.counted
    def _guard(self, op: str, group: LiveGroup) -> dist.ProcessGroup | None:
        if not self.loop_started:
            return self._setup_collective(op, group)
        if self.finished or (self.loop_done and self.scope is None):
            raise UsageError(f"dist.{op} after the step loop: a failure there could not be recovered; "
                             "run it in a `@job.at_end` function")
        if self.scope is None:
            raise UsageError(f"dist.{op} outside `with step:` and outside boundary functions: a failure "
                             "there could not be recovered. Move it into the step, or into a "
                             "@job.every / @job.at_epoch_end function (validation metrics, say).")
        if self.scope == "step":
            if self.committed:
                raise UsageError(f"dist.{op} after optimizer.step() in the same step: a step's "
                                 "collectives must all come before it commits")
            if not self.tracked.sharded and group.whole:
                self._capture_point()
                self._gate()
            # A sharded job's rank-local state travels in its shard snapshots (taken at each
            # boundary, complete): FSDP2's many collectives per step capture nothing. Nor does
            # one of a group of some ranks (dist.new_group): a ward outside it is not there to
            # push, and every rank's capture points must count alike (the gate matches them);
            # the step's collectives of the whole job capture after it.
        return None

    def _setup_collective(self, op: str, group: LiveGroup) -> dist.ProcessGroup | None:
        """A collective before the step loop: recorded (collectives), or, in a joiner, answered
        from its rank's record of the setup, else rank 0's (the others ran it long ago)."""
        rec = self._setup_answers()
        recorded = op in SAME_EVERYWHERE or op in BY_RANK
        if not self.joiner:
            if recorded and not same_everywhere(op, group):  # this rank's own record goes to its successors
                rec.by_rank = rec.by_rank or (f"dist.{op}" if group.whole else f"dist.{op} on a group of some ranks")
            if recorded:
                return self.recording_group(group)
            rec.not_replayable = rec.not_replayable or f"dist.{op}, which baton does not record"
            return None
        if recorded and rec.answering():
            return self.recording_group(group)
        if op == "barrier" and not rec.replay:
            return solo_group()  # the others passed this barrier long ago
        if rec.answering():
            why = f"and {op} has no recorded answer (a collective baton does not record)"
        elif rec.not_replayable:
            why = f"and what they got is not kept (their setup ran {rec.not_replayable})"
        else:
            why = "and the record of their setup has no more collectives: it took another way here (is it deterministic?)"
        raise UsageError(f"dist.{op} before the step loop on a rank that joined later: the others ran it long ago, "
                         f"{why}. Skip it with `if not job.joined:` and track what it produced.")

    def _setup_answers(self) -> Record:
        if self.joiner and not self._setup_answers_read:
            self._setup_answers_read = True
            text = self.assignment.setup if self.assignment is not None else None
            if text is not None:
                bundle = Bundle.from_text(text.model_dump())
                state = bundle.state()
                by_rank = state.get("by_rank", "")
                if by_rank and bundle.rank != self.rank:
                    self.stop(f"rank {self.rank}: the record of the setup's collectives handed to this joiner is "
                              f"rank {bundle.rank}'s, whose setup ran {by_rank} (its result differs by rank): it "
                              "cannot answer this rank's. The job stops here: restart it from your own checkpoint.")
                self.setup_record = Record(replay=Record.replay_of(state), not_replayable=state["not_replayable"],
                                           by_rank=by_rank)
        return self.setup_record

    def setup_text(self) -> m.BundleText | None:
        """This rank's record of its setup's collectives, for the orchestrator to hand to its
        joiners (then dropped here); None when the setup ran none, or, on a rank but 0, when
        every result it holds is the same on every rank (rank 0's serves every joiner)."""
        rec, self.setup_record = self.setup_record, Record()
        if not rec.ops and not rec.not_replayable or (self.rank != 0 and not rec.by_rank):
            return None
        size = sum(t.numel() * t.element_size() for r in rec.ops for t in r.outputs)
        if size > SETUP_RECORD_MAX:
            rec = Record(not_replayable=f"collectives giving {size >> 20} MiB, more than the "
                                        f"{SETUP_RECORD_MAX >> 20} MiB baton keeps of a setup", by_rank=rec.by_rank)
        state = {"not_replayable": rec.not_replayable, "by_rank": rec.by_rank, **rec.served_ops()}
        return bundle_text(Bundle.of(self.rank, (0, 0), self.group.generation, 0, state))

    def recording_group(self, group: LiveGroup) -> RecordingGroup:
        """What records (or answers) the script's collectives on `group`, the world or a sub-group."""
        recording = self._recording_groups.get(id(group))
        if recording is None:
            recording = self._recording_groups[id(group)] = RecordingGroup(self, group)
        return recording

    def collective_record(self) -> tuple[Record, bool]:
        """The record the script's collective goes to, and whether a lost peer is retried in place."""
        return self.setup_record, False

    def recover_in_place(self, exc: BaseException) -> None:
        raise exc  # setup collectives are not retried: a rank lost before training ends the job

    def stop(self, detail: str) -> NoReturn:
        """End the job now, non-zero, saying why (never go on with state that may differ)."""
        print(f"[baton] {detail}", file=sys.__stderr__, flush=True)
        try:
            self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                           differing=["script"], detail=detail[:60000]))
        except Exception:  # noqa: BLE001 - the orchestrator may be ending the job already
            pass
        exit_quietly(1)

    def sync_buffers(self, tensors: list[torch.Tensor], buffer_size: int, authoritative_rank: int) -> None:
        """DDP's buffer broadcast before a forward: baton's own collective (unguarded)."""
        with self.group.internal():
            dist._broadcast_coalesced(self.group, tensors, buffer_size, authoritative_rank)

    def average_bucket(self, buffer: torch.Tensor,
                       into: torch.Tensor | None = None) -> torch.futures.Future[torch.Tensor]:
        """A gradient bucket averaged over the ranks (from DDP's comm hook), in place or
        `into` another tensor of its shape; the future resolves to the averaged tensor."""
        out = buffer if into is None else into
        with selfcost.outside():  # what DDP's reducer does without a hook: not baton's cost
            torch.mul(buffer, 1.0 / self.world_size, out=out)
        return self.group.reduce_gradients(out)

    @selfcost.counted
    def check_forward_placement(self) -> None:
        if self.loop_started and self.scope is None and not self.loop_done:
            raise UsageError("a forward pass of a wrapped model with buffers (which DDP broadcasts) ran "
                             "outside `with step:` and outside boundary functions: run validation in a "
                             "@job.every / @job.at_epoch_end function")

    @selfcost.counted
    def _on_optimizer_step(self, *_: Any) -> None:
        if not self.loop_started or self.loading:
            return
        if self.scope == "step":
            self.committed = True
            self.params_step = self.pos[0] + 1
            for feed in (self.pre_copy, self.hot_feed):
                if feed is not None:
                    feed.after_optimizer_step()
            return
        raise UsageError(self._stepped_outside_steps())

    def _backward_after_step(self) -> str:
        return "loss.backward() ran after optimizer.step() in the same step"

    def _stepped_outside_steps(self) -> str:
        where = "a boundary function" if self.scope == "boundary" else "outside `with step:`"
        return f"optimizer.step() ran in {where}: parameters may only change inside steps"

    def is_peer_failure(self, exc: BaseException) -> bool:
        if isinstance(exc, (UsageError, KeyboardInterrupt, SystemExit, GeneratorExit)):
            return False
        if self.group.failed.is_set():
            return True
        with self.ctl.lock:
            if self.ctl.abort_generation is not None:
                return True
        return isinstance(exc, (CollectiveFailure, dist.DistError))


def bundle_text(b: Bundle) -> m.BundleText:
    return m.BundleText.model_validate(b.to_text())
