"""Peer redundancy for sharded state: every rank's FSDP2 shards at each step boundary,
held in host memory by its buddy, so a lost rank can be rebuilt with no rollback to disk.

At each boundary a rank snapshots its whole state (shards, the small replicated state,
its bundle) into host memory and serves it from its transfer server; each buddy pulls
its wards' snapshots in a background thread while the step computes. Before a buddy's
`optimizer.step()` it waits until it holds its wards' snapshots of the step's start, so
no rank gets two boundaries ahead of a copy of its ward's state.

A rank can be lost before its newest snapshot reached its buddy. The buddy then still
holds the one before (a snapshot is dropped only once the next has arrived), and every
rank keeps its own two newest snapshots, so the job can go back one boundary: the
orchestrator picks the newest boundary that every survivor can reach and every lost
rank's buddy holds. Memory per rank: its own two snapshots plus one or two per ward.

HSDP keeps the same shards in every replica group, so there a buddy pulls only its ward's
state without the shards (`light`): a lost rank's shards come from the own snapshot of a
rank holding the same shards in another replica group.

A rank's own snapshots lie in shared memory (baton.transfer.shared) where the machine
allows it, and a buddy on the same machine maps its ward's instead of pulling a copy: the
copy would die with the machine just as the ward's does. Under HSDP no buddy maps a
snapshot (light pulls), so there they stay in private memory: the digest a mapped block
needs would be a pass over every shard byte at each boundary for no reader. BATON_SNAPSHOT_TRANSPORT=tcp
(`baton run --snapshot-transport tcp`) makes every buddy pull, as one on another node does.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

import torch

from baton import selfcost
from baton.transfer import TransferError
from baton.transfer.client import SnapshotLink
from baton.transfer.shared import SharedBlock, SharedRef
from baton.transfer.shared import available as shared_memory_available
from baton.transfer.bundles import Pos
from baton.transfer.protocol import FlatState
from baton.transfer.server import TransferServer, small_id, snapshot_key

log = logging.getLogger("baton.worker")

TRANSPORT_ENV = "BATON_SNAPSHOT_TRANSPORT"  # auto: map a same-machine ward's snapshots; tcp: always pull


def copy_into(old: FlatState | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors`: into `old`'s buffers where they have the same layout, else new."""
    if old is not None and len(old.tensors) == len(tensors) and all(
            b.shape == t.shape and b.dtype == t.dtype and b.stride() == t.stride() for b, t in zip(old.tensors, tensors)):
        for b, t in zip(old.tensors, tensors):
            b.copy_(t)
        return list(old.tensors)
    return [t.clone() for t in tensors]


def position_of(state: FlatState) -> Pos:
    """The boundary a snapshot describes (read from its skeleton, without decoding it)."""
    k, sub = json.loads(state.meta)["pos"]
    return int(k), int(sub)


def _intact(state: FlatState, step: int) -> bool:
    """A copy held here is whole: a ward's block mapped here must still hold that step, with
    the bytes the ward's digest names (the ward may have died overwriting it)."""
    block = state.shared
    return block is None or block.owner or block.holds(step, check=True)


class Snapshots:
    KEEP_OWN = 2

    def __init__(self, server: TransferServer, token: str, rank: int, timeout_s: float):
        self.server, self.token, self.rank, self.timeout_s = server, token, rank, timeout_s
        self._cond = threading.Condition()
        self._own: dict[int, Pos] = {}  # step -> boundary of this rank's own snapshots
        self._held: dict[int, dict[int, Pos]] = {}  # ward -> step -> boundary
        self._failed: dict[int, tuple[int, str]] = {}  # ward -> (step, why it could not be pulled)
        self._wanted: dict[int, int] = {}  # ward -> the step its puller should fetch next
        self._addrs: dict[int, tuple[str, int]] = {}
        self._epoch = 0  # bumped on every set_wards: older pullers stop
        self.light = False  # wards' snapshots without their shards (HSDP)
        self.pulled_bytes = 0
        self.pull_seconds = 0.0
        transport = os.environ.get(TRANSPORT_ENV, "auto")
        if transport not in ("auto", "tcp"):
            raise ValueError(f"{TRANSPORT_ENV}={transport!r}: expected 'auto' or 'tcp'")
        self.shared = transport == "auto" and shared_memory_available()
        # (ward, pid, fd, inode) -> a ward's block mapped here, and the last step found in it
        self._blocks: dict[tuple[int, int, int, int], tuple[SharedBlock, int]] = {}
        self._pulled: set[int] = set()  # wards whose snapshots could not be mapped: pulled over TCP
        self.mapped_wards: set[int] = set()  # wards whose snapshots this buddy maps (logged once each)

    # ---------------------------------------------------------------- own snapshots
    def keep(self, pos: Pos, state: FlatState, small: FlatState | None = None) -> None:
        """This rank's snapshot at `pos`: served to its buddies, the two newest kept; `small`,
        the same without the shards, is what light buddies pull."""
        step = pos[0]
        self.server.put_snapshot(self.rank, step, state)
        if small is not None:
            self.server.put_snapshot(small_id(self.rank), step, small)
        with self._cond:
            self._own[step] = pos
            for old in sorted(self._own)[:-self.KEEP_OWN]:
                del self._own[old]
            keep = set(self._own)
            for ward in self._wanted:
                self._wanted[ward] = step  # the wards snapshot this boundary too
            self._cond.notify_all()
        self.server.drop_snapshots(self.rank, keep)
        self.server.drop_snapshots(small_id(self.rank), keep)

    def fill(self, pos: Pos, meta: bytes, tensors: list[torch.Tensor], old: FlatState | None) -> FlatState:
        """This rank's snapshot at `pos`: a copy of `tensors`, into `old`'s buffers where they fit,
        in shared memory where this machine gives it."""
        if self.shared and not self.light:
            block = old.shared if old is not None and old.shared is not None and old.shared.fits(tensors, meta) \
                else None
            if block is None:
                try:
                    block = SharedBlock.create(tensors, meta)
                except OSError as exc:
                    log.warning("shard snapshots stay in private memory (buddies on this machine pull copies): "
                                "shared memory could not be reserved: %s", exc)
                    self.shared = False
            if block is not None:
                return FlatState(meta=meta, tensors=block.write(pos, meta, tensors), shared=block)
        private = old if old is not None and old.shared is None else None  # never copy into a shared block here
        return FlatState(meta=meta, tensors=copy_into(private, tensors))

    def reusable(self, step: int) -> FlatState | None:
        """The own snapshot that keeping one of `step` is about to drop, taken back now so its
        buffers can hold the new one: allocating a rank's state afresh every step costs ~20x a
        copy into memory already mapped (page faults). None: allocate."""
        with self._cond:
            if step in self._own or len(self._own) < self.KEEP_OWN:
                return None
            oldest = min(self._own)
        flat = self.server.take_snapshot(self.rank, oldest)
        if flat is not None:
            with self._cond:
                self._own.pop(oldest, None)
        return flat

    def own(self, step: int) -> FlatState | None:
        return self.server.get_snapshot(self.rank, step)

    # ---------------------------------------------------------------- wards' snapshots
    def _id(self, ward: int) -> int:
        return small_id(ward) if self.light else ward

    def set_wards(self, addrs: dict[int, tuple[str, int]], light: bool = False) -> None:
        """Pull these wards' snapshots (from a new generation on: their holders may have
        changed), without their shards if `light`."""
        with self._cond:
            self._epoch += 1
            epoch = self._epoch
            for gone in set(self._held) - set(addrs):
                self._held.pop(gone)
                self.server.drop_snapshots(self._id(gone), set())
            self._blocks = {k: v for k, v in self._blocks.items() if k[0] in addrs}
            self.light = light
            self._addrs = dict(addrs)
            self._wanted = {w: -1 for w in addrs}  # from the next boundary on
            self._pulled.clear()  # a ward's new process may be on another machine, or on this one
            self._failed.clear()
            self._cond.notify_all()
        for ward in addrs:
            selfcost.spawn(self._pull, f"baton-snapshot-pull-{ward}", (ward, epoch))

    def _pull(self, ward: int, epoch: int) -> None:
        with self._cond:
            if self._epoch != epoch or ward not in self._addrs:
                return
            link = SnapshotLink(self._addrs[ward], self.token, timeout=self.timeout_s)
        try:
            self._pull_from(ward, epoch, link)
        finally:
            link.close()

    def _pull_from(self, ward: int, epoch: int, link: SnapshotLink) -> None:
        done = -1
        spare: FlatState | None = None  # the buffers of the copy dropped last: the next pull lands there
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._epoch != epoch or self._wanted.get(ward, -1) > done)
                if self._epoch != epoch:
                    return
                step = self._wanted[ward]
            t0 = time.perf_counter()
            try:
                mapped = self._map(ward, step, link)
                if mapped is None:
                    state, pulled = link.fetch(snapshot_key(self._id(ward), step),
                                               into=spare.tensors if spare is not None else None)
                    spare = None
                    pos = position_of(state)
                else:
                    (pos, state), pulled = mapped, 0
            except (OSError, TransferError) as exc:
                with self._cond:
                    if self._epoch != epoch:
                        return
                    self._failed[ward] = (step, f"rank {ward}'s shard snapshot of step {step} could not be "
                                                f"pulled: {exc}")
                    self._cond.notify_all()
                    done = step  # wait for the next boundary (or a new generation)
                continue
            with self._cond:
                if self._epoch != epoch:
                    return
                self.server.put_snapshot(self._id(ward), step, state)
                held = self._held.setdefault(ward, {})
                held[step] = pos
                for old in [s for s in held if s < step]:  # the older one only once this one is whole
                    del held[old]
                    taken = self.server.take_snapshot(self._id(ward), old)
                    if taken is not None and taken.shared is None:  # never land a pull in a ward's memory
                        spare = taken
                self.server.drop_snapshots(self._id(ward), set(held))
                self._forget_blocks(ward, step, held)
                self._failed.pop(ward, None)
                self.pulled_bytes += pulled
                self.pull_seconds += time.perf_counter() - t0
                self._cond.notify_all()
            done = step

    def _map(self, ward: int, step: int, link: SnapshotLink) -> tuple[Pos, FlatState] | None:
        """The ward's snapshot of `step` mapped from its shared memory, or None where it must be
        pulled (another machine, private memory, `tcp` transport, a light pull)."""
        if not self.shared or self.light or ward in self._pulled:
            return None
        raw = link.ref(snapshot_key(ward, step))
        if raw is None:
            return None
        ref = SharedRef.from_json(raw)
        key = (ward, ref.pid, ref.fd, ref.inode)
        block = self._blocks[key][0] if key in self._blocks else None
        if block is None:
            try:
                block = SharedBlock.attach(ref)
            except (OSError, ValueError) as exc:
                log.info("rank %d's shard snapshots are pulled over TCP: its shared memory cannot be mapped "
                         "here (%s)", ward, exc)
                self._pulled.add(ward)
                return None
            if ward not in self.mapped_wards:
                self.mapped_wards.add(ward)
                log.info("rank %d's shard snapshots are mapped from its shared memory (same machine)", ward)
        got = block.read(step)
        if got is None:
            raise TransferError(f"rank {ward}'s shard snapshot of step {step} was overwritten before it was mapped")
        pos, meta, tensors = got
        with self._cond:
            self._blocks[key] = (block, step)
        return pos, FlatState(meta=meta, tensors=tensors, shared=block)

    def _forget_blocks(self, ward: int, step: int, held: dict[int, Pos]) -> None:
        """Unmap a ward's blocks that hold no snapshot kept here and that its latest
        boundaries did not use (a block its process replaced, or a replaced process's):
        their memory is freed with the last mapping. Under the lock."""
        kept = set()
        for k in held:
            st = self.server.get_snapshot(self._id(ward), k)
            if st is not None and st.shared is not None:
                kept.add(id(st.shared))
        self._blocks = {key: (b, used) for key, (b, used) in self._blocks.items()
                        if key[0] != ward or used >= step - 2 or id(b) in kept}

    def wait_wards(self, step: int, timeout_s: float, cancelled: Callable[[], bool]) -> str | None:
        """Wait until every ward's snapshot of `step` is held here; None, or why not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [w for w in self._addrs if step not in self._held.get(w, {})]
                if not missing:
                    return None
                failed = [self._failed[w][1] for w in missing if self._failed.get(w, (-1, ""))[0] >= step]
                if failed:
                    return failed[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"rank {missing[0]}'s shard snapshot of step {step} did not arrive within {timeout_s:.0f}s"
                if cancelled():
                    return "the generation failed"
                self._cond.wait(min(left, 0.05))

    # ---------------------------------------------------------------- what a recovery needs
    def report(self) -> tuple[list[Pos], dict[int, list[Pos]]]:
        """This rank's own snapshots, and the wards' it holds. A ward's snapshot mapped from its
        shared memory counts only while the block still holds it and its bytes match the
        digest the ward wrote (the ward may have died overwriting it): never a torn copy."""
        with self._cond:
            own = sorted(self._own.values())
            held = {w: dict(h) for w, h in self._held.items() if h}
        out: dict[int, list[Pos]] = {}
        for ward, steps in held.items():
            ok = []
            for step, pos in sorted(steps.items()):
                st = self.server.get_snapshot(self._id(ward), step)
                if st is not None and not _intact(st, step):
                    log.warning("rank %d's snapshot of step %d in its shared memory is no longer whole: not used",
                                ward, step)
                    continue
                ok.append(pos)
            if ok:
                out[ward] = ok
        return own, out

    def copy_at(self, ward: int, pos: Pos) -> FlatState | None:
        """The copy of `ward`'s whole snapshot held here at exactly `pos` (never a light one,
        nor a mapped one its ward has overwritten since), or None."""
        if self.light:
            return None
        st = self.server.get_snapshot(ward, pos[0])
        if st is None or position_of(st) != tuple(pos) or not _intact(st, pos[0]):
            return None
        return st

    def held_bytes(self) -> int:
        return self.server.snapshot_bytes()
