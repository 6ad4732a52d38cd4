"""A classifier trainer in the shape many recipes share (imagenet's main.py, timm's train.py):
an epoch loop calling train() and validate(), BatchNorm and dropout, fp16 autocast with a
dynamic loss scale (GradScaler), gradient accumulation over micro-batches with DDP's
no_sync(), a loss summed on the device in place (no sync a batch), clipping, a OneCycle schedule stepped per optimizer step, a validation that
all-reduces its counts, rank 0 saving a checkpoint each epoch and a resume block that loads
it when present. Written for torchrun; CPU and gloo so that it runs anywhere (`--device cuda`:
the model, the batches, autocast and the scaler on the GPU, still over gloo, which reduces
CUDA tensors: every rank may share one GPU, which NCCL refuses).

    torchrun --nproc-per-node 2 accumulating_amp.py --checkpoint ckpt.pt --export out/
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MICRO_BATCH = 8


class AverageMeter:
    def __init__(self, name):
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, value, n):
        self.sum += value * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def train(loader, model, optimizer, scheduler, scaler, accum, epoch, device):
    model.train()
    losses, skipped = AverageMeter("loss"), 0
    seen = torch.zeros((), dtype=torch.float64, device=device)  # the epoch's summed loss, kept on the device (no sync a batch)
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        syncing = (i + 1) % accum == 0
        with contextlib.nullcontext() if syncing else model.no_sync():
            with torch.autocast(device.type, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) / accum
            scaler.scale(loss).backward()
        losses.update(loss.item() * accum, x.size(0))
        seen += loss.detach() * accum * x.size(0)
        if not syncing:
            continue
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale  # the gradients overflowed: that step was skipped
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return losses.avg, skipped, seen


def validate(loader, model, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), y.numel()], dtype=torch.float,
                                   device=device)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g))
    held_out = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                              nn.Linear(32, 3)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    steps_per_epoch = len(data) // world // MICRO_BATCH // args.accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=args.epochs * steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 18, growth_interval=3)
    start_epoch, best_acc = 0, 0.0
    if os.path.exists(args.checkpoint):  # resume where the last run stopped
        ckpt = torch.load(args.checkpoint, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
    val_loader = DataLoader(held_out, batch_size=MICRO_BATCH, sampler=DistributedSampler(held_out, shuffle=False))
    history, skipped = [], 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss, skipped_now, seen = train(loader, model, optimizer, scheduler, scaler, args.accum, epoch, device)
        acc = validate(val_loader, model, device)
        skipped += skipped_now
        best_acc = max(best_acc, acc)
        history.append([loss, acc, seen.item()])
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
                        "best_acc": best_acc}, args.checkpoint)
    os.makedirs(args.export, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": torch.get_rng_state(),
                "history": torch.tensor(history, dtype=torch.float64), "best_acc": torch.tensor(best_acc),
                "skipped": torch.tensor(skipped),
                **({"cuda_rng": torch.cuda.get_rng_state()} if device.type == "cuda" else {})},
               os.path.join(args.export, f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py)


if __name__ == "__main__":
    main()
