"""The process's random streams as one value: capture, compare, restore.

baton keeps the user's streams continuous, exactly as under torchrun (nothing is
reseeded). What makes a re-run or a joiner exact is that every rank's stream state
at each step boundary is known: captured at the step's first gradient collective
(after the step has drawn everything it draws) and held by a buddy rank before the
step can complete anywhere. See `baton.worker.bundle`.

Covered: torch's CPU generator, the CUDA generators already initialised, Python's
`random`, numpy's global generator, and generators the script passes to `job.track`
(`torch.Generator`, `numpy.random.Generator`, `random.Random`).
"""

from __future__ import annotations

import array
import ctypes
import random
import struct
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def _cuda_devices() -> int:
    """CUDA generators exist only once CUDA is initialised; asked first, it is the cheap question
    (is_available() costs microseconds at every capture on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_initialized() and torch.cuda.is_available() else 0


def capture(extra: dict[str, Any] | None = None, full: bool = True) -> dict[str, Any]:
    """Current state of every covered stream (a few KB; ~50 us on CPU, no device sync).

    `full=False` is for checking that nothing was drawn, at a fraction of the cost: numpy's
    generator is read in place (`numpy_raw`) instead of copied by get_state(), which sees
    every draw except a normal served from numpy's cached second value."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _pack_python(random.getstate())}
    n = _cuda_devices()
    if n:
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(n)]
    if np is not None:
        raw = _numpy_raw() if not full else None
        if raw is not None:
            state["numpy_raw"] = raw
        else:
            state["numpy"] = np.random.get_state()
    if extra:
        state["tracked"] = {name: _gen_state(g) for name, g in extra.items()}
    return state


_MT_WORDS = 624


def _numpy_raw() -> bytes | None:
    """numpy's global MT19937 key and position as stored (~1 us), or None if unavailable."""
    try:
        address = np.random.mtrand._rand._bit_generator.ctypes.state_address
    except AttributeError:  # pragma: no cover - another numpy layout: get_state() instead
        return None
    return ctypes.string_at(address, 4 * _MT_WORDS + 4)


def _numpy_raw_of(state: tuple) -> bytes:
    """The in-place bytes `_numpy_raw` reads, from a get_state() tuple."""
    return np.asarray(state[1], dtype="<u4").tobytes() + struct.pack("<i", int(state[2]))


def restore(state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_unpack_python(state["python"]))
    for i, s in enumerate(state.get("cuda", [])[: _cuda_devices()]):
        torch.cuda.set_rng_state(s, i)
    if np is not None and "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    for name, g in (extra or {}).items():
        if name in state.get("tracked", {}):
            _set_gen_state(g, state["tracked"][name])


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two full captures hold the same streams in the same state."""
    return a.keys() == b.keys() and not describe_difference(a, b)


def describe_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the streams captured in `a` (full or not) that are not where `b` has them."""
    out = []
    if not torch.equal(a["torch"], b["torch"]):
        out.append("torch")
    if not _packed_equal(a["python"], b["python"]):
        out.append("random")
    ca, cb = a.get("cuda", []), b.get("cuda", [])
    if len(ca) != len(cb) or not all(torch.equal(x, y) for x, y in zip(ca, cb)):
        out.append("cuda")
    if "numpy" in a and not _np_equal(a["numpy"], b.get("numpy")):
        out.append("numpy")
    if "numpy_raw" in a and (b.get("numpy") is None or a["numpy_raw"] != _numpy_raw_of(b["numpy"])):
        out.append("numpy")
    if "tracked" in a:
        ta, tb = a["tracked"], b.get("tracked", {})
        out += [k for k in sorted(set(ta) | set(tb)) if k not in ta or k not in tb or not _gen_equal(ta[k], tb[k])]
    return out


def _np_equal(na: Any, nb: Any) -> bool:
    if na is None or nb is None:
        return na is nb
    return na[0] == nb[0] and bool((na[1] == nb[1]).all()) and tuple(na[2:]) == tuple(nb[2:])


def is_generator(obj: Any) -> bool:
    if isinstance(obj, (torch.Generator, random.Random)):
        return True
    return np is not None and isinstance(obj, np.random.Generator)


def _gen_state(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    return g.bit_generator.state  # numpy Generator: a dict of ints (and arrays for some)


def _set_gen_state(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(_python_state(state))
    else:
        g.bit_generator.state = state


def _gen_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_gen_equal(a[k], b[k]) for k in a)
    if np is not None and isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool((a == b).all())
    return _python_state(a) == _python_state(b) if isinstance(a, (tuple, list)) else a == b


def _python_state(s: Any) -> tuple:
    """random.getstate() is (version, tuple-of-ints, gauss_next); a decoded copy may hold lists."""
    if isinstance(s, list):
        s = tuple(s)
    if len(s) == 3 and isinstance(s[1], list):
        s = (s[0], tuple(s[1]), s[2])
    return s


def _pack_python(state: tuple) -> tuple:
    """random.getstate() as (version, uint8 tensor of the 625 words, gauss_next): a tensor
    travels and compares in microseconds where 625 boxed ints would not."""
    version, words, gauss = state
    raw = array.array("I", words).tobytes()
    return (version, torch.frombuffer(bytearray(raw), dtype=torch.uint8), gauss)


def _unpack_python(packed: Any) -> tuple:
    version, raw, gauss = packed
    words = array.array("I")
    words.frombytes(raw.numpy().tobytes())
    return (version, tuple(words), gauss)


def _packed_equal(a: Any, b: Any) -> bool:
    return a[0] == b[0] and a[2] == b[2] and torch.equal(a[1], b[1])
