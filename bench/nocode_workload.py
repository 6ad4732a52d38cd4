"""A torchrun script that never imports baton, for bench/nocode.py: the model, data and
data order of bench/workload.py (workload_parts), in the shape people write: an epoch loop
with `set_epoch`, a DataLoader loop inside it, the step, a counter.

    torchrun --nproc-per-node 3 bench/nocode_workload.py ...     # plain DDP
    baton run --nproc 3 --spares 1 bench/nocode_workload.py ...  # the same file, no code change

Its model-aware port is bench/workload.py --mode baton (job.wrap, job.track, job.steps).
"""

from __future__ import annotations

import argparse
import os
import time

T_PROCESS_START = time.time()

import torch  # noqa: E402 - T_PROCESS_START must be taken before the slow import
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from workload_parts import Progress, build_loader, build_model, finish, window  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--comm-hook", choices=["fp16"], default=None, help="DDP's gradient-compression hook")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = Progress(args.run_dir, rank, window(args))
    progress.emit("start", process_start=T_PROCESS_START)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(args.params_m))
    if args.comm_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = build_loader(world, rank, args.batch)
    done, epoch = 0, 0
    while done < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            done += 1
            progress.step(done)
            if done >= args.steps:
                break
        epoch += 1
    finish(progress, rank, model.module, args)
    dist.destroy_process_group()
    os._exit(0)  # past gloo's exit-time abort with torch 2.13 (see baton/examples/plain_exit.py)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
