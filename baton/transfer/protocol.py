"""What travels: a flat state (a pickled skeleton plus raw tensor bytes) cut into chunks.

Tensors are laid end to end as *segments*; a chunk is a run of pieces of
segments of at most `chunk_bytes`. Small tensors share a chunk, big ones span
many, so per-chunk overhead stays small whatever the state looks like. Every
chunk carries an xxh3-64 checksum computed as it is sent and verified before
a single byte of it is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"BATN2"  # 2: the chunk digest trails its bytes
DEFAULT_CHUNK_BYTES = 8 << 20

_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)}


class TransferError(RuntimeError):
    """A transfer could not complete: bad token, source gone, or data that kept failing checks."""


@dataclass
class FlatState:
    """A state ready to move: `meta` is a JSON skeleton (baton.transfer.codec) whose tensor
    slots index `tensors`. Neither changes once made (buffers are reused by making a new one)."""

    meta: bytes
    tensors: list[torch.Tensor]
    shared: Any = None  # the SharedBlock holding the tensors, for a shard snapshot in shared memory

    @functools.cached_property
    def nbytes(self) -> int:
        return len(self.meta) + sum(t.numel() * t.element_size() for t in self.tensors)


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass(frozen=True)
class Piece:
    segment: int
    offset: int
    length: int


def plan_chunks(sizes: list[int], chunk_bytes: int) -> list[list[Piece]]:
    """Cut segments of the given byte sizes into chunks of at most chunk_bytes."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for seg, size in enumerate(sizes):
        off = 0
        while off < size:
            take = min(size - off, room)
            current.append(Piece(seg, off, take))
            off += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def manifest_of(state: FlatState, chunk_bytes: int) -> dict:
    return {
        "tensors": [{"dtype": str(t.dtype), "shape": list(t.shape)} for t in state.tensors],
        "meta_len": len(state.meta),
        "meta_sha256": hashlib.sha256(state.meta).hexdigest(),
        "chunk_bytes": chunk_bytes,
    }


def sizes_of(manifest: dict) -> list[int]:
    out = []
    for spec in manifest["tensors"]:
        n = 1
        for d in spec["shape"]:
            n *= d
        out.append(n * torch.empty((), dtype=_DTYPES[spec["dtype"]]).element_size())
    return out


def alloc_tensors(manifest: dict, reuse: list[torch.Tensor] | None = None, pool: Any = None) -> list[torch.Tensor]:
    """Empty tensors for the manifest: `reuse` itself when its tensors have exactly its
    shapes and dtypes (contiguous), else carved from `pool` (a ReceivePool: memory mapped
    ahead) where they fit, else new ones."""
    if reuse is not None and len(reuse) == len(manifest["tensors"]) and all(
            t.is_contiguous() and list(t.shape) == list(spec["shape"]) and t.dtype == _DTYPES.get(spec["dtype"])
            for t, spec in zip(reuse, manifest["tensors"])):
        return list(reuse)
    specs = []
    for spec in manifest["tensors"]:
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise TransferError(f"unsupported dtype {spec['dtype']}")
        specs.append((dtype, [int(d) for d in spec["shape"]]))
    carved = pool.carve(specs) if pool is not None else None
    return carved if carved is not None else [torch.empty(shape, dtype=dtype) for dtype, shape in specs]


# ---------------------------------------------------------------- framing helpers
def send_all(sock: socket.socket, *parts: bytes | memoryview) -> None:
    for p in parts:
        sock.sendall(p)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError("connection closed by the other side mid-transfer")
        got += k


def send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    send_all(sock, struct.pack("!Q", len(data)), data)


def recv_json(sock: socket.socket, limit: int = 64 << 20) -> dict:
    (n,) = struct.unpack("!Q", recv_exact(sock, 8))
    if n > limit:
        raise TransferError(f"control message of {n} bytes is too large")
    return json.loads(recv_exact(sock, n))


CHUNK_HEADER = struct.Struct("!IQ")  # index, length; the chunk's bytes follow, then its CHUNK_DIGEST
CHUNK_DIGEST = struct.Struct("!Q")  # xxh3-64 of the chunk's bytes, after them
# Each side checksums a chunk a slice at a time, each slice right after (receiver) or right
# before (sender) its copy through the socket, while it is still in the core's cache: every
# byte is read from memory once, not once to copy and again to hash. That is why the digest
# trails the bytes: the sender knows it only once the last slice has gone. A slice of 1 MiB
# (a core's L2 here) is also few enough syscalls: a 1 GB fetch over loopback on a 2-core VM
# took 0.349 s with 256 KiB slices, 0.273-0.285 s with 512 KiB to 2 MiB (medians of 21,
# bench/fetch_slices.py, fetch-slices-20261206-020159.json).
SLICE_BYTES = 1 << 20
