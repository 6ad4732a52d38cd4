"""What baton's per-step capture path costs one rank, piece by piece, in one idle process.

    .venv/bin/python bench/capture_path.py [--n 3000]

Every step a rank checks that nothing was drawn since its last capture, captures its
random streams and rank-local state as a bundle, encodes the bundle's frame and pushes it
to a buddy, and (as a buddy) takes its ward's frame off the socket at the gate. This
times each piece on the same state a bench rank carries (torch, `random` and numpy
streams, a data position), in microseconds per call. A diagnostic: the whole-tree
figures in the README come from `make bench`; these say which piece to work on. They are
warm-cache figures (each piece run thousands of times back to back): as the first thing
after a training step's math, which streams the model and optimizer through the caches,
the same pieces cost about ten times more (an rng capture: ~10 us here, ~100 us there).
baton's own count (`job.cpu_use()`, the bench's "own CPU" row) is what a step really pays.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Callable

from baton.transfer.bundles import Bundle, WardStore, encode_bundle_frame
from baton.worker import rng


def _us(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="calls per piece")
    args = p.parse_args()
    at_boundary = rng.capture({})
    state = {"rng": at_boundary, "buffers": {}, "local": {}, "data": {"epoch": 0, "index": 12, "record": None}}
    bundle = Bundle.of(1, (5, 0), 1, 0, state)
    frame = encode_bundle_frame(bundle)
    sender, receiver = socket.socketpair()
    wards = WardStore()
    wards.add_connection(receiver)

    def arrive() -> None:
        sender.send(frame)
        wards.wait(1, 1, (5, 0), 0, 1.0, lambda: False)

    pieces = {
        "stray-draw check (capture + compare)": lambda: rng.describe_difference(rng.capture({}), at_boundary),
        "stream capture": lambda: rng.capture({}),
        "bundle encode (codec)": lambda: Bundle.of(1, (5, 0), 1, 0, state),
        "frame encode (header, xxh3)": lambda: encode_bundle_frame(bundle),
        "buddy: frame off the socket, checked": arrive,
    }
    print(f"frame of {len(frame)} bytes; in-place stream reads: "
          f"{'yes' if rng._PY_AT is not None and rng._NP_AT is not None else 'no (getstate fallback)'}")
    total = 0.0
    for name, fn in pieces.items():
        us = _us(fn, args.n)
        total += us
        print(f"  {name:<40} {us:7.1f} us")
    print(f"  {'per step, all of the above':<40} {total:7.1f} us")
    wards.close()
    sender.close()


if __name__ == "__main__":
    main()
