"""Shard redundancy: a sharded (FSDP2) rank's state exists nowhere else, so it copies it
to host memory at each boundary for its buddies, and commits no step before they hold it.
"""

from __future__ import annotations

import logging
from typing import Any

from baton import selfcost
from baton.transfer import codec
from baton.transfer.bundles import Pos
from baton.transfer.protocol import FlatState
from baton.worker import shards
from baton.worker.group import CollectiveFailure
from baton.worker.snapshots import position_of

log = logging.getLogger("baton.worker")


class ShardRedundancy:
    """Mixed into Runtime: shard snapshots for `--redundancy`."""

    def _snapshotting(self) -> bool:
        """Whether this rank keeps shard snapshots for redundancy (a sharded job with buddies)."""
        return bool(self.tracked.sharded) and bool(self.wards)

    @selfcost.counted
    def _snapshot(self) -> None:
        """This rank's whole state at the boundary, copied to host memory for its buddies."""
        state = self._state(full=True, digest=False, encoded=True)
        meta, tensors = codec.encode(state)
        small = None
        if self.replicas:  # HSDP: buddies pull the state without the shards (another replica group has those)
            small_meta, small_tensors = codec.encode({k: v for k, v in state.items() if k != "sharded"})
            small = FlatState(meta=small_meta, tensors=[t.clone() for t in small_tensors])
        old = self.snapshots.reusable(self.pos[0])
        self.snapshots.keep(self.pos, self.snapshots.fill(self.pos, meta, tensors, old), small)
        self.ctl.heartbeat["snapshot_mb"] = round(self.snapshots.held_bytes() / 2**20, 2)

    @selfcost.counted
    def _before_optimizer_step(self, *_: Any) -> None:
        """No rank commits a step before its buddy holds its snapshot of the step's start."""
        if self.loading or self.scope != "step":
            return

        def cancelled() -> bool:
            return self.group.failed.is_set() or self.ctl.abort_generation is not None

        why = self.snapshots.wait_wards(self.pos[0], self.op_timeout, cancelled)
        if why is not None:
            err = CollectiveFailure(f"{why} (peer lost)")
            self.group.note_failure(err)
            raise err

    def _rewind(self, target: Pos) -> None:
        """Go back to this rank's own snapshot at `target` (a lost rank's buddy holds only that one)."""
        flat = self.snapshots.own(target[0])
        if flat is None or position_of(flat) != tuple(target):
            raise RuntimeError(f"rank {self.rank} holds no snapshot of its state at {target}")
        # The snapshot must stay as it is for as long as another failure could need it, and
        # loading may alias state to the tensors it is given: the shards are copied into the
        # live ones (or cloned where the helpers must load them), the rest is cloned here.
        state = codec.decode(flat.meta, list(flat.tensors))
        state = {k: v if k == "sharded" else shards.cloned(v) for k, v in state.items()}
        self._load_replicated(state)
        self._load_sharded(state, owned=False)
        self._stand_at(target, self.group.generation, state["bundle"])
