"""A rank's own state at a boundary (a `Bundle`), its wire frame, and the store a buddy
keeps its wards' bundles in (`WardStore`). Why buddies exist: `baton.worker.bundle`.

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
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from baton.transfer import codec
from baton.transfer.protocol import TransferError, alloc_tensors, byte_view, recv_exact, recv_json

log = logging.getLogger("baton.transfer")

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
