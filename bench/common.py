"""Small helpers shared by the benchmark sections (no torch import here)."""

from __future__ import annotations

import socket
import statistics
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_range(xs: Iterable[float | None]) -> dict:
    """{"median", "min", "max", "n"}: how every figure is reported. None values (a repetition
    that produced no figure) are dropped; with none left, every field but n is None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def interleave(keys: list[str], rounds: int, run: Callable[[str, int], T]) -> list[dict[str, T]]:
    """Runs every key once per round, rotating the order each round (A B C, B C A, C A B, ...)
    so no contender always runs first or last on a machine whose speed drifts. Returns one
    {key: result} per round; ratios are taken within a round."""
    out = []
    for i in range(rounds):
        order = keys[i % len(keys):] + keys[:i % len(keys)]
        out.append({k: run(k, i) for k in order})
    return out
