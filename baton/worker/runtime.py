"""The worker's side of every protocol: units, captures, pauses, recoveries, joins.

A run is a sequence of *units* every rank executes in the same order: steps
(`with step:`) and boundary functions (`job.every`, `job.at_epoch_end`, `job.at_end`).
A *position* `(step, sub)` names the boundary before step `step` after `sub` of its
boundary functions: every rank's state is consistent there, and it is the only
place a rank changes hands.

Rules that make a position exact after any failure, checked as the script runs so a
script that breaks them fails on its first step, not during its first failure:
- a step's collectives all come before its first `optimizer.step()` (its commit); a
  step that fails before committing re-runs from its start position, one that
  committed is complete;
- random numbers are drawn inside steps before their last collective, or inside
  boundary functions (the bundle captured at the collective must still be the state
  at the next boundary);
- collectives run inside steps or boundary functions, where failures are absorbed.
"""

from __future__ import annotations

import logging
import os
import json
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from baton import selfcost
from baton.control import messages as m
from baton.control.buddies import wards_of
from baton.store.rendezvous import RendezvousClient
from baton.transfer import FetchStats, TransferError, codec, fetch_state
from baton.transfer.bundles import Bundle, Frame, Pos, encode_frame, newest
from baton.transfer.protocol import FlatState
from baton.transfer.server import PUSH, SNAPSHOT, TransferServer, connect, small_id, snapshot_key
from baton.worker import fence, module_state, rng, setup_check, shards, verify
from baton.worker.bundle import BundlePushers, StepCapture, fetch_ward_bundle
from baton.worker.collectives import SAME_EVERYWHERE, Record, RecordingGroup
from baton.worker.compile_watch import describe
from baton.worker.control import ControlChannel, cpu_report
from baton.worker.data import DataFeed
from baton.worker.group import CollectiveFailure, LiveGroup, install_as_world, solo_group
from baton.worker.prefetch import Prefetch
from baton.worker.snapshots import Snapshots, position_of
from baton.worker.tracked import Tracked, UsageError, reset_scaler_stage

log = logging.getLogger("baton.worker")


class Divergence(RuntimeError):
    """The state check after a move found replicas (or a joiner) that differ."""


@dataclass
class Unit:
    """A boundary function and when it runs."""

    fn: Callable[[Any], Any]
    every: int | None = None  # after every N completed steps
    epoch_end: bool = False
    at_start: bool = False  # also before the first step
    at_end: bool = False  # after the last step

    def due(self, gap: int, total: int, spe: int | None, start: int = 0) -> bool:
        """Whether it runs after `gap` completed steps of a loop that began at `start`
        (a resumed loop does not redo the end work of the epoch it resumed after)."""
        if self.at_end:
            return gap == total and gap > start
        if self.epoch_end:
            return bool(spe) and gap > start and gap % spe == 0  # type: ignore[operator]
        if self.every:
            return (gap > start or self.at_start) and gap % self.every == 0
        return False


class BoundaryInfo:
    """What a boundary function is told: how many steps are done, and the epoch."""

    def __init__(self, step: int, epoch: int):
        self.step = step
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"Boundary(step={self.step}, epoch={self.epoch})"


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


class Runtime:
    # baton.init() runs inside the script, which may have built its optimizer before it: the
    # step loop then looks for such untracked objects (discover). No code change runs the
    # script under baton from its first line: ScriptRuntime sets this False.
    script_ran_before_discovery = True

    def __init__(self, ctl: ControlChannel, server: TransferServer, store: RendezvousClient, rank: int,
                 world_size: int, joiner: bool, config: m.Registered, token: str):
        self.rank, self.world_size, self.joiner = rank, world_size, joiner
        self.assignment: m.Assign | None = None  # the orchestrator's word that made this process a rank
        self.setup: dict[str, int] = {}  # the setup's fingerprint where the step loop starts (setup_check)
        self.ctl, self.server, self.store, self.token = ctl, server, store, token
        self.assigned_at = time.perf_counter()  # made right after the rank's assignment
        self.setup_s = 0.0
        self.op_timeout = float(config.op_timeout_s)
        self.formation_timeout = float(config.formation_timeout_s)
        self.verify_every = int(config.verify_every)
        self.redundancy = int(config.redundancy)
        self.group = LiveGroup(rank, world_size)
        self.group.guard = self._guard
        self.tracked = Tracked()
        self.feed = DataFeed(None)
        self.units: list[Unit] = []
        self.pos: Pos = (0, 0)
        self.total = 0
        self.spe: int | None = None  # steps per epoch of the tracked loader, if it has a length
        self.loop: m.LoopInfo | None = None
        self.at_pos: Bundle | Frame | None = None  # this rank's bundle describing `pos`
        self.at_pos_rng: dict[str, Any] | None = None
        self.capture: StepCapture | None = None  # latest capture in the current step
        self.small: Any = None  # small state at the current step's start (restored for a re-run)
        self.drawn_with_batch: dict[str, Any] | None = None  # the streams right after the pending batch was drawn
        self.verified_at: Pos | None = None  # where --verify-every last checked
        self.scope: str | None = None  # "step" | "boundary" | None
        self.committed = False
        # How many steps' updates the replicated state (parameters, optimizer) holds. It must
        # equal pos[0] when a step begins: anything else means a step would be applied twice
        # or skipped on this rank while every replica still agrees, a divergence no digest
        # comparison can see.
        self.params_step = 0
        self.seq = 0
        self.loop_started = False
        self.loop_done = False
        self.finished = False
        self.loading = False  # loading arrived state (the DCP helpers may step an optimizer)
        self.metrics: dict[str, float] = {}
        self._busy_s: float | None = None  # this step's own work, until its last gradient bucket
        self.warned_no_capture = False
        self.backward_captured = False  # the syncing backward's start captured this step's bundle
        self.backward_token: object | None = None  # identifies the latest syncing forward
        self.pusher = BundlePushers(lambda addr: connect(addr, token, PUSH, timeout=self.op_timeout))
        # The ranks whose bundles this rank holds (and waits for before completing a step).
        self.wards = wards_of(rank, world_size, config.ranks_per_node or world_size, int(config.redundancy))
        self.snapshots = Snapshots(server, token, rank, self.op_timeout)
        self.ward_addrs: dict[int, tuple[str, int]] = {}  # where the wards are (from the latest Form)
        self.replicas: list[int] = []  # HSDP: the ranks holding this rank's very shards
        self.group.known_local_ports.add(server.address[1])
        self.group.known_remote_ports.update(_ports_of(os.environ.get("BATON_URL", ""),
                                                       os.environ.get("BATON_STORE", "")))
        install_as_world(self.group, store.store)
        ctl.on_abort = lambda: self.group.note_failure("a peer was lost (orchestrator abort)")
        # The script's collectives before its step loop: recorded on the ranks that start the
        # job (rank 0's record goes to each later joiner with its assignment), answered from
        # that record in a joiner, whose peers ran them long ago.
        self.setup_record = Record()
        self._setup_answers_read = False
        self._recording_group: RecordingGroup | None = None
        self.prefetch: Prefetch | None = None
        if joiner:  # a joiner's state can be on its way while the script builds its model
            self.prefetch = Prefetch(self._fetch_for)
            ctl.watch_forms(self.prefetch.offer)
        else:
            cmd = self.wait_for(m.Form)
            self.form(cmd)
            self.ctl.report(m.Formed(generation=cmd.generation, pos=(0, 0)))

    # ================================================================ the loop
    def items(self) -> Iterator[tuple[str, Any]]:
        """Yields ("step", Step) and ("epoch_end", e); runs boundary functions itself."""
        from baton.worker.job import Step

        assert self.loop is not None
        total = self.total
        epoch_style = self.loop.style == "epochs"
        while True:
            gap = self.pos[0]
            due = self._due(gap)
            if self.pos[1] < len(due):
                self._run_unit(due[self.pos[1]], gap)
                continue
            if epoch_style and gap > 0 and gap % self.spe == 0:  # type: ignore[operator]
                yield "epoch_end", gap // self.spe - 1  # type: ignore[operator]
            if gap >= total:
                break
            if not self._boundary():
                continue  # a pause or a recovery moved us: look at the gap again
            step = self._begin_step(Step)
            yield "step", step
            self._end_step(step)
        self.loop_done = True
        self.scope = None
        self.ctl.started = self.total

    def _due(self, gap: int) -> list[Unit]:
        start = self.loop.start_step if self.loop else 0
        return [u for u in self.units if u.due(gap, self.total, self.spe, start)]

    def first_epoch(self, spe: int) -> int:
        """The epoch an epoch-style loop starts in: a joiner may start where end work is pending."""
        k, sub = self.pos
        if k > 0 and k % spe == 0 and sub < len(self._due(k)):
            return k // spe - 1
        return k // spe

    def enter_loop(self, style: str, total: int, epochs: int | None, start: int = 0) -> None:
        if self.loop_started:
            raise UsageError("job.steps()/job.epochs() can be used once per job")
        self.loop_started = True
        self.total = total
        sharded = self._prepare_tracking("create it after baton.init(), or pass it to job.track")
        self.spe = self.feed.steps_per_epoch()
        if not 0 <= start <= total:
            raise ValueError(f"the loop's start ({start}) must lie between 0 and its total ({total})")
        self.loop = m.LoopInfo(style=style, total_steps=total, epochs=epochs,
                               steps_per_epoch=self.spe if style == "epochs" else None, start_step=start,
                               sharded=sharded)
        if start and not self.joiner:  # resumed from the script's own checkpoint
            self.pos = (start, 0)
            self.params_step = start
            position = self.feed.position_at(start)
            if position is not None:
                self.feed.seek(position)
        log.info("loop: %s (tracking %s)", self.loop, sorted(self.tracked.objects))
        # What the tracked loader will yield only: a joiner may draw other numbers before its
        # loop on purpose (`if job.joined:` builds its model on the meta device), never other data.
        self.setup = setup_check.fingerprint({}, {"data": self.feed.data} if self.feed.data is not None else {})
        if self.joiner:
            self.ctl.report(m.Ready(loop=self.loop, joined=True))  # ahead of its Formed (one outbox)
            self._join()
        else:
            start_bundle, start_rng = self._capture_at(self.pos)
            self.at_pos, self.at_pos_rng = start_bundle, start_rng
            self.ctl.report_now(m.Ready(loop=self.loop, bundle=_text(start_bundle), setup=self.setup_text()))

    def _prepare_tracking(self, where_optimizers: str, first_pre_hook: Callable[..., Any] | None = None) -> list[str]:
        """What a step loop needs as it begins: the tracked objects found, the optimizers'
        hooks (`first_pre_hook` before baton's own), the sharded ones and their snapshots, and
        the state checked to be transferable now rather than mid-failure. The sharded names."""
        # A joiner runs the script the first ranks ran, which were checked at their first step.
        self.tracked.add_discovered(scan_for_untracked=self.script_ran_before_discovery and not self.joiner)
        if not self.tracked.optimizers():
            raise UsageError(f"no optimizer found: baton needs the optimizer whose step() commits each step "
                             f"({where_optimizers})")
        for opt in self.tracked.optimizers():
            if first_pre_hook is not None:
                opt.register_step_pre_hook(first_pre_hook)
            opt.register_step_post_hook(self._on_optimizer_step)
        sharded = self.tracked.sharded_names()
        self.tracked.sharded = set(sharded)
        self.tracked.note_loop_start()
        self.replicas = shards.replica_peers(self.tracked)
        if self._snapshotting():
            self.snapshots.light = bool(self.replicas)  # before the first boundary, a joiner's too
            for opt in self.tracked.optimizers():
                opt.register_step_pre_hook(self._before_optimizer_step)
            if not self.joiner:  # a joiner starts pulling when it forms its first generation
                self.snapshots.set_wards(self.ward_addrs, light=bool(self.replicas))
        codec.encode(self.tracked.replicated())
        return sharded

    def _boundary(self) -> bool:
        """The hot-path check before each step: one uncontended lock and a few reads."""
        ctl = self.ctl
        with ctl.lock:
            proceed = not ctl.attention
            if proceed:
                ctl.started = self.pos[0]
        if proceed:
            if self.verify_every and self.pos[0] > 0 and self.pos[0] % self.verify_every == 0 and \
                    self.pos != self.verified_at:
                return self._checked(lambda: self.verify_state(self.group.generation, None, periodic=True))
            return True
        with ctl.lock:
            abort = ctl.abort_generation
            if abort is None and (ctl.pause_at is None or self.pos[0] < ctl.pause_at):
                ctl.started = self.pos[0]
                ctl.attention = ctl.pause_at is not None
                return True
            op = ctl.pause_op
        if abort is not None:
            self.recover(in_step=False, error="peer lost at a boundary")
            return False
        self._paused(op)
        return False

    def _checked(self, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except (CollectiveFailure, dist.DistError) as exc:
            self.recover(in_step=False, error=f"{type(exc).__name__}: {exc}")
            return False

    def _begin_step(self, step_cls: type) -> Any:
        self._check_no_stray_draws("before step")
        if self.params_step != self.pos[0]:
            self._lineage_broken()
        self.small = self.tracked.snapshot_small()
        if self._snapshotting():
            self._snapshot()
        k = self.pos[0]
        epoch = k // self.spe if self.spe else self.feed.epoch
        batch = self._take_batch()
        self.scope, self.committed, self.seq, self.capture = "step", False, 0, None
        self.backward_captured, self.backward_token = False, None
        self.tracked.scope = "step"
        self._step_t0 = time.perf_counter()
        self._busy_s = None
        return step_cls(self, k, batch, epoch)

    def _take_batch(self) -> Any:
        """The step's batch. Drawing it can draw random numbers in this process (a loader
        without workers: random flips in __getitem__, the iterator's seed); a re-run takes the
        batch its first attempt drew, so the streams go to where drawing it left them."""
        if self.feed.data is None:
            return None
        again = self.feed.has_pending
        batch = self.feed.batch()
        if not again:
            self.drawn_with_batch = rng.capture(self.tracked.generators)
        elif self.drawn_with_batch is not None:
            rng.restore(self.drawn_with_batch, self.tracked.generators)
        return batch

    def _end_step(self, step: Any) -> None:
        self.scope = None
        self.tracked.scope = None
        if step.failed:
            self.recover(in_step=True, error=step.error)
            return
        if not step.completed:
            raise UsageError(f"step {step.index} was not run inside `with step:`: write the step's "
                             "code as `for step in job.steps(n): with step: ...`")
        self._note_step_end()
        if self.capture is None and self.tracked.sharded:
            self._capture_point(push=False)  # the step is complete: its end is the next boundary
        if self.capture is None:
            # No collective at all in this step: nothing gated it, so capture now.
            if not self.warned_no_capture:
                log.warning("step %d issued no collective: its bundle was captured after the fact", step.index)
                self.warned_no_capture = True
            self._capture_point()
        assert self.capture is not None
        self.feed.advance()
        self.pos = (self.pos[0] + 1, 0)
        self.params_step = self.pos[0]  # also when a GradScaler skipped the optimizer's step
        self.at_pos, self.at_pos_rng = self.capture.bundle, self.capture.rng
        now = time.perf_counter()
        hb = self.ctl.heartbeat
        hb["step"] = self.pos[0]
        dt = now - self._step_t0
        ema = hb.get("step_time")
        hb["step_time"] = dt if ema is None else 0.8 * ema + 0.2 * dt
        if self._busy_s is not None:
            ema = hb.get("busy_time")
            hb["busy_time"] = self._busy_s if ema is None else 0.8 * ema + 0.2 * self._busy_s
        if self.metrics:
            hb["metrics"] = dict(self.metrics)

    def _note_step_end(self) -> None:
        """What the step registered inside compiled code (compile_watch); the orchestrator
        learns, with the next heartbeat, that this rank can no longer move bit for bit."""
        self.tracked.note_step_end()
        broke = self.tracked.compile_watch.broke
        if broke and "unmovable" not in self.ctl.heartbeat:
            self.ctl.heartbeat["unmovable"] = describe(broke)[:2000]

    def _run_unit(self, unit: Unit, gap: int) -> None:
        """Run one boundary function; a lost peer inside it is absorbed and it runs again."""
        self._check_no_stray_draws("before a boundary function")
        small = self.tracked.snapshot_small()
        start_pos, start_bundle, start_rng = self.pos, self.at_pos, self.at_pos_rng
        reported = False
        spe = self.spe
        epoch = (gap // spe - 1 if unit.epoch_end and spe else (gap // spe if spe else self.feed.epoch))
        self.scope = self.tracked.scope = "boundary"
        try:
            with selfcost.outside():
                unit.fn(BoundaryInfo(gap, epoch))
            self.scope = self.tracked.scope = None
            self._note_step_end()
            after = (gap, self.pos[1] + 1)
            bundle, after_rng = self._capture_at(after)
            self.ctl.report_now(m.UnitDone(pos=after, bundle=_text(bundle)))
            reported = True
            with self.group.internal():  # nobody moves on until every rank's bundle is durable
                self._wait_internal(self.group.barrier(), "the barrier after a boundary function")
        except BaseException as exc:
            self.scope = self.tracked.scope = None
            if not self.is_peer_failure(exc):
                raise
            self._reset_ddp()
            self.recover(in_step=False, error=f"{type(exc).__name__}: {exc}",
                         unit=(start_pos, small, start_bundle, start_rng, reported))
            return
        self.pos, self.at_pos, self.at_pos_rng = after, bundle, after_rng

    def _wait_internal(self, work: dist.Work, what: str) -> None:
        """Wait for one of baton's own collectives. Work.wait's timeout raises a bare
        RuntimeError, before gloo's own op timeout fails the future: that is a lost peer too."""
        try:
            work.wait(timedelta(seconds=self.op_timeout))
        except CollectiveFailure:
            raise
        except RuntimeError as exc:
            err = CollectiveFailure(f"{what} did not complete: {exc} (peer lost)")
            self.group.note_failure(err)
            raise err from exc

    def _check_no_stray_draws(self, where: str) -> None:
        """Nothing was drawn since the last capture (every stream compared, a cached numpy
        normal included), checked before every step and boundary function."""
        if self.at_pos_rng is None:
            return
        now = rng.capture(self.tracked.generators)
        names = rng.describe_difference(now, self.at_pos_rng)
        if names:
            names = ", ".join(names)
            raise UsageError(
                f"random numbers ({names}) were drawn {where} {self.pos[0]} outside what baton can replay: "
                "after a step's last collective (e.g. after loss.backward()), or between steps outside a "
                "boundary function. Draw them inside the step before backward, or in a job.every / "
                "job.at_epoch_end function.")

    # ================================================================ captures and the gate
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
            raise UsageError("loss.backward() ran after optimizer.step() in the same step")
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
    def _guard(self, op: str) -> dist.ProcessGroup | None:
        if not self.loop_started:
            return self._setup_collective(op)
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
            if not self.tracked.sharded:
                self._capture_point()
                self._gate()
            # A sharded job's rank-local state travels in its shard snapshots (taken at each
            # boundary, complete): FSDP2's many collectives per step capture nothing.
        return None

    def _setup_collective(self, op: str) -> dist.ProcessGroup | None:
        """A collective before the step loop: recorded (collectives), or, in a joiner, answered
        from rank 0's record of the setup (the others ran it long ago)."""
        rec = self._setup_answers()
        if not self.joiner:
            if op in SAME_EVERYWHERE:
                return self.recording_group()
            rec.not_replayable = rec.not_replayable or f"dist.{op}, whose result differs by rank"
            return None
        if op in SAME_EVERYWHERE and rec.answering():
            return self.recording_group()
        if op == "barrier" and not rec.replay:
            return solo_group()  # the others passed this barrier long ago
        if rec.answering():
            why = f"and {op} has no recorded answer (its result differs by rank)"
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
                state = Bundle.from_text(text.model_dump()).state()
                self.setup_record = Record(replay=Record.replay_of(state), not_replayable=state["not_replayable"])
        return self.setup_record

    def setup_text(self) -> m.BundleText | None:
        """This rank's record of its setup's collectives, for the orchestrator to hand to joiners
        (then dropped here); None when the setup ran none."""
        rec, self.setup_record = self.setup_record, Record()
        if not rec.ops and not rec.not_replayable:
            return None
        size = sum(t.numel() * t.element_size() for r in rec.ops for t in r.outputs)
        if size > SETUP_RECORD_MAX:
            rec = Record(not_replayable=f"collectives giving {size >> 20} MiB, more than the "
                                        f"{SETUP_RECORD_MAX >> 20} MiB baton keeps of a setup")
        state = {"not_replayable": rec.not_replayable, **rec.served_ops()}
        return _text(Bundle.of(self.rank, (0, 0), self.group.generation, 0, state))

    def recording_group(self) -> RecordingGroup:
        if self._recording_group is None:
            self._recording_group = RecordingGroup(self)
        return self._recording_group

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

    def reduce_bucket(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """A gradient bucket's all-reduce (from DDP's comm hook)."""
        return self.group.reduce_gradients(buffer)

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
            return
        where = "a boundary function" if self.scope == "boundary" else "outside `with step:`"
        raise UsageError(f"optimizer.step() ran in {where}: parameters may only change inside steps")

    def is_peer_failure(self, exc: BaseException) -> bool:
        if isinstance(exc, (UsageError, KeyboardInterrupt, SystemExit, GeneratorExit)):
            return False
        if self.group.failed.is_set():
            return True
        with self.ctl.lock:
            if self.ctl.abort_generation is not None:
                return True
        return isinstance(exc, (CollectiveFailure, dist.DistError))

    # ================================================================ planned moves
    def _paused(self, op: int | None) -> None:
        ctl = self.ctl
        self._check_no_stray_draws("before step")
        ctl.report(m.Paused(op=op or 0, pos=self.pos))
        log.info("paused at %s", self.pos)
        while True:
            with ctl.lock:
                if ctl.abort_generation is not None:
                    break
                if ctl.pause_at is not None and ctl.pause_at > self.pos[0]:
                    return  # re-targeted later: keep stepping
            cmd = ctl.wait_command(0.05)
            if cmd is None:
                continue
            if isinstance(cmd, m.Form):
                try:
                    self.form(cmd)
                    if cmd.verify:
                        self.verify_state(cmd.generation, None)
                except (CollectiveFailure, dist.DistError, TransferError) as exc:
                    log.warning("forming generation %s failed (%s)", cmd.generation, exc)
                    break
                with ctl.lock:
                    ctl.pause_at = ctl.pause_op = None
                    ctl.attention = ctl.abort_generation is not None
                ctl.report(m.Formed(generation=cmd.generation, pos=self.pos))
                return
            if isinstance(cmd, m.Publish):
                self.publish(cmd.generation, full=True)
                if cmd.leave and not self._leave():
                    self.server.retract()
                    break  # superseded by a failure elsewhere: stay, as a survivor
            if isinstance(cmd, m.Abort):
                break
        self.recover(in_step=False, error="peer lost during a planned move")

    def _leave(self) -> bool:
        ctl = self.ctl
        while True:
            cmd = ctl.wait_command(0.5)
            if isinstance(cmd, (m.Release, m.Stop)):
                break
            with ctl.lock:
                if ctl.abort_generation is not None:
                    return False
        ctl.report(m.Left())
        ctl.flush()
        self.pusher.close()
        exit_quietly(0)
        return True  # pragma: no cover

    # ================================================================ shard snapshots
    def _snapshotting(self) -> bool:
        """Whether this rank keeps shard snapshots for redundancy (a sharded job with buddies)."""
        return bool(self.tracked.sharded) and bool(self.wards)

    @selfcost.counted
    def _snapshot(self) -> None:
        """This rank's whole state at the boundary, copied to host memory for its buddies."""
        state = self._state(full=True, digest=False, encoded=True)
        meta, tensors = codec.encode(state)
        small = None
        if self.replicas:  # HSDP: buddies pull the state without the shards (another replica group has those)
            small_meta, small_tensors = codec.encode({k: v for k, v in state.items() if k != "sharded"})
            small = FlatState(meta=small_meta, tensors=[t.clone() for t in small_tensors])
        old = self.snapshots.reusable(self.pos[0])
        self.snapshots.keep(self.pos, self.snapshots.fill(self.pos, meta, tensors, old), small)
        self.ctl.heartbeat["snapshot_mb"] = round(self.snapshots.held_bytes() / 2**20, 2)

    @selfcost.counted
    def _before_optimizer_step(self, *_: Any) -> None:
        """No rank commits a step before its buddy holds its snapshot of the step's start."""
        if self.loading or self.scope != "step":
            return

        def cancelled() -> bool:
            return self.group.failed.is_set() or self.ctl.abort_generation is not None

        why = self.snapshots.wait_wards(self.pos[0], self.op_timeout, cancelled)
        if why is not None:
            err = CollectiveFailure(f"{why} (peer lost)")
            self.group.note_failure(err)
            raise err

    def _rewind(self, target: Pos) -> None:
        """Go back to this rank's own snapshot at `target` (a lost rank's buddy holds only that one)."""
        flat = self.snapshots.own(target[0])
        if flat is None or position_of(flat) != tuple(target):
            raise RuntimeError(f"rank {self.rank} holds no snapshot of its state at {target}")
        # The snapshot must stay as it is for as long as another failure could need it, and
        # loading may alias state to the tensors it is given: the shards are copied into the
        # live ones (or cloned where the helpers must load them), the rest is cloned here.
        state = codec.decode(flat.meta, list(flat.tensors))
        state = {k: v if k == "sharded" else shards.cloned(v) for k, v in state.items()}
        self._load_replicated(state)
        self._load_sharded(state, owned=False)
        bundle_state = state["bundle"]
        self._apply_bundle(bundle_state)
        self.pos = target
        self.at_pos = Bundle.of(self.rank, target, self.group.generation, 0, bundle_state)
        self.at_pos_rng = bundle_state["rng"]

    def publish(self, generation: int, full: bool) -> None:
        meta, tensors = codec.encode(self._state(full))
        self.server.publish(generation, FlatState(meta=meta, tensors=tensors))
        log.info("published generation %s (full=%s): %d tensors", generation, full, len(tensors))

    def _state(self, full: bool, digest: bool = True, encoded: bool = False) -> dict[str, Any]:
        """What this rank serves: its replicated state, and with `full` its own and its shards
        (with `encoded`, already encoded: a snapshot's, without digests)."""
        from baton.worker.ddp import export_state

        assert self.loop is not None
        state: dict[str, Any] = {"replicated": self.tracked.replicated(), "pos": list(self.pos),
                                 "ddp": [export_state(d) for d in self.tracked.ddps],
                                 "loop_start": self.loop.start_step,
                                 "late_buffers": self.tracked.late_buffers(copy=not encoded)}
        if full:
            assert self.at_pos is not None
            bundle_state = self.at_pos.state()
            state["bundle"] = bundle_state
            if self.tracked.sharded:  # this rank's FSDP2 shards exist nowhere else
                state["sharded"] = shards.capture(self.tracked, encoded=encoded)
                if digest:
                    state["sharded_digest"] = verify.combined(shards.digests(state["sharded"]))
            if self.world_size == 1 and digest:
                # No replica to compare the joiner with: it checks against this digest instead
                # (a pass over the whole state, so only here: with replicas, the joiner's
                # replicated state is compared with theirs and its own with the bundle).
                state["digest"] = verify.combined({**self._replicated_digests(state["replicated"]),
                                                   **self._local_digests(bundle_state)})
        return state

    # ================================================================ unplanned
    def recover(self, in_step: bool, error: str,
                unit: tuple[Pos, Any, Bundle | None, Any, bool] | None = None) -> None:
        """Absorb a lost peer: report where this rank's state is, then follow the plan."""
        ctl = self.ctl
        issued = self.group.issued_at
        blocked = round(max(0.0, time.time() - issued), 4) if issued else None
        self.scope = self.tracked.scope = None
        self._reset_ddp()
        self.group.drop()
        pos = self.pos
        unit_reported = False
        if in_step:
            self._restore_start(self.small)
        if unit is not None:
            pos, small, bundle, rng_state, unit_reported = unit
        while True:
            with ctl.lock:
                ctl.pause_at = ctl.pause_op = None
                known = max(self.group.generation, ctl.newest_abort)
            snaps, held = self.snapshots.report() if self._snapshotting() else ([], {})
            ctl.report(m.Recover(generation=known, pos=pos, in_step=in_step,
                                 unit_reported=unit_reported, error=error[:2000], snapshots=snaps, held=held,
                                 replicas=self.replicas, blocked_s=blocked))
            cmd = self.wait_for(m.Form, m.Abort)
            if isinstance(cmd, m.Abort) or cmd.generation < known:
                continue  # a plan made before the latest restart: the next one follows the report
            target: Pos = tuple(cmd.pos)  # type: ignore[assignment]
            # A boundary function every rank finished before the failure keeps its effects.
            unit_done = unit is not None and unit_reported and target == (pos[0], pos[1] + 1)
            completed = None  # the result of the step this rank abandoned, taken from others
            try:
                if unit is not None and not unit_done:
                    self._restore_unit(unit)
                if cmd.rewind:
                    self._rewind(target)
                elif unit_done:
                    self.pos = target
                    self.at_pos, self.at_pos_rng = self._capture_at(target)
                elif target == pos:
                    self.pos = target
                elif self.capture is not None and target == self.capture.bundle.pos:
                    # Others completed the step this rank abandoned: take their result, but
                    # only once the new generation has formed. Until then this rank's state
                    # stays at `pos`, the boundary it reported: if the sources are lost while
                    # forming, the next plan may go back there, and a rank already holding the
                    # step would run it a second time.
                    completed, _ = self._fetch_state(cmd.fetch_from, cmd.generation, target,
                                                       cmd.formation_timeout_s)
                else:
                    raise RuntimeError(f"cannot reach position {target} from {pos}")
                if cmd.publish:
                    self.publish(cmd.generation, full=False)
                self._clear_abort(cmd.generation)
                self.form(cmd)
                if completed is not None:
                    assert self.capture is not None
                    self._load_replicated(completed)
                    self._apply_bundle(self.capture.bundle.state(), data=False)
                    self.feed.advance()  # as the step's completion would (a seek too would skip a batch)
                    self.pos = target
                    self.at_pos, self.at_pos_rng = self.capture.bundle, self.capture.rng
                if cmd.verify:
                    self.verify_state(cmd.generation, None)
            except (CollectiveFailure, dist.DistError, TransferError, OSError) as exc:
                log.warning("recovery into generation %s failed (%s); waiting for the next plan",
                            cmd.generation, exc)
                self.group.drop()
                self.pos = pos
                continue
            self.server.retract()
            ctl.report(m.Formed(generation=cmd.generation, pos=self.pos))
            return

    def _restore_start(self, small: Any) -> None:
        """Undo what an abandoned step attempt changed: small state, streams, buffers."""
        self.tracked.restore_small(small)
        for scaler in self.tracked.scalers():
            reset_scaler_stage(scaler)
        if self.at_pos is not None:
            self._apply_bundle(self.at_pos.state(), data=False)

    def _restore_unit(self, unit: tuple[Pos, Any, Bundle | None, Any, bool]) -> None:
        pos, small, bundle, rng_state, _ = unit
        self.tracked.restore_small(small)
        if bundle is not None:
            self._apply_bundle(bundle.state(), data=False)
        self.pos, self.at_pos, self.at_pos_rng = pos, bundle, rng_state

    def _apply_bundle(self, state: dict[str, Any], data: bool = True) -> None:
        rng.restore(state["rng"], self.tracked.generators)
        buffers = self.tracked.local_buffers()
        with torch.no_grad():
            for name, value in state.get("buffers", {}).items():
                if name in buffers:
                    buffers[name].copy_(value)
        if self.tracked.local is not None and state.get("local"):
            self.tracked.local.load(state["local"])
        if "modes" in state:
            self.tracked.set_modes(state["modes"])
        if data and state.get("data") is not None:
            self.feed.seek(state["data"])

    def _fetch_state(self, sources: list[Any], generation: int, target: Pos,
                     timeout: float | None = None, kind: bytes = b"F") -> tuple[dict[str, Any], FetchStats]:
        """The state `sources` serve for `generation`, checked to be at `target`."""
        flat, stats = fetch_state([tuple(s) for s in sources], generation, self.token,
                                  timeout=timeout or self.formation_timeout, kind=kind)
        state = codec.decode(flat.meta, flat.tensors)
        if tuple(state["pos"]) != tuple(target):
            raise TransferError(f"sources serve position {state['pos']}, expected {list(target)}")
        return state, stats

    def _load_replicated(self, state: dict[str, Any]) -> None:
        late = state.get("late_buffers", {})
        added = self.tracked.adopt_late_buffers(late)
        if added:
            log.info("registered the buffers the source's forward made, which this rank's model lacked: %s",
                     ", ".join(added[:10]))
        broke = {key: reason for key, reason in late.get("broke_compile", {}).items() if key in added}
        if broke:
            detail = f"rank {self.rank} cannot take over bit for bit: in the rank it replaces, {describe(broke)}"
            self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                           differing=sorted(broke)[:200], detail=detail))
            raise Divergence(detail)
        self.tracked.load_replicated(state["replicated"])
        self.params_step = int(state["pos"][0])
        # DDP's "broadcast buffers before the next forward" flag as the step left it on the
        # sources: this rank restored the value from the start of the step it abandoned
        # (False after an evaluation forward), so it would skip the next broadcast alone.
        from baton.worker.ddp import adopt_state

        for ddp, ddp_state in zip(self.tracked.ddps, state["ddp"]):
            adopt_state(ddp, ddp_state)

    def _reset_ddp(self) -> None:
        """Discard what an interrupted step left in DDP's reducer and FSDP2's blocks."""
        from baton.worker.ddp import reset_after_failure

        for ddp in self.tracked.ddps:
            reset_after_failure(ddp)
        if self.tracked.sharded:
            shards.reset_after_failure(self.tracked)

    def _clear_abort(self, generation: int) -> None:
        with self.ctl.lock:
            if self.ctl.abort_generation is not None and self.ctl.abort_generation <= generation:
                self.ctl.abort_generation = None
            self.ctl.attention = self.ctl.abort_generation is not None

    # ================================================================ joining
    def _join(self) -> None:
        self.setup_s = time.perf_counter() - self.assigned_at
        log.info("the script's setup took %.3fs from this rank's assignment to its step loop", self.setup_s)
        if self.tracked.sharded:  # learns the capture only: no optimizer step, nothing to guard
            t0 = time.perf_counter()
            shards.prepare(self.tracked)
            log.info("shards prepared to be loaded in place in %.3fs", time.perf_counter() - t0)
        log.info("joiner ready for state")
        if self.prefetch is not None:
            self.prefetch.close()
            self.ctl.watch_forms(None)
        while True:
            cmd = self.wait_for(m.Form)
            gen, target = cmd.generation, tuple(cmd.pos)
            try:
                t0 = time.perf_counter()
                fetched = self.prefetch.take(cmd) if self.prefetch is not None else None
                state, stats = fetched if fetched is not None else self._fetch_for(cmd)
                t_fetched = time.perf_counter()
                self._load_replicated(state)
                sharded_expected = state.get("sharded_digest")
                if cmd.snapshot:  # check the load against what arrived (its chunks were checked on the way)
                    sharded_expected = verify.combined(shards.digests(state["sharded"]))
                self._load_sharded(state)
                assert self.loop is not None  # the joiner skipped the resume block: adopt its start
                self.loop = self.loop.model_copy(update={"start_step": int(state["loop_start"])})
                expected = None
                if cmd.full_state or cmd.snapshot:
                    bundle_state, expected = state["bundle"], state.get("digest")
                else:
                    bundle_state = self._lost_bundle(cmd.lost, target)
                self._check_setup(bundle_state.get("setup"))
                self._apply_bundle(bundle_state)
                self.pos = target  # type: ignore[assignment]
                self.at_pos = Bundle.of(self.rank, target, gen, 0, bundle_state)  # type: ignore[arg-type]
                self.at_pos_rng = bundle_state["rng"]
                self._clear_abort(gen)
                t_loaded = time.perf_counter()
                self.form(cmd)
                t_formed = time.perf_counter()
                self.verify_state(gen, expected, bundle_state=bundle_state, sharded_expected=sharded_expected)
                t_verified = time.perf_counter()
            except (CollectiveFailure, dist.DistError, TransferError, OSError) as exc:
                log.warning("joining generation %s failed (%s); waiting for the next plan", gen, exc)
                self.group.drop()
                continue
            log.info("joined generation %s at %s: fetch %.3fs (%d bytes), load %.3fs, form %.3fs, verify %.3fs",
                     gen, self.pos, t_fetched - t0, stats.bytes, t_loaded - t_fetched, t_formed - t_loaded,
                     t_verified - t_formed)
            self.ctl.report(m.Formed(generation=gen, pos=self.pos, bytes=stats.bytes, seconds=round(stats.seconds, 4),
                                     setup_s=round(self.setup_s, 4), fetch_wait_s=round(t_fetched - t0, 4)))
            self.joiner = False
            fence.lift()
            return

    def _fetch_for(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats]:
        """The state a joiner's Form says to fetch, from where it says."""
        target = tuple(cmd.pos)
        if cmd.snapshot and cmd.shards_from:  # HSDP: the shards from another replica group
            return self._fetch_from_replica(cmd, target)  # type: ignore[arg-type]
        if cmd.snapshot:  # a lost sharded rank: its buddy's copy of its whole state
            return self._fetch_state(cmd.fetch_from, snapshot_key(self.rank, target[0]), target,  # type: ignore[arg-type]
                                     cmd.formation_timeout_s, kind=SNAPSHOT)
        return self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s)  # type: ignore[arg-type]

    def _fetch_from_replica(self, cmd: m.Form, target: Pos) -> tuple[dict[str, Any], FetchStats]:
        """A lost HSDP rank: its own state from its buddy's copy, its shards from the own
        snapshot of a rank holding the same shards in another replica group."""
        state, stats = self._fetch_state(cmd.fetch_from, snapshot_key(small_id(self.rank), target[0]), target,
                                         cmd.formation_timeout_s, kind=SNAPSHOT)
        errors = []
        for peer, addr in sorted(cmd.shards_from.items()):
            try:
                peer_state, peer_stats = self._fetch_state([addr], snapshot_key(int(peer), target[0]), target,
                                                           cmd.formation_timeout_s, kind=SNAPSHOT)
            except (OSError, TransferError) as exc:
                errors.append(f"rank {peer}: {exc}")
                continue
            state["sharded"] = shards.with_rank_local(peer_state["sharded"], state["bundle"]["buffers"], self.rank)
            log.info("rank %d's shards from rank %d (another replica group), its own buffers from its buddy",
                     self.rank, peer)
            return state, FetchStats(bytes=stats.bytes + peer_stats.bytes, seconds=stats.seconds + peer_stats.seconds)
        raise TransferError(f"no replica of rank {self.rank}'s shards could be fetched: {'; '.join(errors)}")

    def _load_sharded(self, state: dict[str, Any], owned: bool = True) -> None:
        if not self.tracked.sharded:
            return
        if "sharded" not in state:
            raise Divergence(f"rank {self.rank}'s FSDP2 shards did not come with its state: only its "
                             "predecessor (or a copy of it) holds them (a baton bug; please report it)")
        self.loading = True  # the DCP helper may step a fresh optimizer once (lr 0) to create its state
        try:
            in_place = shards.load(self.tracked, state["sharded"], owned=owned)
            log.info("shards loaded: %s in place, %s through the DCP helpers", in_place or "none",
                     sorted(self.tracked.sharded - set(in_place)) or "none")
        finally:
            self.loading = False

    def _lost_bundle(self, lost: m.LostRank | None, target: Pos) -> dict[str, Any]:
        candidates: list[Bundle | None] = []
        if lost is not None and lost.held is not None:
            candidates.append(Bundle.from_text(lost.held.model_dump()))
        for buddy in (lost.buddies if lost is not None else []):
            try:
                candidates.append(fetch_ward_bundle(tuple(buddy), self.token, self.rank, target))
            except (OSError, TransferError) as exc:
                log.warning("could not read rank %d's bundle from %s: %s", self.rank, buddy, exc)
        best = newest(candidates, target)
        if best is None:
            raise TransferError(f"no record of rank {self.rank}'s own state at {target}")
        state = best.state()
        # The data position follows from the step; the epoch record only if it is this epoch's.
        here = self.feed.position_at(target[0])
        if here is not None:
            record = (state.get("data") or {}).get("record")
            if record is not None and record.get("epoch") == here["epoch"]:
                here["record"] = record
            else:
                here["record"] = None
            state["data"] = here
        return state

    def _check_setup(self, theirs: dict[str, int] | None) -> None:
        """A joiner: stop loudly if its setup built other data or drew other numbers than its
        predecessor's did before the step loop (setup_check)."""
        differing = setup_check.differences(self.setup, theirs) if theirs else []
        if differing:
            detail = setup_check.explain(self.rank, differing)
            self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                           differing=[f"setup.{n}" for n in differing][:200], detail=detail))
            raise Divergence(detail)

    def _lineage_broken(self) -> None:
        """Stop the job loudly: this rank's parameters are not at the step it is about to run."""
        detail = (f"rank {self.rank}'s parameters hold the updates of {self.params_step} steps but it is about to "
                  f"run step {self.pos[0]}: a step would be applied twice or skipped (a baton bug; please "
                  "report it with this job's run directory)")
        self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                       differing=["step count"], detail=detail))
        raise Divergence(detail)

    # ================================================================ forming and checking
    def form(self, cmd: m.Form) -> None:
        generation = cmd.generation

        def superseded() -> bool:
            with self.ctl.lock:
                return self.ctl.abort_generation is not None and self.ctl.abort_generation > generation

        self.group.form(self.store, generation, self.op_timeout, cmd.formation_timeout_s or self.formation_timeout,
                        superseded)
        self.pusher.set_buddies([tuple(b) for b in cmd.buddies])
        self.ward_addrs = {int(w): (str(a[0]), int(a[1])) for w, a in cmd.wards.items()}
        if self._snapshotting():
            self.snapshots.set_wards(self.ward_addrs, light=bool(self.replicas))

    def _replicated_digests(self, replicated: dict[str, Any]) -> dict[str, int]:
        """Digests of what every replica holds (BatchNorm-style buffers are each rank's own)."""
        out = verify.entries(replicated)
        for name in self.tracked.local_buffers():
            out.pop(name, None)
        return out

    @staticmethod
    def _local_digests(bundle_state: dict[str, Any]) -> dict[str, int]:
        """Digests of a rank's own state (the data position is a function of the step; the
        non-persistent buffers' digests are compared on their own, see module_state)."""
        return verify.entries({k: v for k, v in bundle_state.items() if k not in ("data", "volatile")},
                              "rank-local")

    def _copy_slots(self) -> int:
        """How many (ward, digest) pairs each rank sends in the state check: the same on every
        rank (an allgather's tensors must agree), two per buddy a rank is meant to have."""
        return 2 * self.redundancy if self.tracked.sharded and not self.replicas else 0

    def _copy_digests(self) -> list[tuple[int, int]]:
        """(ward, digest of its shards) for each copy of a ward's snapshot held here at this
        very boundary: after a recovery, every rank's shards can be compared with a copy that
        another process made of them (shards differ across FSDP ranks, so no replica can)."""
        if not self._snapshotting() or self.replicas:
            return []
        out = []
        for ward in sorted(self.wards)[:self._copy_slots()]:
            flat = self.snapshots.copy_at(ward, self.pos)
            if flat is not None:
                out.append((ward, _shards_digest(flat)))
        return out

    def _own_snapshot_digest(self) -> int | None:
        """The digest of this rank's shards in its own snapshot of this very boundary, where no
        buddy's copy of it can be compared yet (pure FSDP: the buddy pulls it while the step
        runs, and a failure can come first): after going back to the boundary, the live
        shards must still be what was snapshotted there. None: no such snapshot (a joiner's,
        HSDP's, none taken at this position)."""
        if self.joiner or self.replicas or not self._snapshotting():
            return None
        flat = self.snapshots.own(self.pos[0])
        if flat is None or position_of(flat) != tuple(self.pos):
            return None
        return _shards_digest(flat)

    def verify_state(self, generation: int, expected: int | None, periodic: bool = False,
                     bundle_state: dict[str, Any] | None = None, sharded_expected: int | None = None) -> None:
        """Replicas agree on replicated state; a joiner holds exactly what it was sent.
        Every rank of a new generation runs it at the same boundary (a joiner as it joins), so
        it stands for the periodic check there: a rank that ran it again alone would wait
        in a collective the others never enter."""
        self.verified_at = self.pos
        digests = self._replicated_digests(self.tracked.replicated())
        mine = verify.combined(digests)
        # HSDP: every replica group holds the same shards, so those must agree too (not the
        # sharded models' buffers: each rank's are its own).
        shard_digests = shards.digests(shards.without_rank_local(self.tracked, shards.capture(self.tracked))) \
            if self.replicas else {}
        copies = self._copy_digests() if not periodic else []
        t = torch.tensor([verify.to_signed(mine), verify.to_signed(verify.combined(shard_digests)),
                          *[x for ward, digest in copies for x in (ward, verify.to_signed(digest))]]
                         + [-1, 0] * (self._copy_slots() - len(copies)), dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self.group.internal():
            self._wait_internal(self.group.allgather([out], [t]), "the state check")
        rows = [x.tolist() for x in out]
        values = [row[0] for row in rows]
        differing: list[str] = []
        detail = ""
        holders = [(q, row[i + 1]) for q, row in enumerate(rows) for i in range(2, len(row), 2) if row[i] == self.rank]
        own_copy = None if holders or periodic else self._own_snapshot_digest()
        # This rank's shards, digested once for the checks below that need them (a pass over them all).
        live_shards = verify.combined(shards.digests(shards.capture(self.tracked))) \
            if holders or sharded_expected is not None or own_copy is not None else None
        if own_copy is not None and own_copy != live_shards:
            differing.append("sharded (own snapshot)")
            detail = (f"rank {self.rank}'s FSDP2 shards differ from its own snapshot of step {self.pos[0]}'s "
                      "boundary, taken before the failure (no buddy held a copy of it yet)")
        if holders:  # pure FSDP: this rank's shards against its buddies' copies of its snapshot here
            apart = [q for q, digest in holders if digest != verify.to_signed(live_shards)]
            if apart:
                differing.append("sharded (buddy copies)")
                detail = (f"rank {self.rank}'s FSDP2 shards differ from the copy of its snapshot at step {self.pos[0]} "
                          f"that rank(s) {apart} hold")
        if self.replicas:
            sharded = [row[1] for row in rows]
            apart = [p for p in self.replicas if sharded[p] != sharded[self.rank]]
            if apart:
                differing.append("sharded (replica groups)")
                detail = (f"rank {self.rank}'s FSDP2 shards differ from those of rank(s) {apart}, which hold the "
                          "same shards in other replica groups")
        if len(set(values)) > 1:
            key = f"baton/gen{generation}/verify/{self.pos[0]}/{self.pos[1]}"
            deadline = time.monotonic() + self.formation_timeout
            self.store.call(lambda s: s.set(f"{key}/{self.rank}", json.dumps(digests)), deadline)
            majority = max(set(values), key=values.count)
            ref = values.index(majority)
            theirs = json.loads(self.store.call(lambda s: s.get(f"{key}/{ref}"), deadline))
            differing += verify.differing(digests, {k: int(v) for k, v in theirs.items()})
            bad = [r for r, v in enumerate(values) if v != majority]
            detail += ("; " if detail else "") + f"replicated state differs on ranks {bad} (compared with rank {ref})"
        if expected is not None or bundle_state is not None:
            live = self._capture_at(self.pos)[0].state()
            if expected is not None:
                if verify.combined({**digests, **self._local_digests(live)}) != expected:
                    detail += ("; " if detail else "") + "the joiner's state differs from what its predecessor sent"
                    differing.append("joiner")
            elif bundle_state is not None:
                diff = verify.differing(self._local_digests(live), self._local_digests(bundle_state))
                if diff:
                    differing += diff
                    detail += ("; " if detail else "") + "the joiner's own state differs from its record"
            if bundle_state is not None:
                volatile = module_state.differing_buffers(live["volatile"], bundle_state.get("volatile", {}))
                if volatile:
                    differing += [f"rank-local.volatile.{name}" for name in volatile]
                    detail += ("; " if detail else "") + module_state.differing_volatile(volatile)
        if sharded_expected is not None and live_shards != sharded_expected:
            differing.append("sharded")
            detail += ("; " if detail else "") + "the joiner's FSDP2 shards differ from what its predecessor sent"
        ok = not differing
        if ok and periodic:
            return
        self.ctl.report_now(m.Verified(generation=generation, pos=self.pos, ok=ok, differing=differing[:200],
                                       detail=detail))
        if not ok:
            raise Divergence(f"state check failed at step {self.pos[0]}: {detail}: {', '.join(differing[:20])}")

    # ================================================================ finishing
    @selfcost.counted
    def finish(self) -> None:
        """Report the end, then stay available until every rank is done: a rank lost at the
        very end is still replaced, with its state from these survivors."""
        if self.finished:
            return
        self.finished = True
        self.ctl.report(m.Finished(pos=self.pos, cpu=cpu_report()))
        while True:
            cmd = self.ctl.wait_command(0.5)
            if cmd is None:
                continue
            if isinstance(cmd, m.Done):
                break
            if isinstance(cmd, m.Abort):
                self.finished = False
                self.recover(in_step=False, error="peer lost after the step loop")
                self.finished = True
                self.ctl.report(m.Finished(pos=self.pos, cpu=cpu_report()))
        self.ctl.flush()
        self.ctl.stop()
        self.pusher.close()
        self.server.close()

    # ================================================================ helpers
    def wait_for(self, *kinds: type) -> Any:
        while True:
            cmd = self.ctl.wait_command(1.0)
            if cmd is None:
                continue
            if isinstance(cmd, kinds):
                return cmd
            if isinstance(cmd, m.Stop):
                exit_quietly(0)


def _shards_digest(snapshot: FlatState) -> int:
    """The digest of the FSDP2 shards a snapshot holds, comparable with the live shards'."""
    return verify.combined(shards.digests(codec.decode(snapshot.meta, list(snapshot.tensors))["sharded"]))


def _text(b: Bundle) -> m.BundleText:
    return m.BundleText.model_validate(b.to_text())


def _ports_of(url: str, store: str) -> set[int]:
    ports = set()
    for text in (url.rsplit(":", 1)[-1].split("/")[0], store.rsplit(":", 1)[-1]):
        if text.isdigit():
            ports.add(int(text))
    return ports


def exit_quietly(code: int) -> NoReturn:
    """Flush what was printed and leave now, without interpreter teardown: gloo's threads
    could still be dropping a collective's tensors then and abort the process
    (baton/examples/plain_exit.py says how)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

