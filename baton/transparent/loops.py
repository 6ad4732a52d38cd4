"""The loops running right now, per thread, as the rewritten code reports them.

`enter`/`leave` bracket each loop; `iterate` (for) and `head` (while) count its
iterations. An entry remembers the frame it runs in: a loop inside a generator stays
entered while the generator is suspended, so the loops that enclose a point of the
program are the entries whose frames are on that point's stack (`enclosing`), not
simply the top of the list.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterator

from baton.transparent.sites import SITES, LoopSite


@dataclass(eq=False)
class ActiveLoop:
    site: LoopSite
    frame: FrameType
    iterations: int = 0  # heads passed: the body of iteration `iterations - 1` is running
    iterable: Any = None  # a for loop's iterable, as the script wrote it
    iterator: Any = field(default=None, repr=False)  # what `iter(iterable)` gave


class _Counted:
    """A for loop's iterator: counts the items it hands out."""

    __slots__ = ("_it", "_loop")

    def __init__(self, it: Iterator[Any], loop: ActiveLoop):
        self._it, self._loop = it, loop

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._loop.iterations += 1
        return item


class Loops:
    """What rewritten code calls (as `__baton_loops__`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def running(self) -> list[ActiveLoop]:
        """This thread's entered loops, outermost first."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, sid: int) -> None:
        self.running.append(ActiveLoop(SITES[sid], sys._getframe(1)))

    def leave(self, sid: int) -> None:
        frame = sys._getframe(1)
        stack = self.running
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].site.id == sid and stack[i].frame is frame:
                del stack[i]
                return

    def _current(self, sid: int, frame: FrameType) -> ActiveLoop:
        stack = self.running
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].site.id == sid and stack[i].frame is frame:
                return stack[i]
        raise RuntimeError(f"baton: loop {SITES[sid].where} was not entered (a rewriting bug; please report it)")

    def iterate(self, sid: int, iterable: Any) -> _Counted:
        loop = self._current(sid, sys._getframe(1))
        loop.iterable = iterable
        loop.iterator = iter(iterable)
        return _Counted(loop.iterator, loop)

    def head(self, sid: int) -> bool:
        self._current(sid, sys._getframe(1)).iterations += 1
        return True

    def enclosing(self, frame: FrameType | None) -> list[ActiveLoop]:
        """The loops running in `frame` and the frames that called it, outermost first."""
        on_stack = set()
        while frame is not None:
            on_stack.add(id(frame))
            frame = frame.f_back
        return [loop for loop in self.running if id(loop.frame) in on_stack]


LOOPS = Loops()
