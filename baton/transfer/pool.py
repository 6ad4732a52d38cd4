"""Receive memory a spare maps before it is needed.

A joiner receives the state it takes over into memory. Fresh memory costs a page fault per
page on its first write, and at the sizes that matter those faults cost more than the copy
(1 GB: ~0.45 s of faulting against ~0.35 s of copying over loopback, measured here), and
they land inside the move's pause. A spare waits, often for hours, with nothing to do: so
once the ranks have said how large the state is (their heartbeats' `state_mb`), each spare
maps that much memory in the background, on a thread at the lowest priority (huge pages
where the kernel gives them), and a fetch carves its tensors out of it. The pause then pays for the copy only.

One pool per spare, used by one fetch: the tensors carved from it become the rank's state
(an optimizer's moments are adopted as they arrived), so the pool is not refilled. A
fetch that finds it still filling, too small, or already used allocates as before.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import torch

from baton import selfcost

log = logging.getLogger("baton.transfer")

ALIGN = 64  # every tensor carved at a cache-line boundary (any dtype's alignment)
# Only tensors this large are carved: the bytes (and faults) are theirs, and the small ones
# (random generator states, scalars, a step count) stay tensors of their own, as some of
# torch's consumers of those expect: Generator.set_state reads a state viewed into a larger
# block from the block's start ("Invalid mt19937 state", or a crash in a DataLoader's
# generator).
MIN_CARVED = 1 << 20
_STEP = 64 << 20  # mapped in steps of this much, so a fetch can start on a partly filled pool
_PAGE = 4096


class ReceivePool:
    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self._mapped = 0  # bytes mapped from the start so far
        self._used = False
        self._lock = threading.Lock()
        self.fill_s = 0.0
        self._thread = selfcost.spawn(self._fill, "baton-pool")

    def _fill(self) -> None:
        from baton.transfer.client import advise_huge, populate

        t0 = time.perf_counter()
        try:  # the spare's idle time, not the ranks': this thread yields to any of them
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        advise_huge(self._buf)
        start = self._buf.data_ptr()
        for off in range(0, self.nbytes, _STEP):
            with self._lock:
                if self._used:
                    return  # carved meanwhile (the fetch's own prefaulter takes over), or closed
                end = min(self.nbytes, off + _STEP)
                populate(start + off, end - off)
                # and a write to one byte of every page: where the kernel has no
                # MADV_POPULATE_WRITE, or a sandbox accepts the advice and maps nothing (seen
                # in CI: success, and not a page more resident), these writes map the pages;
                # where it did map them, they cost no fault. The pool holds nothing yet.
                self._buf[off:end:_PAGE].zero_()
                self._mapped = end
        self.fill_s = time.perf_counter() - t0
        log.info("receive pool of %.1f MB mapped in %.2fs", self.nbytes / 2**20, self.fill_s)

    @property
    def mapped(self) -> int:
        return self._mapped

    @property
    def used(self) -> bool:
        return self._used

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` was carved from this pool."""
        start = self._buf.data_ptr()
        return start <= t.data_ptr() < start + self.nbytes

    def close(self) -> None:
        """Stop mapping (a larger pool replaces this one): its memory goes with the last reference."""
        with self._lock:
            self._used = True

    def carve(self, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor] | None:
        """Tensors of these dtypes and shapes, the large ones laid out in the pool (the others
        new), or None when they do not fit or the pool was used. Consumes the pool, unless
        none is large enough to be carved: a no-code joiner's first fetch (its predecessor's
        own record, small tensors only) leaves it to the replicated state that follows."""
        spans: list[tuple[int, int] | None] = []  # each tensor's (offset, bytes) in the pool, or not in it
        end = 0
        for dtype, shape in specs:
            n = math.prod(shape) * dtype.itemsize
            if n < MIN_CARVED:
                spans.append(None)
                continue
            end = (end + ALIGN - 1) // ALIGN * ALIGN
            spans.append((end, n))
            end += n
        if end == 0:
            return [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
        with self._lock:
            if self._used or end > self.nbytes:
                return None
            self._used = True
        out = []
        whole = memoryview(self._buf.numpy())
        for span, (dtype, shape) in zip(spans, specs):
            if span is None:
                out.append(torch.empty(shape, dtype=dtype))
            else:  # a storage of its own over its span (it keeps the pool alive): a torch.save of
                # the tensor (a script's checkpoint of the optimizer it became) writes its bytes
                # only, where a view into the pool would write the whole pool
                out.append(torch.frombuffer(whole[span[0]:span[0] + span[1]], dtype=dtype).view(shape))
        log.info("receiving %.1f MB into the pool (%.1f MB of it mapped ahead)", end / 2**20,
                 min(self._mapped, end) / 2**20)
        return out


def release_unadopted(received: list[torch.Tensor], live: list[torch.Tensor], pool: ReceivePool) -> int:
    """Give the kernel back the pages of received tensors the rank did not adopt as they
    are (a module's load copies into its own parameters where they could not take the
    arrived memory; an optimizer's load keeps the tensors it was given): those carved from
    the pool would otherwise hold a second copy for the rank's whole life. Returns the bytes
    released."""
    from baton.transfer.client import discard

    kept = {t.data_ptr() for t in live if t.numel()}
    freed = 0
    for t in received:
        if t.numel() and t.data_ptr() not in kept and pool.holds(t):
            freed += discard(t.data_ptr(), t.numel() * t.element_size())
    return freed
