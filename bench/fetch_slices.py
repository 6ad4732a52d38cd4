"""One state fetch over loopback, by the size of the slices each side checksums and copies.

    PYTHONPATH=. python bench/fetch_slices.py --mb 1000 --rounds 2    # writes bench/results/fetch-slices-<ts>.json

Each side hashes a chunk a slice at a time, beside that slice's copy through the socket
(protocol.SLICE_BYTES): small slices keep the bytes in cache between the copy and the hash,
large ones cost fewer syscalls. This measures where that balance lies on the machine: for
each slice size, one process serves a state of `--mb` (fourteen 64 MiB tensors and 200 small
ones, as a model's layout) from a TransferServer, and the fetching process takes it
`--fetches` times into warm tensors (the first not counted). Sizes run interleaved, order
rotated each round; every fetch is checksummed as in a move.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, interleave, median_range, save_results

SIZES_KIB = (256, 512, 1024, 2048)


def one(slice_bytes: int, mb: float, fetches: int) -> list[float]:
    """In this process: serve from a forked child, fetch `fetches` times, the seconds of each after the first."""
    import torch

    import baton.transfer.client as client
    import baton.transfer.server as server
    from baton.transfer import FlatState, TransferServer, fetch_state
    from baton.transfer.codec import encode

    server.SLICE_BYTES = client.SLICE_BYTES = slice_bytes
    torch.set_num_threads(1)
    big = 16 << 20  # float32 elements: 64 MiB each
    sizes = [big] * max(1, int(mb * 1e6 / (big * 4))) + [4096] * 200
    meta, tensors = encode({f"t{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)})
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        srv = TransferServer("bench")
        srv.publish(1, FlatState(meta, tensors))
        os.write(w, f"{srv.address[0]} {srv.address[1]}\n".encode())
        time.sleep(3600)
        os._exit(0)
    try:
        host, port = os.read(r, 100).decode().split()
        into = [torch.zeros_like(t) for t in tensors]
        del tensors
        times = []
        for _ in range(fetches):
            t0 = time.perf_counter()
            fetch_state([(host, int(port))], 1, "bench", into=into)
            times.append(time.perf_counter() - t0)
        return times[1:]
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=1000)
    p.add_argument("--fetches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this slice size
    args = p.parse_args()
    if args.one is not None:
        print(" ".join(f"{t:.5f}" for t in one(args.one, args.mb, args.fetches)))
        return 0

    def run(key: str, _round: int) -> list[float]:
        out = subprocess.run([sys.executable, __file__, "--one", str(int(key) << 10), "--mb", str(args.mb),
                              "--fetches", str(args.fetches)], capture_output=True, text=True, check=True, timeout=600)
        times = [float(x) for x in out.stdout.split()]
        print(f"  slice {key} KiB: {' '.join(f'{t:.3f}' for t in times)}", flush=True)
        return times

    rounds = interleave([str(k) for k in SIZES_KIB], args.rounds, run)
    summary = {f"{k}KiB": median_range(t for r in rounds for t in r[str(k)]) for k in SIZES_KIB}
    path = save_results(args, "fetch-slices", summary=summary, rounds=rounds)
    for k, v in summary.items():
        print(f"{k:>8}: {v['median']:.3f} s ({v['min']:.3f}-{v['max']:.3f}, n={v['n']})")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
