"""A small ResNet trained with FSDP2 in the shape of an image-classification epoch loop, on baton.

Residual blocks with BatchNorm (each rank's running statistics are its own: FSDP2 shards
parameters, not buffers), dropout before the classifier, SGD with Nesterov momentum and a
one-cycle LR stepped every step, bf16 autocast with a ShardedGradScaler (its found-inf
check agreed across ranks) and gradient clipping after unscaling; a shuffled
DistributedSampler over a synthetic dataset with random flips; at every epoch's end a
validation with an accuracy all_reduce, a sharded checkpoint written with
torch.distributed.checkpoint by every rank, and rank 0's best model gathered as a full
state dict; a resume block that loads the last checkpoint on a fresh start.

    baton run --nproc 4 --spares 1 --redundancy 1 baton/examples/resnet.py --epochs 4 --out final.pt
    torchrun --nproc_per_node 4 baton/examples/resnet.py --plain --epochs 4 --out plain.pt

`--plain` is the same script on torchrun; `--replicas 2` makes it HSDP (2 replica groups,
each sharding over world/2 ranks). Both write each rank's shards, BatchNorm statistics,
optimizer state, LR, loss scale and random stream for a bitwise compare.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import baton
from baton.examples import plain_exit


class ResidualBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, classes: int = 10, dropout: float = 0.2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(ResidualBlock(width, width, 1), ResidualBlock(width, 2 * width, 2))
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(self.drop(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


def synthetic(n: int, seed: int) -> TensorDataset:
    """Images whose class is the quadrant-and-colour pattern of a bright patch, with noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(10, (n,), generator=g)
    x = 0.5 * torch.randn(n, 3, 12, 12, generator=g)
    for i in range(n):
        c = int(y[i])
        row, col = (c % 4) // 2 * 6, (c % 2) * 6
        x[i, c % 3, row:row + 6, col:col + 6] += 1.0 + 0.5 * (c // 4)
    return TensorDataset(x, y)


class Flipped(Dataset):
    """Random horizontal flips, drawn per sample from the process's random stream."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), y


class AppState(Stateful):
    """What a checkpoint holds, in the shape torch.distributed.checkpoint's recipes use: the
    sharded model and optimizer through the state-dict helpers, and the small state."""

    def __init__(self, model, optimizer, scheduler, scaler, epoch: int = -1, best: float = 0.0):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.epoch, self.best = epoch, best

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd, "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "epoch": self.epoch, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.best = state["epoch"], state["best"]


def save_state(path: str, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler,
               best: float) -> None:
    """This rank's shards, BatchNorm statistics and optimizer state (the helpers' sharded
    state dict), LR, loss scale, best accuracy and random stream, for a bitwise comparison."""
    msd, osd = get_state_dict(model, optimizer)
    state = {f"model.{k}": (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in msd.items()}
    for key, s in osd["state"].items():
        state.update({f"opt.{key}.{k}": (v.to_local() if hasattr(v, "to_local") else torch.as_tensor(v)).clone()
                      for k, v in s.items()})
    state["lr"] = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    state["scale"] = torch.tensor(scaler.get_scale())
    state["best"] = torch.tensor(best)
    state["rng"] = torch.get_rng_state()
    torch.save(state, f"{path}.rank{rank}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="plain torchrun + FSDP2 (run under torchrun)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-samples", type=int, default=512)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=2.0)
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: this many replica groups, each sharding the model over world/replicas ranks")
    p.add_argument("--checkpoint", default=None, help="every rank writes a sharded checkpoint under this "
                   "directory at each epoch's end (DIR/epochN)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint directory if it exists")
    p.add_argument("--export", default=None, help="rank 0 writes its best model here as a full state dict")
    p.add_argument("--out", default=None, help="save each rank's state to OUT.rankN")
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds in validation (tests)")
    args = p.parse_args()

    # ---- the only differences between the torchrun and the baton version: setup ...
    if args.plain:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank, world_size, joined = dist.get_rank(), dist.get_world_size(), False
        shape = (args.replicas, world_size // args.replicas) if args.replicas > 1 else (world_size,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if args.replicas > 1 else None)
    else:
        job = baton.init()
        rank, world_size, joined = job.rank, job.world_size, job.joined
        if args.replicas > 1:
            mesh = job.mesh(("replicate", "shard"), (args.replicas, world_size // args.replicas))
        else:
            mesh = job.mesh()

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = ResNet(args.width)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train = Flipped(synthetic(args.train_samples, seed=1))
    val = synthetic(128, seed=2)
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val, batch_size=32, sampler=DistributedSampler(val, world_size, rank, shuffle=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader))
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8, growth_interval=5)
    torch.manual_seed(1000 + rank)  # each rank's flips and dropout are its own

    best = 0.0
    start_epoch = 0
    if args.resume and Path(args.resume).exists() and not joined:  # a joiner gets all of this from its peers
        app = AppState(model, optimizer, scheduler, scaler)
        dcp.load({"app": app}, checkpoint_id=args.resume)
        start_epoch, best = app.epoch + 1, app.best
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    def train_step(images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # a DTensor all_reduce of the norm
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def end_of_epoch(epoch: int, best: float) -> float:
        """Validate; checkpoint (every rank its shards); rank 0 keeps and exports its best model."""
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for images, target in val_loader:
                correct += torch.tensor([float((model(images).argmax(1) == target).sum()), float(len(target))])
        time.sleep(args.val_sleep)
        dist.all_reduce(correct)
        model.train()
        acc = float(correct[0] / correct[1])
        improved = acc > best
        if args.checkpoint:
            dcp.save({"app": AppState(model, optimizer, scheduler, scaler, epoch, max(best, acc))},
                     checkpoint_id=f"{args.checkpoint}/epoch{epoch}")
        if improved and args.export:  # every rank takes part in gathering the full model
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, args.export)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.3f}", flush=True)
        return max(best, acc)

    # ---- ... and the loop.
    if args.plain:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            for images, target in loader:
                train_step(images, target)
            best = end_of_epoch(epoch, best)
        if args.out:
            save_state(args.out, rank, model, optimizer, scheduler, scaler, best)
        plain_exit.leave()

    job.track(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=loader)
    kept = job.local(best=best)  # rank 0's best accuracy: its own, migrates from its own boundary

    @job.at_epoch_end
    def validate(b) -> None:
        kept.best = end_of_epoch(b.epoch, kept.best)

    for epoch in job.epochs(args.epochs, start=start_epoch):
        for step in epoch:
            with step:
                images, target = step.batch
                loss = train_step(images, target)
            if not step.failed:
                job.log(loss=loss.item(), epoch=epoch, scale=scaler.get_scale())
    if args.out:
        save_state(args.out, rank, model, optimizer, scheduler, scaler, kept.best)
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
