"""A rank's own state at a boundary (a `Bundle`), its wire frame, and the store a buddy
keeps its wards' bundles in (`WardStore`). Why buddies exist: `baton.worker.bundle`.

On the wire a bundle is a fixed binary header (who, where, sizes, an xxh3-64), the
tensor list as JSON, then the codec's JSON skeleton and the raw tensors as one payload;
the checksum covers all but the header. A buddy checks it on arrival and keeps the frame
as it came (decoding it is for the rare reader: a joiner, a recovery); a mismatch is
answered with a NACK and the bundle is sent again (it is never stored). Nothing else is
answered: the buddy's gate, not an acknowledgement, is what makes a step wait for a bundle.
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
from typing import Any, Callable, TypeVar

import torch
import xxhash

from baton.transfer import codec
from baton.transfer.protocol import TransferError, alloc_tensors, byte_view, recv_exact

log = logging.getLogger("baton.transfer")

Pos = tuple[int, int]
_B = TypeVar("_B", "Bundle", "Frame")


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


def newest(candidates: list[_B | None], limit: Pos) -> _B | None:
    """The bundle (or frame) that describes `limit`: the latest one at or before it."""
    best = None
    for b in candidates:
        if b is None or b.pos > limit:
            continue
        if best is None or (b.pos, b.generation, b.seq) > (best.pos, best.generation, best.seq):
            best = b
    return best


# ---------------------------------------------------------------- the buddy's side
class WardStore:
    """Bundles pushed by the ranks this process is buddy to, kept as the frames that came; the
    gate waits here.

    Push connections are not read by a thread of their own: a bundle waits in the kernel's
    socket buffer until someone needs the ward store (the training thread at its gate, a
    joiner asking for a ward's bundle), who reads every complete frame there first. At the
    gate the bundle, pushed a whole backward pass earlier, is normally already there: no
    thread has to wake up and hand it over, which on a busy machine costs milliseconds.
    """

    KEEP = 6

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rank: dict[int, list[Frame]] = {}
        self._inbox: dict[socket.socket, bytearray] = {}  # push connections and their unparsed bytes

    def add_connection(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        with self._lock:
            self._inbox[conn] = bytearray()

    def get(self, rank: int, limit: Pos) -> Bundle | None:
        frame = self.get_frame(rank, limit)
        return frame.bundle() if frame is not None else None

    def get_frame(self, rank: int, limit: Pos) -> Frame | None:
        with self._lock:
            self._drain_locked()
            return newest(list(self._by_rank.get(rank, [])), limit)

    def wait(self, rank: int, generation: int, pos: Pos, seq: int, timeout: float,
             cancelled: Callable[[], bool]) -> bool:
        """Until the ward's bundle for (generation, pos, capture point >= seq) is here."""
        deadline = time.monotonic() + timeout

        def here() -> bool:
            return any(f.generation == generation and f.pos == pos and f.seq >= seq
                       for f in self._by_rank.get(rank, []))

        while True:
            with self._lock:
                # Read only until it is here: in steady state one recv takes the frame, and the
                # read that would find the socket empty (an exception in Python) is skipped.
                if here() or self._drain_locked(until=here):
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
    def _put_locked(self, f: Frame) -> None:
        kept = [x for x in self._by_rank.get(f.rank, [])
                if (x.pos, x.generation, x.seq) != (f.pos, f.generation, f.seq)]
        kept.append(f)
        kept.sort(key=lambda x: (x.pos, x.generation, x.seq))
        self._by_rank[f.rank] = kept[-self.KEEP:]

    def _drain_locked(self, until: Callable[[], bool] | None = None) -> bool:
        """Read and parse what the push connections hold; stop early once `until()` holds
        (returns whether it did)."""
        for conn, buf in list(self._inbox.items()):
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if chunk:
                    buf += chunk
                    try:
                        self._parse_locked(conn, buf)
                    except TransferError as exc:
                        log.warning("dropped a bundle push connection: %s", exc)
                        chunk = b""
                if not chunk:  # the pusher closed, or sent something that is not a frame
                    self._close_locked(conn)
                    break
                if until is not None and until():
                    return True
        return False

    def _parse_locked(self, conn: socket.socket, buf: bytearray) -> None:
        while len(buf) >= HEAD.size:
            head = _head_of(bytes(buf[:HEAD.size]))
            if head.end:
                raise TransferError("an end marker on a push connection")
            if len(buf) < head.frame_len:
                return
            frame = Frame(head, bytes(buf[:head.frame_len]))
            del buf[:head.frame_len]
            if frame.checksum_ok():
                self._put_locked(frame)
            else:
                log.warning("bundle from rank %d failed its checksum: asked again", frame.rank)
                try:
                    conn.send(nack_of(frame), socket.MSG_DONTWAIT)
                except OSError:
                    pass

    def _close_locked(self, conn: socket.socket) -> None:
        self._inbox.pop(conn, None)
        try:
            conn.close()
        except OSError:
            pass


# ---------------------------------------------------------------- the frame
# magic, rank, generation, step, unit, seq, tensor-list length, payload length, xxh3-64
HEAD = struct.Struct("!4sqqqqqIQQ")
MAGIC, END_MAGIC = b"BDL1", b"BEND"
MAX_SPECS = 1 << 20
MAX_PAYLOAD = 1 << 30


@dataclass(frozen=True)
class _Head:
    end: bool
    rank: int
    generation: int
    pos: Pos
    seq: int
    specs_len: int
    payload_len: int
    xxh3: int

    @property
    def frame_len(self) -> int:
        return HEAD.size + self.specs_len + self.payload_len


def _head_of(raw: bytes) -> _Head:
    magic, rank, generation, step, unit, seq, specs_len, payload_len, xxh3 = HEAD.unpack(raw)
    if magic == END_MAGIC:
        return _Head(True, 0, 0, (0, 0), 0, 0, 0, 0)
    if magic != MAGIC:
        raise TransferError(f"not a bundle frame (magic {magic!r})")
    if not (0 <= specs_len <= MAX_SPECS and 0 <= payload_len <= MAX_PAYLOAD):
        raise TransferError("bundle header has impossible sizes")
    return _Head(False, rank, generation, (step, unit), seq, specs_len, payload_len, xxh3)


class Frame:
    """A bundle as it travels: what a buddy keeps, decoded only when someone needs the state."""

    __slots__ = ("rank", "generation", "pos", "seq", "_head", "raw")

    def __init__(self, head: _Head, raw: bytes):
        self.rank, self.generation, self.pos, self.seq = head.rank, head.generation, head.pos, head.seq
        self._head, self.raw = head, raw

    def state(self) -> dict[str, Any]:
        """The state it carries (a Frame stands in for its Bundle wherever only this, the
        position and the generation are read)."""
        return self.bundle().state()

    def checksum_ok(self) -> bool:
        return xxhash.xxh3_64_intdigest(memoryview(self.raw)[HEAD.size:]) == self._head.xxh3

    def bundle(self) -> Bundle:
        body = memoryview(self.raw)[HEAD.size:]
        try:
            specs = json.loads(bytes(body[:self._head.specs_len]))
            meta_len = int(specs["meta_len"])
            tensors = alloc_tensors({"tensors": [{"dtype": d, "shape": shape} for d, shape in specs["tensors"]]})
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"bundle frame has a malformed tensor list: {exc}") from exc
        payload = body[self._head.specs_len:]
        if not 0 <= meta_len <= len(payload):
            raise TransferError("bundle skeleton overruns its payload")
        offset = meta_len
        for t in tensors:
            view = byte_view(t)
            if offset + len(view) > len(payload):
                raise TransferError("bundle tensors overrun their payload")
            view[:] = payload[offset:offset + len(view)]
            offset += len(view)
        if offset != len(payload):
            raise TransferError("bundle payload is longer than its tensors")
        return Bundle(self.rank, self.pos, self.generation, self.seq, bytes(payload[:meta_len]), tensors)


def _pack_frame(rank: int, pos: Pos, generation: int, seq: int, meta: bytes, specs: list[list[Any]],
                payloads: list[Any]) -> "Frame":
    """The wire frame: header, tensor list ([dtype, shape] each), skeleton, payloads."""
    raw_specs = json.dumps({"meta_len": len(meta), "tensors": specs}, separators=(",", ":")).encode()
    body = b"".join([raw_specs, meta, *payloads])
    head = _Head(False, rank, generation, (pos[0], pos[1]), seq, len(raw_specs), len(body) - len(raw_specs),
                 xxhash.xxh3_64_intdigest(body))
    return Frame(head, HEAD.pack(MAGIC, rank, generation, pos[0], pos[1], seq, head.specs_len, head.payload_len,
                                 head.xxh3) + body)


def encode_frame(rank: int, pos: Pos, generation: int, seq: int, state: dict[str, Any]) -> "Frame":
    """A rank's state straight to its wire frame: what Bundle.of then encode_bundle_frame make,
    byte for byte, without the tensors in between (the step's hot path: one walk, one join)."""
    meta, payloads = codec.encode_payloads(state)
    return _pack_frame(rank, pos, generation, seq, meta, [[d, s] for d, s, _ in payloads],
                       [p for _, _, p in payloads])


def encode_bundle_frame(b: Bundle) -> bytes:
    return _pack_frame(b.rank, b.pos, b.generation, b.seq, b.meta,
                       [[str(t.dtype), list(t.shape)] for t in b.tensors], [byte_view(t) for t in b.tensors]).raw


END_FRAME = HEAD.pack(END_MAGIC, 0, 0, 0, 0, 0, 0, 0, 0)


def read_bundle_frame(sock: socket.socket) -> Bundle | None:
    """One bundle served on request (a ward's, to a joiner), or None for the end marker.
    Blocking; a frame whose checksum fails is an error, never a bundle."""
    raw_head = recv_exact(sock, HEAD.size)
    head = _head_of(raw_head)
    if head.end:
        return None
    frame = Frame(head, raw_head + recv_exact(sock, head.specs_len + head.payload_len))
    if not frame.checksum_ok():
        raise TransferError(f"rank {head.rank}'s bundle failed its checksum")
    return frame.bundle()


# A buddy's only answer on a push connection: this bundle failed its checksum, send it again.
NACK = struct.Struct("!cQqqq")  # b"-", generation, pos (step, unit), seq


def nack_of(b: "Bundle | Frame") -> bytes:
    return NACK.pack(b"-", b.generation, b.pos[0], b.pos[1], b.seq)
