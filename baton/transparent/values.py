"""The values a script's loops carry, taken as plain values and tensors and put back.

A rank's successor runs the script's setup, so it already holds objects of the same
structure (the meters, the Trainer); what it lacks is their contents and the loops'
variables. `capture` takes them from the running frames as the codec can carry them
(numbers, strings, tensors, lists/tuples/dicts of them; an object of such attributes as
`{"$record": type, "attrs": ...}`); `restore_records` writes an object's attributes back
into the successor's own object in place, so every name that refers to it (a meter both a
local variable and an entry of a ProgressMeter's list) sees the same values. Names a loop
binds are handed back to the rewritten loop head, which rebinds them (`loops.restore`).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from baton.transparent.carried import CARRIED_KINDS, PLAIN_EXACT, Kind, classify, is_attribute_record

RECORD = "$record"


class RestoreError(RuntimeError):
    """The successor's objects do not have the structure its predecessor's had."""


def value(obj: Any, _seen: frozenset[int] = frozenset()) -> Any:
    """`obj` as the codec carries it (tensors copied: the script may change them in place),
    for an object classify() said can be carried."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        items = [value(x, _seen) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {k: value(v, _seen) for k, v in obj.items()}
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, enum.Enum)):
        return record(obj, _seen)
    return obj


def same(a: Any, b: Any) -> bool:
    """Whether two captured values are equal, bit for bit where they are tensors (a NaN
    differs from itself: the careful answer for a joiner deciding whether it may go on)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def record(obj: Any, _seen: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The attributes of an object of plain values (a meter, `self`) that change: numbers,
    strings, tensors, and objects of such; the rest (its model, loader, functions, enums,
    a logger: what the setup made) is the successor's own. An object met again inside
    itself is left where it is."""
    seen = _seen | {id(obj)}
    attrs = {}
    for name, attr in vars(obj).items():
        if type(attr) in PLAIN_EXACT:
            attrs[name] = attr
            continue
        if id(attr) in seen:
            continue
        got = classify(attr, from_setup=True)
        if got.kind in CARRIED_KINDS and not isinstance(attr, enum.Enum):
            attrs[name] = value(attr, seen)
    return {RECORD: type(obj).__qualname__, "attrs": attrs}


def carried_record(obj: Any) -> dict[str, Any] | None:
    """`record(obj)` for an object classify() calls a RECORD, else None (not such an object,
    or one of its attributes cannot be handed over): what `classify(obj).kind is RECORD` and
    `record(obj)` decide together, in one pass over its attributes (asked at every head of every object
    a loop reads, where two passes cost ~0.3 ms a step in bench/nocode.py's script)."""
    if not is_attribute_record(obj):
        return None
    seen = frozenset((id(obj),))
    attrs = {}
    for name, attr in vars(obj).items():
        if type(attr) in PLAIN_EXACT:  # the common case, as classify() and value() would take it
            attrs[name] = attr
            continue
        if id(attr) in seen:
            continue
        got = classify(attr, from_setup=True)
        if got.kind is Kind.REFUSED:
            return None
        if got.kind in CARRIED_KINDS and not isinstance(attr, enum.Enum):
            attrs[name] = value(attr, seen)
    return {RECORD: type(obj).__qualname__, "attrs": attrs}


def is_record(captured: Any) -> bool:
    return isinstance(captured, dict) and RECORD in captured


def restore_record(obj: Any, captured: dict[str, Any], where: str) -> None:
    """Write a captured record's attributes into `obj`, in place."""
    if type(obj).__qualname__ != captured[RECORD]:
        raise RestoreError(f"{where} is a {type(obj).__qualname__} here but was a {captured[RECORD]} in the rank "
                           "this process takes over: the script's setup must build the same objects on every run")
    for name, saved in captured["attrs"].items():
        setattr(obj, name, rebound(saved, getattr(obj, name, None), f"{where}.{name}"))


def _holds_records(saved: Any) -> bool:
    items = saved.values() if isinstance(saved, dict) and not is_record(saved) else \
        saved if isinstance(saved, list) else ()
    return any(is_record(x) or _holds_records(x) for x in items)


def restore_list(current: list[Any], saved: list[Any], where: str) -> None:
    if len(current) != len(saved):
        raise RestoreError(f"{where} holds {len(current)} items here but {len(saved)} in the rank this process "
                           "takes over")
    for i, item in enumerate(saved):
        current[i] = rebound(item, current[i], f"{where}[{i}]")


def restore_dict(current: dict[Any, Any], saved: dict[Any, Any], where: str) -> None:
    """`saved`'s entries into `current`, in their order; an object of the successor's own is
    kept under its key and given the record's attributes, one a defaultdict makes (a
    `defaultdict(AverageMeter)` of meters) is made by it first."""
    old = dict(current)
    current.clear()
    for key, item in saved.items():
        if is_record(item) and key not in old:
            if getattr(current, "default_factory", None) is None:
                raise RestoreError(f"{where}[{key!r}] is missing here, but the rank this process takes over held an "
                                   f"object ({item[RECORD]}) under it")
            restore_record(current[key], item, f"{where}[{key!r}]")  # made by the defaultdict's factory
        else:
            current[key] = rebound(item, old.get(key), f"{where}[{key!r}]")


def restore_container(current: Any, saved: Any, where: str) -> None:
    """Put a list or dict a loop changes in place (`history.append(x)`) back as it was, in
    the successor's own object, so every reference to it sees the contents."""
    if isinstance(current, list) and isinstance(saved, list):
        if _holds_records(saved):
            restore_list(current, saved, where)
        else:
            current[:] = fresh(saved)
    elif isinstance(current, dict) and isinstance(saved, dict) and not is_record(saved):
        restore_dict(current, saved, where)
    else:
        raise RestoreError(f"{where} is a {type(current).__name__} here but was a {type(saved).__name__} in the rank "
                           "this process takes over")


def rebound(captured: Any, current: Any, where: str) -> Any:
    """What a loop variable (or an attribute, an item) is bound to again: a record goes into
    the successor's object of that name (kept, so other references see it), as do the
    records inside a list or dict; anything else is the captured value."""
    if is_record(captured):
        if current is None:
            raise RestoreError(f"{where} is not bound here yet, but the rank this process takes over held an "
                               f"object ({captured[RECORD]}) in it")
        restore_record(current, captured, where)
        return current
    if isinstance(captured, list) and isinstance(current, list) and _holds_records(captured):
        restore_list(current, captured, where)
        return current
    if isinstance(captured, dict) and isinstance(current, dict) and _holds_records(captured):
        restore_dict(current, captured, where)
        return current
    return fresh(captured)


def fresh(captured: Any) -> Any:
    """A captured value to bind again, its tensors copied: what the script then changes in
    place (`total += loss`) must not reach the record it came from, which the rank goes back
    to if the step fails again (a joiner's first step: the record is the state it joined
    with; any rank's step that fails twice)."""
    if isinstance(captured, torch.Tensor):
        return captured.clone()
    if isinstance(captured, list):
        return [fresh(x) for x in captured]
    if type(captured) is tuple:
        return tuple(fresh(x) for x in captured)
    if isinstance(captured, dict) and not is_record(captured):
        return {k: fresh(v) for k, v in captured.items()}
    return captured


def containers(names: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """Of the names a loop changes in place, the lists and dicts that can be carried, captured."""
    return {name: value(values[name]) for name in names
            if isinstance(values.get(name), (list, dict)) and classify(values[name]).kind in CARRIED_KINDS}


def scalars(names: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """Of `names`, those holding numbers, strings, booleans or None (or tuples of them),
    captured: a loop's own targets the code after it reads (`i` of `for i, batch in ...`),
    which only the last item bound. A tensor there (the last batch) is not taken: it would
    cost a copy of every item at every head."""
    return {name: values[name] for name in names if name in values and _scalar(values[name])}


def _scalar(obj: Any) -> bool:
    if type(obj) is tuple:
        return len(obj) <= 8 and all(_scalar(x) for x in obj)
    return obj is None or type(obj) in (int, float, str, bool)


TRACKED = "$tracked"


def returned(obj: Any, tracked: dict[int, str]) -> tuple[Any] | None:
    """What a step loop's `return` returned, captured (in a 1-tuple: None is a value): values
    (numbers, strings, tensors, and containers of them), and the objects whose state moves
    (`tracked`, by id: `return model`), by name, for the successor's own; None where it
    cannot be carried (another object: the successor has none of its own to put it in)."""
    if id(obj) in tracked:
        return ({TRACKED: tracked[id(obj)]},)
    if type(obj) is tuple and any(id(x) in tracked for x in obj):
        parts = [returned(x, tracked) for x in obj]
        return None if any(p is None for p in parts) else (tuple(p[0] for p in parts),)  # type: ignore[index]
    if classify(obj).kind not in (Kind.PLAIN, Kind.TENSOR, Kind.ARRAY):
        return None
    return (value(obj),)


def returned_again(captured: Any, objects: dict[str, Any]) -> Any:
    """A captured return value for a successor to return: its own objects for the tracked."""
    if isinstance(captured, dict) and TRACKED in captured:
        return objects[captured[TRACKED]]
    if type(captured) is tuple:
        return tuple(returned_again(x, objects) for x in captured)
    return fresh(captured)


def carried_names(names: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """Of a loop's bound names, those holding what can be carried, captured (the rest: the
    setup's objects the loop rebinds, such as a model, stay the successor's own)."""
    return {name: value(values[name]) for name in names
            if name in values and classify(values[name]).kind in CARRIED_KINDS}
