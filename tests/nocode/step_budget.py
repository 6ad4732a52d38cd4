"""A plain torchrun script that trains for a budget of optimizer steps rather than epochs,
as many scripts written against a step budget do (TorchTitan's `while step < steps`, HF-style
`max_steps`): a `while done < steps:` around the DataLoader's epochs, the counter assigned
inside the batch loop, `sampler.set_epoch(epoch)` at each pass, a `break` at the budget,
dropout, a warm-up-then-cosine LambdaLR and AdamW; CPU + gloo, tiny.

    torchrun --nproc-per-node 2 step_budget.py --steps 72 --export DIR   # DIR/rank{RANK}.pt
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def lr_at(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=72)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--samples", type=int, default=64, help="per pass over the data (8 steps a pass on 2 ranks)")
    p.add_argument("--export", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 16), torch.randn(args.samples, 4))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, 5, args.steps))
    done, epoch, running = 0, 0, 0.0
    while done < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running = 0.9 * running + 0.1 * loss.item()
            done += 1
            if done >= args.steps:
                break
        epoch += 1
    if args.export:
        os.makedirs(args.export, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                    "done": done, "epoch": epoch, "running": running},
                   os.path.join(args.export, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's gloo can abort in the interpreter's teardown: skip it


if __name__ == "__main__":
    main()
