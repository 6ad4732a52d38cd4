"""A plain torchrun script in the shape of pytorch/examples' imagenet/main.py (CPU + gloo, tiny).

Shape features kept from the original:
- a module-level argparse parser and `global best_acc1`; `main()` seeds `random` and torch,
  then calls `main_worker(gpu, ngpus_per_node, args)`, which joins the process group;
- a small conv net with BatchNorm and dropout (stand-in for a torchvision resnet), DDP,
  CrossEntropyLoss, SGD with momentum and weight decay, StepLR, a `--resume` block;
- a synthetic image Dataset whose `__getitem__` random-crops and flips with torch's RNG
  (like RandomResizedCrop/RandomHorizontalFlip), DataLoader with DistributedSampler and
  `--workers` (default 2) worker processes; a drop_last validation sampler plus the
  original's auxiliary loader over the leftover validation samples;
- `train(...)` with AverageMeter/ProgressMeter (Summary enum) and `accuracy()` top-k;
  `validate(...)` under no_grad that all_reduces its top-1/top-5 meters and returns top1.avg;
- the epoch loop: set_epoch, train, validate, scheduler.step(), is_best / best_acc1, and
  rank 0's `save_checkpoint(...)` writing checkpoint.pth.tar and copying model_best.pth.tar.
Extra: `--export DIR` saves each rank's final state to DIR/rank{RANK}.pt.
"""

import argparse
import logging
import os
import random
import shutil
import sys
import time
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description='Tiny ImageNet-shaped training')
parser.add_argument('-a', '--arch', default='smallnet', choices=['smallnet'])
parser.add_argument('-j', '--workers', default=2, type=int, help='data loading workers per rank')
parser.add_argument('--epochs', default=3, type=int)
parser.add_argument('--start-epoch', default=0, type=int)
parser.add_argument('-b', '--batch-size', default=16, type=int, help='mini-batch size per rank')
parser.add_argument('--lr', '--learning-rate', default=0.05, type=float, dest='lr')
parser.add_argument('--momentum', default=0.9, type=float)
parser.add_argument('--wd', '--weight-decay', default=1e-4, type=float, dest='weight_decay')
parser.add_argument('--lr-step', default=2, type=int, help='StepLR step size in epochs')
parser.add_argument('-p', '--print-freq', default=4, type=int)
parser.add_argument('--resume', default='', type=str, help='path to latest checkpoint')
parser.add_argument('-e', '--evaluate', action='store_true')
parser.add_argument('--dist-backend', default='gloo', type=str)
parser.add_argument('--seed', default=0, type=int)
parser.add_argument('--gpu', default=None, type=int)
parser.add_argument('--out-dir', default='.', help='where checkpoints go')
parser.add_argument('--export', default='', help="save each rank's final state into this folder")

best_acc1 = 0


class SyntheticImages(Dataset):
    """10 classes of 3x20x20 images (class colour + noise); train items are augmented."""

    def __init__(self, n: int, train: bool, seed: int):
        g = torch.Generator().manual_seed(seed)
        protos = torch.randn(10, 3, 1, 1, generator=torch.Generator().manual_seed(99))
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = protos[self.labels] + torch.randn(n, 3, 20, 20, generator=g)
        self.train = train

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        img = self.images[i]
        if self.train:
            top, left = torch.randint(0, 5, (2,)).tolist()
            img = img[:, top:top + 16, left:left + 16]
            if torch.rand(1).item() < 0.5:
                img = img.flip(-1)
        else:
            img = img[:, 2:18, 2:18]
        return img, int(self.labels[i])


def smallnet(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, num_classes))


def main() -> None:
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.distributed = args.world_size > 1
    ngpus_per_node = 1  # CPU only
    main_worker(args.gpu, ngpus_per_node, args)


def main_worker(gpu, ngpus_per_node: int, args) -> None:
    global best_acc1
    args.gpu = gpu
    device = torch.device("cpu")
    args.rank = int(os.environ["RANK"])
    dist.init_process_group(backend=args.dist_backend, init_method="env://")
    if args.rank == 0:
        print(f"=> creating model '{args.arch}'")
    model = torch.nn.parallel.DistributedDataParallel(smallnet().to(device))
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    if args.resume:
        if os.path.isfile(args.resume):
            print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = torch.load(args.resume, map_location=device)
            args.start_epoch = checkpoint['epoch']
            best_acc1 = checkpoint['best_acc1']
            model.load_state_dict(checkpoint['state_dict'])
            optimizer.load_state_dict(checkpoint['optimizer'])
            scheduler.load_state_dict(checkpoint['scheduler'])
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
        else:
            print(f"=> no checkpoint found at '{args.resume}'")

    train_dataset = SyntheticImages(256, train=True, seed=1)
    val_dataset = SyntheticImages(100, train=False, seed=2)
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                              num_workers=args.workers, pin_memory=False, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=False, sampler=val_sampler)
    if args.evaluate:
        validate(val_loader, model, criterion, args)
        return

    last_meters: dict = {}
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        last_meters = train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, args)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            save_checkpoint({'epoch': epoch + 1, 'arch': args.arch, 'state_dict': model.state_dict(),
                             'best_acc1': best_acc1, 'optimizer': optimizer.state_dict(),
                             'scheduler': scheduler.state_dict()}, is_best, args.out_dir)

    if args.export:
        os.makedirs(args.export, exist_ok=True)
        torch.save({'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                    'scheduler': scheduler.state_dict(), 'torch_rng': torch.get_rng_state(),
                    'python_rng': random.getstate(), 'epoch': args.epochs,
                    'best_acc1': best_acc1, 'meters': last_meters},
                   os.path.join(args.export, f'rank{args.rank}.pt'))


def train(train_loader, model, criterion, optimizer, epoch: int, device, args) -> dict:
    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    data_time = AverageMeter('Data', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.NONE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.NONE)
    progress = ProgressMeter(len(train_loader), [batch_time, data_time, losses, top1, top5],
                             prefix=f"Epoch: [{epoch}]")
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        data_time.update(time.time() - end)
        images, target = images.to(device), target.to(device)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0].item(), images.size(0))
        top5.update(acc5[0].item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        if i % args.print_freq == 0 and args.rank == 0:
            progress.display(i + 1)
    # the meters' sums/counts (not their timings, which depend on the wall clock)
    return {m.name: {'sum': m.sum, 'count': m.count} for m in (losses, top1, top5)}


def validate(val_loader, model, criterion, args) -> float:
    def run_validate(loader, base_progress: int = 0) -> None:
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                output = model(images)
                loss = criterion(output, target)
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0].item(), images.size(0))
                top5.update(acc5[0].item(), images.size(0))
                batch_time.update(time.time() - end)
                end = time.time()
                if i % args.print_freq == 0 and args.rank == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.AVERAGE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.AVERAGE)
    leftover = len(val_loader.sampler) * args.world_size < len(val_loader.dataset)
    progress = ProgressMeter(len(val_loader) + int(leftover), [batch_time, losses, top1, top5], prefix='Test: ')
    model.eval()
    run_validate(val_loader)
    top1.all_reduce()
    top5.all_reduce()
    if leftover:  # as in the original, every rank also runs the samples drop_last left out
        aux = Subset(val_loader.dataset, range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        run_validate(DataLoader(aux, batch_size=args.batch_size, shuffle=False,
                                num_workers=args.workers, pin_memory=False), len(val_loader))
    if args.rank == 0:
        progress.display_summary()
    return top1.avg


def save_checkpoint(state: dict, is_best: bool, out_dir: str, filename: str = 'checkpoint.pth.tar') -> None:
    os.makedirs(out_dir, exist_ok=True)
    torch.save(state, os.path.join(out_dir, filename))
    if is_best:
        shutil.copyfile(os.path.join(out_dir, filename), os.path.join(out_dir, 'model_best.pth.tar'))


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self, name: str, fmt: str = ':f', summary_type: Summary = Summary.AVERAGE):
        self.name, self.fmt, self.summary_type = name, fmt, summary_type
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        return ('{name} {val' + self.fmt + '} ({avg' + self.fmt + '})').format(**self.__dict__)

    def summary(self) -> str:
        fmt = {Summary.NONE: '', Summary.AVERAGE: '{name} {avg:.3f}',
               Summary.SUM: '{name} {sum:.3f}', Summary.COUNT: '{name} {count:.3f}'}[self.summary_type]
        return fmt.format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches: int, meters: list, prefix: str = ""):
        digits = len(str(num_batches))
        self.batch_fmtstr = '[{:' + str(digits) + 'd}/' + str(num_batches) + ']'
        self.meters, self.prefix = meters, prefix

    def display(self, batch: int) -> None:
        print('\t'.join([self.prefix + self.batch_fmtstr.format(batch)] + [str(m) for m in self.meters]))

    def display_summary(self) -> None:
        print(' '.join([" *"] + [m.summary() for m in self.meters]))


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list:
    """Computes the accuracy over the k top predictions for the specified values of k."""
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0)) for k in topk]


def _leave() -> None:
    # torch 2.13's gloo can abort during interpreter teardown: tear down by hand, skip it.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == '__main__':
    main()
    _leave()
