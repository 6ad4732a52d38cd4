"""Unplanned losses on the survivors' side: report where this rank's state is, follow the
orchestrator's plan (rewind, serve, re-form), and load what it says to load.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from baton.control import messages as m
from baton.transfer import FetchStats, TransferError, codec, fetch_state
from baton.transfer.bundles import Bundle, Pos
from baton.worker import rng, shards
from baton.worker.compile_watch import describe
from baton.worker.group import CollectiveFailure
from baton.worker.tracked import reset_scaler_stage
from baton.worker.verify import Divergence

log = logging.getLogger("baton.worker")


class Recovery:
    """Mixed into Runtime: absorbing a lost peer."""

    def recover(self, in_step: bool, error: str,
                unit: tuple[Pos, Any, Bundle | None, Any, bool] | None = None) -> None:
        """Absorb a lost peer: report where this rank's state is, then follow the plan."""
        ctl = self.ctl
        issued = self.group.issued_at
        blocked = round(max(0.0, time.time() - issued), 4) if issued else None
        self.scope = self.tracked.scope = None
        self._reset_ddp()
        self._stop_feed()  # a planned move being fed is called off by the recovery
        self._freeze_hot_feed()  # its records stay for a hot spare taking a lost rank over
        in_use = self.group.paths
        self.group.drop()
        if "timed out" in error.lower():  # a path silent with its link up stalls a collective to its timeout:
            ctl.probe_paths(in_use)  # found by probes, reported before this rank's Recover
        pos = self.pos
        unit_reported = False
        if in_step:
            self._restore_start(self.small)
        if unit is not None:
            pos, small, bundle, rng_state, unit_reported = unit
        while True:
            with ctl.lock:
                ctl.pause_at = ctl.pause_op = None
                known = max(self.group.generation, ctl.newest_abort)
            snaps, held = self.snapshots.report() if self._snapshotting() else ([], {})
            ctl.report(m.Recover(generation=known, pos=pos, in_step=in_step,
                                 unit_reported=unit_reported, error=error[:2000], snapshots=snaps, held=held,
                                 replicas=self.replicas, blocked_s=blocked))
            cmd = self.wait_for(m.Form, m.Abort)
            if isinstance(cmd, m.Abort) or cmd.generation < known:
                continue  # a plan made before the latest restart: the next one follows the report
            target: Pos = tuple(cmd.pos)  # type: ignore[assignment]
            # A boundary function every rank finished before the failure keeps its effects.
            unit_done = unit is not None and unit_reported and target == (pos[0], pos[1] + 1)
            completed = None  # the result of the step this rank abandoned, taken from others
            try:
                if unit is not None and not unit_done:
                    self._restore_unit(unit)
                if cmd.rewind:
                    self._rewind(target)
                elif unit_done:
                    self.pos = target
                    self.at_pos, self.at_pos_rng = self._capture_at(target)
                elif target == pos:
                    self.pos = target
                elif self.capture is not None and target == self.capture.bundle.pos:
                    # Others completed the step this rank abandoned: take their result, but
                    # only once the new generation has formed. Until then this rank's state
                    # stays at `pos`, the boundary it reported: if the sources are lost while
                    # forming, the next plan may go back there, and a rank already holding the
                    # step would run it a second time.
                    completed = self._fetch_completed(cmd, target)
                else:
                    raise RuntimeError(f"cannot reach position {target} from {pos}")
                if cmd.publish:
                    self.publish(cmd.generation, full=False)
                self._clear_abort(cmd.generation)
                self.form(cmd)
                if completed is not None:
                    assert self.capture is not None
                    self._load_replicated(completed)
                    self._apply_bundle(self.capture.bundle.state(), data=False)
                    self.feed.advance()  # as the step's completion would (a seek too would skip a batch)
                    self.pos = target
                    self.at_pos, self.at_pos_rng = self.capture.bundle, self.capture.rng
                if cmd.verify:
                    self.verify_state(cmd.generation, None, defer=self.defer_checks)
            except (CollectiveFailure, dist.DistError, TransferError, OSError) as exc:
                log.warning("recovery into generation %s failed (%s); waiting for the next plan",
                            cmd.generation, exc)
                if "timeout" in str(exc).lower():  # gloo could not connect over a path: a silent one?
                    ctl.probe_paths(tuple(cmd.paths))
                self.group.drop()
                self.pos = pos
                continue
            self.server.retract()
            ctl.report(m.Formed(generation=cmd.generation, pos=self.pos))
            return

    def _fetch_completed(self, cmd: m.Form, target: Pos) -> dict[str, Any]:
        """The others' result of the step this rank abandoned, fetched before the group
        forms (the sources serve it until then)."""
        completed, _ = self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s)
        return completed

    def _restore_start(self, small: Any) -> None:
        """Undo what an abandoned step attempt changed: small state, streams, buffers."""
        self.tracked.restore_small(small)
        for scaler in self.tracked.scalers():
            reset_scaler_stage(scaler)
        if self.at_pos is not None:
            self._apply_bundle(self.at_pos.state(), data=False)

    def _restore_unit(self, unit: tuple[Pos, Any, Bundle | None, Any, bool]) -> None:
        pos, small, bundle, rng_state, _ = unit
        self.tracked.restore_small(small)
        if bundle is not None:
            self._apply_bundle(bundle.state(), data=False)
        self.pos, self.at_pos, self.at_pos_rng = pos, bundle, rng_state

    def _apply_bundle(self, state: dict[str, Any], data: bool = True) -> None:
        if "late" in state and (dropped := self.tracked.drop_late_buffers(state["late"])):
            log.info("unregistered the buffers made after the record this rank goes back to: %s",
                     ", ".join(dropped[:10]))
        rng.restore(state["rng"], self.tracked.generators)
        buffers = {**self.tracked.local_buffers(), **self.tracked.extra_tensors()}
        missing = self.tracked.extras_missing(state.get("buffers", {}))
        if missing:
            raise Divergence(f"rank {self.rank}: {', '.join(missing)} changed for the first time after the "
                             "record it goes back to was taken, so its value there is not known. The job stops "
                             "here: restart it from your own checkpoint.")
        with torch.no_grad():
            for name, value in state.get("buffers", {}).items():
                if name in buffers:
                    buffers[name].copy_(value)
        self.tracked.note_extras_restored(state.get("buffers", {}))
        if self.tracked.local is not None and state.get("local"):
            self.tracked.local.load(state["local"])
        if "modes" in state:
            self.tracked.set_modes(state["modes"])
        if data and state.get("data") is not None:
            self.feed.seek(state["data"])

    def _stand_at(self, target: Pos, generation: int, bundle_state: dict[str, Any]) -> None:
        """Take this rank's own state at `target` from `bundle_state` and stand there: it is
        also the boundary's bundle, the one a move from here hands over."""
        self._apply_bundle(bundle_state)
        self.pos = target
        self.at_pos = Bundle.of(self.rank, target, generation, 0, bundle_state)
        self.at_pos_rng = bundle_state["rng"]

    def _fetch_state(self, sources: list[Any], generation: int, target: Pos,
                     timeout: float | None = None, kind: bytes = b"F",
                     pooled: bool = True) -> tuple[dict[str, Any], FetchStats]:
        """The state `sources` serve for `generation`, checked to be at `target` (`pooled`: into
        the memory mapped ahead where it fits, which one fetch uses: the state the rank keeps)."""
        flat, stats = fetch_state([tuple(s) for s in sources], generation, self.token,
                                  timeout=timeout or self.formation_timeout, kind=kind,
                                  pool=self.ctl.receive_pool if pooled else None)
        state = codec.decode(flat.meta, flat.tensors)
        if tuple(state["pos"]) != tuple(target):
            raise TransferError(f"sources serve position {state['pos']}, expected {list(target)}")
        return state, stats

    def _load_replicated(self, state: dict[str, Any], adopt: bool = False) -> None:
        late = state.get("late_buffers", {})
        added = self.tracked.adopt_late_buffers(late)
        if added:
            log.info("registered the buffers the source's forward made, which this rank's model lacked: %s",
                     ", ".join(added[:10]))
        broke = {key: reason for key, reason in late.get("broke_compile", {}).items() if key in added}
        if broke:
            detail = f"rank {self.rank} cannot take over bit for bit: in the rank it replaces, {describe(broke)}"
            self.ctl.report_now(m.Verified(generation=self.group.generation, pos=self.pos, ok=False,
                                           differing=sorted(broke)[:200], detail=detail))
            raise Divergence(detail)
        self.tracked.load_replicated(state["replicated"], adopt=adopt)
        self.params_step = int(state["pos"][0])
        # DDP's "broadcast buffers before the next forward" flag as the step left it on the
        # sources: this rank restored the value from the start of the step it abandoned
        # (False after an evaluation forward), so it would skip the next broadcast alone.
        from baton.worker.ddp import adopt_state

        for ddp, ddp_state in zip(self.tracked.ddps, state["ddp"]):
            adopt_state(ddp, ddp_state)

    def _reset_ddp(self) -> None:
        """Discard what an interrupted step left in DDP's reducer and FSDP2's blocks."""
        from baton.worker.ddp import reset_after_failure

        for ddp in self.tracked.ddps:
            reset_after_failure(ddp)
        if self.tracked.sharded:
            shards.reset_after_failure(self.tracked)

    def _clear_abort(self, generation: int) -> None:
        with self.ctl.lock:
            if self.ctl.abort_generation is not None and self.ctl.abort_generation <= generation:
                self.ctl.abort_generation = None
            self.ctl.attention = self.ctl.abort_generation is not None
