"""What the instrumentation learned about each loop of the script, before it ran.

A `LoopSite` is one `for`/`while` statement in one of the script's own modules: where it
is, what it iterates over, which names its body assigns (the candidates for what the
loop carries from one iteration to the next), and its top-level statements (so the
regions before and after an inner loop can be named). Sites are numbered in the order
they are instrumented; rewritten code refers to them by that number.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Statement:
    """One top-level statement of a loop's body: its lines and a one-line summary."""

    line: int
    end_line: int
    text: str
    calls: tuple[str, ...] = ()  # the functions and methods it calls, as written ("validate", "scheduler.step")


DRAW = "<draw an item>"


@dataclass(frozen=True)
class LoopSite:
    id: int
    file: str
    line: int
    col: int
    kind: str  # "for" | "while"
    scope: str  # the enclosing function's qualified name, or "<module>"
    header: str  # "for x in <iter>" / "while <test>", shortened
    targets: tuple[str, ...]  # names a for loop's target binds: each iteration's item
    assigned: tuple[str, ...]  # names the loop (target, body, else) binds in its scope
    mutated: tuple[str, ...]  # names whose attributes or items the loop changes (self.x = ..., d[k] = ..., h.append(x))
    reads: tuple[str, ...]  # names the loop reads (a module-level loop's meters are globals it reads)
    resumable: bool = True  # False: a while loop whose else clause jumps (kept in its plain form)
    live: tuple[str, ...] = ()  # of `assigned`, those holding what is read after the head (liveness)
    returns: bool = False  # its body or else clause holds a `return` (an exit that is not a break nor its end)
    # What a for loop's target unpacks without drawing an item (None for `x`, (None, None) for
    # `x, y`), or DRAW where it cannot be built (a starred, attribute or subscript target).
    placeholder: object = None
    has_else: bool = False  # an else clause: what an exit at its end, not by a break, runs
    body: tuple[Statement, ...] = field(default=(), compare=False)

    @functools.cached_property
    def targets_read_after(self) -> tuple[str, ...]:
        """Its own targets that the code after it reads (`i` of `for i, batch in ...`): only its
        last item bound them, so each head carries those it can (controller.script_section)."""
        return tuple(n for n in self.targets if n in self.live)

    @functools.cached_property
    def scope_names(self) -> tuple[str, ...]:
        """Every name a head's record may read from the loop's scope (controller.script_section):
        looked up one by one, not by copying the scope (a module-level loop's is every global)."""
        return tuple(dict.fromkeys((*self.reads, *self.mutated, *self.assigned)))

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def key(self) -> str:
        """The same loop in every process running the script: its file, line and column."""
        return f"{self.file}:{self.line}:{self.col}"


class SiteTable:
    """Every site instrumented in this process, by number (append-only, thread-safe)."""

    def __init__(self) -> None:
        self._sites: list[LoopSite] = []
        self._lock = threading.Lock()
        self.files: set[str] = set()  # the files whose code was instrumented
        self.globals: dict[str, tuple[str, ...]] = {}  # file -> names its functions declare global

    def add(self, make: Callable[[int], LoopSite]) -> LoopSite:
        with self._lock:
            site = make(len(self._sites))
            self._sites.append(site)
            self.files.add(site.file)
            return site

    def declare_globals(self, filename: str, names: tuple[str, ...]) -> None:
        with self._lock:
            self.files.add(filename)
            if names:
                self.globals[filename] = names

    def __getitem__(self, sid: int) -> LoopSite:
        return self._sites[sid]

    def __len__(self) -> int:
        return len(self._sites)


SITES = SiteTable()
