"""The data position: which batch of which epoch the next step consumes.

baton iterates the tracked loader itself (`step.batch`), so it always knows the
position, and it rebuilds the loader's iterator at any position on a joiner
without loading the skipped samples: for a map-style `DataLoader` the skip happens
on batch *indices* (the sampler), not on data.

Rebuilding must also reproduce the epoch's shuffle. `iter(loader)` draws seeds from
torch's generator (or the loader's own): the generator states just before the
epoch's iterator was created are kept as the *epoch record*, part of the rank's
bundle, and a rebuild recreates the iterator from them.

Loader worker processes (`num_workers > 0`) are seeded from that same draw, and each
one's random stream then advances with every sample it transforms (random crops,
flips, noise). Skipping on indices would hand a worker a fresh stream, so with workers
the rebuild loads the epoch's earlier batches and drops them: slower (the time to load
them, in parallel workers), but each worker's stream is exactly where it was.
`persistent_workers=True` keeps streams across epochs, which no rebuild can reproduce,
so it is refused up front.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from baton import selfcost


class _SkipBatches:
    """A batch sampler that drops the first `skip` batches of another one."""

    def __init__(self, inner: Iterable[list[int]], skip: int):
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]


def _loader_from(loader: DataLoader, skip: int) -> DataLoader:
    """The same in-process loader (no workers: those are rebuilt by reading) from batch `skip` on."""
    return DataLoader(loader.dataset, batch_sampler=_SkipBatches(loader.batch_sampler, skip),
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, generator=loader.generator)


def _generators(data: Any) -> list[torch.Generator]:
    """The generators iter(data) draws from, in a fixed order."""
    gens = [torch.default_generator]
    for owner in (data, getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not x for x in gens):
            gens.append(g)
    return gens


class DataFeed:
    def __init__(self, data: Any | None, batches_per_step: int = 1):
        if isinstance(data, DataLoader) and data.num_workers > 0 and data.persistent_workers:
            from baton.worker.tracked import UsageError

            raise UsageError("job.track(data=...): a DataLoader with persistent_workers=True keeps its workers' "
                             "random streams across epochs, which a replacement rank cannot reproduce; "
                             "use persistent_workers=False")
        self.data = data
        self.per_step = batches_per_step
        self.epoch = 0
        self.index = 0  # batches of `epoch` already consumed by completed steps
        self.record: dict[str, Any] | None = None  # generator states when this epoch's iterator began
        self._iter: Iterator[Any] | None = None
        self._pending: Any = None
        self._has_pending = False

    def steps_per_epoch(self) -> int | None:
        try:
            n = len(self.data)  # type: ignore[arg-type]
        except TypeError:
            return None
        return n // self.per_step

    def position_at(self, step: int) -> dict[str, Any] | None:
        """The position before step `step` (positions are a function of the step index; the
        epoch record, if this epoch's iterator exists already, is this rank's own)."""
        if self.data is None:
            return None
        spe = self.steps_per_epoch()
        if spe:
            epoch, index = step // spe, (step % spe) * self.per_step
        else:
            epoch, index = 0, step * self.per_step
        return {"epoch": epoch, "index": index, "record": self.record if epoch == self.epoch else None}

    def seek(self, position: dict[str, Any]) -> None:
        """Move to a position (a joiner, or a survivor catching up): the iterator is rebuilt lazily."""
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self.record = position.get("record")
        self._iter, self._pending, self._has_pending = None, None, False

    @property
    def has_pending(self) -> bool:
        """A batch was taken for the step about to run (a re-run of that step takes it again)."""
        return self._has_pending

    def batch(self) -> Any:
        """The batch(es) of the step about to run; the same object again if that step re-runs."""
        if self.data is None:
            return None
        if not self._has_pending:
            if self.per_step == 1:
                self._pending = self._next()
            else:
                self._pending = [self._next_at(self.index + i) for i in range(self.per_step)]
            self._has_pending = True
        return self._pending

    def advance(self) -> None:
        """The step that used the pending batch completed."""
        if self.data is None:
            return
        if not self._has_pending:
            self.batch()
        self._pending, self._has_pending = None, False
        self.index += self.per_step
        spe = self.steps_per_epoch()
        if spe is not None and self.index >= spe * self.per_step:
            self.epoch += 1
            self.index = 0
            self._iter, self.record = None, None

    def _next(self) -> Any:
        return self._next_at(self.index)

    def _next_at(self, index: int) -> Any:
        if self._iter is None:
            self._iter = self._make_iter(index)
        try:
            with selfcost.outside():  # the script's data pipeline: its own work, as under torchrun
                return next(self._iter)
        except StopIteration:
            # A steps-style loop runs through epochs: start the next one.
            self.epoch += 1
            self.index = 0
            self.record = None
            self._iter = self._make_iter(0)
            with selfcost.outside():
                return next(self._iter)

    def _make_iter(self, skip: int) -> Iterator[Any]:
        data = self.data
        sampler = getattr(data, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler reshuffles per epoch
        gens = _generators(data)
        if self.record is None or skip == 0:
            # A fresh epoch: remember where the generators were, then draw as torchrun would.
            self.record = {"epoch": self.epoch, "states": [g.get_state() for g in gens]}
            return self._iter_at(skip)
        # Rebuild the epoch's iterator from its record, then put the generators back.
        now = [g.get_state() for g in gens]
        for g, state in zip(gens, self.record["states"]):
            g.set_state(state)
        try:
            return self._iter_at(skip)
        finally:
            for g, state in zip(gens, now):
                g.set_state(state)

    def _iter_at(self, skip: int) -> Iterator[Any]:
        data = self.data
        if skip == 0:
            with selfcost.outside():  # starting the epoch's loader (its workers): the script's work
                it = iter(data)
        elif isinstance(data, DataLoader) and data.batch_sampler is not None and data.num_workers == 0 and \
                not isinstance(data.dataset, IterableDataset):
            it = iter(_loader_from(data, skip))
        else:
            it = iter(data)
            for _ in range(skip):  # loader workers, generic iterables: read and drop
                next(it)
            return it
        # Draw what the first next() draws (a RandomSampler's seed) now, as the original
        # iterator did when its first batch was taken, without consuming that batch.
        sampler_iter = getattr(it, "_sampler_iter", None)
        if sampler_iter is not None:
            try:
                first = next(sampler_iter)
            except StopIteration:
                return it
            it._sampler_iter = itertools.chain([first], sampler_iter)  # type: ignore[attr-defined]
        return it
