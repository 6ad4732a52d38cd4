"""State digests: do replicas agree, and does a joiner hold exactly its predecessor's state?

Each entry of the state (one tensor, or one leaf value) gets an xxh3-64 digest under a
readable name ("model.fc.weight", "optimizer.state.3.exp_avg", "lr_scheduler.last_epoch"),
so a mismatch names what differs. Ranks first compare one combined digest; only when
those differ do they exchange the per-entry list to name the differing entries.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash

from baton.transfer.protocol import byte_view


class Divergence(RuntimeError):
    """The state check after a move found replicas (or a joiner) that differ."""


def entries(state: Any, prefix: str = "", later: list[tuple[str, torch.Tensor]] | None = None) -> dict[str, int]:
    """Flatten a nested state into {name: digest}. With `later`, tensors of 1 MiB or more are
    not digested but listed there, to be digested elsewhere (`tensor_digest`)."""
    out: dict[str, int] = {}
    _walk(state, prefix, out, later)
    return out


LATER_BYTES = 1 << 20


def tensor_digest(obj: torch.Tensor) -> int:
    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = xxhash.xxh3_64()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(byte_view(t) if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())
    return h.intdigest()


def _walk(obj: Any, name: str, out: dict[str, int], later: list[tuple[str, torch.Tensor]] | None) -> None:
    if isinstance(obj, torch.Tensor):
        if later is not None and obj.numel() * obj.element_size() >= LATER_BYTES:
            later.append((name, obj))
        else:
            out[name] = tensor_digest(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{name}.{k}" if name else str(k), out, later)
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        for i, v in enumerate(obj):
            _walk(v, f"{name}[{i}]", out, later)
    else:
        try:
            text = json.dumps(obj, sort_keys=True, default=repr)
        except (TypeError, ValueError):
            text = repr(obj)
        out[name] = xxhash.xxh3_64_intdigest(text.encode())


def combined(digests: dict[str, int]) -> int:
    h = xxhash.xxh3_64()
    for name in sorted(digests):
        h.update(name.encode())
        h.update(digests[name].to_bytes(8, "little"))
    return h.intdigest()


def differing(mine: dict[str, int], theirs: dict[str, int]) -> list[str]:
    names = sorted(set(mine) | set(theirs))
    return [n for n in names if mine.get(n) != theirs.get(n)]


def to_signed(x: int) -> int:
    """A 64-bit digest as an int64 tensor element."""
    return x - (1 << 64) if x >= 1 << 63 else x
