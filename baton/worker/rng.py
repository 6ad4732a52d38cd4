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


# ---------------------------------------------------------------- reading generators in place
# random.getstate() and numpy's get_state() build hundreds of Python ints or a dict and an
# array: 9 and 34 us, twice a step. Both generators keep their state in a fixed C struct, so
# a capture reads its bytes in place (~1 us). Where each field lies is found once, on a
# generator of the same type put into a known state, and checked against getstate(); where
# that check fails (another Python or numpy build) capture falls back to getstate(). Both
# ways give the same value, so bundles and comparisons never depend on which was used.
_MT_WORDS = 624
_MT_BYTES = 4 * _MT_WORDS + 4  # the 624 words, then the position in them (an int)


def _struct_bytes(obj: Any, offset: int, size: int) -> bytes:
    return ctypes.string_at(id(obj) + offset, size)


def _find(obj: Any, needle: bytes) -> int | None:
    raw = ctypes.string_at(id(obj), type(obj).__basicsize__)
    at = raw.find(needle)
    return at if at >= 0 and raw.find(needle, at + 1) < 0 else None


def _python_raw_getstate(r: random.Random) -> tuple[bytes, float | None]:
    _, words, gauss = r.getstate()
    return array.array("I", words).tobytes(), gauss  # 624 words and the index, as getstate has them


def _probe_python() -> int | None:
    """Offset of `random.Random`'s `index` field in the object (its 624 state words follow
    it), or None."""
    try:
        probe = random.Random(12345)
        probe.random()
        words, _ = _python_raw_getstate(probe)
        state_at = _find(probe, words[: 4 * _MT_WORDS])
        if state_at is None or state_at < 4:
            return None
        # CPython: `int index; uint32_t state[624]`. Our raw form is the words, then the index.
        def read(r: random.Random) -> bytes:
            b = _struct_bytes(r, state_at - 4, _MT_BYTES)
            return b[4:] + b[:4]
        for seed in (1, 2):
            probe.seed(seed)
            for _ in range(seed * 700):
                probe.random()
            if read(probe) != _python_raw_getstate(probe)[0]:
                return None
        return state_at - 4
    except Exception:  # noqa: BLE001 - any surprise: use getstate()
        return None


def _probe_numpy() -> int | None:
    """Offset of numpy RandomState's (has_gauss: int, gauss: double) pair, or None. The key and
    position are the bit generator's own struct, whose address numpy publishes."""
    if np is None:
        return None
    try:
        probe = np.random.RandomState(7)
        key, pos = probe.get_state()[1:3]
        marker = 1.2345678901234567
        probe.set_state(("MT19937", key, pos, 1, marker))
        gauss_at = _find(probe, struct.pack("=d", marker))
        if gauss_at is None:
            return None
        has_at = gauss_at - 8  # `int has_gauss; double gauss` (aligned)
        for has, value in ((0, 0.0), (1, -3.5), (1, 2.0 ** -30)):
            probe.set_state(("MT19937", key, pos, has, value))
            if _numpy_gauss_at(probe, has_at) != (has, value):
                return None
        probe.standard_normal()  # leaves a cached value: has_gauss 1
        st = probe.get_state()
        if _numpy_gauss_at(probe, has_at) != (st[3], st[4]):
            return None
        return has_at
    except Exception:  # noqa: BLE001
        return None


def _numpy_gauss_at(rs: Any, has_at: int) -> tuple[int, float]:
    """(has_gauss, gauss) of a RandomState: an int, then (8-aligned) a double."""
    raw = _struct_bytes(rs, has_at, 16)
    return struct.unpack_from("=i", raw)[0], struct.unpack_from("=d", raw, 8)[0]


_PY_AT = _probe_python()
_NP_AT = _probe_numpy()


def _python_now() -> tuple[bytes, float | None]:
    inst = random._inst  # type: ignore[attr-defined]
    if _PY_AT is None:
        return _python_raw_getstate(inst)
    b = _struct_bytes(inst, _PY_AT, _MT_BYTES)
    return b[4:] + b[:4], inst.gauss_next


def _numpy_now() -> tuple[bytes, list]:
    rs = np.random.mtrand._rand
    if _NP_AT is not None:
        try:
            address = rs._bit_generator.ctypes.state_address
        except AttributeError:  # pragma: no cover - another numpy layout
            address = None
        if address is not None:
            has, gauss = _numpy_gauss_at(rs, _NP_AT)
            return ctypes.string_at(address, _MT_BYTES), [has, gauss if has else 0.0]
    _, key, pos, has, gauss = rs.get_state()
    return np.asarray(key, dtype="<u4").tobytes() + struct.pack("<i", int(pos)), [int(has), float(gauss) if has else 0.0]


def bytes_of(t: torch.Tensor) -> bytes:
    """A generator's state tensor as capture() holds it."""
    return t.numpy().tobytes()


def _tensor_of(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# ---------------------------------------------------------------- the streams as one value
def capture(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Current state of every covered stream (a few KB of bytes and scalars; ~6 us on CPU
    for the built-in streams, no device sync). Bytes compare in nanoseconds and the codec
    carries them as raw payload.

    Form: torch (its byte state), python (the 624 words, then the index) and python_gauss,
    numpy (key, then position) and numpy_gauss [has, value], cuda (one byte state per
    initialised device), tracked (the script's own generators)."""
    words, gauss = _python_now()
    state: dict[str, Any] = {"torch": bytes_of(torch.get_rng_state()), "python": words, "python_gauss": gauss}
    n = _cuda_devices()
    if n:
        state["cuda"] = [bytes_of(torch.cuda.get_rng_state(i)) for i in range(n)]
    if np is not None:
        state["numpy"], state["numpy_gauss"] = _numpy_now()
    if extra:
        state["tracked"] = {name: _gen_state(g) for name, g in extra.items()}
    return state


def restore(state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    torch.set_rng_state(_tensor_of(state["torch"]))
    words = array.array("I")
    words.frombytes(state["python"])
    random.setstate((random.Random.VERSION, tuple(words), state["python_gauss"]))
    for i, s in enumerate(state.get("cuda", [])[: _cuda_devices()]):
        torch.cuda.set_rng_state(_tensor_of(s), i)
    if np is not None and "numpy" in state:
        raw = state["numpy"]
        key = np.frombuffer(raw[: 4 * _MT_WORDS], dtype="<u4").astype(np.uint32)
        (pos,) = struct.unpack("<i", raw[4 * _MT_WORDS:])
        has, gauss = state["numpy_gauss"]
        np.random.set_state(("MT19937", key, pos, int(has), float(gauss)))
    for name, g in (extra or {}).items():
        if name in state.get("tracked", {}):
            _set_gen_state(g, state["tracked"][name])


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two captures hold the same streams in the same state."""
    return a.keys() == b.keys() and not describe_difference(a, b)


def describe_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the streams that are not where they were: a cached numpy normal included."""
    out = []
    if a["torch"] != b["torch"]:
        out.append("torch")
    if a["python"] != b["python"] or a["python_gauss"] != b["python_gauss"]:
        out.append("random")
    if a.get("cuda", []) != b.get("cuda", []):
        out.append("cuda")
    if a.get("numpy") != b.get("numpy") or list(a.get("numpy_gauss", ())) != list(b.get("numpy_gauss", ())):
        out.append("numpy")
    if "tracked" in a or "tracked" in b:
        ta, tb = a.get("tracked", {}), b.get("tracked", {})
        out += [k for k in sorted(set(ta) | set(tb)) if k not in ta or k not in tb or not _gen_equal(ta[k], tb[k])]
    return out


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
