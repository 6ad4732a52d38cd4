"""Joining: a spare that takes over a rank fetches its state (from the leaver, a replica,
or the buddies holding its shards and bundle), checks its setup matched its predecessor's,
and forms the next generation at the rank's position.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from baton.control import messages as m
from baton.transfer import FetchStats, TransferError
from baton.transfer.bundles import Bundle, Pos, newest
from baton.transfer.codec import tensors_in
from baton.transfer.pool import release_unadopted
from baton.transfer.server import SNAPSHOT, small_id, snapshot_key
from baton.worker import fence, setup_check, shards, verify
from baton.worker.bundle import fetch_ward_bundle
from baton.worker.group import CollectiveFailure
from baton.worker.precopy import load_small_state
from baton.worker.verify import Divergence

log = logging.getLogger("baton.worker")


class Joining:
    """Mixed into Runtime: a spare taking over a rank."""

    def _lift_fence(self) -> None:
        """It holds its rank's place: its script's writes go through again (fence.py), and the
        files its setup wrote go to the orchestrator, for the next successor's fence."""
        written = fence.lift()
        if written:
            self.ctl.report(m.SetupWritten(files=written))

    def setup_waited_for(self) -> float:
        """The part of the joiner's setup (`setup_s`) training waited for: all of it where the
        Form came with the Assign (a recovery), none where the Form came once the joiner was
        ready (a planned move)."""
        form_at = self.ctl.first_form_at
        setup_end = self.assigned_at + self.setup_s
        return max(0.0, setup_end - max(self.assigned_at, form_at)) if form_at else 0.0

    def _join(self) -> None:
        self.setup_s = time.perf_counter() - self.assigned_at
        self.setup_in_pause_s = self.setup_waited_for()
        log.info("the script's setup took %.3fs from this rank's assignment to its step loop", self.setup_s)
        if self.tracked.sharded:  # learns the capture only: no optimizer step, nothing to guard
            t0 = time.perf_counter()
            shards.prepare(self.tracked)
            log.info("shards prepared to be loaded in place in %.3fs", time.perf_counter() - t0)
        log.info("joiner ready for state")
        if self.prefetch is not None:
            self.prefetch.close()
            self.ctl.watch_forms(None)
        form: m.Form | None = None
        while True:
            cmd = form or self.wait_for(m.Form, m.CatchUp)
            form = None
            if isinstance(cmd, m.CatchUp):  # a planned move: follow the leaver until the pause
                form = self._follow(cmd)
                continue
            gen, target = cmd.generation, tuple(cmd.pos)
            try:
                t0 = t_followed = time.perf_counter()
                if self.follower is not None and self.follower.woken_at:  # it came while a step was replayed
                    t0 = min(t0, self.follower.woken_at)
                followed = self._finish_following(cmd) if self.follower is not None else None
                if followed is not None:
                    state, stats, t_followed = followed
                    t_fetched = time.perf_counter()
                    self._load_followed(state, target)  # type: ignore[arg-type]
                else:
                    fetched = self.prefetch.take(cmd) if self.prefetch is not None else None
                    state, stats = fetched if fetched is not None else self._fetch_for(cmd)
                    t_fetched = time.perf_counter()
                    # Received for this load alone (or a hot spare's mirror, stopped): the parameters take it.
                    self._load_replicated(state, adopt=True)
                    if "small" in state:  # a hot spare's: the survivors' schedulers, scalers, settings
                        load_small_state(self.tracked, state["small"])
                    self._release_received(state)
                sharded_expected = state.get("sharded_digest")
                if cmd.snapshot:  # check the load against what arrived (its chunks were checked on the way)
                    sharded_expected = verify.combined(shards.digests(state["sharded"]))
                self._load_sharded(state)
                assert self.loop is not None  # the joiner skipped the resume block: adopt its start
                self.loop = self.loop.model_copy(update={"start_step": int(state["loop_start"])})
                expected = None
                if cmd.full_state or cmd.snapshot:
                    bundle_state, expected = state["bundle"], state.get("digest")
                else:
                    bundle_state = self._lost_bundle(cmd.lost, target)
                self._check_setup(bundle_state.get("setup"))
                self._stand_at(target, gen, bundle_state)  # type: ignore[arg-type]
                self._clear_abort(gen)
                t_loaded = time.perf_counter()
                self.form(cmd)
                t_formed = time.perf_counter()
                self.verify_state(gen, expected, bundle_state=bundle_state, sharded_expected=sharded_expected,
                                  defer=self.defer_checks)
                t_verified = time.perf_counter()
            except (CollectiveFailure, dist.DistError, TransferError, OSError) as exc:
                log.warning("joining generation %s failed (%s); waiting for the next plan", gen, exc)
                self._stop_following()
                self.group.drop()
                continue
            log.info("joined generation %s at %s: %sfetch %.3fs (%d bytes), load %.3fs, form %.3fs, verify %.3fs",
                     gen, self.pos, f"followed the leaver, its last steps {t_followed - t0:.3f}s; " if followed else "",
                     t_fetched - t_followed, stats.bytes, t_loaded - t_fetched, t_formed - t_loaded,
                     t_verified - t_formed)
            phases = {"fetch": round(t_fetched - t_followed, 4), "load": round(t_loaded - t_fetched, 4),
                      "form": round(t_formed - t_loaded, 4), "verify": round(t_verified - t_formed, 4)}
            if followed is not None:
                phases = {"follow": round(t_followed - t0, 4), **phases}
            if self.setup_in_pause_s:
                phases = {"setup": round(self.setup_in_pause_s, 4), **phases}
            self.ctl.report(m.Formed(generation=gen, pos=self.pos, bytes=stats.bytes, seconds=round(stats.seconds, 4),
                                     setup_s=round(self.setup_s, 4), fetch_wait_s=round(t_fetched - t0, 4),
                                     phases=phases, hot_spare=self.hot_use))
            if self.mirror is not None:  # a move that did not need it (a planned one)
                self.mirror.close()
                self.mirror = None
            self.joiner = False
            self._lift_fence()
            return

    def _release_received(self, state: dict[str, Any]) -> None:
        """Received into the receive pool: the pages of what the load copied (the parameters)
        go back to the kernel, those the load kept (an optimizer's moments) stay."""
        pool = self.ctl.receive_pool
        if pool is None or not pool.used:
            return
        freed = release_unadopted(tensors_in(state["replicated"]), tensors_in(self.tracked.replicated()), pool)
        self.ctl.receive_pool = None
        log.info("received into memory mapped ahead; %.1f MB of it the load copied from given back", freed / 2**20)

    def _fetch_for(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats]:
        """The state a joiner's Form says to fetch, from where it says (a hot spare's mirror
        holds the replicated part: only the rest moves)."""
        if self.mirror is not None:
            hot = self._state_from_mirror(cmd)
            if hot is not None:
                return hot
        target = tuple(cmd.pos)
        if cmd.snapshot and cmd.shards_from:  # HSDP: the shards from another replica group
            return self._fetch_from_replica(cmd, target)  # type: ignore[arg-type]
        if cmd.snapshot:  # a lost sharded rank: its buddy's copy of its whole state
            return self._fetch_state(cmd.fetch_from, snapshot_key(self.rank, target[0]), target,  # type: ignore[arg-type]
                                     cmd.formation_timeout_s, kind=SNAPSHOT)
        return self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s)  # type: ignore[arg-type]

    def _fetch_from_replica(self, cmd: m.Form, target: Pos) -> tuple[dict[str, Any], FetchStats]:
        """A lost HSDP rank: its own state from its buddy's copy, its shards from the own
        snapshot of a rank holding the same shards in another replica group."""
        state, stats = self._fetch_state(cmd.fetch_from, snapshot_key(small_id(self.rank), target[0]), target,
                                         cmd.formation_timeout_s, kind=SNAPSHOT)
        errors = []
        for peer, addr in sorted(cmd.shards_from.items()):
            try:
                peer_state, peer_stats = self._fetch_state([addr], snapshot_key(int(peer), target[0]), target,
                                                           cmd.formation_timeout_s, kind=SNAPSHOT)
            except (OSError, TransferError) as exc:
                errors.append(f"rank {peer}: {exc}")
                continue
            state["sharded"] = shards.with_rank_local(peer_state["sharded"], state["bundle"]["buffers"], self.rank)
            log.info("rank %d's shards from rank %d (another replica group), its own buffers from its buddy",
                     self.rank, peer)
            return state, stats.plus(peer_stats)
        raise TransferError(f"no replica of rank {self.rank}'s shards could be fetched: {'; '.join(errors)}")

    def _load_sharded(self, state: dict[str, Any], owned: bool = True) -> None:
        if not self.tracked.sharded:
            return
        if "sharded" not in state:
            raise Divergence(f"rank {self.rank}'s FSDP2 shards did not come with its state: only its "
                             "predecessor (or a copy of it) holds them (a baton bug; please report it)")
        self.loading = True  # the DCP helper may step a fresh optimizer once (lr 0) to create its state
        try:
            in_place = shards.load(self.tracked, state["sharded"], owned=owned)
            log.info("shards loaded: %s in place, %s through the DCP helpers", in_place or "none",
                     sorted(self.tracked.sharded - set(in_place)) or "none")
        finally:
            self.loading = False

    def _lost_bundle(self, lost: m.LostRank | None, target: Pos) -> dict[str, Any]:
        state = self._lost_record(lost, target)
        # The data position follows from the step; the epoch record only if it is this epoch's.
        here = self.feed.position_at(target[0])
        if here is not None:
            record = (state.get("data") or {}).get("record")
            if record is not None and record.get("epoch") == here["epoch"]:
                here["record"] = record
            else:
                here["record"] = None
            state["data"] = here
        return state

    def _lost_record(self, lost: m.LostRank | None, target: Pos) -> dict[str, Any]:
        """The lost rank's own record of `target` as it sent it (its held bundle, its buddies'
        frames): nothing of this process's setup read, so any thread may ask for it."""
        candidates: list[Bundle | None] = []
        if lost is not None and lost.held is not None:
            candidates.append(Bundle.from_text(lost.held.model_dump()))
        for buddy in (lost.buddies if lost is not None else []):
            try:
                candidates.append(fetch_ward_bundle(tuple(buddy), self.token, self.rank, target))
            except (OSError, TransferError) as exc:
                log.warning("could not read rank %d's bundle from %s: %s", self.rank, buddy, exc)
        best = newest(candidates, target)
        if best is None:
            raise TransferError(f"no record of rank {self.rank}'s own state at {target}")
        return best.state()

    def _check_setup(self, theirs: dict[str, int] | None) -> None:
        """A joiner: stop loudly if its setup built other data or drew other numbers than its
        predecessor's did before the step loop (setup_check)."""
        differing = setup_check.differences(self.setup, theirs) if theirs else []
        if differing:
            detail = setup_check.explain(self.rank, differing)
            self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                           differing=[f"setup.{n}" for n in differing][:200], detail=detail))
            raise Divergence(detail)

    def _lineage_broken(self) -> None:
        """Stop the job loudly: this rank's parameters are not at the step it is about to run."""
        detail = (f"rank {self.rank}'s parameters hold the updates of {self.params_step} steps but it is about to "
                  f"run step {self.pos[0]}: a step would be applied twice or skipped (a baton bug; please "
                  "report it with this job's run directory)")
        self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                       differing=["step count"], detail=detail))
        raise Divergence(detail)
