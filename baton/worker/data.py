"""The data position: which batch of which epoch the next step consumes.

baton iterates the tracked loader itself (`step.batch`), so it always knows
the position, and it can rebuild the loader's iterator at any position on a
joiner without loading the skipped samples: for a map-style `DataLoader` the
skip happens on batch *indices* (the sampler), not on data.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

from torch.utils.data import DataLoader, IterableDataset, Sampler


class _SkipBatches(Sampler):
    """A batch sampler that drops the first `skip` batches of another one."""

    def __init__(self, inner: Iterable[list[int]], skip: int):
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]


def _loader_from(loader: DataLoader, skip: int) -> DataLoader:
    kwargs: dict[str, Any] = dict(
        batch_sampler=_SkipBatches(loader.batch_sampler, skip),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
    )
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor,
                      multiprocessing_context=loader.multiprocessing_context)
    return DataLoader(loader.dataset, **kwargs)


class DataFeed:
    def __init__(self, data: Any | None):
        self.data = data
        self.epoch = 0
        self.index = 0  # batches of `epoch` already consumed by completed steps
        self._iter: Iterator[Any] | None = None
        self._pending: Any = None
        self._has_pending = False

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict[str, int]) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self._iter, self._pending, self._has_pending = None, None, False

    def batch(self) -> Any:
        """The batch of the step about to run; the same object again if that step re-runs."""
        if self.data is None:
            return None
        if not self._has_pending:
            self._pending = self._next()
            self._has_pending = True
        return self._pending

    def advance(self) -> None:
        """The step that used the pending batch completed."""
        if self.data is None:
            return
        if not self._has_pending:
            self.batch()
        self._pending, self._has_pending = None, False
        self.index += 1

    def _next(self) -> Any:
        if self._iter is None:
            self._iter = self._make_iter(self.index)
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self.index = 0
            self._iter = self._make_iter(0)
            return next(self._iter)

    def _make_iter(self, skip: int) -> Iterator[Any]:
        data = self.data
        sampler = getattr(data, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler reshuffles per epoch
        if skip == 0:
            return iter(data)
        if isinstance(data, DataLoader) and data.batch_sampler is not None and \
                not isinstance(data.dataset, IterableDataset):
            return iter(_loader_from(data, skip))
        it = iter(data)
        for _ in range(skip):  # generic iterables: no way around reading them
            next(it)
        return it
