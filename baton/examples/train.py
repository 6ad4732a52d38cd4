"""A small deterministic DDP training script written against baton's API.

Used by `baton demo`, the tests and the benchmarks. Every rank starts from the
same seed; the data is a fixed synthetic regression set served by a DataLoader
with a DistributedSampler, so a run is reproducible bit for bit on CPU/gloo.

    baton run --nproc 4 --spares 1 baton/examples/train.py --steps 200 --out final.pt
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import baton


def build_model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers += [torch.nn.Linear(width if i else 16, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests)")
    p.add_argument("--out", default=None, help="save final parameters here (rank 0) and .rankN copies")
    p.add_argument("--bug-at-step", type=int, default=None, help="raise a user error at this step (rank 1)")
    p.add_argument("--user-allreduce", action="store_true", help="also all_reduce the loss on job.group")
    p.add_argument("--progress-file", default=None, help="rank 0 appends 'step loss' lines here")
    p.add_argument("--clamp", type=float, default=None,
                   help="clip every weight to [-C, C] after each optimizer step (as WGAN's critic does)")
    args = p.parse_args()

    job = baton.init()
    torch.manual_seed(0)
    model = job.wrap(build_model(args.width, args.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh() + 0.01 * torch.randn(args.samples, 1, generator=g)
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=job.world_size, rank=job.rank,
                                 shuffle=True, seed=7)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, sampler=sampler, drop_last=True)
    job.track(model=model, optimizer=opt, data=loader)

    for step in job.steps(args.steps):
        with step:
            xb, yb = step.batch
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if args.user_allreduce:  # collectives come before the step commits (optimizer.step)
                total = loss.detach().clone()
                dist.all_reduce(total, group=job.group)
                loss = total / job.world_size
            opt.step()
            opt.zero_grad()
            if args.clamp is not None:  # parameters changed outside the optimizer's step
                with torch.no_grad():
                    for w in model.parameters():
                        w.clamp_(-args.clamp, args.clamp)
            if args.bug_at_step is not None and step.index == args.bug_at_step and job.rank == 1:
                raise ValueError(f"user bug at step {step.index}")
            if args.step_sleep:
                time.sleep(args.step_sleep)
        job.log(loss=loss.item())
        if args.progress_file and job.rank == 0:
            with open(args.progress_file, "a") as f:
                f.write(f"{step.index} {loss.item():.6f}\n")

    if args.out:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(params, f"{args.out}.rank{job.rank}")
        if job.rank == 0:
            torch.save(params, args.out)
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
