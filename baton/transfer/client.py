"""Fetches a published state from one or several sources, striped, verified chunk by chunk.

With several sources (unplanned recovery: every healthy DDP replica holds the
same bytes) chunks are pulled from all of them at once. A chunk whose checksum
fails is asked for again (from another source when there is one); a source that
drops out has its outstanding chunks handed to the others. Nothing is returned
until every chunk has verified.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import xxhash

from baton import selfcost
from baton.transfer.protocol import (
    CHUNK_DIGEST,
    CHUNK_HEADER,
    SLICE_BYTES,
    FlatState,
    Piece,
    TransferError,
    alloc_tensors,
    byte_view,
    plan_chunks,
    recv_exact,
    recv_into_exact,
    recv_json,
    send_all,
    sizes_of,
)
from baton.transfer.server import FETCH, LINK_FETCH, LINK_REF, LINK_REQUEST, SNAPSHOT_LINK, connect

log = logging.getLogger("baton.transfer")

MAX_ATTEMPTS = 4
BATCH = 4  # chunks asked for per request: enough to keep a source's pipe full


@dataclass
class FetchStats:
    bytes: int = 0
    seconds: float = 0.0
    sources: int = 0
    corrupt_chunks: int = 0
    resent_chunks: int = 0
    per_source: dict[str, int] = field(default_factory=dict)

    def plus(self, other: "FetchStats") -> "FetchStats":
        """Two fetches of one state's parts, as one."""
        per_source = dict(self.per_source)
        for addr, n in other.per_source.items():
            per_source[addr] = per_source.get(addr, 0) + n
        return FetchStats(bytes=self.bytes + other.bytes, seconds=self.seconds + other.seconds,
                          sources=len(per_source) or max(self.sources, other.sources),
                          corrupt_chunks=self.corrupt_chunks + other.corrupt_chunks,
                          resent_chunks=self.resent_chunks + other.resent_chunks, per_source=per_source)


def _read_manifest(sock: socket.socket, addr: tuple[str, int]) -> tuple[dict, bytes]:
    """What a source sends before the chunks: the manifest (or its refusal) and the state's
    skeleton, checked against the manifest's digest."""
    manifest = recv_json(sock)
    if "error" in manifest:
        raise TransferError(f"source {addr[0]}:{addr[1]} refused: {manifest['error']}")
    meta = recv_exact(sock, int(manifest["meta_len"]))
    if hashlib.sha256(meta).hexdigest() != manifest.get("meta_sha256"):
        raise TransferError(f"source {addr[0]}:{addr[1]}: state skeleton failed its checksum")
    return manifest, meta


class _Source:
    def __init__(self, addr: tuple[str, int], generation: int, token: str, timeout: float, kind: bytes = FETCH):
        self.addr = addr
        self.sock = connect(addr, token, kind, generation, timeout)
        self.manifest, self.meta = _read_manifest(self.sock, addr)

    def close(self) -> None:
        try:
            send_all(self.sock, struct.pack("!I", 0))
        except OSError:
            pass
        self.sock.close()


class SnapshotLink:
    """A buddy's one connection to its ward's transfer server, kept open from boundary to
    boundary: where each of the ward's snapshots lies in its shared memory, or the snapshot
    itself (a new connection per step cost the ward's server an accept and a thread, and
    the buddy a handshake and its fetch threads, every step: ~1 ms of CPU, more than a
    light HSDP snapshot's own bytes)."""

    def __init__(self, addr: tuple[str, int], token: str, timeout: float = 60.0):
        self.addr, self.token, self.timeout = tuple(addr), token, timeout
        self._sock: socket.socket | None = None

    def ref(self, key: int) -> dict | None:
        """Where the snapshot `key` lies (waiting until the rank holds it, as a fetch does),
        or None where it is in private memory only."""
        try:
            reply = recv_json(self._ask(LINK_REF, key))
        except BaseException:
            self.close()  # a late answer must never be read as the next one's
            raise
        if "error" in reply:
            self.close()
            raise TransferError(f"source {self.addr[0]}:{self.addr[1]} refused: {reply['error']}")
        return reply.get("ref")

    def fetch(self, key: int, into: list[torch.Tensor] | None = None,
              wait_s: float | None = None, pool: Any = None) -> tuple[FlatState, int]:
        """The snapshot `key` (waiting until the rank holds it: up to `wait_s` where the rank
        may take longer than the link's timeout to get there, as a feed's next step does)
        and the bytes received, into `into`'s tensors where they fit, else `pool`'s
        (alloc_tensors); each chunk checked, a corrupt one asked for again. close() from
        another thread ends the wait."""
        try:
            sock = self._ask(LINK_FETCH, key)
            if wait_s is not None:
                sock.settimeout(max(wait_s, self.timeout))
            manifest, meta = _read_manifest(sock, self.addr)
            sock.settimeout(self.timeout)
            tensors = alloc_tensors(manifest, into, pool)
            views = [byte_view(t) for t in tensors]
            chunks = plan_chunks(sizes_of(manifest), int(manifest["chunk_bytes"]))
            if len(chunks) != int(manifest["chunks"]):
                raise TransferError("chunk plan mismatch between source and receiver")
            attempts = [0] * len(chunks)
            wanted = list(range(len(chunks)))
            while wanted:
                send_all(sock, struct.pack(f"!I{len(wanted)}I", len(wanted), *wanted))
                again = []
                for expected in wanted:
                    index, length = CHUNK_HEADER.unpack(recv_exact(sock, CHUNK_HEADER.size))
                    if index != expected:
                        raise TransferError(f"source sent chunk {index}, expected {expected}")
                    if not _receive_chunk(sock, chunks[index], views, length):
                        attempts[index] += 1
                        if attempts[index] >= MAX_ATTEMPTS:
                            raise TransferError(f"chunk {index} failed its checksum {attempts[index]} times")
                        again.append(index)
                wanted = again
            send_all(sock, struct.pack("!I", 0))
        except BaseException:
            self.close()  # the connection may hold the rest of an answer: never read it as the next one's
            raise
        return FlatState(meta=meta, tensors=tensors), len(meta) + sum(len(v) for v in views)

    def _ask(self, op: bytes, key: int) -> socket.socket:
        if self._sock is None:
            self._sock = connect(self.addr, self.token, SNAPSHOT_LINK, 0, self.timeout)
        send_all(self._sock, LINK_REQUEST.pack(op, key))
        return self._sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:  # wakes a fetch blocked on it in another thread (a close alone would not)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def fetch_state(sources: list[tuple[str, int]], generation: int, token: str,
                timeout: float = 60.0, kind: bytes = FETCH,
                into: list[torch.Tensor] | None = None, pool: Any = None) -> tuple[FlatState, FetchStats]:
    """The state the sources publish for `generation` (with kind SNAPSHOT: the shard
    snapshot whose `snapshot_key` it is), received into `into`'s tensors where they fit,
    else into `pool` (a ReceivePool, mapped ahead) where it fits."""
    t0 = time.perf_counter()
    conns: list[_Source] = []
    errors: list[str] = []
    for addr in sources:
        try:
            conns.append(_Source(tuple(addr), generation, token, timeout, kind))
        except (OSError, TransferError) as exc:
            errors.append(f"{addr}: {exc}")
    if not conns:
        raise TransferError("no source could serve the state: " + "; ".join(errors))
    # Every source must describe the same bytes; keep those that agree with the first.
    reference = json.dumps(conns[0].manifest, sort_keys=True)
    agreeing = [c for c in conns if json.dumps(c.manifest, sort_keys=True) == reference]
    for c in conns:
        if c not in agreeing:
            c.close()
    conns = agreeing
    manifest = conns[0].manifest
    t_conn = time.perf_counter()
    tensors = alloc_tensors(manifest, into, pool)
    views = [byte_view(t) for t in tensors]
    chunks = plan_chunks(sizes_of(manifest), int(manifest["chunk_bytes"]))
    if len(chunks) != int(manifest["chunks"]):
        raise TransferError("chunk plan mismatch between source and receiver")

    stats = FetchStats(sources=len(conns))
    t_alloc = time.perf_counter()
    work: deque[int] = deque(range(len(chunks)))
    attempts = [0] * len(chunks)
    prefault = _Prefaulter(tensors, chunks)
    lock = threading.Condition()
    in_flight = [0]
    failure: list[str] = []

    def take() -> list[int]:  # under the lock
        batch = [work.popleft() for _ in range(min(BATCH, len(work)))]
        in_flight[0] += len(batch)
        return batch

    def worker(src: _Source, first: list[int]) -> None:
        name = f"{src.addr[0]}:{src.addr[1]}"
        batch = first
        while True:
            if not batch:
                with lock:
                    while not work and in_flight[0] > 0 and not failure:
                        lock.wait(0.5)
                    if not work or failure:
                        return
                    batch = take()
            prefault.reached(max(batch))
            done = 0
            try:
                send_all(src.sock, struct.pack(f"!I{len(batch)}I", len(batch), *batch))
                for expected in batch:
                    index, length = CHUNK_HEADER.unpack(recv_exact(src.sock, CHUNK_HEADER.size))
                    if index != expected:
                        raise TransferError(f"source sent chunk {index}, expected {expected}")
                    ok = _receive_chunk(src.sock, chunks[index], views, length)
                    with lock:
                        done += 1
                        in_flight[0] -= 1
                        if ok:
                            stats.bytes += length
                            stats.per_source[name] += length
                        else:
                            stats.corrupt_chunks += 1
                            attempts[index] += 1
                            if attempts[index] >= MAX_ATTEMPTS:
                                failure.append(f"chunk {index} failed its checksum {attempts[index]} times")
                            else:
                                stats.resent_chunks += 1
                                work.append(index)
                        lock.notify_all()
            except (OSError, TransferError, struct.error) as exc:
                with lock:
                    rest = batch[done:]
                    in_flight[0] -= len(rest)
                    work.extendleft(reversed(rest))
                    errors.append(f"{name}: {exc}")
                    lock.notify_all()
                return
            batch = []

    # Every source starts with a batch of its own, so all pipes fill at once whichever
    # thread the scheduler runs first; after that, whoever is free takes the next batch.
    firsts = [take() for _ in conns]
    stats.per_source.update({f"{c.addr[0]}:{c.addr[1]}": 0 for c in conns})
    prefault.start()
    threads = [selfcost.spawn(worker, "baton-fetch", (c, first)) for c, first in zip(conns, firsts)]
    for t in threads:
        t.join()
    prefault.stop()
    for c in conns:
        c.close()
    if failure:
        raise TransferError("; ".join(failure))
    if work or in_flight[0]:
        raise TransferError("sources dropped out before the state was complete: " + "; ".join(errors))
    stats.bytes += len(conns[0].meta)
    stats.seconds = time.perf_counter() - t0
    log.info("fetched %d bytes from %d source(s): waiting for the manifest %.3fs, allocating %.3fs, chunks %.3fs",
             stats.bytes, len(conns), t_conn - t0, t_alloc - t_conn, stats.seconds - (t_alloc - t0))
    return FlatState(meta=conns[0].meta, tensors=tensors), stats


# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): fault a whole range in with one system call.
_MADV_POPULATE_WRITE = 23
# madvise(MADV_HUGEPAGE): back a range with 2 MB pages where the kernel can (THP "madvise" mode).
_MADV_HUGEPAGE = 14
_MADV_DONTNEED = 4
_PAGE = 4096
_HUGE = 2 << 20


def _madvise_fn():
    if os.uname().sysname != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _madvise_fn()


def advise_huge(t: torch.Tensor) -> None:
    """Ask for 2 MB pages behind the tensor's 2 MB-aligned interior (advice: refused is fine)."""
    if _madvise is None:
        return
    start = t.data_ptr()
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = (start + t.numel() * t.element_size()) & ~(_HUGE - 1)
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)


def discard(addr: int, length: int) -> int:
    """Drop the pages wholly inside [addr, addr + length) (they read as zeros after); the
    bytes dropped."""
    lo = (addr + _PAGE - 1) & ~(_PAGE - 1)
    hi = (addr + length) & ~(_PAGE - 1)
    if _madvise is None or hi <= lo or _madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


def populate(addr: int, length: int) -> bool:
    """Fault the pages of [addr, addr + length) in, contents untouched; False where the
    kernel cannot (not Linux, before 5.14)."""
    lo = (addr + _PAGE - 1) & ~(_PAGE - 1)
    hi = (addr + length) & ~(_PAGE - 1)
    if _madvise is None:
        return False
    return hi <= lo or _madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0


class _Prefaulter:
    """Faults the fresh receive buffers in ahead of the socket, on a thread of its own.

    A first write to fresh memory costs a page fault per 4 KB page, and on the receiving
    thread those faults cost more than the copy itself (1 GB: ~0.9 s of faults against
    ~0.1 s of copying, measured here). One madvise(MADV_POPULATE_WRITE) per chunk, in
    chunk order ahead of the receiver, maps the pages in bulk (~0.45 s per GB, GIL
    released) while the receiver waits on the socket. Contents are never touched: a range the
    receiver already wrote is left as it is. Without the call (not Linux, older kernel)
    the receiver faults the pages in itself, as before.

    Before any page is touched, each buffer's 2 MB-aligned interior is advised to use huge
    pages: one fault then maps 2 MB instead of 4 KB. A 1 GB planned move's chunks took
    1.2-1.7 s with the joiner mostly in the kernel, 0.97-1.06 s with this advice (and
    0.5-0.7 s where the kernel backs every allocation with huge pages).
    """

    def __init__(self, tensors: list, chunks: list[list[Piece]]):
        for t in tensors:
            advise_huge(t)
        self._ranges: list[list[tuple[int, int]]] = []
        for pieces in chunks:
            ranges = []
            for p in pieces:
                t = tensors[p.segment]
                start = t.data_ptr() + p.offset
                lo = (start + _PAGE - 1) & ~(_PAGE - 1)
                hi = (start + p.length) & ~(_PAGE - 1)
                if hi > lo:
                    ranges.append((lo, hi - lo))
            self._ranges.append(ranges)
        self._receiver_at = -1  # highest chunk index a receiver has started on
        self._stop = False
        self._thread: threading.Thread | None = None

    def reached(self, index: int) -> None:
        if index > self._receiver_at:
            self._receiver_at = index

    def start(self) -> None:
        if _madvise is not None and sum(len(r) for r in self._ranges) > 0:
            self._thread = selfcost.spawn(self._run, "baton-prefault")

    def stop(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        assert _madvise is not None
        for index, ranges in enumerate(self._ranges):
            if self._stop:
                return
            if index <= self._receiver_at:
                continue  # the receiver got there first: it faults these pages in itself
            for addr, length in ranges:
                if _madvise(addr, length, _MADV_POPULATE_WRITE) != 0:
                    return  # not supported here: the receiver's writes fault pages in


def _receive_chunk(sock: socket.socket, pieces: list[Piece], views: list[memoryview], length: int) -> bool:
    """Receive a chunk straight into its destination tensors, hashing each slice as it lands
    (still in cache: protocol.SLICE_BYTES), then check it against the digest that trails it."""
    if length != sum(p.length for p in pieces):
        raise TransferError("chunk length does not match the manifest")
    h = xxhash.xxh3_64()
    for p in pieces:
        dest = views[p.segment][p.offset:p.offset + p.length]
        for at in range(0, p.length, SLICE_BYTES):
            part = dest[at:at + SLICE_BYTES]
            recv_into_exact(sock, part)
            h.update(part)
    (digest,) = CHUNK_DIGEST.unpack(recv_exact(sock, CHUNK_DIGEST.size))
    return h.intdigest() == digest
