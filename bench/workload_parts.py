"""What every benchmark workload shares, and nothing of baton: the model, the data and its
order, and the progress and CPU files the drivers read (see workload.py for their format).
bench/workload.py (plain DDP, baton's model-aware API, TorchFT) and bench/nocode_workload.py
(a torchrun script that never imports baton) both build on it, so the contenders differ only
in the harness around the step."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_model(params_m: float, width: int = 1024) -> torch.nn.Module:
    depth = max(1, round(params_m * 1e6 / (width * width + width)))
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width)]
    for _ in range(depth):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    layers += [torch.nn.ReLU(), torch.nn.Linear(width, 1)]
    return torch.nn.Sequential(*layers)


def build_loader(world: int, rank: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = batch * world * 64  # a fixed-size set; training cycles through epochs
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(data, batch_size=batch, drop_last=True,
                      sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3))


def _cpu_mark(done: int, own=None) -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    mark = {"t": time.time(), "cpu_s": ru.ru_utime + ru.ru_stime, "step": done}
    if own is not None:  # baton's own count (job.cpu_use()): its share of this process's CPU
        use = own()
        mark["baton"] = {"entry_s": use.entry_s, "threads_s": use.threads_s, "baton_s": use.baton_s}
    return mark


class Progress:
    """Rank 0's event log and every rank's pid and CPU files, for the drivers that kill and time."""

    def __init__(self, run_dir: str | None, rank: int, window: tuple[int, int] | None = None, own=None, **tags):
        self.dir = Path(run_dir) if run_dir else None
        self.own = own
        self.rank = rank
        self.window = window  # (warmup, steps): when to read this process's CPU time
        self.marks: dict[str, dict] = {}
        self.tags = tags
        self.log = None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"pid.rank{rank}").write_text(str(os.getpid()))
            # rank 0's events drive the harness; the others' steps time a replacement's return
            name = "progress.jsonl" if rank == 0 else f"progress.rank{rank}.jsonl"
            self.log = open(self.dir / name, "a", buffering=1)

    def emit(self, ev: str, **kw) -> None:
        if self.log is not None and (self.rank == 0 or ev == "step"):
            self.log.write(json.dumps({"ev": ev, "t": time.time(), **self.tags, **kw}) + "\n")

    def step(self, done: int, **kw) -> None:
        """`done` steps are complete: read this process's CPU time at the window's edges (before
        the event, so rank 0's event, which the harness acts on, follows every mark it pairs with)."""
        if self.dir is not None and self.window is not None:
            warmup, steps = self.window
            if "warm" not in self.marks and done >= warmup:
                self.marks["warm"] = _cpu_mark(done, self.own)
            if "end" not in self.marks and "warm" in self.marks and done >= steps:
                self.marks["end"] = _cpu_mark(done, self.own)
                tmp = self.dir / f".cpu.rank{self.rank}.json.tmp"
                tmp.write_text(json.dumps({"pid": os.getpid(), **self.marks}))
                os.replace(tmp, self.dir / f"cpu.rank{self.rank}.json")
        self.emit("step", step=done, **kw)


def window(args) -> tuple[int, int] | None:
    return (args.warmup, args.steps) if args.warmup is not None else None


def finish(progress: Progress, rank: int, model: torch.nn.Module, args) -> None:
    if rank == 0 and args.run_dir:
        torch.save(model.state_dict(), Path(args.run_dir) / "final.pt")
        progress.emit("done", step=args.steps, params=sum(p.numel() for p in model.parameters()))
