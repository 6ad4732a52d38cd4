"""Raw copy baselines between two processes: what migration downtime is divided by.

    python bench/rawcopy.py --mb 100 --reps 5      # prints both baselines as JSON

One receiver process (plain Python + numpy, no torch) is started on first use and kept
alive across repetitions and sizes, so no repetition pays a Python start. Sender and
receiver talk over one persistent loopback TCP connection. For every size both sides
allocate their buffers once and pre-fault them (every page written before any timing):
the baselines are copies into *warm* memory, the fastest a migration could hope for.

Only the copy is timed; allocation, pre-faulting, attaching the shared-memory segment and
telling the receiver the size all happen before the clock starts.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import struct
import subprocess
import sys
import time
from multiprocessing import shared_memory

import numpy as np

_HEADER = struct.Struct("!4sQ")  # op, nbytes
_PAGE = 4096


class RawCopyError(RuntimeError):
    """The receiver process failed or went away."""


def _prefault(buf: np.ndarray) -> None:
    """Write every page so that no timed copy pays a page fault."""
    if buf.size:
        buf.fill(1)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise RawCopyError("connection closed mid-copy")
        got += k


def _recv_header(sock: socket.socket) -> tuple[bytes, int]:
    raw = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(raw))
    return _HEADER.unpack(raw)


# ----------------------------------------------------------------------------- receiver side
def _receiver_main() -> None:
    """The receiving process: one connection from the sender, commands until 'quit'."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sys.stdout.write(f"{srv.getsockname()[1]}\n")
    sys.stdout.flush()
    srv.settimeout(120)
    conn, _ = srv.accept()
    srv.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.empty(0, dtype=np.uint8)
    shm: shared_memory.SharedMemory | None = None
    shm_view: np.ndarray | None = None
    while True:
        op, n = _recv_header(conn)
        if op == b"prep":
            # Allocate and pre-fault the destination; attach and touch the shm segment.
            payload = bytearray(n)  # size (8 bytes) + the segment's name
            _recv_exact(conn, memoryview(payload))
            shm_view = None
            if shm is not None:
                shm.close()
                shm = None
            (size,) = struct.unpack("!Q", bytes(payload[:8]))
            seg = bytes(payload[8:]).decode()
            if buf.size != size:
                buf = np.empty(0, dtype=np.uint8)  # free the old one first
                buf = np.empty(size, dtype=np.uint8)
                _prefault(buf)
            if seg:
                shm = shared_memory.SharedMemory(name=seg)
                _untrack(shm)
                shm_view = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf)
                int(shm_view[::_PAGE].sum())  # map every page of the segment in this process
            conn.sendall(b"r")
        elif op == b"tcp_":
            _recv_exact(conn, memoryview(buf)[:n])
            conn.sendall(b"k")
        elif op == b"shm_":
            assert shm_view is not None
            np.copyto(buf[:n], shm_view[:n])
            conn.sendall(b"k")
        elif op == b"quit":
            shm_view = None
            if shm is not None:
                shm.close()
            conn.close()
            return
        else:
            raise RawCopyError(f"unknown op {op!r}")


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """The sender owns the segment: keep this process's resource tracker from unlinking it."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort; Python 3.13 has track=False instead
        pass


# ----------------------------------------------------------------------------- sender side
class _Peer:
    """The sender's end: the receiver process, the connection, and warm buffers for one size."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receiver"],
                                     stdout=subprocess.PIPE, env=env)
        line = self.proc.stdout.readline() if self.proc.stdout else b""
        if not line.strip():
            self.proc.kill()
            raise RawCopyError(f"raw-copy receiver did not start (exit code {self.proc.poll()})")
        self.sock = socket.create_connection(("127.0.0.1", int(line)), timeout=600)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.nbytes = -1
        self.src = np.empty(0, dtype=np.uint8)
        self.shm: shared_memory.SharedMemory | None = None
        self.shm_view: np.ndarray | None = None

    def _ack(self) -> None:
        b = self.sock.recv(1)
        if not b:
            raise RawCopyError(f"raw-copy receiver went away (exit code {self.proc.poll()})")

    def prepare(self, nbytes: int) -> None:
        if nbytes == self.nbytes:
            return
        self._free()
        self.src = np.empty(nbytes, dtype=np.uint8)
        _prefault(self.src)
        self.shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self.shm_view = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.shm.buf)
        _prefault(self.shm_view)
        payload = struct.pack("!Q", nbytes) + self.shm.name.encode()
        self.sock.sendall(_HEADER.pack(b"prep", len(payload)) + payload)
        self._ack()
        self.nbytes = nbytes

    def _free(self) -> None:
        self.shm_view = None
        self.src = np.empty(0, dtype=np.uint8)
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
        self.nbytes = -1

    def tcp(self, nbytes: int) -> float:
        self.prepare(nbytes)
        self.sock.sendall(_HEADER.pack(b"tcp_", nbytes))
        t0 = time.perf_counter()
        self.sock.sendall(memoryview(self.src))
        self._ack()
        return time.perf_counter() - t0

    def shm_copy(self, nbytes: int) -> float:
        self.prepare(nbytes)
        assert self.shm_view is not None
        t0 = time.perf_counter()
        np.copyto(self.shm_view, self.src)
        self.sock.sendall(_HEADER.pack(b"shm_", nbytes))
        self._ack()
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.sock.sendall(_HEADER.pack(b"quit", 0))
            self.sock.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._free()


_peer: _Peer | None = None


def _get_peer() -> _Peer:
    global _peer
    if _peer is not None and _peer.proc.poll() is not None:
        _peer._free()
        _peer = None
    if _peer is None:
        _peer = _Peer()
    return _peer


def close() -> None:
    """Stop the receiver process and free both sides' buffers (also done at exit)."""
    global _peer
    if _peer is not None:
        _peer.close()
        _peer = None


atexit.register(close)


def tcp_copy_s(nbytes: int) -> float:
    """Seconds to move `nbytes` from this process to another over loopback TCP.

    Timed at the sender with time.perf_counter(): from just before the first payload byte
    is handed to sendall() until the receiver's one-byte acknowledgement arrives, which it
    sends once all `nbytes` sit in its destination buffer. Both buffers are pre-faulted
    (warm); the connection is already open (one persistent connection, TCP_NODELAY);
    the receiver is a long-lived process. Not timed: allocation, pre-faulting, connecting.
    """
    return _get_peer().tcp(int(nbytes))


def shm_copy_s(nbytes: int) -> float:
    """Seconds to move `nbytes` from this process to another through shared memory.

    Timed at the sender with time.perf_counter(): from the start of the sender's write of
    `nbytes` (numpy copyto from its warm buffer into a multiprocessing.shared_memory
    segment in /dev/shm) until the receiver's acknowledgement, which it sends after being
    told (a 12-byte message over loopback TCP) and copying all `nbytes` out of the segment
    into its own warm buffer (numpy copyto). Two memcpys in sequence plus one round trip.
    The segment is created, written once and mapped by both sides before any timing.
    """
    return _get_peer().shm_copy(int(nbytes))


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mb", default="100", help="sizes in MB (1e6 bytes), comma-separated")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if args.receiver:
        _receiver_main()
        return 0
    out = []
    for mb in (float(x) for x in args.mb.split(",")):
        n = int(mb * 1e6)
        tcp = [tcp_copy_s(n) for _ in range(args.reps)]
        shm = [shm_copy_s(n) for _ in range(args.reps)]
        out.append({"nbytes": n, "tcp_s": tcp, "shm_s": shm,
                    "tcp_gbs": n / sorted(tcp)[len(tcp) // 2] / 1e9, "shm_gbs": n / sorted(shm)[len(shm) // 2] / 1e9})
    close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
