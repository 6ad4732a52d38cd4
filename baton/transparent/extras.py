"""State the script's setup made that no interception saw, found in the frames of the nest.

Optimizers, schedulers and scalers are tracked as they are created, models as DDP wraps
them or fully_shard shards them. A script holds more state than that: an EMA of its
model (a plain module it updates after each step), a `torch.Generator` its sampler
shuffles with. Left out, a rank's successor would start them from the setup's values
and its run would differ from the lost rank's, with nothing to say so. So each frame of
the nest is read as a joiner reaches it (and, in the ranks that start the job, at the
first optimizer step): the setup's names in it (not bound by a loop of that code), and
one level into the script's own objects (`self.ema`, `self.train_data`), give

- modules holding tensors that no tracked model holds, and tensors the loops read (an
  EMA kept as a list of tensors, or of DTensors: each rank's shards; a running total
  changed in place): rank-local state, in the record of every head that goes to the
  buddies, as a wrapped model's BatchNorm statistics are (an EMA of such statistics
  differs by rank; and what the step changed before a failure is put back for its
  re-run), and
- generators, held directly or by a DataLoader or Sampler (any attribute of it: a script's
  own sampler's `self.rng`): their state joins the random streams in that record, and in
  those noted at each head of an outer loop, where a successor's walk puts them back
  before the loop below it draws its first item (a sampler's permutation).

The cost: a copy of each such object per step once it has changed (an EMA: the model's
size again); one that never changes (a frozen teacher, a dataset held as a tensor) is never
copied.

Every process reads the same frames in the same order with the same rule, so they give
every object the same name (`script.<path>`).
"""

from __future__ import annotations

from types import FrameType, ModuleType
from typing import Any, Iterator

import torch

from baton.transparent.carried import script_record_type
from baton.transparent.sites import SITES
from baton.worker import rng
from baton.worker.dtensors import is_dtensor
from baton.worker.tracked import Tracked

PREFIX = "script."


def track(tracked: Tracked, frame: FrameType, sharded: list[torch.nn.Module]) -> list[str]:
    """Track what `frame`'s setup names hold that nothing tracks yet; the names added.
    `sharded`: the modules fully_shard() was given (tracked as sharded models only once the
    loop starts, after a joiner's walk has read its frames)."""
    owned = _owned_tensors(tracked) | {id(t) for m in sharded for t in (*m.parameters(), *m.buffers())}
    known = {id(o) for o in (*tracked.objects.values(), *tracked.generators.values(), *tracked.extras.values())}
    added = []
    for path, obj in _untracked(frame, owned, known):
        name = PREFIX + path
        while name in tracked.extras or name in tracked.generators:
            name += "_"
        if rng.is_generator(obj):
            tracked.add(name, obj)
        else:
            tracked.extras[name] = obj
        added.append(name)
    return added


def untracked_in(frame: FrameType) -> list[tuple[str, Any]]:
    """What `track` would add in `frame` in a process where nothing is tracked yet but the
    models the script wrapped in DDP (`baton explain`, which runs under plain torch: sharded
    state is left out, as nothing says which modules fully_shard() was given)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    owned = {id(t) for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)
             for t in (*obj.module.parameters(), *obj.module.buffers())}
    return [(PREFIX + path, obj) for path, obj in _untracked(frame, owned, set())
            if rng.is_generator(obj) or not _sharded(_tensors(obj))]


def _untracked(frame: FrameType, owned: set[int], known: set[int]) -> Iterator[tuple[str, Any]]:
    """The candidates of `frame` not `known` (by id), once each: generators, and holders of
    tensors not all `owned` (a tracked model's, or a part of one); `owned` grows with theirs."""
    for path, obj in _candidates(frame):
        if id(obj) in known:
            continue
        known.add(id(obj))
        if not rng.is_generator(obj):
            tensors = _tensors(obj)
            if not tensors or all(id(t) in owned for t in tensors):
                continue
            owned.update(id(t) for t in tensors)
        yield path, obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    return list(obj.values() if isinstance(obj, dict) else obj)


def _owned_tensors(tracked: Tracked) -> set[int]:
    return {id(t) for obj in tracked.objects.values() if isinstance(obj, torch.nn.Module)
            for t in (*obj.parameters(), *obj.buffers())}


def _sharded(tensors: list[torch.Tensor]) -> bool:
    return any(is_dtensor(t) for t in tensors)


def _scope(frame: FrameType) -> dict[str, Any]:
    code = frame.f_code
    if code.co_qualname == "<module>":
        return frame.f_locals
    return {**{n: v for n, v in frame.f_globals.items() if n in code.co_names}, **frame.f_locals}


def _names(frame: FrameType) -> tuple[list[str], set[str]]:
    """The names of `frame`'s scope that no loop of its code binds or changes in place by a
    method (`history.append`: carried as a loop's value), sorted; and those its loops read."""
    code = frame.f_code
    bound: set[str] = set()
    read: set[str] = set()
    for sid in range(len(SITES)):
        site = SITES[sid]
        if site.file == code.co_filename and site.scope == code.co_qualname:
            bound.update(site.assigned, site.mutated)
            read.update(site.reads)
    return sorted(n for n in _scope(frame) if n not in bound and not n.startswith("__")), read


def _candidates(frame: FrameType) -> Iterator[tuple[str, Any]]:
    """Modules anywhere in the setup's names and in the file's globals; tensors (and lists,
    tuples and dicts of tensors) the loops read or the file holds (an EMA kept as a list of
    tensors, a running total changed in place): only those changed are ever copied. The
    generators of its loaders and samplers, and the generators its loops use themselves: a
    generator the setup alone used (to make data, on the rank that made it) is no state.
    Objects of the script's classes are looked into for modules, loaders and generators
    (their tensors are carried with their other attributes, as loop values)."""
    scope = _scope(frame)
    names, read = _names(frame)
    for name in names:
        value = scope[name]
        yield from _state_in(name, value, name in read)
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(value, (type, ModuleType, torch.nn.Module)) and \
                script_record_type(type(value)):
            for attr in sorted(attrs):
                if not _is_tensor_state(attrs[attr]):
                    yield from _state_in(f"{name}.{attr}", attrs[attr], name in read)
    if frame.f_code.co_qualname != "<module>":  # an EMA a function updates through a global of the file
        for name in sorted(frame.f_globals):
            value = frame.f_globals[name]
            if name not in scope and (isinstance(value, torch.nn.Module) or _is_tensor_state(value)):
                yield from _state_in(name, value)


_MAX_ITEMS = 4096  # a longer list of tensors is data (samples), not state a step changes


def _is_tensor_state(value: Any) -> bool:
    """A tensor, or a list, tuple or dict of up to _MAX_ITEMS tensors (not parameters:
    those are a module's)."""
    def plain(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)

    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return 0 < len(value) <= _MAX_ITEMS and all(plain(t) for t in items)
    return plain(value)


def _state_in(path: str, value: Any, used: bool = True) -> Iterator[tuple[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler, DataLoader, Sampler

    if isinstance(value, DistributedDataParallel):
        return
    if isinstance(value, torch.nn.Module):
        yield path, value
    elif _is_tensor_state(value):
        if used:
            yield path, value
    elif rng.is_generator(value):
        if used:
            yield path, value
    elif isinstance(value, DataLoader):
        yield from _state_in(f"{path}.generator", value.generator)
        yield from _state_in(f"{path}.sampler", value.sampler)
        yield from _state_in(f"{path}.batch_sampler", value.batch_sampler)
    elif isinstance(value, BatchSampler):
        yield from _state_in(f"{path}.sampler", value.sampler)
    elif isinstance(value, Sampler):  # `generator`, or a script's own sampler's `self.rng`
        attrs = getattr(value, "__dict__", {})
        for attr in sorted(attrs):
            if rng.is_generator(attrs[attr]):
                yield f"{path}.{attr}", attrs[attr]
