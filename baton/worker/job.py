"""What a training script uses: `baton.init()`, `Job`, `Step`, `Epoch`.

    job = baton.init()
    model = job.wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)          # discovered: no need to track it
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 30)       # discovered too
    job.track(data=train_loader)
    best = job.local(acc=0.0)                                   # rank-local values

    @job.at_epoch_end
    def validate(b):                                            # collectives are covered here
        ...; scheduler.step(); best.acc = max(best.acc, acc)

    for epoch in job.epochs(90):
        for step in epoch:
            with step:
                images, target = step.batch
                ...
    job.finish()

The hot path is one uncontended lock at each step boundary plus the bundle capture at
the step's first gradient bucket; everything else runs on background threads.
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
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from baton import selfcost
from baton.address import node_address
from baton.control import messages as m
from baton.store.rendezvous import RendezvousClient
from baton.transfer import TransferServer
from baton.worker import ddp as ddp_mod
from baton.worker import discover, fence, orphan, whole_saves
from baton.worker.control import ControlChannel, OrchestratorGone
from baton.worker.data import DataFeed
from baton.worker.exit import exit_quietly
from baton.worker.hot import Mirror
from baton.worker.runtime import Runtime, Unit
from baton.worker.script_files import ScriptModules, script_dir_of
from baton.worker.torchrun_env import torchrun_env
from baton.worker.tracked import _BATON_OWNED, LocalValues, UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("baton.worker")

ENV_URL, ENV_TOKEN, ENV_WORKER, ENV_STORE, ENV_SLOT = (
    "BATON_URL", "BATON_TOKEN", "BATON_WORKER_ID", "BATON_STORE", "BATON_SLOT")


class Step:
    """One optimizer step. Use as a context manager so a failure inside it can be absorbed:
    a step that fails before its optimizer.step() runs again, from the same state, batch and
    random numbers; `step.failed` tells code after the `with` block that this attempt did not
    count (the loop will yield the same step again)."""

    def __init__(self, rt: Runtime, index: int, batch: Any, epoch: int):
        self.index = index
        self.epoch = epoch
        self._batch = batch
        self._rt = rt
        self.failed = False
        self.completed = False
        self.error: str = ""

    @property
    def batch(self) -> Any:
        return self._batch

    @property
    def batches(self) -> list[Any]:
        """The step's micro-batches (`job.steps(n, batches_per_step=k)`)."""
        return self._batch if isinstance(self._batch, list) else [self._batch]

    def __enter__(self) -> "Step":
        return self

    @selfcost.counted
    def __exit__(self, exc_type, exc, tb) -> bool:
        rt = self._rt
        if exc_type is None:
            self.completed = True
            return False
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            return False
        if not rt.committed and rt.is_peer_failure(exc):
            self.failed = True
            self.error = f"{exc_type.__name__}: {exc}"[:2000]
            return True
        return False

    def __repr__(self) -> str:
        return f"Step(index={self.index}, epoch={self.epoch}, failed={self.failed})"


class Epoch(int):
    """One epoch of an epoch-style loop: iterate it for its steps."""

    def __new__(cls, value: int, items: Iterator[tuple[str, Any]]) -> "Epoch":
        obj = super().__new__(cls, value)
        obj._items = items  # type: ignore[attr-defined]
        return obj

    def __iter__(self) -> Iterator[Step]:  # type: ignore[override]
        for kind, item in self._items:  # type: ignore[attr-defined]
            if kind == "step":
                yield item
            elif kind == "epoch_end" and item >= int(self):
                return


class Job:
    """The handle a training script holds: its rank, the live group, and the loop."""

    def __init__(self, rt: Runtime):
        self._rt = rt
        self.rank = rt.rank
        self.world_size = rt.world_size
        self.group = rt.group
        self.slot = os.environ.get(ENV_SLOT, "")
        self.joined = rt.joiner  # this process took over a rank from another (skip resume-from-file code)
        self._meshes: dict[tuple, DeviceMesh] = {}

    # ------------------------------------------------------------------ setup
    def mesh(self, dim_names: tuple[str, ...] | None = None, shape: tuple[int, ...] | None = None,
             *, device_type: str = "cpu") -> "DeviceMesh":
        """A DeviceMesh over the live group, for `fully_shard(module, mesh=...)`.

        `job.mesh()` is 1-D (FSDP); `job.mesh(("replicate", "shard"), (2, 2))` is HSDP's 2-D
        mesh, laid out like `init_device_mesh` (rank = replicate index * shard size + shard
        index). Each dimension's group is a live sub-group: its collectives follow the job
        across generations like the world group's, and a failure on one fails the generation.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if shape is None:
            shape = (self.world_size,)
        shape = tuple(int(n) for n in shape)
        names = tuple(dim_names) if dim_names is not None else None
        if names is not None and (isinstance(dim_names, str) or len(names) != len(shape)):
            raise ValueError(f"job.mesh: give one name per dimension, as a tuple: {dim_names!r} for shape {shape}")
        if any(n < 1 for n in shape) or torch.Size(shape).numel() != self.world_size:
            raise ValueError(f"job.mesh: shape {shape} does not hold the job's {self.world_size} ranks")
        key = (names, shape, device_type)
        if key not in self._meshes:
            if len(shape) == 1:
                self._meshes[key] = DeviceMesh.from_group(self.group, device_type, mesh_dim_names=names)
            else:
                if names is None:
                    raise ValueError("job.mesh: a mesh of more than one dimension needs dimension names")
                layout = torch.arange(self.world_size).view(shape)
                coords = [int(c) for c in torch.nonzero(layout == self.rank)[0]]
                groups = []
                for dim in range(len(shape)):
                    line = list(coords)
                    line[dim] = slice(None)  # type: ignore[call-overload]
                    groups.append(self.group.subgroup(layout[tuple(line)].tolist()))
                self._meshes[key] = DeviceMesh.from_group(groups, device_type, mesh=layout,
                                                          mesh_dim_names=names)
        return self._meshes[key]

    def wrap(self, model: torch.nn.Module, **ddp_kwargs: Any) -> ddp_mod.LiveDDP:
        """DistributedDataParallel over the live group; numerically identical to torchrun + DDP."""
        ddp = ddp_mod.build(self._rt, model, **ddp_kwargs)
        self._rt.tracked.add_wrapped(ddp, model)
        return ddp

    def track(self, **objects: Any) -> None:
        """Register what must migrate under a name. Models, optimizers, schedulers and scalers
        need state_dict()/load_state_dict(); generators (torch, numpy, random.Random) are kept
        exactly; `data` is the loader whose position baton tracks itself."""
        for name, obj in objects.items():
            if name == "data":
                self._rt.feed = DataFeed(obj, self._rt.feed.per_step)
                continue
            if isinstance(obj, ddp_mod.DistributedDataParallel):
                obj = obj.module
            if isinstance(obj, torch.nn.Module) and any(obj is w for w in self._rt.tracked.wrapped):
                for old, existing in list(self._rt.tracked.objects.items()):
                    if existing is obj:
                        del self._rt.tracked.objects[old]
            self._rt.tracked.add(name, obj)

    def local(self, **values: Any) -> LocalValues:
        """Values this rank keeps for itself (rank 0's best validation loss, say). They migrate
        from this rank's own latest boundary, and may only change in boundary functions."""
        if self._rt.tracked.local is not None:
            self._rt.tracked.local.load(values)
            return self._rt.tracked.local
        self._rt.tracked.local = LocalValues(self._rt.tracked, values)
        return self._rt.tracked.local

    # ------------------------------------------------------------------ boundary functions
    def every(self, steps: int, at_start: bool = False) -> Callable[[Callable], Callable]:
        """Decorator: run the function after every `steps` completed steps (and before the
        first step with at_start=True). Collectives inside are covered: a lost peer makes it
        run again from the same state."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError("job.every(steps): steps must be a positive integer")

        def register(fn: Callable) -> Callable:
            self._add_unit(Unit(fn, every=steps, at_start=at_start))
            return fn

        return register

    def at_epoch_end(self, fn: Callable) -> Callable:
        """Decorator: run the function after the last step of every epoch (validation,
        scheduler.step(), rank 0's checkpoint). Covered like job.every. It is called with one
        argument: `.step` (steps done) and `.epoch` (the epoch that just ended, from 0)."""
        self._add_unit(Unit(fn, epoch_end=True))
        return fn

    def at_end(self, fn: Callable) -> Callable:
        """Decorator: run the function once after the last step (a final evaluation)."""
        self._add_unit(Unit(fn, at_end=True))
        return fn

    def _add_unit(self, unit: Unit) -> None:
        if self._rt.loop_started:
            raise UsageError("boundary functions must be registered before the step loop starts")
        self._rt.units.append(unit)

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int, batches_per_step: int = 1, start: int = 0) -> Iterator[Step]:
        """Yield steps `start`..`total`-1 (`start`: where a resume block left off; `step.index`
        counts from 0 either way); a joiner starts at the step its rank was on."""
        return selfcost.counted_iter(self._steps(total, batches_per_step, start))

    def _steps(self, total: int, batches_per_step: int, start: int) -> Iterator[Step]:
        self._check_total(total, "job.steps")
        self._check_total(start, "job.steps(start=...)")
        rt = self._rt
        rt.feed.per_step = batches_per_step
        rt.enter_loop("steps", total, None, start)
        for kind, item in rt.items():
            if kind == "step":
                yield item

    def epochs(self, total: int, batches_per_step: int = 1, start: int = 0) -> Iterator[Epoch]:
        """Yield epochs `start`..`total`-1, each iterating its steps over the tracked loader
        (`start`: the epoch a resume block loaded); a joiner starts in the epoch its rank was in.
        Epochs count from 0; the loader's sampler gets set_epoch(e) before epoch e (do not call it)."""
        return selfcost.counted_iter(self._epochs(total, batches_per_step, start))

    def _epochs(self, total: int, batches_per_step: int, start: int) -> Iterator[Epoch]:
        self._check_total(total, "job.epochs")
        self._check_total(start, "job.epochs(start=...)")
        rt = self._rt
        rt.feed.per_step = batches_per_step
        spe = rt.feed.steps_per_epoch()
        if not spe:
            raise UsageError("job.epochs() needs job.track(data=loader) with a loader that has a "
                             "length; use job.steps(total) for endless data")
        rt.enter_loop("epochs", total * spe, total, start * spe)
        items = selfcost.counted_iter(rt.items())
        for epoch in range(rt.first_epoch(spe), total):
            yield Epoch(epoch, items)
        for _ in items:  # boundary functions after the last epoch, if any are left
            pass

    def cpu_use(self) -> selfcost.CpuUse:
        """CPU-seconds this process has used, and baton's own share of them (counted as it
        runs: see baton.selfcost). Subtract two readings for a window."""
        return selfcost.snapshot()

    def _check_total(self, total: int, where: str) -> None:
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise ValueError(f"{where}(total): total must be a non-negative integer, got {total!r}")

    @selfcost.counted
    def log(self, **metrics: float) -> None:
        """Attach metrics (loss, ...) to this rank's next heartbeat; shown by `baton status`."""
        self._rt.metrics.update({k: float(v) for k, v in metrics.items()})

    def finish(self) -> None:
        """Report completion; returns once every rank has finished (a rank lost at the end is
        replaced first). Code after it (saving, say) runs as usual."""
        self._rt.finish()
        # Interpreter teardown would destroy gloo groups with the GIL held, which can hang;
        # once the script is done, leave without it, with the script's own exit code.
        atexit.register(_exit_now)
        sys.exit = _exit_with  # type: ignore[assignment]


def init() -> Job:
    """Join the job started by `baton run`; returns when this process holds a rank.

    A warm spare blocks here, with torch imported and its transfer endpoint open, until
    the orchestrator gives it a rank. The script's random streams are left untouched.
    Called again (or after the script read RANK, which joins the job: rank_env), it returns
    the same job.
    """
    if _JOB[0] is not None:
        return _JOB[0]
    if _RUNTIME[0] is not None:
        raise UsageError("baton.init() in a script that `baton run` started with no code change (it found no "
                         "`import baton` in the script or the modules of its directory: is baton loaded some other "
                         "way?): run it with `baton run --mode model-aware`")
    _JOB[0] = Job(join(Runtime, sys.argv[0] or "."))
    return _JOB[0]


def join(runtime_class: type[Runtime], script: str) -> Runtime:
    """What init() does, with the runtime the script's mode needs (a script with no code
    change is driven by its own loop: baton.transparent). A joiner's `script` is fenced: its
    setup leaves the job's files alone until it holds its rank's place (fence)."""
    missing = [k for k in (ENV_URL, ENV_TOKEN, ENV_WORKER, ENV_STORE) if not os.environ.get(k)]
    if missing:
        raise RuntimeError("baton.init() must run under `baton run` (missing " + ", ".join(missing) + ")")
    orphan.die_with_parent()
    if os.environ.get("BATON_LOG"):
        logging.basicConfig(level=os.environ["BATON_LOG"],
                            format=f"%(created).3f [{os.environ.get(ENV_WORKER)}] %(name)s: %(message)s")
    else:
        # A script that sets the root logger to INFO (hydra does) would otherwise get a line per
        # control-plane request (httpx) and baton's own notes among its prints.
        for name in ("baton", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    discover.install()
    whole_saves.install()  # a successor's resume block may read a checkpoint rank 0 is writing; before its fence
    token = os.environ[ENV_TOKEN]
    ctl = ControlChannel(os.environ[ENV_URL], token, os.environ[ENV_WORKER])
    server = TransferServer(token, host=node_address())
    _install_excepthook(ctl)
    _warm_up()  # before registering: a registered spare is a warm spare
    try:
        config = ctl.register(os.getpid(), server.address)
    except OrchestratorGone:
        exit_quietly(0)  # a spare that started after the job stopped needing it
    ctl.report_now(m.Heartbeat())
    ctl.start()
    cmd = None
    mirror: Mirror | None = None  # --hot-spares: the replicated state, kept current while waiting
    while cmd is None:
        got = ctl.wait_command(1.0)
        if isinstance(got, m.Stop):
            exit_quietly(0)
        if isinstance(got, m.Follow):
            if mirror is not None:
                mirror.close()
            mirror = Mirror(got, token, config.op_timeout_s, ctl.report).start()
        if isinstance(got, m.Assign):
            cmd = got
            log.info("assigned rank %s (joiner=%s)", got.rank, got.joiner)
    if cmd.joiner:
        selfcost.count_spare_time()
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    store = RendezvousClient(host, int(port), config.formation_timeout_s)
    local = config.ranks_per_node or cmd.world_size
    os.environ.update(torchrun_env(cmd.rank, cmd.world_size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                   int(os.environ.get("MASTER_PORT", "29500")), os.environ.get("BATON_JOB_ID", "baton"),
                                   local_world_size=local, node_rank=cmd.rank // local,
                                   nodes=max(1, cmd.world_size // local)))
    rt = runtime_class(ctl, server, store, cmd.rank, cmd.world_size, cmd.joiner, config, token)
    if cmd.joiner:
        fence.raise_for(ScriptModules(script_dir_of(script)).own, cmd.training_since, cmd.setup_files)
    rt.assignment = cmd
    if mirror is not None:  # a recovery's state comes from it (hot.py); a planned move's does not
        rt.mirror = mirror
    _RUNTIME[0] = rt
    sys.exit = _exit_with  # type: ignore[assignment]  # the script's exit code, for _left_early
    atexit.register(_left_early, rt)
    return rt


def _left_early(rt: Runtime) -> None:
    """A script leaving without job.finish() (an error for the job: the others would wait
    for it): the job learns the step it left at, which the message ending the job names,
    and the process leaves without interpreter teardown, which can hang in gloo's
    destructors (it would then look hung, not exited)."""
    if rt.finished:
        return
    try:
        rt.ctl.report_now(m.Heartbeat(step=rt.pos[0]))
    except Exception:  # noqa: BLE001 - the orchestrator may be gone: nothing to tell
        pass
    _exit_now()


def _warm_up() -> None:
    """Pay torch's lazy first-use costs now, while waiting, not on a migration's critical path.

    The first DistributedDataParallel construction imports torch._dynamo (~2 CPU-s here,
    already paid by the zygote a forked spare comes from); the first optimizer step and
    backward have smaller one-off costs of their own; the world-of-one gloo group every
    wrapped model's own bookkeeping uses (`solo_group`) took 7-10 ms of a joiner's setup.
    The script's random streams are saved and put back: warm-up draws must not show.
    """
    t0 = time.perf_counter()
    from baton.worker import rng
    from baton.worker.group import IdleGroup, solo_group
    from torch.nn.parallel import DistributedDataParallel

    saved = rng.capture()
    with discover.paused():
        model = torch.nn.Linear(4, 1)
        ddp = DistributedDataParallel(model, process_group=IdleGroup(), init_sync=False)
        opt = torch.optim.AdamW(ddp.parameters())
        ddp(torch.zeros(2, 4)).sum().backward()
        opt.step()
    solo_group()
    rng.restore(saved)
    _BATON_OWNED.extend([ddp, opt])  # never the script's (discovery skips them)
    log.info("warm-up took %.2fs", time.perf_counter() - t0)


_EXIT_CODE = [0]
_RUNTIME: list[Runtime | None] = [None]
_JOB: list[Job | None] = [None]  # a model-aware script's job (init() returns it again)
# A rank whose script died of a lost peer (not of its own bug) exits with this code, and the
# orchestrator recovers it like any lost rank instead of ending the job as a script error.
EXIT_PEER_LOST = 75


def _exit_now() -> None:
    logging.shutdown()
    exit_quietly(_EXIT_CODE[0])


def _exit_with(code: Any = 0) -> None:
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    _EXIT_CODE[0] = code
    raise SystemExit(code)


def report_script_error(ctl: ControlChannel, exc: BaseException, tb: Any = None) -> None:
    """The script ended with an exception: a lost peer it could not absorb makes this rank
    exit to be replaced (EXIT_PEER_LOST); anything else is the script's own error, reported
    with its traceback so the job ends with it (never a respawn loop)."""
    exc_type = type(exc)
    _EXIT_CODE[0] = 1
    rt = _RUNTIME[0]
    if rt is not None and not issubclass(exc_type, (KeyboardInterrupt, UsageError)) and rt.is_peer_failure(exc):
        print(f"[baton] rank {rt.rank}: a peer was lost and the script could not absorb it here "
              f"({exc_type.__name__}: {exc}); this rank will be replaced", file=sys.__stderr__, flush=True)  # torch's
        # rank-prefixing excepthook, which calls this one, points sys.stderr at a buffer
        exit_quietly(EXIT_PEER_LOST)
    if not issubclass(exc_type, KeyboardInterrupt):
        try:
            text = "".join(traceback.format_exception(exc_type, exc, tb if tb is not None else exc.__traceback__))
            phase = "usage" if issubclass(exc_type, UsageError) else "script"
            ctl.report_now(m.UserError(traceback=text[-60000:], exit_code=1, phase=phase))
        except Exception:  # noqa: BLE001
            pass


def _install_excepthook(ctl: ControlChannel) -> None:
    """Report the script's uncaught exception, from the rank's own process only.

    A process the script forks (a DataLoader worker) inherits the hook and the control
    socket, and multiprocessing calls sys.excepthook itself for an error in a helper
    thread (resource_sharer's, when the rank stops reading from it): that is not the
    rank failing, and must not speak for it.
    """
    previous = sys.excepthook
    owner = os.getpid()

    def hook(exc_type, exc, tb):  # noqa: ANN001
        if os.getpid() == owner:
            report_script_error(ctl, exc, tb)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
