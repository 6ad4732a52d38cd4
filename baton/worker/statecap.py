"""Capturing and loading what migrates: tracked state_dicts, RNG streams, data position.

State is split in two because the two kinds come from different places after
an unplanned failure: *replicated* state (model, optimizer, schedulers: equal
on every data-parallel replica) is fetched from healthy survivors, while
*rank-local* state (RNG streams) only the lost rank had; baton keeps its last
boundary snapshot with the orchestrator.
"""

from __future__ import annotations

import base64
import pickle
import random
from typing import Any

import torch

from baton.transfer.protocol import FlatState

try:  # numpy is a dependency, but keep the import local to what uses it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


class _TensorSlot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        tensors.append(t)
        return _TensorSlot(len(tensors) - 1)
    if isinstance(obj, dict):
        return type(obj)((k, _flatten(v, tensors)) for k, v in obj.items()) if type(obj) is not dict \
            else {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _unflatten(v, tensors)) for k, v in obj.items()) if type(obj) is not dict \
            else {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


def pack(state: dict[str, Any]) -> FlatState:
    """Nested state -> skeleton bytes + tensors (zero-copy for contiguous CPU tensors)."""
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(state, tensors)
    return FlatState(meta=pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), tensors=tensors)


def unpack(flat: FlatState) -> dict[str, Any]:
    return _unflatten(pickle.loads(flat.meta), flat.tensors)


# ---------------------------------------------------------------- rank-local RNG
def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if not torch.equal(a["torch"], b["torch"]) or a["python"] != b["python"]:
        return False
    if "numpy" in a and "numpy" in b:
        na, nb = a["numpy"], b["numpy"]
        return na[0] == nb[0] and bool((na[1] == nb[1]).all()) and na[2:] == nb[2:]
    return True


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])


def encode(obj: Any) -> str:
    """Small rank-local state -> text, for the heartbeat that carries it to the orchestrator."""
    return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))
