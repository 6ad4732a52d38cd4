"""An epoch loop with validation, in the shape of a classic image-classification script.

BatchNorm and dropout in the model, SGD with StepLR, GradScaler with bf16 autocast, a
shuffled DistributedSampler, validation every epoch with a metric all_reduce, rank 0
keeping its best accuracy and writing a checkpoint, and a resume-from-file block that
a joiner skips. Data is synthetic (made here), so it runs anywhere on CPU.

    baton run --nproc 3 --spares 1 baton/examples/epochs.py --epochs 4 --out final.pt
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import baton


class Net(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


class Augmented(torch.utils.data.Dataset):
    """Random flips and noise per sample, drawn in the loader's worker processes."""

    def __init__(self, base: TensorDataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.05 * torch.randn_like(x), y


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--train-samples", type=int, default=384)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--augment", action="store_true", help="random flips and noise per training sample")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests)")
    p.add_argument("--val-sleep", type=float, default=0.0, help="extra seconds in validation (tests)")
    p.add_argument("--out", default=None, help="save the final state here (rank 0) and .rankN copies")
    p.add_argument("--checkpoint", default=None, help="rank 0 writes its best checkpoint here")
    p.add_argument("--resume", default=None, help="resume from this checkpoint if it exists")
    args = p.parse_args()

    job = baton.init()
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP scripts do
    model = job.wrap(Net(args.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    train = synthetic(args.train_samples, 1)
    if args.augment:
        train = Augmented(train)
    val = synthetic(96, 2)
    sampler = DistributedSampler(train, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=3)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True, num_workers=args.workers)
    val_loader = DataLoader(val, batch_size=16,
                            sampler=DistributedSampler(val, job.world_size, job.rank, shuffle=False))
    job.track(data=loader)  # model, optimizer, scheduler and scaler are found by baton
    best = job.local(acc=0.0)  # rank 0's best accuracy: its own, migrates from its own boundary

    start_epoch = 0
    if args.resume and os.path.exists(args.resume) and not job.joined:  # a joiner gets all of this from peers
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        best.acc = ckpt["acc"]
        start_epoch = ckpt["epoch"] + 1

    @job.at_epoch_end
    def validate(b) -> None:
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                pred = model(x).argmax(dim=1)
                correct += torch.tensor([float((pred == y).sum()), float(len(y))])
                if args.val_sleep:
                    time.sleep(args.val_sleep)
        dist.all_reduce(correct)
        acc = float(correct[0] / correct[1])
        model.train()
        scheduler.step()
        if job.rank == 0 and acc > best.acc:
            best.acc = acc
            if args.checkpoint:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": b.epoch, "acc": acc},
                           args.checkpoint)

    for epoch in job.epochs(args.epochs, start=start_epoch):
        for step in epoch:
            with step:
                images, target = step.batch
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(images), target)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            if not step.failed:
                job.log(loss=loss.item(), epoch=epoch)

    if args.out:
        state = {f"model.{k}": v.clone() for k, v in model.module.state_dict().items()}
        state.update({f"opt.{i}": s["momentum_buffer"].clone()
                      for i, s in optimizer.state_dict()["state"].items()})
        state["lr"] = torch.tensor(scheduler.get_last_lr())
        state["scale"] = torch.tensor(scaler.get_scale())
        state["best"] = torch.tensor(best.acc)
        state["rng"] = torch.get_rng_state()
        torch.save(state, f"{args.out}.rank{job.rank}")
        if job.rank == 0:
            torch.save(state, args.out)
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
