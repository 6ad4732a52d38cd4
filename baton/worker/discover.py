"""Finding the optimizers, LR schedulers and GradScalers a script creates.

A script that forgets to pass its scheduler to `job.track` would otherwise migrate
without it and silently diverge. From `baton.init()` on, the constructors of
those classes note every instance in creation order, so the same script names
them the same way on every rank and on a joiner ("optimizer", "lr_scheduler",
"grad_scaler", then "optimizer1", ...). Instances created *before* baton.init()
cannot be named reliably; the step loop refuses to start and names them.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable

import torch

_CLASSES: list[tuple[type, str]] = []
_created: list[tuple[str, weakref.ref]] = []
listeners: list[Callable[[str, Any], None]] = []  # told of each instance as it is noted
_installed = False
_paused = threading.local()  # per thread: a hot spare's mirror builds its optimizer while the script may build its own


def _kinds() -> list[tuple[type, str]]:
    if not _CLASSES:
        from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

        _CLASSES.extend([(torch.optim.Optimizer, "optimizer"), (LRScheduler, "lr_scheduler"),
                         (ReduceLROnPlateau, "lr_scheduler"), (torch.amp.GradScaler, "grad_scaler")])
    return _CLASSES


def install() -> None:
    """Start noting instances (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for cls, kind in _kinds():
        original = cls.__init__

        def init(self: Any, *args: Any, __original=original, __kind=kind, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            if not getattr(_paused, "depth", 0) and not any(ref() is self for _, ref in _created):
                _created.append((__kind, weakref.ref(self)))
                for listener in list(listeners):
                    listener(__kind, self)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = init  # type: ignore[method-assign]


class paused:
    """Objects baton creates for itself (the warm-up, a hot spare's mirror) on this thread are
    not the script's."""

    def __enter__(self) -> None:
        _paused.depth = getattr(_paused, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _paused.depth -= 1


def created() -> list[tuple[str, Any]]:
    """(kind, object) for each live instance noted since install(), in creation order."""
    out = []
    for kind, ref in _created:
        obj = ref()
        if obj is not None:
            out.append((kind, obj))
    return out


def untracked_before_init(known: list[Any]) -> list[str]:
    """Live optimizers/schedulers/scalers that were neither noted nor tracked explicitly."""
    gc.collect()
    noted = {id(obj) for _, obj in created()} | {id(obj) for obj in known}
    classes = tuple(cls for cls, _ in _kinds())
    found = []
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), classes) and id(obj) not in noted:
                found.append(f"{type(obj).__name__} at 0x{id(obj):x}")
        except ReferenceError:
            continue
    return found
