"""What a training script uses: `baton.init()`, `Job.wrap/track/steps/finish`, `Step`.

A step boundary is the only place a rank changes hands. In steady state the
boundary costs one uncontended lock and a few attribute reads; everything else
(heartbeats, step reports, commands) runs on background threads.

Failure handling inside `with step:`: an exception is absorbed when the live
group saw a collective fail or the orchestrator announced a lost peer; any
other exception is the user's own bug and ends the job with its traceback.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from baton.transfer import TransferServer, fetch_state
from baton.worker import statecap
from baton.worker.control import ControlChannel
from baton.worker.data import DataFeed
from baton.worker.group import CollectiveFailure, LiveGroup, install_as_world, solo_group

log = logging.getLogger("baton.worker")

ENV_URL, ENV_TOKEN, ENV_WORKER, ENV_STORE, ENV_SLOT = (
    "BATON_URL", "BATON_TOKEN", "BATON_WORKER_ID", "BATON_STORE", "BATON_SLOT")


class Step:
    """One optimizer step. Use as a context manager so a failure inside it can be absorbed."""

    def __init__(self, job: "Job", index: int, batch: Any):
        self.index = index
        self.batch = batch
        self._job = job
        self.failed = False
        self.completed = False
        self.error: str = ""

    def __enter__(self) -> "Step":
        self._job._optimizer_stepped = False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.completed = True
            return False
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            return False
        if self._job._is_peer_failure(exc):
            self.failed = True
            self.error = f"{exc_type.__name__}: {exc}"
            return True
        self._job._report_user_error(exc_type, exc, tb)
        return False


class Job:
    """The handle a training script holds: its rank, the live group, and the step loop."""

    def __init__(self, ctl: ControlChannel, server: TransferServer, store: dist.Store, rank: int,
                 world_size: int, joiner: bool, config: dict[str, Any], token: str):
        self.rank = rank
        self.world_size = world_size
        self.group = LiveGroup(rank, world_size)
        self.slot = os.environ.get(ENV_SLOT, "")
        self._ctl = ctl
        self._server = server
        self._store = store
        self._token = token
        self._joiner = joiner
        self._config = config
        self._op_timeout = float(config.get("op_timeout_s", 5.0))
        self._formation_timeout = float(config.get("formation_timeout_s", 120.0))
        self._ddps: list[DistributedDataParallel] = []
        self._tracked: dict[str, Any] = {}
        self._feed = DataFeed(None)
        self._optimizer_stepped = False
        self._start_index = 0
        self._step_times: list[float] = []
        self._metrics: dict[str, float] = {}
        self._boundary_rng: tuple[int, dict[str, Any]] | None = None
        self._sent_rng: dict[str, Any] | None = None
        self._finished = False
        self.group.known_local_ports.add(server.address[1])
        self.group.known_remote_ports.update(_ports_of(os.environ.get(ENV_URL, ""), os.environ.get(ENV_STORE, "")))
        install_as_world(self.group, store)
        ctl.local_snapshot = self._encoded_snapshot
        ctl.on_abort = lambda: self.group.note_failure("a peer was lost (orchestrator abort)")
        if not joiner:
            cmd = self._wait_for("form")
            self._form(int(cmd["generation"]))
            self._ctl.report("formed", generation=int(cmd["generation"]), step=0)

    # ------------------------------------------------------------------ user API
    def wrap(self, model: torch.nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
        """DistributedDataParallel whose gradients are averaged over the live group.

        DDP runs over a world-of-one group with a comm hook that sends each bucket to
        the live group: DDP's own collectives never involve peers, and the bucket layout
        is fixed from the parameter order at construction, so a freshly built DDP on a
        joiner reduces exactly like the survivors' (same bits, same float summation order).
        """
        if isinstance(model, DistributedDataParallel):
            raise TypeError("job.wrap() takes the bare module; it builds DistributedDataParallel itself")
        for key in ("process_group", "init_sync"):
            if key in ddp_kwargs:
                raise TypeError(f"job.wrap() sets {key} itself")
        if not self._joiner:
            self._broadcast_from_rank0(model)
        ddp = _LiveDDP(model, process_group=solo_group(), init_sync=False, **ddp_kwargs)
        ddp.register_comm_hook(self, _allreduce_hook)
        _fix_bucket_layout(ddp)
        buffers = [b for b in model.buffers()]
        if buffers and ddp.forward_sync_buffers:
            # DDP's own buffer broadcast would go to its world-of-one group: do it on the live one.
            model.register_forward_pre_hook(
                lambda *_: dist._broadcast_coalesced(self.group, buffers, 250 * 1024 * 1024, 0))
        self._ddps.append(ddp)
        return ddp

    def track(self, **objects: Any) -> None:
        """Register what must migrate. Everything needs state_dict()/load_state_dict(), except
        `data`, an iterable of batches (a DataLoader) whose position baton tracks itself."""
        for name, obj in objects.items():
            if name == "data":
                self._feed = DataFeed(obj)
                continue
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"job.track({name}=...): {type(obj).__name__} has no "
                                "state_dict()/load_state_dict(), so it cannot migrate")
            self._tracked[name] = obj
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_post_hook(self._on_optimizer_step)

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps up to `total`; a joiner starts at the step its rank was on."""
        if self._joiner:
            self._join()
        else:
            self._ctl.report("ready")
        index = self._start_index
        ctl = self._ctl
        last = time.perf_counter()
        while index < total:
            # ---- step boundary (hot path: one uncontended lock, no I/O) ----
            with ctl.lock:
                proceed = not ctl.attention
                if proceed:
                    ctl.started = index
            if not proceed:
                index, proceed = self._interrupt(index)
                if not proceed:
                    continue
            step = Step(self, index, self._feed.batch())
            yield step
            if step.failed:
                index = self._recover(index, step)
                last = time.perf_counter()
                continue
            self._feed.advance()
            index += 1
            now = time.perf_counter()
            self._note_boundary(index, now - last)
            last = now
        self._start_index = index

    def log(self, **metrics: float) -> None:
        """Attach metrics (loss, ...) to this rank's next heartbeat; shown by `baton status`."""
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    def finish(self) -> None:
        """Report completion and leave the group; the launcher ends spares once all ranks finish."""
        if self._finished:
            return
        self._finished = True
        self._ctl.report("finished", step=self._start_index)
        self._ctl.flush()
        self._ctl.stop()
        self._server.close()
        # Interpreter teardown would destroy gloo groups with the GIL held, which can hang;
        # once the script is done, leave without it (after the script's own atexit work).
        atexit.register(_exit_now)

    # ------------------------------------------------------------------ internals: steady state
    def _note_boundary(self, index: int, step_time: float) -> None:
        hb = self._ctl.heartbeat
        hb["step"] = index
        ema = hb.get("step_time")
        hb["step_time"] = step_time if ema is None else 0.8 * ema + 0.2 * step_time
        if self._metrics:
            hb["metrics"] = dict(self._metrics)
        # Rank-local RNG at this boundary (~25 us): what a spare restores if this rank dies
        # in the next step. It reaches the orchestrator with the next heartbeat.
        self._boundary_rng = (index, statecap.capture_rng())

    def _encoded_snapshot(self) -> tuple[int, str | None] | None:
        """(step, encoded rank-local snapshot) for the next heartbeat. The encoding is None when
        the RNG streams did not move since the last one sent (the common case: no dropout):
        the orchestrator's copy is then still valid at `step`, and heartbeats stay small."""
        snap = self._boundary_rng
        if snap is None:
            return None
        step, rng = snap
        if self._sent_rng is not None and statecap.same_rng(self._sent_rng, rng):
            return step, None
        self._sent_rng = rng
        return step, statecap.encode({"rng": rng})

    def _on_optimizer_step(self, *_: Any) -> None:
        self._optimizer_stepped = True

    def _is_peer_failure(self, exc: BaseException) -> bool:
        if self.group.failed.is_set():
            return True
        with self._ctl.lock:
            if self._ctl.abort_generation is not None:
                return True
        return isinstance(exc, (CollectiveFailure, dist.DistError))

    def _report_user_error(self, exc_type, exc, tb) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        try:
            self._ctl.report_now("user_error", traceback=text, exit_code=1)
        except Exception:  # noqa: BLE001 - the process is failing anyway; the exit code tells
            pass

    # ------------------------------------------------------------------ internals: interrupts
    def _interrupt(self, index: int) -> tuple[int, bool]:
        """Something needs this rank at the boundary before step `index`.

        Returns (index to continue from, whether to run that step now)."""
        ctl = self._ctl
        with ctl.lock:
            abort = ctl.abort_generation
            if abort is None and (ctl.pause_at is None or index < ctl.pause_at):
                ctl.started = index  # a pause is pending further ahead: keep stepping
                ctl.attention = ctl.pause_at is not None
                return index, True
            op = ctl.pause_op
        if abort is not None:
            return self._recover(index, None), False
        return self._paused(index, op), False

    def _paused(self, index: int, op: int | None) -> int:
        ctl = self._ctl
        ctl.report("paused", op=op, step=index)
        log.info("paused at %s", index)
        while True:
            with ctl.lock:
                if ctl.abort_generation is not None:
                    return self._recover(index, None)
                if ctl.pause_at is not None and ctl.pause_at > index:
                    return index  # re-targeted later: keep stepping
            cmd = ctl.wait_command(0.05)
            if cmd is None or cmd["type"] == "_wake":
                continue
            if cmd["type"] == "form":
                gen = int(cmd["generation"])
                log.info("form %s received", gen)
                self._form(gen)
                log.info("formed %s", gen)
                with ctl.lock:
                    ctl.pause_at = ctl.pause_op = None
                    ctl.attention = ctl.abort_generation is not None
                ctl.report("formed", generation=gen, step=index)
                return index
            if cmd["type"] == "publish":
                self._publish(int(cmd["generation"]), index, full=True)
                if cmd.get("leave") and not self._leave():
                    # The move was superseded by a failure elsewhere: stay, as a survivor.
                    self._server.retract()
                    return self._recover(index, None)
            if cmd["type"] == "abort":
                return self._recover(index, None)

    def _leave(self) -> bool:
        """This rank moved to a spare: wait until the orchestrator confirms, then exit.

        Returns False (without exiting) when the move is called off by a failure elsewhere."""
        ctl = self._ctl
        while True:
            cmd = ctl.wait_command(0.5)
            if cmd is not None and cmd["type"] in ("release", "stop"):
                break
            with ctl.lock:
                if ctl.abort_generation is not None:
                    return False
        ctl.report("left")
        ctl.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _recover(self, index: int, step: Step | None) -> int:
        """Absorb a lost peer. Returns the step index to continue from."""
        ctl = self._ctl
        for ddp in self._ddps:
            _reset_after_failure(ddp)
        self.group.drop()
        boundary = index
        rerun = step is not None
        if step is not None and self._optimizer_stepped:
            # The optimizer step of the failed step had run: this rank's state is the next boundary.
            self._feed.advance()
            boundary, rerun = index + 1, False
        while True:
            with ctl.lock:
                ctl.pause_at = ctl.pause_op = None
            ctl.report("recover", step=boundary, rerun=rerun,
                       error=step.error if step is not None else "peer lost at a boundary")
            cmd = self._wait_for("form", also=("abort",))
            if cmd["type"] == "abort":
                continue
            gen, target = int(cmd["generation"]), int(cmd["step"])
            try:
                if cmd.get("publish"):
                    self._publish(gen, boundary, full=False)
                if cmd.get("fetch_from"):
                    state, nbytes, secs = self._fetch(cmd["fetch_from"], gen)
                    self._load(state, local=False)  # also moves the data feed to `target`
                    boundary = target
                self._clear_abort(gen)
                self._form(gen)
            except Exception as exc:  # noqa: BLE001 - another failure while recovering
                log.warning("recovery of generation %s failed (%s); waiting for the next plan", gen, exc)
                self.group.drop()
                continue
            self._server.retract()
            ctl.report("formed", generation=gen, step=target)
            return target

    def _join(self) -> None:
        """A spare became this rank: fetch the rank's state, load it, join the group."""
        log.info("joiner ready for state")
        while True:
            cmd = self._wait_for("form")
            log.info("form %s received", cmd["generation"])
            gen, target = int(cmd["generation"]), int(cmd["step"])
            try:
                state, nbytes, secs = self._fetch(cmd["fetch_from"], gen)
                log.info("fetched %d bytes in %.4fs", nbytes, secs)
                self._load(state, local=bool(cmd.get("full_state")))
                log.info("state loaded")
                if not cmd.get("full_state") and cmd.get("local_state"):
                    local = statecap.decode(cmd["local_state"])
                    statecap.restore_rng(local["rng"])
                self._form(gen)
            except Exception as exc:  # noqa: BLE001
                log.warning("joining generation %s failed (%s); waiting for the next plan", gen, exc)
                self.group.drop()
                continue
            self._start_index = target
            log.info("formed generation %s", gen)
            self._clear_abort(gen)
            self._ctl.report("formed", generation=gen, step=target, bytes=nbytes, seconds=secs)
            self._joiner = False
            return

    def _clear_abort(self, generation: int) -> None:
        """Forget aborts this generation answers; a newer one (a second failure) stays set,
        so forming `generation` is abandoned at once instead of waiting for its timeout."""
        with self._ctl.lock:
            if self._ctl.abort_generation is not None and self._ctl.abort_generation <= generation:
                self._ctl.abort_generation = None
            self._ctl.attention = self._ctl.abort_generation is not None

    # ------------------------------------------------------------------ internals: state
    def _capture(self, boundary: int, full: bool) -> dict[str, Any]:
        state = {
            "replicated": {name: obj.state_dict() for name, obj in self._tracked.items()},
            "local": {"data": self._feed.position(), "step": boundary},
        }
        if full:
            state["local"]["rng"] = statecap.capture_rng()
        return state

    def _publish(self, generation: int, boundary: int, full: bool) -> None:
        self._server.publish(generation, statecap.pack(self._capture(boundary, full)))

    def _fetch(self, sources: list[Any], generation: int) -> tuple[dict[str, Any], int, float]:
        flat, stats = fetch_state([tuple(s) for s in sources], generation, self._token,
                                  timeout=self._formation_timeout)
        return statecap.unpack(flat), stats.bytes, stats.seconds

    def _load(self, state: dict[str, Any], local: bool) -> None:
        for name, sd in state["replicated"].items():
            if name not in self._tracked:
                raise RuntimeError(f"state for {name!r} arrived but this process tracks "
                                   f"{sorted(self._tracked)}: call job.track() with the same names on every rank")
            self._tracked[name].load_state_dict(sd)
        self._feed.seek(state["local"]["data"])
        if local and "rng" in state["local"]:
            statecap.restore_rng(state["local"]["rng"])

    def _form(self, generation: int) -> None:
        def superseded() -> bool:
            with self._ctl.lock:
                return self._ctl.abort_generation is not None and self._ctl.abort_generation > generation

        self.group.form(self._store, generation, self._op_timeout, self._formation_timeout, superseded)

    def _broadcast_from_rank0(self, model: torch.nn.Module) -> None:
        """Initial ranks start from rank 0's parameters, as DDP's constructor would do."""
        tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
        if tensors:
            dist._broadcast_coalesced(self.group, tensors, 250 * 1024 * 1024, 0)

    def _wait_for(self, kind: str, also: tuple[str, ...] = ()) -> dict[str, Any]:
        while True:
            cmd = self._ctl.wait_command(1.0)
            if cmd is None or cmd["type"] == "_wake":
                continue
            if cmd["type"] == kind or cmd["type"] in also:
                return cmd
            if cmd["type"] == "stop":
                _exit_quietly(0)


class _LiveDDP(DistributedDataParallel):
    """DistributedDataParallel that lists its parameters to the reducer last-layer first.

    baton fixes the bucket layout at construction (see _fix_bucket_layout) from the
    reducer's parameter order. Listing parameters in reverse puts the last layers, whose
    gradients are ready first, in the first bucket: communication overlaps the backward
    pass as it does with DDP's own rebuilt buckets.
    """

    def _build_params_for_reducer(self):  # noqa: ANN202 - torch's private hook point
        params, expect_sparse = super()._build_params_for_reducer()
        return list(reversed(params)), list(reversed(expect_sparse))


def _allreduce_hook(job, bucket):  # DDP inspects real annotations; see below
    buffer = bucket.buffer()
    buffer.div_(job.world_size)  # average as DDP's default hook does: divide, then sum
    return job.group.allreduce([buffer]).get_future().then(_first)


def _first(fut):
    return fut.value()[0]


_allreduce_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def _fix_bucket_layout(ddp: DistributedDataParallel) -> None:
    """Build the final bucket layout now, from parameter order, instead of after the first step.

    DDP normally rebuilds buckets in gradient-ready order after iteration one; a joiner's
    fresh DDP would then reduce its first step with a different layout than the
    survivors', which changes float summation order (or deadlocks). Fixing the layout
    up front makes every DDP instance of this model identical whenever it was built.
    """
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def _reset_after_failure(ddp: DistributedDataParallel) -> None:
    """Discard a partial backward: clear grads and the reducer's in-flight state."""
    ddp.reducer._reset_state()
    _fix_bucket_layout(ddp)
    for p in ddp.parameters():
        p.grad = None


def _ports_of(url: str, store: str) -> set[int]:
    ports = set()
    for text in (url.rsplit(":", 1)[-1].split("/")[0], store.rsplit(":", 1)[-1]):
        if text.isdigit():
            ports.add(int(text))
    return ports


def _exit_quietly(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init() -> Job:
    """Join the job started by `baton run`; returns when this process holds a rank.

    A warm spare blocks here, with torch imported and its transfer endpoint open,
    until the orchestrator gives it a rank.
    """
    missing = [k for k in (ENV_URL, ENV_TOKEN, ENV_WORKER, ENV_STORE) if not os.environ.get(k)]
    if missing:
        raise RuntimeError("baton.init() must run under `baton run` (missing " + ", ".join(missing) + ")")
    if os.environ.get("BATON_LOG"):
        logging.basicConfig(level=os.environ["BATON_LOG"],
                            format=f"%(created).3f [{os.environ.get(ENV_WORKER)}] %(name)s: %(message)s")
    # A worker declared hung gets SIGUSR1 before SIGKILL: its stacks land in its stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    token = os.environ[ENV_TOKEN]
    ctl = ControlChannel(os.environ[ENV_URL], token, os.environ[ENV_WORKER])
    server = TransferServer(token)
    _install_excepthook(ctl)
    _warm_up()  # before registering: a registered spare is a warm spare
    config = ctl.register(os.getpid(), server.address)
    ctl.report_now("heartbeat")  # first report synchronously: its lazy imports happen now, not later
    ctl.start()
    cmd = None
    while cmd is None:
        got = ctl.wait_command(1.0)
        if got is None or got["type"] == "_wake":
            continue
        if got["type"] == "stop":
            _exit_quietly(0)
        if got["type"] == "assign":
            cmd = got
            log.info("assigned rank %s (joiner=%s)", got["rank"], got["joiner"])
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=timedelta(seconds=float(config.get("formation_timeout_s", 120))))
    rank, world = int(cmd["rank"]), int(cmd["world_size"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    return Job(ctl, server, store, rank, world, bool(cmd["joiner"]), config, token)


def _warm_up() -> None:
    """Pay torch's lazy first-use costs now, while waiting, not on a migration's critical path.

    The first DistributedDataParallel construction imports torch._dynamo (~1.3 s here);
    the first optimizer step and backward have smaller one-off costs of their own.
    """
    t0 = time.perf_counter()
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model, process_group=solo_group(), init_sync=False)
    opt = torch.optim.AdamW(ddp.parameters())
    ddp(torch.zeros(2, 4)).sum().backward()
    opt.step()
    # Kept alive on purpose: destroying a gloo group joins its threads while holding the
    # GIL, which can deadlock against a pending future callback that needs the GIL.
    _KEEP_ALIVE.append((ddp, opt))
    log.info("warm-up took %.2fs", time.perf_counter() - t0)


_KEEP_ALIVE: list[Any] = []


_EXIT_CODE = [0]


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(_EXIT_CODE[0])


def _install_excepthook(ctl: ControlChannel) -> None:
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # noqa: ANN001
        _EXIT_CODE[0] = 1
        if not issubclass(exc_type, KeyboardInterrupt):
            try:
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                ctl.report_now("user_error", traceback=text, exit_code=1)
            except Exception:  # noqa: BLE001
                pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
