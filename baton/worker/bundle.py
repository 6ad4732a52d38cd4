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

On the wire a bundle is a JSON header, then the codec's JSON skeleton and the raw
tensors as one payload with an xxh3-64 over it; a mismatch is answered with a NACK and
the bundle is sent again (it is never stored). Nothing else is answered: the buddy's gate,
not an acknowledgement, is what makes a step wait for a bundle.
"""

from __future__ import annotations

import base64
import json
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from baton.transfer.protocol import (
    TransferError,
    alloc_tensors,
    byte_view,
    recv_exact,
    recv_json,
    send_json,
)
from baton.worker import codec

log = logging.getLogger("baton.worker")

Pos = tuple[int, int]


@dataclass
class Bundle:
    """A rank's own state as of position `pos` (next step, boundary units done before it)."""

    rank: int
    pos: Pos
    generation: int
    seq: int  # capture point within the step (0 = the first gradient collective)
    meta: bytes
    tensors: list[torch.Tensor]

    def state(self) -> dict[str, Any]:
        return codec.decode(self.meta, self.tensors)

    @classmethod
    def of(cls, rank: int, pos: Pos, generation: int, seq: int, state: dict[str, Any]) -> "Bundle":
        meta, tensors = codec.encode(state)
        return cls(rank, pos, generation, seq, meta, tensors)

    def digest(self) -> int:
        h = xxhash.xxh3_64()
        h.update(self.meta)
        for t in self.tensors:
            h.update(byte_view(t))
        return h.intdigest()

    # ---- text form, for the orchestrator's JSON API
    def to_text(self) -> dict[str, Any]:
        return {"rank": self.rank, "pos": list(self.pos), "generation": self.generation, "seq": self.seq,
                "meta": self.meta.decode(),
                "tensors": [{"dtype": str(t.dtype), "shape": list(t.shape),
                             "data": base64.b64encode(bytes(byte_view(t))).decode()} for t in self.tensors]}

    @classmethod
    def from_text(cls, d: dict[str, Any]) -> "Bundle":
        specs = d["tensors"]
        tensors = alloc_tensors({"tensors": [{"dtype": s["dtype"], "shape": s["shape"]} for s in specs]})
        for t, s in zip(tensors, specs):
            raw = base64.b64decode(s["data"])
            view = byte_view(t)
            if len(raw) != len(view):
                raise TransferError("bundle tensor size does not match its shape")
            view[:] = raw
        return cls(int(d["rank"]), (int(d["pos"][0]), int(d["pos"][1])), int(d["generation"]), int(d["seq"]),
                   d["meta"].encode(), tensors)


def newest(candidates: list[Bundle | None], limit: Pos) -> Bundle | None:
    """The bundle that describes `limit`: the latest one at or before it."""
    best = None
    for b in candidates:
        if b is None or b.pos > limit:
            continue
        if best is None or (b.pos, b.generation, b.seq) > (best.pos, best.generation, best.seq):
            best = b
    return best


# ---------------------------------------------------------------- the buddy's side
class WardStore:
    """Bundles pushed by the ranks this process is buddy to; the gate waits here.

    Push connections are not read by a thread of their own: a bundle waits in the kernel's
    socket buffer until someone needs the ward store (the training thread at its gate, a
    joiner asking for a ward's bundle), who reads every complete frame there first. At the
    gate the bundle, pushed a whole backward pass earlier, is normally already there: no
    thread has to wake up and hand it over, which on a busy machine costs milliseconds.
    """

    KEEP = 6
    MAX_HEADER = 1 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rank: dict[int, list[Bundle]] = {}
        self._inbox: dict[socket.socket, bytearray] = {}  # push connections and their unparsed bytes

    def add_connection(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        with self._lock:
            self._inbox[conn] = bytearray()

    def put(self, b: Bundle) -> None:
        with self._lock:
            self._put_locked(b)

    def get(self, rank: int, limit: Pos) -> Bundle | None:
        with self._lock:
            self._drain_locked()
            return newest(list(self._by_rank.get(rank, [])), limit)

    def wait(self, rank: int, generation: int, pos: Pos, seq: int, timeout: float,
             cancelled: Callable[[], bool]) -> bool:
        """Until the ward's bundle for (generation, pos, capture point >= seq) is here."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._drain_locked()
                if any(b.generation == generation and b.pos == pos and b.seq >= seq
                       for b in self._by_rank.get(rank, [])):
                    return True
                conns = list(self._inbox)
            if cancelled():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if conns:
                try:
                    select.select(conns, [], [], min(left, 0.05))
                except (OSError, ValueError):  # a connection closed meanwhile: drain drops it
                    time.sleep(0.001)
            else:
                time.sleep(min(left, 0.05))

    def close(self) -> None:
        with self._lock:
            for conn in list(self._inbox):
                self._close_locked(conn)

    # ---- reading the push connections (under the lock)
    def _put_locked(self, b: Bundle) -> None:
        kept = [x for x in self._by_rank.get(b.rank, [])
                if (x.pos, x.generation, x.seq) != (b.pos, b.generation, b.seq)]
        kept.append(b)
        kept.sort(key=lambda x: (x.pos, x.generation, x.seq))
        self._by_rank[b.rank] = kept[-self.KEEP:]

    def _drain_locked(self) -> None:
        for conn, buf in list(self._inbox.items()):
            ended = False
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    ended = True
                    break
                buf += chunk
            try:
                self._parse_locked(conn, buf)
            except (TransferError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropped a bundle push connection: %s", exc)
                ended = True
            if ended:
                self._close_locked(conn)

    def _parse_locked(self, conn: socket.socket, buf: bytearray) -> None:
        while len(buf) >= 8:
            (n,) = struct.unpack_from("!Q", buf)
            if n > self.MAX_HEADER:
                raise TransferError(f"bundle header of {n} bytes is too large")
            if len(buf) < 8 + n:
                return
            header = json.loads(bytes(buf[8:8 + n]))
            payload_len = _checked_sizes(header)
            if len(buf) < 8 + n + payload_len:
                return
            payload = bytes(buf[8 + n:8 + n + payload_len])
            del buf[:8 + n + payload_len]
            b = _bundle_of(header, payload)
            if b.checksum_ok:  # type: ignore[attr-defined]
                self._put_locked(b)
            else:
                log.warning("bundle from rank %d failed its checksum: asked again", b.rank)
                try:
                    conn.send(nack_of(b), socket.MSG_DONTWAIT)
                except OSError:
                    pass

    def _close_locked(self, conn: socket.socket) -> None:
        self._inbox.pop(conn, None)
        try:
            conn.close()
        except OSError:
            pass


def read_bundle_frame(sock: socket.socket) -> Bundle | None:
    """One bundle: a JSON header, then the skeleton and every tensor's bytes as one payload
    (a few KB), checked against the header's xxh3 (`checksum_ok`). Blocking: for a ward's
    bundle served on request (pushes are parsed by `WardStore` as they are drained)."""
    header = recv_json(sock, limit=WardStore.MAX_HEADER)
    if header.get("end"):
        return None
    return _bundle_of(header, recv_exact(sock, _checked_sizes(header)))


def _checked_sizes(header: dict[str, Any]) -> int:
    """The payload length a bundle header announces, refused if impossible."""
    meta_len, payload_len = int(header["meta_len"]), int(header["payload_len"])
    if not 0 <= meta_len <= payload_len <= 1 << 30:
        raise TransferError("bundle header has impossible sizes")
    return payload_len


def _bundle_of(header: dict[str, Any], data: bytes) -> Bundle:
    meta_len, payload_len = int(header["meta_len"]), int(header["payload_len"])
    payload = memoryview(data)
    tensors = alloc_tensors({"tensors": header["tensors"]})
    offset = meta_len
    for t in tensors:
        view = byte_view(t)
        if offset + len(view) > payload_len:
            raise TransferError("bundle tensors overrun their payload")
        view[:] = payload[offset:offset + len(view)]
        offset += len(view)
    if offset != payload_len:
        raise TransferError("bundle payload is longer than its tensors")
    b = Bundle(int(header["rank"]), (int(header["pos"][0]), int(header["pos"][1])), int(header["generation"]),
               int(header["seq"]), bytes(payload[:meta_len]), tensors)
    b.checksum_ok = xxhash.xxh3_64_intdigest(payload) == int(header["xxh3"])  # type: ignore[attr-defined]
    return b


def encode_bundle_frame(b: Bundle) -> bytes:
    payload = b"".join([b.meta, *(byte_view(t) for t in b.tensors)])
    header = json.dumps({"rank": b.rank, "pos": list(b.pos), "generation": b.generation, "seq": b.seq,
                         "meta_len": len(b.meta), "payload_len": len(payload),
                         "xxh3": xxhash.xxh3_64_intdigest(payload),
                         "tensors": [{"dtype": str(t.dtype), "shape": list(t.shape)} for t in b.tensors]}).encode()
    return b"".join([struct.pack("!Q", len(header)), header, payload])


def write_bundle_frame(sock: socket.socket, b: Bundle) -> None:
    sock.sendall(encode_bundle_frame(b))


# A buddy's only answer on a push connection: this bundle failed its checksum, send it again.
NACK = struct.Struct("!cQqqq")  # b"-", generation, pos (step, unit), seq


def nack_of(b: Bundle) -> bytes:
    return NACK.pack(b"-", b.generation, b.pos[0], b.pos[1], b.seq)


# ---------------------------------------------------------------- the ward's side
class BundlePushers:
    """One pusher per buddy (bundles survive as many simultaneous losses as there are buddies)."""

    def __init__(self, connect: Callable[[tuple[str, int]], socket.socket]):
        self._connect = connect
        self._pushers: dict[tuple[str, int], BundlePusher] = {}

    def set_buddies(self, addrs: list[tuple[str, int]]) -> None:
        wanted = {(str(a[0]), int(a[1])) for a in addrs}
        for addr in list(self._pushers):
            if addr not in wanted:
                self._pushers.pop(addr).close()
        for addr in wanted - set(self._pushers):
            self._pushers[addr] = BundlePusher(self._connect, addr)

    def push(self, b: Bundle) -> None:
        if self._pushers:
            frame = encode_bundle_frame(b)
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
    """

    RECENT = 8  # bundles kept to answer a NACK (a step makes one or two)
    ATTEMPTS = 3  # connections tried per frame before it is given up (the buddy's gate fails)

    def __init__(self, connect: Callable[[tuple[str, int]], socket.socket], addr: tuple[str, int]):
        self._connect = connect
        self._addr = addr
        self._lock = threading.Lock()  # who may write to the socket: the training thread or the writer
        self._wake = threading.Condition(self._lock)
        self._backlog: deque[_Frame] = deque()  # what the writer must send, in order
        self._busy = False  # the writer is sending the backlog's head outside the lock
        self._recent: deque[Bundle] = deque(maxlen=self.RECENT)
        self._sock: socket.socket | None = None
        self._closed = False
        self.sent = 0
        self.resent = 0
        threading.Thread(target=self._writer, name="baton-bundle-push", daemon=True).start()

    def push(self, b: Bundle, frame: bytes) -> None:
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
                    return
                item = _Frame(frame, n)
            else:
                item = _Frame(frame, 0)
            self._backlog.append(item)
            self._wake.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

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
                    threading.Thread(target=self._nack_reader, args=(sock,), name="baton-bundle-nack",
                                     daemon=True).start()
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
                        self._backlog.append(_Frame(encode_bundle_frame(again[-1]), 0))
                        self._wake.notify()
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
    bundle: Bundle


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
    if b is not None and not getattr(b, "checksum_ok", False):
        raise TransferError(f"rank {rank}'s bundle from {addr} failed its checksum")
    return b
