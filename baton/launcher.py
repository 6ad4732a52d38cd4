"""`baton run`: the embedded control plane of one job.

One process hosts the rendezvous store (in a child it restarts if it dies; never
a rank, so rank 0 can migrate), the orchestrator with its SQLite state and HTTP API, and a scheduler that starts
N ranks and K warm spares running the user's script: on this machine (local), or
as job steps of the Slurm allocation it runs in (slurm, chosen by itself inside
one). Its exit code is the script's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from baton.address import addr_towards
from baton.control import messages as m
from baton.control.api import ApiServer
from baton.control.orchestrator import TICK_S, Config, Orchestrator
from baton.control.state import describe_cpu
from baton.rundir import RunDir, RunDirError
from baton.schedulers.forked import Zygote
from baton.schedulers.local import LocalScheduler
from baton.health.gpu import GpuThresholds
from baton.schedulers.slurm import Allocation, SlurmError, SlurmScheduler, in_allocation, plan_slots
from baton.store.rendezvous_process import RendezvousProcess, StoreStartError
from baton.store.sqlite import SqliteStore


@dataclass
class RunOptions:
    script: str
    script_args: list[str]
    nproc: int
    spares: int = 1
    slots: int | None = None
    run_dir: Path = Path(".baton")
    op_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 3.0
    formation_timeout_s: float = 120.0
    spare_wait_s: float = 600.0
    verify_every: int = 0
    redundancy: int = 2  # buddies holding each rank's own state (and an FSDP2 rank's shards)
    job_id: str = "job"
    quiet: bool = False
    env: dict[str, str] = field(default_factory=dict)
    scheduler: str = "auto"  # local | slurm | auto (slurm inside an allocation)
    nodes: int | None = None  # with it, nproc is per node (torchrun's --nnodes/--nproc-per-node)
    spare_nodes: int | None = None  # nodes that hold only spares (nproc each); replaces --spares
    advertise_addr: str | None = None  # where workers reach the launcher (default: found)
    return_home: bool = False  # move ranks back to their first node once it is healthy again
    pre_copy: bool = False  # planned moves copy the replicated state while training goes on (precopy.py)
    hot_spares: bool = False  # spares mirror the replicated state at every step (worker/hot.py)
    straggler_factor: float = 0.0  # 0: the straggler detector is off
    straggler_steps: int = 20
    borrow_spares: bool = False  # with no dedicated spare left, borrow a node through Slurm preemption
    borrow_partition: str | None = None  # the partition to ask in (default: the allocation's)
    gpu_limits: GpuThresholds = GpuThresholds()  # NVML readings past these taint a slot
    mode: str = "model-aware"  # "no-code": the script does not import baton (baton.transparent.worker runs it)
    tail_copies: bool = True  # no-code: each step's parameters and buckets kept (baton.transparent.tail)
    data_paths: tuple[str, ...] = ()  # interfaces the groups run over, the same names on every node
    path_hold_down_s: float = 5.0  # a path back is used again once up this long everywhere
    path_grace_s: float = 60.0  # a node with a path down this long is tainted (its ranks move)


class EventPrinter:
    """Prints the orchestrator's decisions as they happen, like torchrun's agent log."""

    def __init__(self, run_dir: RunDir, quiet: bool):
        self.quiet = quiet
        self.log = open(run_dir.path / "events.jsonl", "a", buffering=1)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.log.write(json.dumps({"t": time.time(), "event": kind, "data": data}) + "\n")
        if self.quiet or kind in ("spare", "ledger"):
            return
        if kind == "resolved" and data["kind"] == "path-failover":
            text = (f"{data['cause']}: re-formed without it at step {data['step']}, downtime "
                    f"{data['downtime_s']:.3f}s, no rank moved, steps lost {data['steps_lost']}, "
                    f"re-run {data['steps_rerun']}")
        elif kind == "resolved":
            text = (f"{data['kind']} move of rank {data['rank']} {data['from_slot']} -> {data['to_slot']} "
                    f"resolved at step {data['step']}: downtime {data['downtime_s']:.3f}s, "
                    f"steps lost {data['steps_lost']}, re-run {data['steps_rerun']}")
        elif kind == "finished" and "cpu" in data:
            text = f"training finished; {describe_cpu(data['cpu'])}"
        elif kind == "user-error":
            text = f"rank {data.get('rank')} failed with an error in the training script"
        else:
            text = f"{kind} " + " ".join(f"{k}={v}" for k, v in data.items())
        print(f"[baton] {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Placement:
    """Where the job's ranks and spares go, and where its workers reach the launcher."""

    world_size: int
    spares: int
    slots: list[str]
    allocation: Allocation | None  # None: local processes on this machine
    advertise_addr: str


def _placement(opts: RunOptions) -> Placement:
    if opts.scheduler not in ("auto", "local", "slurm"):
        raise SystemExit(f"baton run: --scheduler must be local, slurm or auto, got {opts.scheduler!r}")
    for flag, value, least in (("--nodes", opts.nodes, 1), ("--spare-nodes", opts.spare_nodes, 0)):
        if value is not None and value < least:
            raise SystemExit(f"baton run: {flag} must be at least {least}, got {value}")
    slurm = opts.scheduler == "slurm" or (opts.scheduler == "auto" and in_allocation())
    if not slurm:
        if opts.borrow_spares:
            raise SystemExit("baton run: --borrow-spares borrows nodes through Slurm's preemption, which needs "
                             "--scheduler slurm (run inside a Slurm allocation)")
        if (opts.nodes or 1) > 1 or opts.spare_nodes:
            raise SystemExit("baton run: --nodes/--spare-nodes place ranks on several machines, which needs "
                             "--scheduler slurm (run inside a Slurm allocation)")
        count = opts.slots if opts.slots is not None else opts.nproc + opts.spares + 1
        if count < opts.nproc + opts.spares:
            raise SystemExit(f"baton run: --slots {count} is fewer than ranks + spares ({opts.nproc + opts.spares})")
        return Placement(opts.nproc, opts.spares, [f"local/{i}" for i in range(count)], None,
                         opts.advertise_addr or "127.0.0.1")
    nodes = opts.nodes or 1
    spare_nodes = opts.spare_nodes if opts.spare_nodes is not None else 0
    try:
        alloc = Allocation.from_env()
        slots = plan_slots(alloc, nodes, opts.nproc, spare_nodes)
        # Workers reach the launcher at its address on the route to the first node.
        addr = opts.advertise_addr or addr_towards(alloc.node_addr(alloc.nodes[0]))
    except SlurmError as exc:
        raise SystemExit(f"baton run: {exc}") from None
    spares = spare_nodes * opts.nproc if opts.spare_nodes is not None else opts.spares
    world = nodes * opts.nproc
    if world + spares > len(slots):
        raise SystemExit(f"baton run: {world} ranks + {spares} spares need more than the {len(slots)} slots of "
                         f"--nodes {nodes} + --spare-nodes {spare_nodes} with --nproc-per-node {opts.nproc}: "
                         "use --spare-nodes to hold spares")
    return Placement(world, spares, slots, alloc, addr)


def validate(opts: RunOptions) -> None:
    """Refuse bad options before anything starts (SystemExit with the reason)."""
    if opts.nproc < 1:
        raise SystemExit("baton run: --nproc must be at least 1")
    for flag, value in (("--op-timeout", opts.op_timeout_s), ("--heartbeat-timeout", opts.heartbeat_timeout_s),
                        ("--formation-timeout", opts.formation_timeout_s), ("--spare-wait", opts.spare_wait_s),
                        ("--path-hold-down", opts.path_hold_down_s), ("--path-grace", opts.path_grace_s)):
        if not math.isfinite(value) or value <= 0:
            raise SystemExit(f"baton run: {flag} must be a positive number of seconds, got {value}")
    if opts.redundancy < 0:
        raise SystemExit("baton run: --redundancy must be >= 0")
    bad = [p for p in opts.data_paths if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", p)]
    if bad or len(set(opts.data_paths)) != len(opts.data_paths):
        raise SystemExit(f"baton run: --data-paths takes distinct interface names (at most 15 letters, digits or "
                         f"'_.:@-'), comma-separated: got {','.join(opts.data_paths)!r}")
    if "auto" in opts.data_paths and len(opts.data_paths) > 1:
        raise SystemExit("baton run: --data-paths auto finds the interfaces itself: name them or say auto, not both")
    if opts.verify_every < 0:
        raise SystemExit("baton run: --verify-every must be >= 0")
    g = opts.gpu_limits
    if not math.isfinite(g.temp_c) or g.temp_c < 0 or g.ecc_uncorrected < 0 or g.ecc_corrected < 0:
        raise SystemExit("baton run: --taint-gpu-temp and --taint-ecc-* must be >= 0 (0: that check is off)")
    if not math.isfinite(opts.straggler_factor) or (opts.straggler_factor and opts.straggler_factor <= 1) \
            or opts.straggler_steps < 1:
        raise SystemExit("baton run: --straggler-factor must be 0 (off) or above 1, and --straggler-steps at least 1")
    if opts.spares < 0:
        raise SystemExit("baton run: --spares must be >= 0")
    if not Path(opts.script).is_file():
        raise SystemExit(f"baton run: script not found: {opts.script}")


def worker_env(opts: RunOptions, url: str, token: str, store_addr: str, store_port: int) -> dict[str, str]:
    """What every worker process gets: the control plane, the rendezvous store, and torch's."""
    env = dict(os.environ)
    env.update(opts.env)
    env.update(BATON_URL=url, BATON_TOKEN=token, BATON_STORE=f"{store_addr}:{store_port}",
               TORCH_DIST_INIT_BARRIER="0", MASTER_ADDR=store_addr, MASTER_PORT=str(store_port),
               BATON_JOB_ID=opts.job_id, BATON_MODE=opts.mode, BATON_TAIL_COPIES="1" if opts.tail_copies else "0")
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several ranks per node
    return env


def worker_command(opts: RunOptions) -> tuple[str, list[str]]:
    """What each worker's python runs: the script itself (it calls baton.init()), or, for a
    script with no code change, baton's worker around it (`python -m baton.transparent.worker`)."""
    if opts.mode == "no-code":
        return "-m", ["baton.transparent.worker", opts.script, *opts.script_args]
    return opts.script, list(opts.script_args)


def make_scheduler(placement: Placement, opts: RunOptions, env: dict[str, str],
                   on_exit: Callable[[str, int], None], zygote: Zygote | None = None) -> LocalScheduler | SlurmScheduler:
    first, rest = worker_command(opts)
    if placement.allocation is not None:
        return SlurmScheduler(placement.allocation, placement.slots, first, rest, env,
                              on_exit=on_exit, borrow_partition=opts.borrow_partition)
    return LocalScheduler(first, rest, env, len(placement.slots), on_exit=on_exit, zygote=zygote)


def run(opts: RunOptions, listeners: list[Callable[[str, dict[str, Any]], None]] | None = None,
        started: Callable[[Orchestrator, str, str], None] | None = None) -> int:
    validate(opts)
    placement = _placement(opts)
    logging.basicConfig(level=os.environ.get("BATON_LOG", "WARNING"))

    run_dir = RunDir(Path(opts.run_dir))
    try:
        token = run_dir.create()
    except RunDirError as exc:
        raise SystemExit(f"baton run: {exc}") from None
    try:
        db = SqliteStore(run_dir.db)
    except sqlite3.Error as exc:
        raise SystemExit(f"baton run: cannot open the state store {run_dir.db}: {exc}") from None
    host = placement.advertise_addr
    # On this machine, one warm process forks the store and every worker (schedulers/zygote.py).
    # Its environment: what each worker's holds, in all that python and torch read at start.
    zygote = Zygote(sys.executable, worker_env(opts, "", "", host, 0)) if placement.allocation is None else None
    if zygote is not None:
        zygote.start()
    try:
        store = RendezvousProcess(host, zygote=zygote).start()
    except StoreStartError as exc:
        if zygote is not None:
            zygote.close()
        raise SystemExit(f"baton run: {exc}") from None
    config = Config(world_size=placement.world_size, spares=placement.spares, job_id=opts.job_id,
                    op_timeout_s=opts.op_timeout_s, heartbeat_timeout_s=opts.heartbeat_timeout_s,
                    formation_timeout_s=opts.formation_timeout_s, verify_every=opts.verify_every,
                    redundancy=opts.redundancy, spare_wait_s=opts.spare_wait_s,
                    ranks_per_node=opts.nproc if placement.allocation is not None else 0,
                    return_home=opts.return_home, pre_copy=opts.pre_copy, hot_spares=opts.hot_spares,
                    straggler_factor=opts.straggler_factor,
                    straggler_steps=opts.straggler_steps, borrow_spares=opts.borrow_spares,
                    gpu_limits=opts.gpu_limits, mode=opts.mode, data_paths=tuple(opts.data_paths),
                    path_hold_down_s=opts.path_hold_down_s, path_grace_s=opts.path_grace_s)
    orch = Orchestrator(config, db)
    orch.helper_cpu = store.cpu_s
    db.on_error = lambda text: orch.handle(m.StoreFailed(message=text))
    orch.listeners.append(EventPrinter(run_dir, opts.quiet))
    orch.listeners.extend(listeners or [])
    api = ApiServer(orch, token, host=host)
    api.start()
    run_dir.write_endpoint(api.url)

    env = worker_env(opts, api.url, token, host, store.port)

    def on_exit(wid: str, code: int) -> None:
        orch.handle(m.WorkerExited(worker_id=wid, returncode=code))

    sched = make_scheduler(placement, opts, env, on_exit, zygote)
    orch.scheduler = sched
    if isinstance(sched, LocalScheduler):
        orch.imports_cpu = sched.zygote.cpu_s

    def on_signal(signum: int, _frame: Any) -> None:
        print(f"[baton] received signal {signum}: stopping the job", file=sys.stderr, flush=True)
        orch.handle(m.Interrupted(signum=signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}

    orch.start()
    if started is not None:
        started(orch, api.url, token)
    try:
        while not orch.done.wait(TICK_S):
            orch.handle(m.Tick(now=time.time()))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    code = orch.exit_code or 0
    if orch.failure and code != 0:
        # Give the failing rank a moment to print its own traceback, then make sure it shows.
        time.sleep(0.5)
        print(f"[baton] job failed (exit code {code}):\n{orch.failure}",
              file=sys.stderr, flush=True)
    sched.shutdown(grace_s=5.0 if code == 0 else 2.0)
    store.stop()
    if zygote is not None:
        zygote.close()
    api.stop()
    db.close()
    run_dir.endpoint_file.unlink(missing_ok=True)
    run_dir.release()
    return code
