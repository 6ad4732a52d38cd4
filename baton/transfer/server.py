"""Serves this process's published state to authenticated peers, straight from tensor memory.

Every worker runs one from `baton.init()` on: its address is known to the
orchestrator before any failure, so a joiner can connect the moment it is told
which generation to fetch. Nothing is copied to publish: the rank is paused at
a step boundary, so the tensors do not change while they are served.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading

import xxhash

from baton import selfcost
from baton.transfer.protocol import (
    CHUNK_DIGEST,
    CHUNK_HEADER,
    DEFAULT_CHUNK_BYTES,
    MAGIC,
    SLICE_BYTES,
    FlatState,
    Piece,
    TransferError,
    byte_view,
    manifest_of,
    plan_chunks,
    recv_exact,
    recv_json,
    send_all,
    send_json,
)

log = logging.getLogger("baton.transfer")


# Request kinds, sent right after the nonce: fetch a published state, push bundles to
# this process as a buddy, read one ward bundle back, fetch a shard snapshot (whose key,
# `snapshot_key(rank, step)`, goes where the others send a generation), or open a buddy's
# link: one connection kept from boundary to boundary, over which it asks where each
# snapshot lies in shared memory (a buddy on the same machine maps it; see shared.py) or
# fetches it. FETCH_TAIL fetches the part of a published state a joiner needs only in one
# case (a script's record of the step its predecessor was lost after), published apart so
# that the others never move its bytes. FETCH_OWN fetches a planned move's leaver's own
# record (no-code mode), published apart and first: its successor walks its script to the
# rank's place from it while the rest of the state arrives.
FETCH, PUSH, WARD, SNAPSHOT, SNAPSHOT_LINK, FETCH_TAIL, FETCH_OWN = b"F", b"P", b"W", b"S", b"R", b"T", b"O"
# A link's requests: an op, then the snapshot key.
LINK_REQUEST = struct.Struct("!cQ")
LINK_REF, LINK_FETCH = b"R", b"S"


SMALL = 1 << 22  # marks the snapshot id of a rank's state without its shards (see small_id)


def small_id(rank: int) -> int:
    """The snapshot id under which `rank`'s state without its shards is kept: an HSDP rank's
    buddy needs only that, a rank of another replica group holding the same shards."""
    return rank | SMALL


PRE_COPY_BASE, PRE_COPY_STEPS = 1 << 21, 1 << 20  # mark the ids of a pre-copy's base and its steps (ranks < 2**20)


def pre_copy_ids(rank: int) -> tuple[int, int]:
    """The snapshot ids under which a planned move's leaver serves its joiner the replicated
    state at one boundary (key step 0) and then its optimizer steps (key step: their sequence)."""
    return rank | PRE_COPY_BASE, rank | PRE_COPY_STEPS


# the same for a rank feeding hot spares (--hot-spares); ids stay below 2**24 (snapshot_key)
HOT_BASE, HOT_STEPS = 1 << 23 | PRE_COPY_BASE, 1 << 23 | PRE_COPY_STEPS


def hot_ids(rank: int) -> tuple[int, int]:
    """The snapshot ids under which a rank feeds the hot spares: its replicated state at one
    boundary, then its step records (as pre_copy_ids, apart from any planned move's)."""
    return rank | HOT_BASE, rank | HOT_STEPS


def snapshot_key(rank: int, step: int) -> int:
    """`rank` is a rank, or the id `small_id` gives."""
    return (rank << 40) | step


def auth_digest(token: str, nonce: bytes, generation: int, kind: bytes = FETCH) -> bytes:
    return hmac.new(token.encode(), nonce + kind + struct.pack("!Q", generation), "sha256").digest()


def connect(addr: tuple[str, int], token: str, kind: bytes, generation: int = 0,
            timeout: float = 60.0) -> socket.socket:
    """Open an authenticated connection of the given kind to a worker's transfer endpoint."""
    sock = socket.create_connection(tuple(addr), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        magic_nonce = recv_exact(sock, len(MAGIC) + 16)
        if magic_nonce[: len(MAGIC)] != MAGIC:
            raise TransferError(f"{addr} is not a baton transfer endpoint")
        nonce = magic_nonce[len(MAGIC):]
        send_all(sock, kind, struct.pack("!Q", generation), auth_digest(token, nonce, generation, kind))
    except BaseException:
        sock.close()
        raise
    return sock


# The generation of a state published before its generation is known (a leaver's, readied at
# its pause): no request asks for it; promote() gives it its number.
STAGED = -1

# How long a request waits for the state or snapshot it asks for to be here (a rank that has
# yet to reach the boundary it is asked at, or to copy a large state there) before it is
# answered that it is not.
PUBLISH_WAIT_S = 120.0


class TransferServer:
    def __init__(self, token: str, host: str = "127.0.0.1", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 publish_wait_s: float = PUBLISH_WAIT_S):
        self.token = token
        self.chunk_bytes = chunk_bytes
        self.publish_wait_s = publish_wait_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.address = self._sock.getsockname()[:2]
        self._cond = threading.Condition()
        # by request kind (FETCH, FETCH_TAIL): the generation, its state and how it is sent
        self._published: dict[bytes, tuple[int, FlatState, list[list[Piece]], list[memoryview]]] = {}
        self._closed = False
        # Fault injection for tests: corrupt the first sending of these chunk indices.
        env = os.environ.get("BATON_FAULT_CORRUPT_CHUNKS", "")
        self._corrupt_once = {int(x) for x in env.split(",") if x.strip()}
        self.chunks_served = 0
        from baton.transfer.bundles import WardStore

        self.wards = WardStore()
        # Shard snapshots by (rank, step): this rank's own, and its wards' it pulled as their
        # buddy (see baton.worker.snapshots). Served the way a published state is.
        self._snapshots: dict[tuple[int, int], tuple[FlatState, list[list[Piece]], list[memoryview]]] = {}
        self._reading: dict[int, int] = {}  # id(snapshot) -> connections sending it now
        selfcost.spawn(self._accept_loop, "baton-transfer")

    def put_snapshot(self, rank: int, step: int, state: FlatState) -> None:
        """Serve `state` as that snapshot. Its chunk plan is made when it is first sent: most
        snapshots are dropped unsent (a mapped one is never sent), and the plan costs a rank
        ~1 ms per boundary for a state of some hundred tensors."""
        with self._cond:
            self._snapshots[(rank, step)] = (state, [], [])
            self._cond.notify_all()

    def drop_snapshots(self, rank: int, keep: set[int]) -> None:
        """Forget `rank`'s snapshots other than the steps in `keep`."""
        with self._cond:
            for key in [k for k in self._snapshots if k[0] == rank and k[1] not in keep]:
                del self._snapshots[key]

    def snapshot_steps(self, rank: int) -> list[int]:
        with self._cond:
            return sorted(k[1] for k in self._snapshots if k[0] == rank)

    def get_snapshot(self, rank: int, step: int) -> FlatState | None:
        with self._cond:
            found = self._snapshots.get((rank, step))
        return found[0] if found is not None else None

    def take_snapshot(self, rank: int, step: int) -> FlatState | None:
        """Remove that snapshot and return it, for its buffers to hold a newer one; None if it
        is not here or a connection is still sending it (its bytes must not change under it)."""
        with self._cond:
            found = self._snapshots.get((rank, step))
            if found is None or self._reading.get(id(found[0]), 0):
                return None
            del self._snapshots[(rank, step)]
            return found[0]

    def snapshot_bytes(self) -> int:
        """Host memory the snapshots here take (a ward's block mapped here is the ward's)."""
        with self._cond:
            return sum(st.nbytes for st, _, _ in self._snapshots.values()
                       if st.shared is None or st.shared.owner)

    def _wait_snapshot(self, key: int, plan: bool = True) -> tuple[FlatState, list[list[Piece]], list[memoryview]] | None:
        rank, step = key >> 40, key & ((1 << 40) - 1)

        def here_or_gone() -> bool:  # gone: a newer one is here and this one never will be
            return (rank, step) in self._snapshots or self._closed or \
                any(k[0] == rank and k[1] > step for k in self._snapshots)

        with self._cond:
            self._cond.wait_for(here_or_gone, timeout=self.publish_wait_s)
            found = self._snapshots.get((rank, step))
            if found is None:
                return None
            state = found[0]
            if plan and not found[2] and state.tensors:
                views = [byte_view(t) for t in state.tensors]
                found = self._snapshots[(rank, step)] = (state, plan_chunks([len(v) for v in views],
                                                                            self.chunk_bytes), views)
            self._reading[id(state)] = self._reading.get(id(state), 0) + 1  # not reused until sent (take_snapshot)
            return found

    def _done_reading(self, state: FlatState) -> None:
        with self._cond:
            left = self._reading.get(id(state), 0) - 1
            if left > 0:
                self._reading[id(state)] = left
            else:
                self._reading.pop(id(state), None)

    def publish(self, generation: int, state: FlatState, kind: bytes = FETCH) -> None:
        views = [byte_view(t) for t in state.tensors]
        chunks = plan_chunks([len(v) for v in views], self.chunk_bytes)
        with self._cond:
            self._published[kind] = (generation, state, chunks, views)
            self._cond.notify_all()

    def promote(self, generation: int) -> None:
        """Serve what was published as STAGED as `generation`'s (readied before its number was known)."""
        with self._cond:
            for kind, (gen, state, chunks, views) in list(self._published.items()):
                if gen == STAGED:
                    self._published[kind] = (generation, state, chunks, views)
            self._cond.notify_all()

    def retract(self) -> None:
        with self._cond:
            self._published.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._sock.close()
        except OSError:
            pass
        self.wards.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            selfcost.spawn(self._serve, "baton-transfer-conn", (conn,))

    def _wait_published(self, generation: int,
                        kind: bytes = FETCH) -> tuple[FlatState, list[list[Piece]], list[memoryview]] | None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: kind in self._published and self._published[kind][0] >= generation,
                timeout=self.publish_wait_s,
            )
            if not ok or kind not in self._published or self._published[kind][0] != generation:
                return None
            _, state, chunks, views = self._published[kind]
            return state, chunks, views

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with conn:
                nonce = secrets.token_bytes(16)
                send_all(conn, MAGIC, nonce)
                kind = recv_exact(conn, 1)
                (generation,) = struct.unpack("!Q", recv_exact(conn, 8))
                digest = recv_exact(conn, 32)
                if kind not in (FETCH, PUSH, WARD, SNAPSHOT, SNAPSHOT_LINK, FETCH_TAIL, FETCH_OWN) or \
                        not hmac.compare_digest(digest, auth_digest(self.token, nonce, generation, kind)):
                    send_json(conn, {"error": "authentication failed: wrong job token"})
                    return
                if kind == PUSH:
                    # A ward's bundles: read by whoever needs the ward store next (see WardStore).
                    self.wards.add_connection(conn.dup())
                    return
                if kind == WARD:
                    self._serve_ward(conn)
                    return
                if kind == SNAPSHOT_LINK:
                    self._serve_link(conn)
                    return
                if kind == SNAPSHOT:
                    found = self._wait_snapshot(generation)
                    if found is None:
                        send_json(conn, {"error": f"no snapshot of rank {(generation >> 40) & (SMALL - 1)} at step "
                                                  f"{generation & ((1 << 40) - 1)} here"})
                        return
                    try:
                        self._send_state(conn, *found)
                    finally:
                        self._done_reading(found[0])
                    return
                else:
                    found = self._wait_published(generation, kind)
                    if found is None:
                        send_json(conn, {"error": f"no state published for generation {generation}"})
                        return
                self._send_state(conn, *found)
        except (OSError, TransferError, struct.error) as exc:
            log.debug("transfer connection ended: %s", exc)

    def _send_state(self, conn: socket.socket, state: FlatState, chunks: list[list[Piece]],
                    views: list[memoryview]) -> None:
        manifest = manifest_of(state, self.chunk_bytes)
        manifest["chunks"] = len(chunks)
        send_json(conn, manifest)
        send_all(conn, state.meta)
        while True:
            (count,) = struct.unpack("!I", recv_exact(conn, 4))
            if count == 0:
                return
            wanted = struct.unpack(f"!{count}I", recv_exact(conn, 4 * count))
            for index in wanted:
                self._send_chunk(conn, index, chunks, views)

    def _serve_link(self, conn: socket.socket) -> None:
        """A buddy's requests, one snapshot at a time for as long as it keeps the connection:
        where that snapshot lies in this process's shared memory (None: it does not, fetch
        it), or the snapshot itself, sent as a fetch is. A buddy pulls its ward's snapshot
        at every boundary: a new connection for each cost an accept, a thread and a
        handshake on both sides (~1 ms of CPU, more than a light snapshot's bytes)."""
        conn.settimeout(None)
        while True:
            try:
                op, key = LINK_REQUEST.unpack(recv_exact(conn, LINK_REQUEST.size))
            except TransferError:
                return  # the buddy closed the connection
            if op not in (LINK_REF, LINK_FETCH):
                send_json(conn, {"error": f"unknown request {op!r}"})
                return
            found = self._wait_snapshot(key, plan=op == LINK_FETCH)
            if found is None:
                send_json(conn, {"error": f"no snapshot of rank {(key >> 40) & (SMALL - 1)} at step "
                                          f"{key & ((1 << 40) - 1)} here"})
                return
            try:
                if op == LINK_FETCH:
                    self._send_state(conn, *found)
                else:
                    block = found[0].shared
                    send_json(conn, {"ref": block.ref.to_json() if block is not None and block.owner else None})
            finally:
                self._done_reading(found[0])

    def _serve_ward(self, conn: socket.socket) -> None:
        from baton.transfer.bundles import END_FRAME

        req = recv_json(conn)
        frame = self.wards.get_frame(int(req["rank"]), (int(req["pos"][0]), int(req["pos"][1])))
        conn.sendall(frame.raw if frame is not None else END_FRAME)  # as it came: checked by the reader

    def _send_chunk(self, conn: socket.socket, index: int, chunks: list[list[Piece]],
                    views: list[memoryview]) -> None:
        if index >= len(chunks):
            raise TransferError(f"chunk {index} requested, only {len(chunks)} exist")
        pieces = [views[p.segment][p.offset:p.offset + p.length] for p in chunks[index]]
        send_all(conn, CHUNK_HEADER.pack(index, sum(len(p) for p in pieces)))
        corrupt = index in self._corrupt_once
        self._corrupt_once.discard(index)
        h = xxhash.xxh3_64()
        for piece in pieces:
            for at in range(0, len(piece), SLICE_BYTES):
                part = piece[at:at + SLICE_BYTES]
                h.update(part)
                if corrupt and len(part):  # hashed as it is, sent with one byte flipped
                    bad = bytearray(part)
                    bad[len(bad) // 2] ^= 0xFF
                    part, corrupt = memoryview(bytes(bad)), False
                    log.warning("fault injection: corrupted chunk %d on the wire", index)
                conn.sendall(part)
        send_all(conn, CHUNK_DIGEST.pack(h.intdigest()))
        self.chunks_served += 1
