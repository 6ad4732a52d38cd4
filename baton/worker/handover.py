"""Planned hand-over: a rank pauses at the agreed boundary, serves its full state, and
either leaves (the leaver) or forms the next generation with its successor (everyone else).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from baton.control import messages as m
from baton.transfer import TransferError, codec
from baton.transfer.protocol import FlatState
from baton.transfer.server import FETCH, FETCH_OWN, STAGED
from baton.worker import shards, verify
from baton.worker.exit import exit_quietly
from baton.worker.group import CollectiveFailure

log = logging.getLogger("baton.worker")


class PlannedHandover:
    """Mixed into Runtime: pausing, serving and leaving at a planned move."""

    def _paused(self, op: int | None) -> None:
        ctl = self.ctl
        self._check_no_stray_draws("before step")
        ctl.report(m.Paused(op=op or 0, pos=self.pos))
        log.info("paused at %s", self.pos)
        with ctl.lock:
            leaving = ctl.pause_leave
        # The leaver readies what it serves while the others reach the boundary: its joiner's
        # fetch then finds it there (the state and its encoding: 0.02-0.05 s at 1 GB, dev machine).
        if leaving:
            self.publish(STAGED, full=True)
        lost_peer = self._paused_loop(staged=leaving)
        if leaving:  # not handed over: nothing staged (or served) stays
            self.server.retract()
        if lost_peer:
            self.recover(in_step=False, error="peer lost during a planned move")

    def _paused_loop(self, staged: bool) -> bool:
        """Until this rank forms the next generation or leaves (False), or a peer is lost (True).
        `staged`: what it serves was published as STAGED at this pause (a Publish promotes it)."""
        ctl = self.ctl
        while True:
            with ctl.lock:
                if ctl.abort_generation is not None:
                    return True
                if ctl.pause_at is not None and ctl.pause_at > self.pos[0]:
                    return False  # re-targeted later: keep stepping
            cmd = ctl.wait_command(0.05)
            if cmd is None:
                continue
            if isinstance(cmd, m.Form):
                try:
                    self.form(cmd)
                    if cmd.verify:
                        self.verify_state(cmd.generation, None, defer=self.defer_checks)
                except (CollectiveFailure, dist.DistError, TransferError) as exc:
                    log.warning("forming generation %s failed (%s)", cmd.generation, exc)
                    return True
                with ctl.lock:
                    ctl.pause_at = ctl.pause_op = None
                    ctl.attention = ctl.abort_generation is not None
                ctl.report(m.Formed(generation=cmd.generation, pos=self.pos))
                return False
            if isinstance(cmd, m.Publish):
                if staged and tuple(cmd.pos) == tuple(self.pos):  # paused: the position it was staged at
                    self.server.promote(cmd.generation)
                    log.info("published generation %s (readied at the pause)", cmd.generation)
                else:
                    self.publish(cmd.generation, full=True)
                if cmd.leave and not self._leave():
                    self.server.retract()
                    return True  # superseded by a failure elsewhere: stay, as a survivor
            if isinstance(cmd, m.Abort):
                return True

    def _leave(self) -> bool:
        ctl = self.ctl
        while True:
            cmd = ctl.wait_command(0.5)
            if isinstance(cmd, (m.Release, m.Stop)):
                break
            with ctl.lock:
                if ctl.abort_generation is not None:
                    return False
        ctl.report(m.Left())
        ctl.flush()
        self.pusher.close()
        exit_quietly(0)
        return True  # pragma: no cover

    def publish(self, generation: int, full: bool) -> None:
        t0 = time.perf_counter()
        state = self._state(full)
        t_state = time.perf_counter()
        for kind, part in self._served_parts(state).items():
            meta, tensors = codec.encode(part)
            self.server.publish(generation, FlatState(meta=meta, tensors=tensors), kind)
            log.info("published generation %s (full=%s, %s): %d tensors (state %.3fs, then %.3fs)", generation,
                     full, kind.decode(), len(tensors), t_state - t0, time.perf_counter() - t_state)

    def _served_parts(self, state: dict[str, Any]) -> dict[bytes, dict[str, Any]]:
        """What this rank serves, by request kind, in the order published (a pre-copied
        move's joiner takes only the first)."""
        if self.pre_copy is not None:
            return {FETCH_OWN: self._feed_parts(state), FETCH: state}
        if self.hot_spares:  # a hot spare takes only the rest: the rank's own state (a move's) and the small
            return {FETCH_OWN: self._hot_part(state), FETCH: state}
        return {FETCH: state}

    def _state(self, full: bool, digest: bool = True, encoded: bool = False) -> dict[str, Any]:
        """What this rank serves: its replicated state, and with `full` its own and its shards
        (with `encoded`, already encoded: a snapshot's, without digests)."""
        from baton.worker.ddp import export_state

        assert self.loop is not None
        state: dict[str, Any] = {"replicated": self.tracked.replicated(), "pos": list(self.pos),
                                 "ddp": [export_state(d) for d in self.tracked.ddps],
                                 "loop_start": self.loop.start_step,
                                 "late_buffers": self.tracked.late_buffers(copy=not encoded)}
        if full:
            assert self.at_pos is not None
            bundle_state = self.at_pos.state()
            state["bundle"] = bundle_state
            if self.tracked.sharded:  # this rank's FSDP2 shards exist nowhere else
                state["sharded"] = shards.capture(self.tracked, encoded=encoded)
                if digest:
                    state["sharded_digest"] = verify.combined(shards.digests(state["sharded"]))
            if self.world_size == 1 and digest:
                # No replica to compare the joiner with: it checks against this digest instead
                # (a pass over the whole state, so only here: with replicas, the joiner's
                # replicated state is compared with theirs and its own with the bundle).
                state["digest"] = verify.combined({**self._replicated_digests(state["replicated"]),
                                                   **self._local_digests(bundle_state)})
        return state
