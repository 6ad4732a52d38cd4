"""Forming a generation and checking its state: after every move the ranks compare digests
of their replicated state, and the joiner its own state with what its predecessor held.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch

from baton.control import messages as m
from baton.transfer import codec
from baton.transfer.protocol import FlatState
from baton.worker import module_state, shards, verify
from baton.worker.snapshots import position_of
from baton.worker.verify import Divergence

log = logging.getLogger("baton.worker")


class StateCheck:
    """Mixed into Runtime: forming and the state check after a move."""

    def form(self, cmd: m.Form) -> None:
        generation = cmd.generation
        self.drop_pending_check()

        def superseded() -> bool:
            with self.ctl.lock:
                return self.ctl.abort_generation is not None and self.ctl.abort_generation > generation

        self.ctl.path_peers = [dict(p) for p in cmd.path_peers]  # before: a formation that fails probes them
        self.group.form(self.store, generation, self.op_timeout, cmd.formation_timeout_s or self.formation_timeout,
                        superseded, paths=tuple(cmd.paths))
        self.pusher.set_buddies([tuple(b) for b in cmd.buddies])
        self.ward_addrs = {int(w): (str(a[0]), int(a[1])) for w, a in cmd.wards.items()}
        if self._snapshotting():
            self.snapshots.set_wards(self.ward_addrs, light=bool(self.replicas))

    def _replicated_digests(self, replicated: dict[str, Any],
                            later: list[tuple[str, torch.Tensor]] | None = None) -> dict[str, int]:
        """Digests of what every replica holds (BatchNorm-style buffers are each rank's own);
        with `later`, the large tensors are listed there instead (verify.entries)."""
        out = verify.entries(replicated, later=later)
        local = self.tracked.local_buffers()
        for name in local:
            out.pop(name, None)
        if later is not None:
            later[:] = [(name, t) for name, t in later if name not in local]
        return out

    @staticmethod
    def _local_digests(bundle_state: dict[str, Any]) -> dict[str, int]:
        """Digests of a rank's own state (the data position is a function of the step; the
        non-persistent buffers' digests are compared on their own, see module_state)."""
        return verify.entries({k: v for k, v in bundle_state.items() if k not in ("data", "volatile")},
                              "rank-local")

    def _copy_slots(self) -> int:
        """How many (ward, digest) pairs each rank sends in the state check: the same on every
        rank (an allgather's tensors must agree), two per buddy a rank is meant to have."""
        return 2 * self.redundancy if self.tracked.sharded and not self.replicas else 0

    def _copy_digests(self) -> list[tuple[int, int]]:
        """(ward, digest of its shards) for each copy of a ward's snapshot held here at this
        very boundary: after a recovery, every rank's shards can be compared with a copy that
        another process made of them (shards differ across FSDP ranks, so no replica can)."""
        if not self._snapshotting() or self.replicas:
            return []
        out = []
        for ward in sorted(self.wards)[:self._copy_slots()]:
            flat = self.snapshots.copy_at(ward, self.pos)
            if flat is not None:
                out.append((ward, _shards_digest(flat)))
        return out

    def _own_snapshot_digest(self) -> int | None:
        """The digest of this rank's shards in its own snapshot of this very boundary, where no
        buddy's copy of it can be compared yet (pure FSDP: the buddy pulls it while the step
        runs, and a failure can come first): after going back to the boundary, the live
        shards must still be what was snapshotted there. None: no such snapshot (a joiner's,
        HSDP's, none taken at this position)."""
        if self.joiner or self.replicas or not self._snapshotting():
            return None
        flat = self.snapshots.own(self.pos[0])
        if flat is None or position_of(flat) != tuple(self.pos):
            return None
        return _shards_digest(flat)

    def verify_state(self, generation: int, expected: int | None, periodic: bool = False,
                     bundle_state: dict[str, Any] | None = None, sharded_expected: int | None = None,
                     defer: bool = False) -> None:
        """Replicas agree on replicated state; a joiner holds exactly what it was sent.
        Every rank of a new generation runs it at the same boundary (a joiner as it joins), so
        it stands for the periodic check there: a rank that ran it again alone would wait
        in a collective the others never enter.

        With `defer` (a move's check in a job with no FSDP2 shards), the pass over the whole
        replicated state runs on a thread while the next step's forward and backward do, and
        the comparison waits for the step's first optimizer step (or the next boundary
        function, or the loop's end): the move's pause no longer holds a second pass over
        the state, and nothing is committed, saved or finished before the check has passed.
        What the next step changes before its commit (random streams, buffers) is read now."""
        self.verified_at = self.pos
        live = self._capture_at(self.pos)[0].state() if expected is not None or bundle_state is not None else None
        if defer and not self.tracked.sharded and not periodic:
            later: list[tuple[str, torch.Tensor]] = []
            now = self._replicated_digests(self.tracked.replicated(), later)
            self.pending_check = PendingCheck(generation, self.pos, dict(expected=expected, bundle_state=bundle_state,
                                                                         live=live), now, later)
            log.info("state check of generation %s at %s: %d large tensors digested beside the next step",
                     generation, self.pos, len(later))
            return
        self._compare(generation, self._replicated_digests(self.tracked.replicated()), periodic, expected,
                      bundle_state, live, sharded_expected)

    def finish_pending_check(self) -> None:
        """Compare the digests a deferred check computed (see verify_state): on every rank at
        the same point, before anything the check covers is committed."""
        pending, self.pending_check = self.pending_check, None
        if pending is None:
            return
        t0 = time.perf_counter()
        digests = pending.digests()
        waited = time.perf_counter() - t0
        self._compare(pending.generation, digests, False, **pending.args, started=t0)
        log.info("state check of generation %s at %s, deferred: digests %.3fs on a thread (%.3fs waited for), "
                 "compared %.3fs", pending.generation, pending.pos, pending.seconds, waited,
                 time.perf_counter() - t0 - waited)

    def drop_pending_check(self) -> None:
        """A new generation forms: a deferred check of the old one is moot (it could not run
        its collective), and every rank of the new one drops it alike."""
        pending, self.pending_check = self.pending_check, None
        if pending is not None:
            pending.digests()  # its thread reads the state: let it finish before the state changes
            log.info("state check of generation %s at %s, deferred: dropped uncompared, a new generation forms",
                     pending.generation, pending.pos)

    def _compare(self, generation: int, digests: dict[str, int], periodic: bool, expected: int | None,
                 bundle_state: dict[str, Any] | None, live: dict[str, Any] | None,
                 sharded_expected: int | None = None, started: float | None = None) -> None:
        """The comparison (`started`: when a deferred check's step began waiting for it)."""
        mine = verify.combined(digests)
        # HSDP: every replica group holds the same shards, so those must agree too (not the
        # sharded models' buffers: each rank's are its own).
        shard_digests = shards.digests(shards.without_rank_local(self.tracked, shards.capture(self.tracked))) \
            if self.replicas else {}
        copies = self._copy_digests() if not periodic else []
        t = torch.tensor([verify.to_signed(mine), verify.to_signed(verify.combined(shard_digests)),
                          *[x for ward, digest in copies for x in (ward, verify.to_signed(digest))]]
                         + [-1, 0] * (self._copy_slots() - len(copies)), dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self.group.internal():
            self._wait_internal(self.group.allgather([out], [t]), "the state check")
        rows = [x.tolist() for x in out]
        values = [row[0] for row in rows]
        differing: list[str] = []
        detail = ""
        holders = [(q, row[i + 1]) for q, row in enumerate(rows) for i in range(2, len(row), 2) if row[i] == self.rank]
        own_copy = None if holders or periodic else self._own_snapshot_digest()
        # This rank's shards, digested once for the checks below that need them (a pass over them all).
        live_shards = verify.combined(shards.digests(shards.capture(self.tracked))) \
            if holders or sharded_expected is not None or own_copy is not None else None
        if own_copy is not None and own_copy != live_shards:
            differing.append("sharded (own snapshot)")
            detail = (f"rank {self.rank}'s FSDP2 shards differ from its own snapshot of step {self.pos[0]}'s "
                      "boundary, taken before the failure (no buddy held a copy of it yet)")
        if holders:  # pure FSDP: this rank's shards against its buddies' copies of its snapshot here
            apart = [q for q, digest in holders if digest != verify.to_signed(live_shards)]
            if apart:
                differing.append("sharded (buddy copies)")
                detail = (f"rank {self.rank}'s FSDP2 shards differ from the copy of its snapshot at step {self.pos[0]} "
                          f"that rank(s) {apart} hold")
        if self.replicas:
            sharded = [row[1] for row in rows]
            apart = [p for p in self.replicas if sharded[p] != sharded[self.rank]]
            if apart:
                differing.append("sharded (replica groups)")
                detail = (f"rank {self.rank}'s FSDP2 shards differ from those of rank(s) {apart}, which hold the "
                          "same shards in other replica groups")
        if len(set(values)) > 1:
            key = f"baton/gen{generation}/verify/{self.pos[0]}/{self.pos[1]}"
            deadline = time.monotonic() + self.formation_timeout
            self.store.call(lambda s: s.set(f"{key}/{self.rank}", json.dumps(digests)), deadline)
            majority = max(set(values), key=values.count)
            ref = values.index(majority)
            theirs = json.loads(self.store.call(lambda s: s.get(f"{key}/{ref}"), deadline))
            differing += verify.differing(digests, {k: int(v) for k, v in theirs.items()})
            bad = [r for r, v in enumerate(values) if v != majority]
            detail += ("; " if detail else "") + f"replicated state differs on ranks {bad} (compared with rank {ref})"
        if live is not None:
            if expected is not None:
                if verify.combined({**digests, **self._local_digests(live)}) != expected:
                    detail += ("; " if detail else "") + "the joiner's state differs from what its predecessor sent"
                    differing.append("joiner")
            elif bundle_state is not None:
                diff = verify.differing(self._local_digests(live), self._local_digests(bundle_state))
                if diff:
                    differing += diff
                    detail += ("; " if detail else "") + "the joiner's own state differs from its record"
            if bundle_state is not None:
                volatile = module_state.differing_buffers(live["volatile"], bundle_state.get("volatile", {}))
                if volatile:
                    differing += [f"rank-local.volatile.{name}" for name in volatile]
                    detail += ("; " if detail else "") + module_state.differing_volatile(volatile)
        if sharded_expected is not None and live_shards != sharded_expected:
            differing.append("sharded")
            detail += ("; " if detail else "") + "the joiner's FSDP2 shards differ from what its predecessor sent"
        ok = not differing
        if ok and periodic:
            return
        after = None if started is None else round(time.perf_counter() - started, 4)
        self.ctl.report_now(m.Verified(generation=generation, pos=self.pos, ok=ok, differing=differing[:200],
                                       detail=detail, after_resume_s=after))
        if not ok:
            raise Divergence(f"state check failed at step {self.pos[0]}: {detail}: {', '.join(differing[:20])}")


class PendingCheck:
    """A move's state check whose pass over the large tensors of the replicated state runs on a
    thread (xxhash lets go of the GIL) while training goes on. Everything else was digested
    at the boundary (what a step may change before its commit: random streams, buffers,
    small values), and the step's first optimizer step waits for the rest."""

    def __init__(self, generation: int, pos: tuple[int, int], args: dict[str, Any], now: dict[str, int],
                 later: list[tuple[str, torch.Tensor]]):
        self.generation, self.pos, self.args = generation, pos, args
        self.seconds = 0.0
        self._digests = now
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(later,), name="baton-state-check", daemon=True)
        self._thread.start()

    def _run(self, later: list[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        try:
            for name, t in later:
                self._digests[name] = verify.tensor_digest(t)
        except BaseException as exc:  # noqa: BLE001 - raised again on the training thread
            self._error = exc
        self.seconds = time.perf_counter() - t0

    def digests(self) -> dict[str, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digests


def _shards_digest(snapshot: FlatState) -> int:
    """The digest of the FSDP2 shards a snapshot holds, comparable with the live shards'."""
    return verify.combined(shards.digests(codec.decode(snapshot.meta, list(snapshot.tensors))["sharded"]))
