"""The benchmark workload: one script, two harnesses, same model, data and loop.

    torchrun --nproc-per-node 3 bench/workload.py --mode ddp   ...   # plain DDP
    baton run --nproc 3 bench/workload.py --mode baton ...          # job.wrap + job.steps

Rank 0 writes per-step wall times (after warm-up) to --out as JSON.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import cycle  # bench/ is on the path: this file runs as a script


def build_model(params_m: float, width: int = 1024) -> torch.nn.Module:
    depth = max(1, round(params_m * 1e6 / (width * width + width)))
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width)]
    for _ in range(depth):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    layers += [torch.nn.ReLU(), torch.nn.Linear(width, 1)]
    return torch.nn.Sequential(*layers)




def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "baton"], required=True)
    p.add_argument("--params-m", type=float, default=2.0, help="model size in millions of parameters")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    if args.mode == "baton":
        import baton

        job = baton.init()
        rank, world = job.rank, job.world_size
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = build_model(args.params_m)
    g = torch.Generator().manual_seed(1)
    n = args.batch * world * 64  # a fixed-size set; the loader cycles through epochs
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
    loader = DataLoader(data, batch_size=args.batch, drop_last=True,
                        sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3))
    if args.mode == "baton":
        model = job.wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        job.track(model=model, optimizer=opt, data=loader)
        loop = ((s.index, s, s.batch) for s in job.steps(args.steps))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loop = ((i, None, b) for i, b in zip(range(args.steps), cycle(loader)))

    times = []
    last = time.perf_counter()
    for index, step, batch in loop:
        with step if step is not None else contextlib.nullcontext():
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        now = time.perf_counter()
        if index >= args.warmup:
            times.append(now - last)
        last = now
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "params": nparams, "step_times": times, "world": world}, f)
    if args.mode == "baton":
        job.finish()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
