"""baton's own CPU in this process, counted as it runs.

The overhead a user pays should be a figure measured on their own job, not a benchmark's
estimate, and a top-down comparison cannot resolve 1% on a busy machine (two identical
plain-DDP runs differ by more). So baton counts its own work, bottom up:

- entry points: the CPU (the calling thread's own clock) spent inside baton's code that user
  code or torch calls: the `job` methods, the step loop between steps, the forward, backward,
  gradient and optimizer hooks, the collective guard. User code that baton calls from there
  (boundary functions, the DataLoader producing a batch) is left out; a nested entry counts
  once.
- threads: the whole CPU of every thread baton starts (heartbeats, commands, bundle pushes,
  the transfer server), read from each thread's clock.

Reading a thread clock costs about 0.7 us; a step enters baton a handful of times (the loop,
the forward, the backward's start, one gradient hook per bucket, the optimizer), so counting
costs some 10 us per step. What it cannot see: work baton makes torch do outside these
entry points (the C++ side of calling a Python comm hook, say); the benchmark's whole-tree
comparison with plain DDP covers that.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_local = threading.local()
_lock = threading.Lock()
_entry_totals: list[list[int]] = []  # one [depth, started_ns, total_ns] per thread that entered baton
_live_clocks: dict[int, int] = {}  # thread ident -> its CPU clock id, for baton's running threads
_ended_ns = 0  # CPU of baton's threads that have ended
_spare_ns = 0  # the process's CPU while it was a spare, when it later took a rank over


@dataclass(frozen=True)
class CpuUse:
    """CPU-seconds this process has used since it started: the whole, and baton's share."""

    process_s: float  # every thread: the script, torch, gloo, baton
    entry_s: float  # inside baton's entry points (training thread and torch's callback threads)
    threads_s: float  # baton's own threads
    spare_s: float = 0.0  # the whole process while it waited as a spare (a joiner only)

    @property
    def baton_s(self) -> float:
        return self.entry_s + self.threads_s + self.spare_s

    def __sub__(self, other: "CpuUse") -> "CpuUse":
        return CpuUse(self.process_s - other.process_s, self.entry_s - other.entry_s,
                      self.threads_s - other.threads_s, self.spare_s - other.spare_s)


def _counter() -> list[int]:
    try:
        return _local.counter
    except AttributeError:
        c = _local.counter = [0, 0, 0]
        with _lock:
            _entry_totals.append(c)
        return c


def counted(fn: F) -> F:
    """Count the CPU of calls to `fn` as baton's own (a nested counted call counts once)."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        c = _counter()
        if c[0] == 0:
            c[1] = time.thread_time_ns()
        c[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            c[0] -= 1
            if c[0] == 0:
                c[2] += time.thread_time_ns() - c[1]

    return entry  # type: ignore[return-value]


_counted_next = counted(next)


def counted_iter(it: Iterator[T]) -> Iterator[T]:
    """Iterate `it`, counting the CPU of producing each item as baton's (a generator's body
    runs only inside next(), which a decorator on the generator function never sees)."""
    while True:
        try:
            item = _counted_next(it)
        except StopIteration:
            return
        yield item


class inside:  # noqa: N801 - used like a function: `with selfcost.inside():`
    """A block counted as `counted` counts a call: for code that reads its caller's frame,
    where a decorator's own frame would be in the way (the no-code mode's loop hooks)."""

    __slots__ = ("_c",)

    def __enter__(self) -> None:
        c = self._c = _counter()
        if c[0] == 0:
            c[1] = time.thread_time_ns()
        c[0] += 1

    def __exit__(self, *exc: object) -> None:
        c = self._c
        c[0] -= 1
        if c[0] == 0:
            c[2] += time.thread_time_ns() - c[1]


class outside:  # noqa: N801 - used like a function: `with selfcost.outside():`
    """User code called from inside baton (a boundary function, the loader's next batch):
    not baton's. A baton entry point reached from it is counted again."""

    __slots__ = ("_c", "_depth")

    def __enter__(self) -> None:
        c = self._c = _counter()
        self._depth = c[0]
        if self._depth:
            c[2] += time.thread_time_ns() - c[1]
            c[0] = 0

    def __exit__(self, *exc: object) -> None:
        if self._depth:
            self._c[0] = self._depth
            self._c[1] = time.thread_time_ns()


def spawn(target: Callable[..., Any], name: str, args: tuple = (), daemon: bool = True) -> threading.Thread:
    """Start one of baton's own threads, its CPU counted as baton's."""

    def run() -> None:
        global _ended_ns
        _name_os_thread(name)
        ident = threading.get_ident()
        with _lock:
            _live_clocks[ident] = time.pthread_getcpuclockid(ident)
        try:
            target(*args)
        finally:
            with _lock:
                _ended_ns += time.thread_time_ns()
                del _live_clocks[ident]

    t = threading.Thread(target=run, name=name, daemon=daemon)
    t.start()
    return t


def _name_os_thread(name: str) -> None:
    """Give the OS thread baton's name (15 bytes), so `top -H`, py-spy and /proc/<pid>/task
    tell baton's threads apart from torch's and the script's (Python does not name them):
    "baton-snapshot-pull-3" shows as "b:snapshot-pull"."""
    try:
        _libc().prctl(15, ("b:" + name.removeprefix("baton-")).encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def count_spare_time() -> None:
    """This process waited as a spare until now and takes a rank over: all of it was baton's
    (its own threads' share is already counted, and not twice)."""
    global _spare_ns
    _spare_ns = max(0, time.process_time_ns() - int(snapshot().threads_s * 1e9))


def snapshot() -> CpuUse:
    process = time.process_time_ns()
    with _lock:
        entry = sum(c[2] for c in _entry_totals)
        threads = _ended_ns
        for clock in _live_clocks.values():
            try:
                threads += time.clock_gettime_ns(clock)
            except OSError:  # ending right now: its CPU lands in _ended_ns, next time
                pass
    return CpuUse(process / 1e9, entry / 1e9, threads / 1e9, _spare_ns / 1e9)
