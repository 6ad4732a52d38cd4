"""Nested training state <-> (JSON skeleton, tensors), with no pickle.

Whatever crosses a socket is decoded by a reader that cannot run code: the
skeleton is JSON, tensors travel as raw bytes described by dtype and shape.
State dicts hold more than JSON can say (int keys, tuples, OrderedDicts with
`_metadata`, numpy arrays in RNG states), so those are tagged objects:

    {"$t": 3}                  tensor number 3
    {"$tu": [...]}             tuple
    {"$d": [[k, v], ...]}      dict with non-string (or "$"-prefixed) keys, order kept
    {"$od": [[k, v], ...], "$meta": ...}   OrderedDict (a module state_dict) and its _metadata
    {"$np": 3, "dtype": "uint32"}          numpy array, carried as tensor number 3
    {"$bt": 3}                 bytes, carried as (uint8) tensor number 3
    {"$at": 7, "$enc": ...}    a subtree encoded ahead of time (Encoded): its own skeleton,
                               its tensors numbered from 0 and carried from number 7 on

Anything else (a lambda in a scheduler, an open file) is refused with the path to
it, when the state is first captured, not when a failure needs it.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dependency
    np = None  # type: ignore[assignment]


class EncodeError(TypeError):
    """A value in tracked state that baton cannot carry without pickle."""


@dataclass(frozen=True)
class Encoded:
    """A subtree already encoded: `skeleton` numbers its own `tensors` from 0. Lets a caller
    that knows a state's structure (a learned shard capture) skip walking it at every step.
    The tensors must already be what encode makes of them: detached, contiguous, on CPU."""

    skeleton: Any
    tensors: list[torch.Tensor]


class Dumped:
    """A part of a skeleton that never changes, with its JSON made once: a learned shard
    capture's skeleton (the same hundreds of entries at every boundary) would otherwise be
    serialized again each time (~0.3 ms a boundary for the llama bench's state). Equal to
    the plain skeleton it holds, so a check against the codec's own walk still compares."""

    __slots__ = ("skeleton", "text")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, skeleton: Any):
        self.skeleton = skeleton
        self.text = json.dumps(skeleton, separators=(",", ":"))

    def __eq__(self, other: object) -> bool:
        return self.skeleton == (other.skeleton if isinstance(other, Dumped) else other)


# Where a Dumped part goes while the rest is serialized: a string no state can hold by chance.
_MARK = f"\x00baton-dumped-{secrets.token_hex(8)}-"


def _dumps(skeleton: Any) -> bytes:
    parts: list[str] = []

    def mark(obj: Any) -> str:
        if type(obj) is not Dumped:
            raise TypeError(f"{type(obj).__name__} in a skeleton")
        parts.append(obj.text)
        return f"{_MARK}{len(parts) - 1}"

    text = json.dumps(skeleton, separators=(",", ":"), default=mark)
    for i, part in enumerate(parts):
        text = text.replace(json.dumps(f"{_MARK}{i}"), part, 1)
    return text.encode()


class _DeviceCopies(threading.local):
    """The devices whose tensors a capture on this thread copied to the host without waiting.

    A device tensor is copied with `non_blocking=True`, which lands in pinned host memory from
    torch's caching host allocator (reused from one capture to the next), and the capture
    waits once at its end. On an H100 a synchronous `.to("cpu")` per tensor moved 1.5 GB/s
    into fresh pageable memory against 55 GB/s for a pinned copy (bench/gpu.py)."""

    def __init__(self) -> None:
        self.devices: set[torch.device] = set()

    def wait(self) -> None:
        while self.devices:
            torch.cuda.current_stream(self.devices.pop()).synchronize()


_device_copies = _DeviceCopies()


def _walk(state: Any, tensors: list[torch.Tensor]) -> Any:
    try:
        return _enc(state, tensors, ("state",))
    finally:
        _device_copies.wait()  # every tensor handed out is complete, also when the walk raised


def encoded(state: Any) -> Encoded:
    """`state` encoded as a subtree (the slow path of whoever builds Encoded itself)."""
    tensors: list[torch.Tensor] = []
    return Encoded(_walk(state, tensors), tensors)


def encode_into(state: Any, tensors: list[torch.Tensor]) -> Any:
    """`state`'s skeleton, its tensors appended to `tensors` and numbered after those there."""
    return _walk(state, tensors)


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """State -> (UTF-8 JSON skeleton, tensors). Tensors are detached, contiguous, on CPU."""
    tensors: list[torch.Tensor] = []
    skeleton = _walk(state, tensors)
    return _dumps(skeleton), tensors


class Payloads(list):
    """Where encode_payloads collects what encode would make tensors of: (dtype, shape, bytes)
    triples, with bytes kept as they are (no tensor made, no copy) for a frame to join."""


def encode_payloads(state: Any) -> tuple[bytes, Payloads]:
    """Like encode, for a wire frame written at once: the payloads as (dtype, shape, bytes-like)."""
    payloads = Payloads()
    skeleton = _walk(state, payloads)
    return _dumps(skeleton), payloads


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a state's nested dicts, lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def decode(meta: bytes, tensors: list[torch.Tensor]) -> Any:
    return _dec(json.loads(meta), tensors)


Path = tuple  # (parent path, key) pairs down from ("state",): built per node, formatted only on error


def _path_text(path: Path) -> str:
    keys = []
    while len(path) == 2:
        path, key = path
        keys.append(key)
    return path[0] + "".join(f"[{k!r}]" if not isinstance(k, _Attr) else f".{k}" for k in reversed(keys))


class _Attr(str):
    """A path step that is an attribute (`._metadata`), not a key."""


def _tensor_index(t: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    t = t.detach()
    if t.device.type == "cuda":
        _device_copies.devices.add(t.device)
        t = t.contiguous().to("cpu", non_blocking=True)  # pinned; _walk waits for it
    elif t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if type(tensors) is Payloads:
        flat = t.reshape(-1)
        tensors.append((str(t.dtype), list(t.shape), flat.view(torch.uint8).numpy() if flat.numel() else b""))
    else:
        tensors.append(t)
    return len(tensors) - 1


def _bytes_index(b: bytes | bytearray, tensors: list[torch.Tensor]) -> int:
    if type(tensors) is Payloads:
        tensors.append(("torch.uint8", [len(b)], bytes(b)))
    else:
        tensors.append(torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8))
    return len(tensors) - 1


def _enc(obj: Any, tensors: list[torch.Tensor], path: Path) -> Any:
    # Ordered by how often each kind occurs in a step's bundle (encoded twice a step).
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        items = [(k, _enc(v, tensors, (path, k))) for k, v in obj.items()]
        if isinstance(obj, OrderedDict):
            out: dict[str, Any] = {"$od": [[_key(k, path), v] for k, v in items]}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                out["$meta"] = _enc(dict(meta), tensors, (path, _Attr("_metadata")))
            return out
        if all(type(k) is str and not k.startswith("$") for k, _ in items):
            return dict(items)
        return {"$d": [[_key(k, path), v] for k, v in items]}
    if isinstance(obj, (bytes, bytearray)):
        return {"$bt": _bytes_index(obj, tensors)}
    if isinstance(obj, list):
        return [_enc(v, tensors, (path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, torch.Tensor):
        return {"$t": _tensor_index(obj, tensors)}
    if np is not None and isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        raw = torch.from_numpy(arr.reshape(-1).view(np.uint8).copy())
        return {"$np": _tensor_index(raw, tensors), "dtype": arr.dtype.str, "shape": list(arr.shape)}
    if np is not None and isinstance(obj, np.generic):
        return _enc(obj.item(), tensors, path)
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    if type(obj) is Encoded:
        base = len(tensors)
        if type(tensors) is Payloads:
            for t in obj.tensors:
                _tensor_index(t, tensors)
        else:
            tensors.extend(obj.tensors)
        return {"$at": base, "$enc": obj.skeleton}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"$tu": [_enc(v, tensors, (path, i)) for i, v in enumerate(obj)]}
    raise EncodeError(f"{_path_text(path)} is a {type(obj).__name__}, which baton cannot migrate "
                      "(tracked state may hold tensors, numbers, strings, lists, tuples and dicts)")


def _key(k: Any, path: Path) -> Any:
    if isinstance(k, (str, int, float, bool)) or k is None:
        return k
    if isinstance(k, tuple):
        return {"$tu": [_key(x, path) for x in k]}
    raise EncodeError(f"{_path_text(path)} has a key of type {type(k).__name__}, which baton cannot migrate")


def _dec(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_dec(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$t" in obj:
        return tensors[obj["$t"]]
    if "$tu" in obj:
        return tuple(_dec(v, tensors) for v in obj["$tu"])
    if "$d" in obj:
        return {_dec(k, tensors): _dec(v, tensors) for k, v in obj["$d"]}
    if "$enc" in obj:
        at = obj["$at"]
        if type(at) is not int or not 0 <= at <= len(tensors):
            raise ValueError(f"a pre-encoded subtree starts at tensor {at!r} of {len(tensors)}")
        return _dec(obj["$enc"], tensors[at:])
    if "$od" in obj:
        out = OrderedDict((_dec(k, tensors), _dec(v, tensors)) for k, v in obj["$od"])
        if "$meta" in obj:
            out._metadata = _dec(obj["$meta"], tensors)  # type: ignore[attr-defined]
        return out
    if "$np" in obj:
        if np is None:  # pragma: no cover
            raise EncodeError("numpy state arrived but numpy is not installed")
        raw = tensors[obj["$np"]].numpy()
        return raw.view(np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "$dtype" in obj:
        return getattr(torch, obj["$dtype"])
    if "$bt" in obj:
        return tensors[obj["$bt"]].numpy().tobytes()
    return {k: _dec(v, tensors) for k, v in obj.items()}
