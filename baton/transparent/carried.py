"""What a loop's variables hold, and whether a rank's successor can be given it.

A spare that takes over a rank runs the script's setup again, so what the setup built
(the model, the optimizer, the loaders, imported modules, functions) exists in it
already: models, optimizers, schedulers and scalers move through their state_dict, a
loader's position is replayed. What a loop carries from one iteration to the next has
to be handed over by value: counters, best metrics, running sums, a prefetched batch,
meters, attributes of `self`. Only plain values and tensors cross a socket (never a
pickle), so each value is classified here: carried as it is, carried attribute by
attribute (an object of plain values, such as a meter), rebuilt by the setup, or refused
(an open file, a lambda, a generator), with the reason.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import fractions
import functools
import io
import pathlib
import random
import socket
import subprocess
import threading
import types
from dataclasses import dataclass
from typing import Any

import torch

_PLAIN = (type(None), bool, int, float, str, bytes)  # what the codec carries as it is
_NOT_CARRIED_YET = (complex, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal, fractions.Fraction,
                    pathlib.PurePath, range, slice)
_RNG = (torch.Generator, random.Random)
_SETUP = (types.ModuleType, type, types.BuiltinFunctionType, types.MethodType, types.MethodWrapperType,
          torch.device, torch.dtype)
_OS_RESOURCES = (io.IOBase, socket.socket, threading.Thread, subprocess.Popen, type(threading.Lock()),
                 type(threading.RLock()))
_MAX_DEPTH = 4
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset)
_CONTAINERS = frozenset(_CONTAINER_TYPES)  # the exact types, for the quick checks at every head
PLAIN_EXACT = frozenset(_PLAIN)  # the exact types (not subclasses: an IntEnum), carried as they are


class Kind(str, enum.Enum):
    PLAIN = "value"  # numbers, strings, and lists/tuples/dicts of them (tensors included)
    TENSOR = "tensor"
    ARRAY = "numpy"
    RECORD = "object"  # attributes carried one by one
    STATE = "state"  # moves through state_dict (model, optimizer, scheduler, scaler, generator)
    LOADER = "loader"  # a DataLoader (the loop iterating it replays its position), a Dataset, a Sampler
    SETUP = "setup"  # rebuilt by the successor's own setup
    REFUSED = "refused"


@dataclass(frozen=True)
class Classified:
    kind: Kind
    detail: str  # what it is, for a person: "int", "Tensor[8, 16] int64", "AverageMeter: sum, count"
    why: str = ""  # REFUSED: why it cannot be carried


_PLAIN_BY_TYPE = {t: Classified(Kind.PLAIN, t.__name__) for t in _PLAIN}  # the exact types, not subclasses (an IntEnum)


@functools.cache
def _state_types() -> tuple[type, ...]:
    from torch.optim.lr_scheduler import LRScheduler

    out: list[type] = [torch.nn.Module, torch.optim.Optimizer, LRScheduler, torch.amp.GradScaler, *_RNG]
    try:
        import numpy as np

        out += [np.random.Generator, np.random.RandomState]
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return tuple(out)


@functools.cache
def _loader_types() -> tuple[type, ...]:
    from torch.utils.data import DataLoader, Dataset, Sampler

    return DataLoader, Dataset, Sampler


@functools.cache
def _loader_iterator_type() -> type:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return _BaseDataLoaderIter


def _is_setup_object(value: Any) -> bool:
    if isinstance(value, _SETUP):
        return True
    if isinstance(value, types.FunctionType):
        return "<locals>" not in value.__qualname__ and value.__name__ != "<lambda>"
    module = type(value).__module__ or ""
    # torch's own helpers (autocast contexts, process groups, device meshes) and contexts
    return module.startswith(("torch.distributed", "contextlib")) or type(value).__name__ in ("autocast",)


def _tensor_detail(t: torch.Tensor) -> str:
    return f"Tensor{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def classify(value: Any, from_setup: bool = False, _depth: int = 0,
             _seen: set[int] | None = None) -> Classified:
    """What `value` is, as far as handing it to a successor goes. With `from_setup` (made
    by the setup, not by the loop), a function, an open file or a lock is the setup's: the
    successor's setup makes its own; a generator or iterator still has a position."""
    seen = _seen if _seen is not None else set()
    got = _by_type(value, from_setup)
    if got is not None:
        return got
    if id(value) in seen or _depth >= _MAX_DEPTH:
        return Classified(Kind.RECORD, type(value).__name__)
    seen.add(id(value))
    if isinstance(value, _CONTAINER_TYPES):
        return _container(value, from_setup, _depth, seen)
    if not _of_attributes(value):
        return _without_attributes(value, from_setup)
    carried = []
    for name, attr in vars(value).items():
        got = classify(attr, from_setup, _depth + 1, seen)
        if got.kind is Kind.REFUSED:
            return Classified(Kind.REFUSED, f"{type(value).__name__}.{name}: {got.detail}", got.why)
        if got.kind in (Kind.PLAIN, Kind.TENSOR, Kind.ARRAY, Kind.RECORD):
            carried.append(name)
    shown = ", ".join(carried[:6]) + (", ..." if len(carried) > 6 else "")
    return Classified(Kind.RECORD, f"{type(value).__name__}: {shown}" if carried else type(value).__name__)


def is_attribute_record(value: Any) -> bool:
    """Whether classify() judges `value` by its attributes (an object of the script's own
    class or a namespace; not a module, optimizer, loader, function, container...): it is
    then a RECORD unless one of them is refused (values.carried_record)."""
    cls = type(value)
    if cls in _TYPED or isinstance(value, torch.Tensor):  # a tensor never is (_by_type)
        return False
    if _by_type(value, True) is not None:
        if not issubclass(cls, types.FunctionType):  # else the instance decides (a lambda)
            _TYPED.add(cls)
        return False
    return not isinstance(value, _CONTAINER_TYPES) and _of_attributes(value)


_TYPED: set[type] = set()  # classes whose type alone decides (_by_type): asked at every head of every name a loop reads


def _of_attributes(value: Any) -> bool:
    return not hasattr(value, "__next__") and script_record_type(type(value)) and \
        isinstance(getattr(value, "__dict__", None), dict)


def _without_attributes(value: Any, from_setup: bool) -> Classified:
    if hasattr(value, "__next__"):
        return Classified(Kind.REFUSED, type(value).__name__,
                          "an iterator whose position baton cannot read or rebuild")
    if not script_record_type(type(value)):  # a logger, a progress bar, a library's object: the setup's
        return Classified(Kind.SETUP, type(value).__name__)
    if from_setup:  # an opaque object the setup made (a compiled regex, a C extension's)
        return Classified(Kind.SETUP, type(value).__name__)
    return Classified(Kind.REFUSED, type(value).__name__,
                      "an object without attributes baton can read (no __dict__)")


def _by_type(value: Any, from_setup: bool) -> Classified | None:
    """What `value`'s type alone says it is; None for a container or an object judged by its contents."""
    plain = _PLAIN_BY_TYPE.get(type(value))  # asked at every head: the common cases first, and cheaply
    if plain is not None:
        return plain
    if type(value) in _CONTAINERS:  # no test below takes these
        return None
    if isinstance(value, torch.nn.Parameter):
        return Classified(Kind.STATE, "Parameter (moves with its model)")
    if isinstance(value, torch.Tensor) and hasattr(value, "_local_tensor"):  # a DTensor (not imported: costly)
        if from_setup:  # made by the setup, changed in place: the rank's own shard moves (extras.py)
            return Classified(Kind.STATE, f"DTensor{list(value.shape)}")
        return Classified(Kind.REFUSED, f"DTensor{list(value.shape)}",
                          "a DTensor holds this rank's shard of a tensor spread over a device mesh, which a value "
                          "handed to a successor cannot rebuild")
    if isinstance(value, torch.Tensor):
        return Classified(Kind.TENSOR, _tensor_detail(value))
    if isinstance(value, enum.Enum):
        return Classified(Kind.SETUP, f"{type(value).__name__}.{value.name}")
    if isinstance(value, _PLAIN):
        return Classified(Kind.PLAIN, type(value).__name__)
    if isinstance(value, _NOT_CARRIED_YET):
        if from_setup:  # a Path or a date the setup made: the successor's setup makes its own
            return Classified(Kind.SETUP, type(value).__name__)
        return Classified(Kind.REFUSED, type(value).__name__,
                          "baton hands over numbers, strings and tensors (never a pickle); keep it as a string "
                          "or a number in the loop's variables")
    try:
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)):
            return Classified(Kind.ARRAY, f"{type(value).__name__} {getattr(value, 'shape', '')}".strip())
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, _state_types()):
        return Classified(Kind.STATE, type(value).__name__)
    if isinstance(value, _loader_iterator_type()):
        return Classified(Kind.REFUSED, "a DataLoader's iterator",
                          "the loop draws its batches from it with next(), and its position lives in the iterator: "
                          "a successor's iterator would start elsewhere, and an iteration run again after a lost "
                          "peer would draw a new batch")
    if isinstance(value, _loader_types()):
        return Classified(Kind.LOADER, type(value).__name__)
    if isinstance(value, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return Classified(Kind.REFUSED, type(value).__name__,
                          "a generator's position lives in its suspended frame, which cannot be saved or rebuilt")
    if isinstance(value, types.FunctionType) and from_setup:
        return Classified(Kind.SETUP, value.__qualname__)
    if isinstance(value, types.FunctionType) and not _is_setup_object(value):
        return Classified(Kind.REFUSED, value.__qualname__,
                          "a lambda or nested function made here closes over values baton cannot hand over")
    if isinstance(value, _OS_RESOURCES):
        if from_setup:
            return Classified(Kind.SETUP, type(value).__name__)
        return Classified(Kind.REFUSED, type(value).__name__,
                          "an operating-system resource (open file, socket, thread, lock, process) cannot move "
                          "to another process")
    if _is_setup_object(value):
        return Classified(Kind.SETUP, type(value).__name__ if not callable(value) else
                          getattr(value, "__qualname__", type(value).__name__))
    return None


@functools.cache
def script_record_type(cls: type) -> bool:
    """Objects whose attributes are carried: of a class the script's own modules define (a
    meter, a Trainer, a config dataclass), or a namespace of values (argparse's, types').
    Once per class (the no-code mode asks at every head of every name a loop reads): a
    module is instrumented, its file known, before its classes exist."""
    import argparse
    import sys

    from baton.transparent.sites import SITES

    if cls in (argparse.Namespace, types.SimpleNamespace):
        return True
    module = sys.modules.get(cls.__module__)
    return getattr(module, "__file__", None) in SITES.files


def _container(value: Any, from_setup: bool, depth: int, seen: set[int]) -> Classified:
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    kinds = set()
    for key, item in items:
        got = classify(item, from_setup, depth + 1, seen)
        if got.kind is Kind.REFUSED:
            return Classified(Kind.REFUSED, f"{type(value).__name__}[{key!r}]: {got.detail}", got.why)
        kinds.add(got.kind)
    detail = f"{type(value).__name__} of {len(items)}"
    if kinds & {Kind.RECORD}:
        return Classified(Kind.RECORD, detail)
    if kinds <= {Kind.PLAIN, Kind.TENSOR, Kind.ARRAY}:
        return Classified(Kind.PLAIN, detail)
    return Classified(Kind.STATE if Kind.STATE in kinds else Kind.SETUP, detail)


CARRIED_KINDS = (Kind.PLAIN, Kind.TENSOR, Kind.ARRAY, Kind.RECORD)
