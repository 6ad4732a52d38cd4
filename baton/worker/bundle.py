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
the bundle is sent again (it is never stored).
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from baton.transfer.protocol import (
    TransferError,
    alloc_tensors,
    byte_view,
    recv_exact,
    recv_into_exact,
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
    """Bundles pushed by the ranks this process is buddy to; the gate waits here."""

    KEEP = 6

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_rank: dict[int, list[Bundle]] = {}

    def put(self, b: Bundle) -> None:
        with self._cond:
            kept = [x for x in self._by_rank.get(b.rank, [])
                    if (x.pos, x.generation, x.seq) != (b.pos, b.generation, b.seq)]
            kept.append(b)
            kept.sort(key=lambda x: (x.pos, x.generation, x.seq))
            self._by_rank[b.rank] = kept[-self.KEEP:]
            self._cond.notify_all()

    def get(self, rank: int, limit: Pos) -> Bundle | None:
        with self._cond:
            return newest(list(self._by_rank.get(rank, [])), limit)

    def wait(self, rank: int, generation: int, pos: Pos, seq: int, timeout: float,
             cancelled: Callable[[], bool]) -> bool:
        """Until the ward's bundle for (generation, pos, capture point >= seq) is here."""
        deadline = time.monotonic() + timeout

        def present() -> bool:
            return any(b.generation == generation and b.pos == pos and b.seq >= seq
                       for b in self._by_rank.get(rank, []))

        with self._cond:
            while not present():
                if cancelled():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True


def read_bundle_frame(sock: socket.socket) -> Bundle | None:
    """One bundle: a JSON header, then the skeleton and every tensor's bytes as one payload
    (a few KB: one receive), checked against the header's xxh3 (`checksum_ok`)."""
    header = recv_json(sock, limit=1 << 20)
    if header.get("end"):
        return None
    meta_len, payload_len = int(header["meta_len"]), int(header["payload_len"])
    if not 0 <= meta_len <= payload_len <= 1 << 30:
        raise TransferError("bundle header has impossible sizes")
    payload = memoryview(bytearray(payload_len))
    recv_into_exact(sock, payload)
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


def write_bundle_frame(sock: socket.socket, b: Bundle) -> None:
    payload = b"".join([b.meta, *(byte_view(t) for t in b.tensors)])
    header = json.dumps({"rank": b.rank, "pos": list(b.pos), "generation": b.generation, "seq": b.seq,
                         "meta_len": len(b.meta), "payload_len": len(payload),
                         "xxh3": xxhash.xxh3_64_intdigest(payload),
                         "tensors": [{"dtype": str(t.dtype), "shape": list(t.shape)} for t in b.tensors]}).encode()
    sock.sendall(b"".join([struct.pack("!Q", len(header)), header, payload]))


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
        for p in self._pushers.values():
            p.push(b)

    def close(self) -> None:
        for p in self._pushers.values():
            p.close()


class BundlePusher:
    """Sends this rank's step bundles to one buddy on a background thread."""

    def __init__(self, connect: Callable[[tuple[str, int]], socket.socket], addr: tuple[str, int]):
        self._connect = connect
        self._addr = addr
        self._queue: queue.Queue[Bundle | None] = queue.Queue()
        self._sock: socket.socket | None = None
        self.sent = 0
        self.resent = 0
        threading.Thread(target=self._run, name="baton-bundle-push", daemon=True).start()

    def push(self, b: Bundle) -> None:
        self._queue.put(b)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            b = self._queue.get()
            if b is None:
                self._drop()
                return
            for attempt in range(3):
                try:
                    if self._sock is None:
                        self._sock = self._connect(self._addr)
                    write_bundle_frame(self._sock, b)
                    if recv_exact(self._sock, 1) == b"+":
                        self.sent += 1
                        break
                    self.resent += 1
                except (OSError, TransferError) as exc:
                    log.debug("bundle push to %s failed: %s", self._addr, exc)
                    self._drop()
                    if attempt < 2:
                        time.sleep(0.02)

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None


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
