"""The benchmark workload: one script, one model, one data order, three harnesses.

    torchrun --nproc-per-node 3 bench/workload.py --mode ddp ...      # plain DDP
    torchrun --max-restarts 3 ... bench/workload.py --mode ddp --ckpt-every K ...  # checkpoint-restart
    baton run --nproc 3 --spares 1 bench/workload.py --mode baton ... # job.wrap + job.steps
    (per replica group) torchrun ... bench/workload.py --mode torchft ...  # TorchFT DDP + lighthouse

Every mode trains the same MLP on the same batches in the same order (a
DataLoader over a DistributedSampler, cycled over epochs), so the modes differ
only in the harness around the step. What the workload leaves in --run-dir:

  progress.jsonl  rank 0's events, one JSON line each, wall-clock "t" (time.time()):
                  {"ev": "start", "process_start"} / {"ev": "resume", "step", "load_s"} /
                  {"ev": "step", "step"} (steps done) / {"ev": "absorbed", "step"} (baton: an attempt
                  at that step failed, was absorbed and will run again; not progress) /
                  {"ev": "save", "step", "save_s"} / {"ev": "done"}
  progress.rank<R>.jsonl  the other ranks' "step" events (a replacement appends to its rank's)
  pid.rank<R>     the pid of the process that is rank R now (rewritten by a restart or a spare)
  cpu.rank<R>.json  this rank's own CPU time (getrusage RUSAGE_SELF: every thread, µs resolution)
                  when it had done --warmup steps and when it had done all --steps, with the
                  wall-clock time of each mark: the ranks' share of the steady-state CPU figure
  ckpt/           checkpoint-restart only: step-<N>.pt, written atomically by rank 0
  final.pt        rank 0's final parameters
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

T_PROCESS_START = time.time()

import torch  # noqa: E402 - T_PROCESS_START must be taken before the slow import
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from workload_parts import Progress, build_loader, build_model  # noqa: E402
from workload_parts import finish as _finish  # noqa: E402
from workload_parts import window as _window  # noqa: E402


def batches_from(loader: DataLoader, step: int):
    """(step, batch) from `step` on, forever: epoch e reshuffles with set_epoch(e), as a
    resumed job must, so a restart continues exactly where the failure-free run would be."""
    per_epoch = len(loader)
    epoch, skip = divmod(step, per_epoch)
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in itertools.islice(loader, skip, None):
            yield step, batch
            step += 1
        epoch, skip = epoch + 1, 0


def _latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def _init_ddp_group(attempt: int) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives restarts and gloo's mesh keys are not per attempt: without a
        # prefix, restarted ranks dial the dead ranks' addresses (connectFullMesh refused).
        from datetime import timedelta

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")


def _step(model, opt, batch, step_sleep: float) -> None:
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if step_sleep:
        time.sleep(step_sleep)


def run_ddp(args) -> None:
    """Plain DDP; with --ckpt-every K, the checkpoint-restart contender (save every K steps,
    resume from the newest checkpoint after torchrun restarts the job)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init_ddp_group(attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = Progress(args.run_dir, rank, _window(args), attempt=attempt)
    progress.emit("start", process_start=T_PROCESS_START)
    torch.manual_seed(0)
    # DDP rebuilds its buckets after the first step in gradient-ready order, so the first step
    # after a restart reduces in a different order than the failure-free run did at that step.
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.params_m))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = build_loader(world, rank, args.batch)
    start = 0
    ckpt_dir = Path(args.run_dir or ".") / "ckpt"
    if args.ckpt_every:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        latest = _latest_checkpoint(ckpt_dir)
        if latest is not None:
            t0 = time.perf_counter()
            state = torch.load(latest, weights_only=True)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = state["step"]
            progress.emit("resume", step=start, load_s=time.perf_counter() - t0)
    for step, batch in batches_from(loader, start):
        if step >= args.steps:
            break
        _step(model, opt, batch, args.step_sleep)
        done = step + 1
        progress.step(done)
        if args.ckpt_every and rank == 0 and done % args.ckpt_every == 0 and done < args.steps:
            t0 = time.perf_counter()
            tmp = ckpt_dir / f".step-{done}.pt.tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, ckpt_dir / f"step-{done}.pt")
            progress.emit("save", step=done, save_s=time.perf_counter() - t0)
    _finish(progress, rank, model.module, args)
    from baton.examples import plain_exit

    plain_exit.leave()  # past gloo's exit-time abort (see there), as baton's workers end


def run_baton(args) -> None:
    import baton

    job = baton.init()
    progress = Progress(args.run_dir, job.rank, _window(args), own=job.cpu_use)
    progress.emit("start", process_start=T_PROCESS_START)
    torch.manual_seed(0)
    # A rank taking another's over gets every weight from the ranks: it builds on the meta device
    # and allocates the model uninitialised, as the README's model-aware example does (its
    # initialisation, 0.3-1.2 s at 83M parameters here, would be the joiner's setup, in the downtime).
    with torch.device("meta" if job.joined else "cpu"):
        net = build_model(args.params_m)
    if job.joined:
        net.to_empty(device="cpu")
    model = job.wrap(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    job.track(model=model, optimizer=opt, data=build_loader(job.world_size, job.rank, args.batch))
    for s in job.steps(args.steps):
        with s:
            _step(model, opt, s.batch, args.step_sleep)
        if s.failed:  # absorbed: this attempt did not count and the loop yields the same step again
            progress.emit("absorbed", step=s.index + 1)
            continue
        progress.step(s.index + 1)
    _finish(progress, job.rank, model.module, args)
    job.finish()


def run_torchft(args) -> None:
    """TorchFT's DDP wrapper and optimizer wrapper; this process is one replica group of one
    rank. A restarted replica heals model and optimizer from a live one; TorchFT does not
    heal the data position, so it reads the batch for the manager's current step."""
    from datetime import timedelta

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    replica, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    progress = Progress(args.run_dir, replica, _window(args),
                        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    progress.emit("start", process_start=T_PROCESS_START)
    if args.run_dir and progress.tags["attempt"] == 0:
        _wait_for_pid_files(Path(args.run_dir), groups)
    torch.manual_seed(0)
    model = build_model(args.params_m)
    loader = build_loader(groups, replica, args.batch)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{replica}",
                      timeout=timedelta(seconds=30), init_sync=False)  # all replicas start from seed 0
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    feed = batches_from(loader, 0)
    at = 0
    while manager.current_step() < args.steps:
        if manager.current_step() != at:  # healed to a later step: jump the data there
            at = manager.current_step()
            feed = batches_from(loader, at)
        _, batch = next(feed)
        x, y = batch
        before = manager.current_step()
        opt.zero_grad()  # starts the quorum (and healing, for a restarted replica)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()  # should_commit: steps only if every participant's allreduce succeeded
        if args.step_sleep:
            time.sleep(args.step_sleep)
        at += 1  # an uncommitted step leaves current_step behind: the same batch is retried
        progress.step(manager.current_step(), committed=manager.current_step() > before,
                      participants=manager.num_participants(), batches=manager.batches_committed())
    _finish(progress, replica, model, args)
    manager.shutdown(wait=False)


def _wait_for_pid_files(run_dir: Path, n: int, timeout: float = 120) -> None:
    """Benchmark plumbing: the first replicas to arrive would otherwise form the first quorum
    alone (the lighthouse allows one replica fewer) and the late one would heal into the job."""
    deadline = time.time() + timeout
    while sum((run_dir / f"pid.rank{r}").exists() for r in range(n)) < n:
        if time.time() > deadline:
            raise TimeoutError("replica groups did not all start")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "baton", "torchft"], required=True)
    p.add_argument("--params-m", type=float, default=2.0, help="model size in millions of parameters")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0, help="idle seconds per step (a longer step "
                   "without more CPU: stands in for a GPU step on a 2-core machine)")
    p.add_argument("--ckpt-every", type=int, default=0, help="ddp: save a checkpoint every K steps, resume")
    p.add_argument("--warmup", type=int, default=None, help="write cpu.rank<R>.json: this process's CPU time "
                   "after WARMUP steps and after the last step")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    {"ddp": run_ddp, "baton": run_baton, "torchft": run_torchft}[args.mode](args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
