"""The worker's side of every protocol: the step and boundary units, and the class that
joins the others (captures and the gate: capture.py; planned hand-over: handover.py; shard
redundancy: redundancy.py; unplanned losses: recovery.py; joining: joining.py; forming and
the state check: state_check.py), each a mixin over the one Runtime's attributes, as the
orchestrator's protocols are.

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

from dataclasses import dataclass
from datetime import timedelta
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch.distributed as dist

from baton import selfcost
from baton.control import messages as m
from baton.control.buddies import wards_of
from baton.store.rendezvous import RendezvousClient
from baton.transfer import codec
from baton.transfer.bundles import Bundle, Frame, Pos
from baton.transfer.server import PUSH, TransferServer, connect
from baton.worker import rng, setup_check, shards
from baton.worker.bundle import BundlePushers, StepCapture
from baton.worker.capture import Captures, bundle_text
from baton.worker.collectives import Record, RecordingGroup
from baton.worker.compile_watch import describe
from baton.worker.control import ControlChannel, cpu_report
from baton.worker.data import DataFeed
from baton.worker.ddp import ddp_layout_known
from baton.worker.exit import exit_quietly
from baton.worker.group import CollectiveFailure, LiveGroup, install_as_world
from baton.worker.handover import PlannedHandover
from baton.worker.hot import HotSpares
from baton.worker.joining import Joining
from baton.worker.precopy import PreCopying
from baton.worker.prefetch import Prefetch
from baton.worker.recovery import Recovery
from baton.worker.redundancy import ShardRedundancy
from baton.worker.snapshots import Snapshots
from baton.worker.state_check import PendingCheck, StateCheck
from baton.worker.tracked import Tracked, UsageError

log = logging.getLogger("baton.worker")


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


class Runtime(Captures, PlannedHandover, ShardRedundancy, Recovery, Joining, StateCheck, PreCopying, HotSpares):
    """One rank's runtime: its loop position, tracked state and channels; the protocols it
    speaks are the mixins'."""

    # baton.init() runs inside the script, which may have built its optimizer before it: the
    # step loop then looks for such untracked objects (discover). No code change runs the
    # script under baton from its first line: ScriptRuntime sets this False.
    script_ran_before_discovery = True
    # A move's state check overlaps the next step's forward and backward (state_check).
    defer_checks = True
    # A DDP joiner of a recovery fetches the survivors' state while its script sets up
    # (prefetch); a no-code joiner fetches as it walks to its rank's place instead.
    prefetch_replicated = True

    def __init__(self, ctl: ControlChannel, server: TransferServer, store: RendezvousClient, rank: int,
                 world_size: int, joiner: bool, config: m.Registered, token: str):
        self.rank, self.world_size, self.joiner = rank, world_size, joiner
        self.assignment: m.Assign | None = None  # the orchestrator's word that made this process a rank
        self.setup: dict[str, int] = {}  # the setup's fingerprint where the step loop starts (setup_check)
        self.ctl, self.server, self.store, self.token = ctl, server, store, token
        self.assigned_at = time.perf_counter()  # made right after the rank's assignment
        self.setup_s = 0.0
        self.setup_in_pause_s = 0.0  # the part of setup_s training waited for (joining._join)
        self.op_timeout = float(config.op_timeout_s)
        self.formation_timeout = float(config.formation_timeout_s)
        self.verify_every = int(config.verify_every)
        self.redundancy = int(config.redundancy)
        self.hot_spares = bool(config.hot_spares)
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
        self.pending_check: PendingCheck | None = None  # a move's state check still being digested
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
        self._last_step_end = 0.0  # perf_counter at the last step's end: the step period's start
        self.warned_no_capture = False
        self.backward_captured = False  # the syncing backward's start captured this step's bundle
        self.backward_token: object | None = None  # identifies the latest syncing forward
        self.pusher = BundlePushers(lambda addr: connect(addr, token, PUSH, timeout=self.op_timeout),
                                    first_wait_s=self.op_timeout)
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
        # job (rank 0's goes to each later joiner with its assignment, a rank's own to its
        # joiners where a result was the rank's own), answered from it in a joiner, whose peers
        # ran them long ago.
        self.setup_record = Record()
        self._setup_answers_read = False
        self._recording_groups: dict[int, RecordingGroup] = {}  # by id of the live group they run on
        self.prefetch: Prefetch | None = None
        if joiner:  # a joiner's state can be on its way while the script builds its model
            # Not with --hot-spares: a hot spare's mirror (given after this) holds that state.
            self.prefetch = Prefetch(self._fetch_for, replicated=lambda: self.prefetch_replicated and
                                     not self.hot_spares)
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
            if self.pending_check is not None and (self.pos[1] < len(due) or gap >= total):
                self._checked(self.finish_pending_check)  # before a boundary function or the end
                continue
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
            self.ctl.report_now(m.Ready(loop=self.loop, bundle=bundle_text(start_bundle), setup=self.setup_text()))

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
            opt.register_step_pre_hook(self._check_before_commit)
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
        for opt in self.tracked.optimizers():  # last: the step's own checks have passed when it runs
            opt.register_step_pre_hook(self._feed_before_optimizer_step)
        codec.encode(self.tracked.replicated())
        return sharded

    def _boundary(self) -> bool:
        """The hot-path check before each step: one uncontended lock and a few reads."""
        ctl = self.ctl
        with ctl.lock:
            proceed = not ctl.attention
            if proceed:
                ctl.started = self.pos[0]
        if not proceed:
            self._on_attention()
            if not self._attend():
                return False
        # Every rank runs the checks due here, whether or not a command made it look closer
        # (a rank that skipped the periodic check for a pause still ahead left the others
        # waiting in its collective until they timed out).
        if self.pending_check is not None and self.pending_check.pos != self.pos:
            return self._checked(self.finish_pending_check)  # a step with no optimizer step (inf grads)
        if self.verify_every and self.pos[0] > 0 and self.pos[0] % self.verify_every == 0 and \
                self.pos != self.verified_at:
            return self._checked(lambda: self.verify_state(self.group.generation, None, periodic=True))
        return True

    def _on_attention(self) -> None:
        """A command is due at this boundary, seen under the lock that decides whether it
        stops here: what a move from here hands over must describe this boundary (the
        no-code runtime captures its loop head now)."""

    def _attend(self) -> bool:
        """The boundary's closer look, after a command: whether this rank steps on from here
        (a pause still ahead) or not (it paused, or recovered from a lost peer)."""
        ctl = self.ctl
        with ctl.lock:
            feed_op, ctl.pre_copy_op = ctl.pre_copy_op, None
            hot_op, ctl.hot_feed_op = ctl.hot_feed_op, None
            drop_base, ctl.hot_base_drop = ctl.hot_base_drop, None
            abort = ctl.abort_generation
        if feed_op == -1:
            self._stop_feed()
        elif feed_op is not None and abort is None:
            self._start_feed(feed_op)  # a planned move's joiner takes the state from here on
        if drop_base is not None and self.hot_feed is not None and self.hot_feed.op == drop_base:
            self.hot_feed.drop_base()
        if hot_op == -1:
            self._stop_hot_feed()
        elif hot_op is not None and abort is None:
            self._start_hot_feed(hot_op)  # the hot spares mirror the replicated state from here on
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

    def _check_before_commit(self, *_: Any) -> None:
        """A deferred state check ends before the step's first optimizer step commits it."""
        if self.pending_check is not None and not self.loading:
            self.finish_pending_check()

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
        self.ctl.outside_steps(False)
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
        for feed in (self.pre_copy, self.hot_feed):
            if feed is not None:
                feed.end_step(self.pos[0] - 1)
        self.at_pos, self.at_pos_rng = self.capture.bundle, self.capture.rng
        now = time.perf_counter()
        hb = self.ctl.heartbeat
        hb["step"] = self.pos[0]
        self.ctl.step_reached = time.monotonic()
        dt = now - self._step_t0
        ema = hb.get("step_time")
        hb["step_time"] = dt if ema is None else 0.8 * ema + 0.2 * dt
        if self._last_step_end:
            period, ema = now - self._last_step_end, hb.get("step_period")
            hb["step_period"] = period if ema is None else 0.8 * ema + 0.2 * period
        self._last_step_end = now
        if self._busy_s is not None:
            ema = hb.get("busy_time")
            hb["busy_time"] = self._busy_s if ema is None else 0.8 * ema + 0.2 * self._busy_s
        if self.metrics:
            hb["metrics"] = dict(self.metrics)
        if "state_mb" not in hb and not self.tracked.sharded:
            hb["state_mb"] = self._replicated_mb()

    def _replicated_mb(self) -> float:
        """The size of the replicated state a joiner receives, once a step has given the
        optimizers their state: spares map that much receive memory ahead (pool.py)."""
        from baton.transfer.codec import tensors_in

        return round(sum(t.numel() * t.element_size() for t in tensors_in(self.tracked.replicated())) / 2**20, 1)

    def _note_step_end(self) -> None:
        """What the step registered inside compiled code (compile_watch); the orchestrator
        learns, with the next heartbeat, that this rank can no longer move bit for bit."""
        self.tracked.note_step_end()
        for ddp in self.tracked.ddps:
            ddp_layout_known(ddp)
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
        self.ctl.outside_steps(True)
        try:
            with selfcost.outside():
                unit.fn(BoundaryInfo(gap, epoch))
            self.scope = self.tracked.scope = None
            self._note_step_end()
            after = (gap, self.pos[1] + 1)
            bundle, after_rng = self._capture_at(after)
            self.ctl.report_now(m.UnitDone(pos=after, bundle=bundle_text(bundle)))
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
                while self.pending_check is not None:
                    self._checked(self.finish_pending_check)
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


def _ports_of(url: str, store: str) -> set[int]:
    ports = set()
    for text in (url.rsplit(":", 1)[-1].split("/")[0], store.rsplit(":", 1)[-1]):
        if text.isdigit():
            ports.add(int(text))
    return ports
