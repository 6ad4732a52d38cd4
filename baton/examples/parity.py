"""One script, two launchers: check that `baton run` trains exactly as torchrun + DDP does.

A classic data-parallel script (conv + BatchNorm + dropout + an MLP head, AdamW with
StepLR, a shuffled DistributedSampler over synthetic data made here) written twice only
where it must be: `--plain` is the ordinary torchrun version (init_process_group + DDP +
a for-loop), without it the same script uses baton. Both write each rank's final state
(parameters, BatchNorm buffers, optimizer state, LR, torch's RNG state) to --out.rankN,
so the two runs can be compared bit for bit:

    torchrun --nproc_per_node 3 baton/examples/parity.py --plain --out plain.pt
    baton run --nproc 3 baton/examples/parity.py --out baton.pt

(tests/test_torchrun_parity.py does exactly this and compares every tensor.)
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import baton
from baton.examples import plain_exit


class Net(nn.Module):
    """~0.8M parameters (3.2 MB): after its first step DDP splits the gradients into two
    buckets (the first one is capped at 1 MiB), so the bucket layout matters."""

    def __init__(self, width: int = 16, hidden: int = 512):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc1 = nn.Linear(width * 8 * 8, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.2)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        x = F.gelu(self.fc1(torch.flatten(x, 1)))
        x = self.drop(F.gelu(self.fc2(x)))
        return self.fc3(x)


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = (x[:, 0].mean(dim=(1, 2)) * 60).long().clamp(-5, 4) + 5
    return TensorDataset(x, y)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
               target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(images), target)  # dropout draws from torch's global RNG
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def save_state(path: str, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        state.update({f"opt.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    state["lr"] = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    state["rng"] = torch.get_rng_state()
    torch.save(state, f"{path}.rank{rank}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="plain torchrun + DDP (run under torchrun)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--train-samples", type=int, default=480)  # 10 steps per epoch on 3 ranks
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", required=True, help="each rank writes its final state to OUT.rankN")
    args = p.parse_args()

    # ---- the only differences between the two versions: setup ...
    if args.plain:
        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        job = baton.init()
        rank, world_size = job.rank, job.world_size

    torch.manual_seed(0)  # the same initial weights on every rank
    net = Net()
    model = DDP(net) if args.plain else job.wrap(net)  # ... and wrapping ...
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train = synthetic(args.train_samples, seed=1)
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks

    # ---- ... and the loop.
    if args.plain:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for images, target in loader:
                train_step(model, optimizer, images, target)
            scheduler.step()
        save_state(args.out, rank, net, optimizer, scheduler)
        plain_exit.leave()
    else:
        job.track(data=loader)  # baton calls sampler.set_epoch(epoch) itself

        @job.at_epoch_end
        def end_of_epoch(b) -> None:
            scheduler.step()

        for epoch in job.epochs(args.epochs):
            for step in epoch:
                with step:
                    train_step(model, optimizer, *step.batch)
        save_state(args.out, rank, net, optimizer, scheduler)
        job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
