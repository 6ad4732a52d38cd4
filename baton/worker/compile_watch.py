"""Which buffers a forward registered inside compiled code by breaking its graph.

A joiner is given the buffers its predecessor's first forward registered (a mask, running
statistics) before its own first forward, so it never runs that registration. Under
torch.compile that can change which code runs: a registration dynamo cannot trace (inside
an activation-checkpointed region it is an "unsafe side effect") breaks the graph, and the
predecessor has run that region eagerly ever since, while the joiner, finding the buffer
already there, compiles it. Eager and inductor code round and draw random numbers
differently, so the run would end differing from one without the failure, with exit 0
and no digest to see it (every rank takes the same reduced gradients). The predecessor
notes such buffers at the end of the step that made them and tells the orchestrator, which
refuses planned moves of it; a joiner that would pre-register one (the rank was lost) stops
the job with a divergence instead of training on (runtime).

A graph break in the step that registered a buffer inside a compiled module is taken as
that registration's: torch keeps no record linking the two. A break elsewhere in the same
first step flags the buffer too, which stops a move that would have been exact; the
message says how to avoid both (register the buffer in `__init__`).
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Iterable, Mapping

import torch

log = logging.getLogger("baton.worker")


def graph_breaks() -> Mapping[str, int]:
    """Dynamo's graph breaks in this process so far, by reason (its live counter); empty
    where nothing compiled (dynamo is imported by the first torch.compile call, never here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["graph_break"] if utils is not None else {}


def compiled_module_ids(models: Iterable[torch.nn.Module]) -> set[int]:
    """The ids of every module that runs inside a torch.compile'd module of `models`
    (`torch.compile(module)` and `module.compile()` alike)."""
    out: set[int] = set()
    for model in models:
        for module in model.modules():
            inner = getattr(module, "_orig_mod", None)  # torch.compile(module): an OptimizedModule
            if isinstance(inner, torch.nn.Module):
                out.update(id(m) for m in inner.modules())
            elif getattr(module, "_compiled_call_impl", None) is not None:  # module.compile()
                out.update(id(m) for m in module.modules())
    return out


def first_line(reason: str) -> str:
    return reason.strip().splitlines()[0] if reason.strip() else reason


def describe(broke: dict[str, str]) -> str:
    """Why the state of a rank whose forward made `broke` cannot move bit for bit, and the fix."""
    keys = sorted(broke)
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return (f"its first forward registered {shown} inside compiled code and broke the graph there "
            f"({next(iter(broke.values()))}), so that code has run eagerly since; a new process, given the "
            "buffers before its first forward, would compile it and compute different numbers (a torchrun job "
            "resumed from a checkpoint would too). Register them in the module's __init__, before "
            "torch.compile, and the job moves bit for bit")


class CompileWatch:
    """Checked at the end of each step and boundary function: a compare of dynamo's few
    graph-break counts, and more only in a step that registered something and broke a graph."""

    def __init__(self) -> None:
        self.registrations = -1
        self.breaks: dict[str, int] = {}  # dynamo's graph breaks as the step began
        self.seen: set[str] = set()  # late buffers already looked at
        self.broke: dict[str, str] = {}  # late buffer key -> the graph break its registration took

    def start(self, registrations: int) -> None:
        """The step loop begins: nothing registered so far was registered by one of its forwards."""
        self.registrations, self.breaks, self.seen = registrations, dict(graph_breaks()), set()

    def step_ended(self, registrations: int, late: Callable[[], list[tuple[str, torch.nn.Module]]],
                   models: Callable[[], Iterable[torch.nn.Module]]) -> None:
        """`late()`: (key, owning module) of every buffer registered since the loop began."""
        breaks = graph_breaks()
        if registrations != self.registrations:
            fresh = [(key, owner) for key, owner in late() if key not in self.seen]
            new_reasons = [r for r, n in breaks.items() if n > self.breaks.get(r, 0)]
            if fresh and new_reasons:
                self._flag(fresh, first_line(new_reasons[0]), models())
            self.seen.update(key for key, _ in fresh)
            self.registrations = registrations
        if breaks != self.breaks:
            self.breaks = dict(breaks)

    def adopted(self, keys: Iterable[str]) -> None:
        """Buffers registered before a forward (given by a source), not by one."""
        self.seen.update(keys)

    def _flag(self, fresh: list[tuple[str, torch.nn.Module]], reason: str, models: Iterable[torch.nn.Module]) -> None:
        compiled = compiled_module_ids(models)
        flagged = [key for key, owner in fresh if id(owner) in compiled]
        for key in flagged:
            self.broke[key] = reason
        if flagged:
            log.warning("this rank cannot move bit for bit (planned moves are refused, and its loss stops the "
                        "job with a divergence): %s", describe(self.broke))
