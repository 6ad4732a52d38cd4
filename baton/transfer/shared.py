"""Shard snapshots in shared memory, for a buddy on the same machine.

A buddy on the ward's own machine gains nothing from a second copy of the ward's snapshot:
both copies die with the machine, and a process's death frees neither once the buddy
holds a reference to the first. So each rank writes its snapshot into a memfd, and a
buddy on the same kernel opens that memfd through /proc/<pid>/fd/<n> and maps it instead
of pulling the bytes over TCP: the rank's copy into host memory, which it makes anyway,
is then the whole cost of the redundancy. A buddy on another machine (the placement rule
for a job that spans nodes) still pulls over TCP.

A block is [header | layout | data]. The ward marks the header WRITING before it
overwrites a block and COMMITTED, with the boundary and an xxh3-64 of what it wrote,
after; a buddy trusts a block only while its header names the step it holds, and checks
the bytes against that digest before a recovery may use the copy. The ward hashes each
tensor right after copying it, while its bytes are still in cache: a second pass over the
block (the buddy's, when it mapped it) cost as much as the copy's own reads. So a ward
killed half way through a snapshot leaves its previous one, intact and verifiable, in
its other block, and bytes changed after the commit are never loaded.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from baton.transfer.protocol import _DTYPES

# magic, state, step, sub, layout bytes, meta bytes, data bytes, xxh3-64 of layout, meta and tensors, nonce
HEADER = struct.Struct("<8sQqqQQQQ16s")
MAGIC = b"BATONSH2"
WRITING, COMMITTED = 1, 2
_ALIGN = 64
_PAGE = 4096
_LAYOUT_ROOM = 1 << 16  # bytes kept for the layout and the skeleton beyond what the first needs


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()


def available() -> bool:
    return hasattr(os, "memfd_create") and bool(BOOT_ID)


@dataclass(frozen=True)
class SharedRef:
    """Where a buddy finds a ward's block: on this machine (same boot id), in that process."""

    boot_id: str
    pid: int
    fd: int
    inode: int
    size: int
    nonce: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SharedRef":
        return cls(str(d["boot_id"]), int(d["pid"]), int(d["fd"]), int(d["inode"]), int(d["size"]),
                   str(d["nonce"]))


Layout = tuple[tuple[tuple[str, tuple[int, ...], int, int], ...], int]  # (dtype, shape, offset, bytes)..., data bytes


class SharedBlock:
    """One snapshot's memory: written by its rank (`owner`), mapped by a buddy."""

    def __init__(self, mm: mmap.mmap, nonce: bytes, owner: bool, ref: SharedRef):
        self._mm, self.nonce, self.owner, self.ref = mm, nonce, owner, ref
        self._layout: Layout | None = None
        self._data_off = 0
        self._room = 0
        self._layout_bytes = b""  # the layout as the owner wrote it (a buddy: as it last parsed it)
        self._digests: dict[int, int] = {}  # a buddy's: step -> the digest the header held when mapped
        self._tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []  # each tensor's bytes in the block, for the digest

    # ---------------------------------------------------------------- the ward's side
    @classmethod
    def create(cls, tensors: list[torch.Tensor], meta: bytes) -> "SharedBlock":
        """A block for tensors of these shapes and dtypes. Raises OSError where the memory
        cannot be reserved (the caller keeps its snapshot in private memory instead)."""
        layout = _layout_of(tensors)
        room = _round(len(_layout_json(layout, 0)) + len(meta) + _LAYOUT_ROOM, _PAGE)
        size = _PAGE + room + _round(layout[1], _PAGE)
        fd = os.memfd_create("baton-snapshot", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs must fail here, not SIGBUS later
            mm = mmap.mmap(fd, size)
            inode = os.fstat(fd).st_ino
        except OSError:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(16)
        # The descriptor stays open for as long as the block lives: it is how a buddy finds it.
        block = cls(mm, nonce, True, SharedRef(BOOT_ID, os.getpid(), fd, inode, size, nonce.hex()))
        weakref.finalize(block, os.close, fd)
        block._room, block._data_off = room, _PAGE + room
        block._set_layout(layout)
        block._layout_bytes = _layout_json(layout, block._data_off)
        block._write_header(WRITING, -1, 0, 0, 0, 0, 0)
        return block

    def fits(self, tensors: list[torch.Tensor], meta: bytes) -> bool:
        """Whether a snapshot of these tensors can be written here: each the dtype and shape
        of the block's own (compared directly: building the layout again to compare it took
        ~0.4 ms a boundary for the llama bench's 159 tensors, 0.1% of its step's CPU)."""
        mine = self._tensors
        return self.owner and len(tensors) == len(mine) and len(self._layout_bytes) + len(meta) <= self._room \
            and all(t.dtype == b.dtype and t.shape == b.shape for t, b in zip(tensors, mine))

    def write(self, pos: tuple[int, int], meta: bytes, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy a snapshot in and commit it with its digest; the block's tensors, which now hold
        it. The caller has made sure it `fits`."""
        assert self._layout is not None and len(tensors) == len(self._tensors)
        self._write_header(WRITING, -1, 0, 0, 0, 0, 0)
        layout = self._layout_bytes
        end = _PAGE + len(layout)
        self._mm[_PAGE:end] = layout
        self._mm[end:end + len(meta)] = meta
        h = xxhash.xxh3_64()
        h.update(memoryview(self._mm)[_PAGE:end + len(meta)])
        for dst, src, view in zip(self._tensors, tensors, self._views):
            dst.copy_(src)
            h.update(view)
        self._write_header(COMMITTED, pos[0], pos[1], len(layout), len(meta), self._layout[1], h.intdigest())
        return list(self._tensors)

    # ---------------------------------------------------------------- the buddy's side
    @classmethod
    def attach(cls, ref: SharedRef) -> "SharedBlock":
        """Map a ward's block. Raises OSError where it is not on this machine or cannot be
        opened (another host, another user, a process already gone)."""
        if ref.boot_id != BOOT_ID:
            raise OSError("the block is on another machine")
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_ino != ref.inode or st.st_size != ref.size:
                raise OSError("the descriptor no longer names the ward's snapshot block")
            mm = mmap.mmap(fd, ref.size)  # the mapping keeps the memory once the ward is gone
        finally:
            os.close(fd)
        block = cls(mm, bytes.fromhex(ref.nonce), False, ref)
        header = block._header()
        if header[0] != MAGIC or header[-1] != block.nonce:
            raise OSError("the descriptor no longer names the ward's snapshot block")
        return block

    def read(self, step: int) -> tuple[tuple[int, int], bytes, list[torch.Tensor]] | None:
        """The committed snapshot of `step` as views into the block, or None if the block no
        longer holds it (its ward has moved on, or died writing it)."""
        magic, state, k, sub, layout_len, meta_len, _, digest, nonce = self._header()
        if magic != MAGIC or state != COMMITTED or k != step or nonce != self.nonce:
            return None
        written = bytes(self._mm[_PAGE:_PAGE + layout_len])
        if written != self._layout_bytes:  # parsed only when it changes (~0.3 ms for some hundred tensors)
            raw = json.loads(written)
            layout: Layout = (tuple((str(d), tuple(int(x) for x in shape), int(off), int(n))
                                    for d, shape, off, n in raw["specs"]), int(raw["data_len"]))
            data_off = int(raw["data_off"])
            if data_off + layout[1] > self.ref.size or any(d not in _DTYPES for d, *_ in layout[0]):
                return None
            self._data_off = data_off
            self._set_layout(layout)
            self._layout_bytes = written
        meta = bytes(self._mm[_PAGE + layout_len:_PAGE + layout_len + meta_len])
        if self._header()[7] != digest or not self.holds(step):  # overwritten while it was read
            return None
        self._digests = {step: digest}
        return (k, sub), meta, list(self._tensors)

    def holds(self, step: int, check: bool = False) -> bool:
        """The block still holds the committed snapshot of `step` (and, with `check`, the
        bytes its ward wrote: the header's digest, the one `read` saw, matches them)."""
        magic, state, k, _, layout_len, meta_len, _, digest, nonce = self._header()
        if magic != MAGIC or state != COMMITTED or k != step or nonce != self.nonce:
            return False
        return not check or self._digests.get(step) == digest == self._digest(layout_len, meta_len)

    @property
    def nbytes(self) -> int:
        return self.ref.size

    # ---------------------------------------------------------------- internals
    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._tensors, self._views = [], []
        whole = memoryview(self._mm)
        for dtype, shape, off, nbytes in layout[0]:
            dt = _DTYPES[dtype]
            n = nbytes // torch.empty((), dtype=dt).element_size()
            t = torch.frombuffer(self._mm, dtype=dt, count=n, offset=self._data_off + off) if n else \
                torch.empty(0, dtype=dt)
            self._tensors.append(t.view(shape))
            self._views.append(whole[self._data_off + off:self._data_off + off + nbytes])

    def _digest(self, layout_len: int, meta_len: int) -> int:
        """What `write` computes: the layout and skeleton, then each tensor's bytes."""
        h = xxhash.xxh3_64()
        h.update(memoryview(self._mm)[_PAGE:_PAGE + layout_len + meta_len])
        for view in self._views:
            h.update(view)
        return h.intdigest()

    def _header(self) -> tuple[Any, ...]:
        return HEADER.unpack_from(self._mm, 0)

    def _write_header(self, state: int, step: int, sub: int, layout_len: int, meta_len: int, data_len: int,
                      digest: int) -> None:
        HEADER.pack_into(self._mm, 0, MAGIC, state, step, sub, layout_len, meta_len, data_len, digest, self.nonce)


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout_of(tensors: list[torch.Tensor]) -> Layout:
    """Each tensor's dtype, shape, offset and size in the data region (64-byte aligned)."""
    specs, off = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((str(t.dtype), tuple(t.shape), off, nbytes))
        off = _round(off + nbytes, _ALIGN)
    return tuple(specs), off


def _layout_json(layout: Layout, data_off: int) -> bytes:
    return json.dumps({"specs": [[d, list(s), o, n] for d, s, o, n in layout[0]], "data_len": layout[1],
                       "data_off": data_off}, separators=(",", ":")).encode()
