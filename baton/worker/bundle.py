"""A rank's own state at a boundary (random streams, BatchNorm-style buffers, data-epoch
record, local values), and the buddy that holds it before any step can complete.

Why a buddy: after an unplanned loss the lost rank's parameters come from replicas,
but its random streams and its buffers existed only in it. Each rank captures them
at its step's first gradient collective (everything the step draws has been drawn by
then; `Loop` checks that nothing is drawn later) and pushes them to its buddy, rank
r+1. The buddy does not contribute to the step's last gradient bucket until the
bundle has arrived, so no rank can complete a step whose bundles are not held by
someone else. The wait is normally zero: the push left a whole backward pass earlier.
Bundles at the end of boundary functions go to the orchestrator instead (durable
across any number of losses, and boundary functions are rare).

This module is the ward's side (pushing); the bundle, its wire frame and the buddy's
store are in `baton.transfer.bundles`.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from baton import selfcost
from baton.transfer.bundles import NACK, Bundle, Frame, Pos, encode_bundle_frame, read_bundle_frame
from baton.transfer.protocol import TransferError, recv_exact, send_json

log = logging.getLogger("baton.worker")


# ---------------------------------------------------------------- the ward's side
class BundlePushers:
    """One pusher per buddy (bundles survive as many simultaneous losses as there are buddies)."""

    def __init__(self, connect: Callable[[tuple[str, int]], socket.socket], first_wait_s: float = 10.0):
        self._connect = connect
        self._first_wait_s = first_wait_s
        self._pushers: dict[tuple[str, int], BundlePusher] = {}

    def set_buddies(self, addrs: list[tuple[str, int]]) -> None:
        wanted = {(str(a[0]), int(a[1])) for a in addrs}
        for addr in list(self._pushers):
            if addr not in wanted:
                self._pushers.pop(addr).close()
        for addr in wanted - set(self._pushers):
            self._pushers[addr] = BundlePusher(self._connect, addr, self._first_wait_s)

    def push(self, b: Bundle | Frame) -> None:
        if self._pushers:
            frame = b.raw if isinstance(b, Frame) else encode_bundle_frame(b)
            for p in self._pushers.values():
                p.push(b, frame)

    def close(self) -> None:
        for p in self._pushers.values():
            p.close()


class BundlePusher:
    """Sends this rank's step bundles to one buddy.

    The hot path is one non-blocking send from the training thread: a bundle is a few KB
    and the socket buffer takes it whole. A thread of its own takes over only to connect,
    to finish a send the buffer could not take, and to send again a bundle the buddy
    refused (NACK: its checksum failed there); another one sits in recv for those NACKs.
    Neither wakes up in steady state, and nothing is acknowledged: the buddy's gate is
    what waits for a bundle to be there.

    Except the first frame, which waits until it is handed to the kernel (at most
    `first_wait_s`): until then there is no connection, and a rank killed meanwhile (the
    first step after a move gave it this buddy) would leave its place with no live process.
    The kernel delivers what it holds of a killed process's socket.
    """

    RECENT = 8  # bundles kept to answer a NACK (a step makes one or two)
    ATTEMPTS = 3  # connections tried per frame before it is given up (the buddy's gate fails)

    def __init__(self, connect: Callable[[tuple[str, int]], socket.socket], addr: tuple[str, int],
                 first_wait_s: float = 10.0):
        self._connect = connect
        self._addr = addr
        self._first_wait_s = first_wait_s
        self._delivered = False  # a frame went whole to the kernel (a connection exists or existed)
        self._lock = threading.Lock()  # who may write to the socket: the training thread or the writer
        self._wake = threading.Condition(self._lock)
        self._backlog: deque[_Frame] = deque()  # what the writer must send, in order
        self._busy = False  # the writer is sending the backlog's head outside the lock
        self._recent: deque[Bundle | Frame] = deque(maxlen=self.RECENT)
        self._sock: socket.socket | None = None
        self._closed = False
        self.sent = 0
        self.resent = 0
        selfcost.spawn(self._writer, "baton-bundle-push")

    def push(self, b: Bundle | Frame, frame: bytes) -> None:
        """Send `b`, already encoded as `frame` (once for every buddy)."""
        with self._lock:
            self._recent.append(b)
            self.sent += 1
            if self._sock is not None and not self._busy and not self._backlog:
                try:
                    n = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    log.debug("bundle push to %s failed: %s", self._addr, exc)
                    self._drop_locked()
                    n = 0
                if n == len(frame):
                    self._delivered = True
                    return
                item = _Frame(frame, n)
            else:
                item = _Frame(frame, 0)
            self._backlog.append(item)
            self._wake.notify_all()
            if not self._delivered:
                self._wake.wait_for(lambda: self._delivered or self._closed or not self._backlog,
                                    timeout=self._first_wait_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    # ---- the writer thread: connect, finish partial sends, answer NACKs
    def _writer(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and not self._closed:
                    self._wake.wait()
                if not self._backlog:  # closed, and everything sent
                    self._drop_locked()
                    return
                item, sock = self._backlog[0], self._sock
                self._busy = True
            ok = self._send(item, sock)
            with self._lock:
                self._busy = False
                self._backlog.popleft()
                self._delivered = self._delivered or ok
                self._wake.notify_all()
                if not ok:
                    log.debug("bundle push to %s given up after %d attempts", self._addr, self.ATTEMPTS)

    def _send(self, item: "_Frame", sock: socket.socket | None) -> bool:
        for attempt in range(self.ATTEMPTS):
            try:
                if sock is None:
                    sock = _blocking(self._connect(self._addr))
                    item.offset = 0  # a new connection gets the whole frame
                    with self._lock:
                        self._sock = sock
                    selfcost.spawn(self._nack_reader, "baton-bundle-nack", (sock,))
                sock.sendall(memoryview(item.frame)[item.offset:])
                return True
            except (OSError, TransferError) as exc:
                log.debug("bundle push to %s failed: %s", self._addr, exc)
                with self._lock:
                    if self._sock is sock:
                        self._drop_locked()
                sock = None
                if attempt < self.ATTEMPTS - 1:
                    time.sleep(0.02)
        return False

    def _nack_reader(self, sock: socket.socket) -> None:
        try:
            while True:
                _, generation, step, unit, seq = NACK.unpack(recv_exact(sock, NACK.size))
                with self._lock:
                    again = [b for b in self._recent if (b.generation, b.pos, b.seq) == (generation, (step, unit), seq)]
                    if again:
                        log.warning("buddy %s refused a bundle (checksum): sending it again", self._addr)
                        self.resent += 1
                        b = again[-1]
                        self._backlog.append(_Frame(b.raw if isinstance(b, Frame) else encode_bundle_frame(b), 0))
                        self._wake.notify_all()
        except (OSError, TransferError, struct.error):
            return  # the connection ended: the writer reconnects when it next has something to send

    def _drop_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the NACK reader
            except OSError:
                pass
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None


def _blocking(sock: socket.socket) -> socket.socket:
    """No Python-level timeout (with one, every send polls first, and a MSG_DONTWAIT send would
    wait for room); the kernel's send timeout bounds the writer's blocking sends instead."""
    seconds = sock.gettimeout() or 60.0
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", int(seconds), int((seconds % 1) * 1e6)))
    return sock


@dataclass
class _Frame:
    frame: bytes
    offset: int  # bytes of it already sent on the current connection


@dataclass
class StepCapture:
    """What this rank captured in the current step: its streams (to check at the boundary that
    nothing was drawn after the capture) and the bundle sent to its buddies."""

    rng: dict[str, Any]
    bundle: Bundle | Frame


def fetch_ward_bundle(addr: tuple[str, int], token: str, rank: int, limit: Pos,
                      timeout: float = 30.0) -> Bundle | None:
    """Ask the buddy that held `rank`'s bundles for the one describing `limit`."""
    from baton.transfer.server import WARD, connect

    sock = connect(tuple(addr), token, WARD, timeout=timeout)
    try:
        send_json(sock, {"rank": rank, "pos": list(limit)})
        b = read_bundle_frame(sock)
    finally:
        sock.close()
    return b
