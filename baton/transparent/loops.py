"""The loops running right now, per thread, as the rewritten code reports them.

`enter`/`leave` bracket each loop; `iterate` (for) and `head` (while) count its
iterations. An entry remembers the frame it runs in: a loop inside a generator stays
entered while the generator is suspended, so the loops that enclose a point of the
program are the entries whose frames are on that point's stack (`enclosing`), not
simply the top of the list.

A `Controller` (the no-code runtime) may be attached: it is told of every head before the
next item is drawn (where a step boundary is) and after (drawing it may draw random numbers:
a Dataset's random crop without loader workers), may hand a loop's variables back at a head
(`restore`) or right after the loop (`restore_exit`: a successor taking over where the
step loop had ended), and decides whether an exception out of a loop's body is a lost peer to
absorb (`absorb`): the step then runs again from its first head, on the same items (a step
that accumulates gradients over several iterations drew several), each with the streams as
drawing it left them (`again`). With none
attached (`baton explain`), the loops behave exactly as written.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterator, Protocol

from baton import selfcost
from baton.transparent.sites import DRAW, SITES, LoopSite


@dataclass(eq=False)
class ActiveLoop:
    site: LoopSite
    frame: FrameType
    iterations: int = 0  # heads passed: the body of iteration `iterations - 1` is running
    iterable: Any = None  # a for loop's iterable, as the script wrote it
    iterator: Any = field(default=None, repr=False)  # what `iter(iterable)` gave
    item: Any = field(default=None, repr=False)  # the item of the running iteration
    # The step loop: the heads passed since its step began (a step accumulating gradients
    # over several iterations spans several), and a for loop's items drawn since, each with
    # the random streams as drawing it left them; after a recovery, those to hand again.
    step_heads: int = 0
    heads_last_step: int = 0  # the heads the step before this one spanned (0: none yet this loop)
    drawn: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    # The step before's heads and items, kept through the running step: a sharded survivor
    # may go back to its head and run it again (`back_one`: absorb hands them too).
    heads_before: int = 0
    drawn_before: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    back_one: bool = False
    replay: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    exhausted: bool = False  # end the loop at the next head (a successor reaching a loop's exit)
    ran_out: bool = False  # a for loop's iterator ran out, a while loop's test was false (not a break, ...)
    breaking: bool = False  # leave by a break at the next head (a successor: its predecessor did)
    raised: bool = False  # left with an exception on its way out
    returned: bool = False  # left by a `return` of its body or else clause (with `return_value`)
    return_value: Any = field(default=None, repr=False)
    returning: bool = False  # leave by a `return` at the next head (a successor: its predecessor did)
    counted: "_Counted | None" = field(default=None, repr=False)  # a for loop's iterator (positioned by a successor)
    head_rng: Any = field(default=None, repr=False)  # the random streams at this iteration's head (nest loops)


class Controller(Protocol):
    """The runtime's side; it sets `LOOPS.restoring` when it has values for a head."""

    def before_item(self, loop: ActiveLoop) -> None: ...

    def drawn(self, loop: ActiveLoop) -> None: ...

    def again(self, loop: ActiveLoop, streams: Any) -> None: ...

    def restore(self, loop: ActiveLoop) -> dict[str, Any] | None: ...

    def absorb(self, loop: ActiveLoop, exc: BaseException) -> bool: ...

    def ran_out(self, loop: ActiveLoop) -> None: ...

    def left(self, loop: ActiveLoop) -> None: ...

    def restore_exit(self, sid: int, frame: FrameType) -> dict[str, Any] | None: ...

    def return_value(self, loop: ActiveLoop) -> Any: ...


class _Counted:
    """A for loop's iterator: counts the items it hands out, tells the controller of each
    head first, and hands the same item again when an iteration re-runs."""

    __slots__ = ("_it", "_loop")

    def __init__(self, it: Iterator[Any], loop: ActiveLoop):
        self._it, self._loop = it, loop

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        loop = self._loop
        controller = LOOPS.controller
        if loop.replay:  # an iteration runs again after a recovery: the items its step had drawn
            with selfcost.inside():
                if controller is not None and loop.drawn:
                    controller.before_item(loop)  # a head inside the step (accumulation), not its first
                else:
                    loop.step_heads += 1  # its first head: the step began again at the recovery
                return self._again(loop, controller)
        if controller is not None:
            with selfcost.inside():
                controller.before_item(loop)
                if loop.replay:  # this head's recovery went back to the step before's: its items again
                    return self._again(loop, controller)
        if loop.exhausted:
            loop.exhausted = False
            raise StopIteration
        loop.returned = False  # (a return a `finally` of the body cancelled)
        if (loop.breaking or loop.returning) and loop.site.placeholder is not DRAW:
            return loop.site.placeholder  # nothing drawn: the head breaks right after (a successor, as its predecessor)
        try:
            loop.item = item = next(self._it)
        except StopIteration:
            loop.ran_out = True
            if controller is not None:
                with selfcost.inside():
                    controller.ran_out(loop)
            raise
        loop.iterations += 1
        if controller is not None:
            with selfcost.inside():
                controller.drawn(loop)
        return item

    @staticmethod
    def _again(loop: ActiveLoop, controller: "Controller | None") -> Any:
        loop.item, streams = item, _ = loop.replay.pop(0)
        loop.iterations += 1
        loop.drawn.append((item, streams))
        if controller is not None:
            controller.again(loop, streams)
        return item

    def skip(self, n: int) -> None:
        """Draw and drop `n` items (a successor replaying a loader to its rank's place)."""
        for _ in range(n):
            next(self._it)
            self._loop.iterations += 1

    def replace(self, iterable: Any) -> None:
        """Iterate `iterable` instead (a successor given the range its predecessor had)."""
        self._loop.iterable = iterable
        self._loop.iterator = self._it = iter(iterable)


class Loops:
    """What rewritten code calls (as `__baton_loops__`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.controller: Controller | None = None
        self.restoring = False  # read at every head: the controller sets it when it has values to hand back

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
                loop = stack.pop(i)
                loop.raised = sys.exc_info()[1] is not None  # (called from the loop's finally clause)
                if self.controller is not None:
                    with selfcost.inside():
                        self.controller.left(loop)
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
        loop.counted = _Counted(loop.iterator, loop)
        return loop.counted

    def head(self, sid: int) -> bool:
        loop = self._current(sid, sys._getframe(1))
        if self.controller is not None:
            with selfcost.inside():
                self.controller.before_item(loop)
        loop.iterations += 1
        loop.returned = False
        return True

    def ran_out(self, sid: int) -> None:
        """A while loop's test was false: it ends as written (its else clause runs)."""
        self._current(sid, sys._getframe(1)).ran_out = True

    def breaking(self, sid: int) -> bool:
        """At a head, after `restore`: leave the loop by a break now (once)."""
        loop = self._current(sid, sys._getframe(1))
        breaking, loop.breaking = loop.breaking, False
        return breaking

    def returning(self, sid: int) -> bool:
        """At a head, after `restore`: leave the loop's function by a return now (once)."""
        loop = self._current(sid, sys._getframe(1))
        returning, loop.returning = loop.returning, False
        return returning

    def return_value(self, sid: int) -> Any:
        """What that return returns: the predecessor's value."""
        loop = self._current(sid, sys._getframe(1))
        assert self.controller is not None
        with selfcost.inside():
            return self.controller.return_value(loop)

    def returned(self, value: Any) -> Any:
        """A `return` in a loop's body, on its way out: every loop of its frame is left by it."""
        frame = sys._getframe(1)
        for loop in self.running:
            if loop.frame is frame:
                loop.returned, loop.return_value = True, value
        return value

    def restore(self, sid: int) -> dict[str, Any] | None:
        if self.controller is None:
            return None
        loop = self._current(sid, sys._getframe(1))
        with selfcost.inside():
            return self.controller.restore(loop)

    def restore_exit(self, sid: int) -> dict[str, Any] | None:
        """After a loop, in its frame: the variables a successor takes over at the loop's exit."""
        if self.controller is None:
            return None
        frame = sys._getframe(1)
        with selfcost.inside():
            return self.controller.restore_exit(sid, frame)

    def absorb(self, sid: int, exc: BaseException) -> bool:
        if self.controller is None:
            return False
        loop = self._current(sid, sys._getframe(1))
        with selfcost.inside():
            if not self.controller.absorb(loop, exc):
                return False
        if loop.back_one:  # the controller put it back to the step before's head (`put_back`)
            loop.back_one = False
            return True
        self.put_back(loop, loop.drawn, loop.step_heads)  # the step runs again from its first head
        return True

    @staticmethod
    def put_back(loop: ActiveLoop, items: list[tuple[Any, Any]], heads: int) -> None:
        """Put `loop` back by `heads` heads: a for loop hands `items` (drawn there) again, a
        while loop's next head begins the first of them again."""
        if loop.site.kind == "for":
            loop.replay = list(items)
            loop.iterations -= len(items)
        else:
            loop.iterations -= heads
        loop.step_heads, loop.drawn = 0, []

    def enclosing(self, frame: FrameType | None) -> list[ActiveLoop]:
        """The loops running in `frame` and the frames that called it, outermost first."""
        on_stack = set()
        while frame is not None:
            on_stack.add(id(frame))
            frame = frame.f_back
        return [loop for loop in self.running if id(loop.frame) in on_stack]


LOOPS = Loops()
