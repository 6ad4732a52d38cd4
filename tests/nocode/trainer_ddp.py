"""A plain torchrun script in the shape of pytorch/examples' DDP tutorial series
(distributed/ddp-tutorial-series/multigpu_torchrun.py) with parts of minGPT-ddp's trainer
(distributed/minGPT-ddp/mingpt/trainer.py and main.py); CPU + gloo, tiny.

Shape features:
- `ddp_setup()` from the torchrun env; a `Trainer(model, train_data, optimizer, save_every,
  snapshot_path)` that loads `snapshot.pt` when present (`self.epochs_run` from it) and wraps
  the model in DDP;
- `_run_epoch(epoch)` peeks a batch with `len(next(iter(self.train_data))[0])` (an extra
  DataLoader iterator at each epoch's start), prints, calls `sampler.set_epoch(epoch)`, then
  `for source, targets in self.train_data:` -> `_run_batch(source, targets)`;
- `train(max_epochs)` loops `range(self.epochs_run, max_epochs)` and saves a snapshot on local
  rank 0 every save_every epochs;
- from minGPT-ddp: an optional `--random-split` of one dataset into train/test with
  `torch.utils.data.random_split` without a generator (it draws from the global RNG),
  grad-norm clipping, and an evaluation pass over a test loader each epoch under no_grad
  (its loss all_reduced);
- a Dataset class built in the script, DataLoader + DistributedSampler(shuffle=True), AdamW;
- argparse with positional total_epochs/save_every as in the tutorial.
Extra: `--hidden N` widens the hidden layer; `--export DIR` saves each rank's final state to DIR/rank{RANK}.pt; `--comm-hook fp16|bf16`
registers DDP's gradient-compression hook.
"""

import argparse
import logging
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class MyTrainDataset(Dataset):
    """Points in 20-d labelled by a fixed random linear teacher (4 classes)."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 20, generator=g)
        teacher = torch.randn(20, 4, generator=torch.Generator().manual_seed(1234))
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class Trainer:
    def __init__(self, model: nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str, test_data: DataLoader | None = None,
                 grad_norm_clip: float = 1.0) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.test_data = test_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.grad_norm_clip = grad_norm_clip
        self.epochs_run = 0
        self.last_loss = 0.0
        self.test_loss = float("nan")
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_norm_clip)
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        self.model.train()
        for source, targets in self.train_data:
            self.last_loss = self._run_batch(source, targets)

    @torch.no_grad()
    def _evaluate(self, epoch: int) -> None:
        self.model.eval()
        total = torch.zeros(2)
        for source, targets in self.test_data:
            total[0] += F.cross_entropy(self.model(source), targets, reduction="sum")
            total[1] += len(targets)
        dist.all_reduce(total)
        self.test_loss = (total[0] / total[1]).item()
        if self.global_rank == 0:
            print(f"Epoch {epoch} | train loss {self.last_loss:.4f} | test loss {self.test_loss:.4f}")

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch + 1}  # the tutorial stores `epoch` and so reruns it
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            if self.test_data is not None:
                self._evaluate(epoch)
            self.epochs_run = epoch + 1


def load_train_objs(use_random_split: bool, hidden: int = 64):
    if use_random_split:  # minGPT-ddp: one dataset, split without a generator
        dataset = MyTrainDataset(640)
        train_set, test_set = random_split(dataset, [512, 128])
    else:
        train_set, test_set = MyTrainDataset(512), MyTrainDataset(128, seed=1)
    model = nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return train_set, test_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset, shuffle=shuffle))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str,
         use_random_split: bool, seed: int, export: str, comm_hook: str = "", hidden: int = 64) -> None:
    ddp_setup()
    torch.manual_seed(seed)  # not in the tutorial (model init is unseeded there)
    random.seed(seed)
    train_set, test_set, model, optimizer = load_train_objs(use_random_split, hidden)
    train_data = prepare_dataloader(train_set, batch_size)
    test_data = prepare_dataloader(test_set, batch_size, shuffle=False)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, test_data)
    if comm_hook:  # gradients compressed for the all-reduce, as DDP's docs show
        trainer.model.register_comm_hook(None, getattr(default_hooks, f"{comm_hook}_compress_hook"))
    trainer.train(total_epochs)
    if export:
        os.makedirs(export, exist_ok=True)
        torch.save({"model": trainer.model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                    "epochs_run": trainer.epochs_run, "last_loss": trainer.last_loss,
                    "test_loss": trainer.test_loss},
                   os.path.join(export, f"rank{dist.get_rank()}.pt"))
    destroy_process_group()


def _leave() -> None:
    # torch 2.13's gloo can abort during interpreter teardown: tear down by hand, skip it.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, nargs="?", default=4, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, nargs="?", default=2, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device")
    parser.add_argument("--snapshot-path", default="snapshot.pt", help="where the snapshot lives")
    parser.add_argument("--random-split", action="store_true", help="split one dataset (minGPT-ddp)")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--hidden", default=64, type=int, help="the hidden layer's width")
    parser.add_argument("--export", default="", help="save each rank's final state into this folder")
    parser.add_argument("--comm-hook", choices=["fp16", "bf16"], default="", help="DDP gradient compression")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path,
         args.random_split, args.seed, args.export, args.comm_hook, args.hidden)
    _leave()
