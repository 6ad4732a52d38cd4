"""Hot spares (`baton run --hot-spares`): one rank feeds the spares its replicated state and
then each step's gradients, and every warm spare keeps a mirror of that state current
(baton.worker.hot). A lost rank's replacement then takes only its own state and the small
state from the survivors.

The feed starts once every rank is in its step loop and starts afresh after every
operation (a recovery stops the ranks' feeds where they were; a move may take the feeder
away): a new feed id, a new base, each spare following it. A spare whose mirror cannot keep
up, or cannot follow at all (an optimizer outside torch.optim, parameters changed outside
the optimizer), stays an ordinary spare until the next operation, and status says why.
"""

from __future__ import annotations

import logging

from baton.control import messages as m
from baton.control.state import Worker, WorkerRole

log = logging.getLogger("baton.orchestrator")

# A spare told to follow a feed older than this many steps would find the records it needs
# gone (the feeder keeps 64 records, two a step: worker/precopy.KEEP_RECORDS): a new feed instead.
HOT_RECORDS_STEPS = 24


class HotSpareFeeds:
    """Mixed into the Orchestrator; runs under its decision lock."""

    _hot_op = 0  # the current feed's id (0: none yet)
    _hot_feeder: str | None = None  # the worker feeding it
    _hot_stopped = False  # every spare gave up on the current feed: none until the next operation
    _hot_base_dropped = False  # the current feed's base is freed: a spare that comes later needs a new feed
    _hot_since = 0  # the step the current feed began at
    _hot_told: dict[str, int]  # spare -> the feed it was told to follow
    _hot: dict[str, m.HotState]  # spare -> its latest word on the current feed

    def _init_hot(self) -> None:
        self._hot_told, self._hot = {}, {}

    def _hot_wanted(self) -> bool:
        loop = self.loop
        return (self.config.hot_spares and self.exit_code is None and not self._training_done
                and self.training_since is not None and loop is not None and not loop.sharded
                and self.config.world_size > 1)

    def _refresh_hot_spares(self) -> None:
        """Keep a feed running and every ready spare following it (between operations)."""
        if not self._hot_wanted() or self.op is not None:
            return
        feeder = self.workers.get(self._hot_feeder or "")
        if feeder is None or feeder.role != WorkerRole.RANK or feeder.rank is None:
            if not self._start_hot_feed():
                return
            feeder = self.workers[self._hot_feeder or ""]
        if self._hot_stopped:
            return
        late = [s for s in self._ready_spares() if self._hot_told.get(s.id) != self._hot_op]
        # A spare that comes later needs the base, and every record since: a new feed (a new base copy)
        # once the base is freed or the feeder keeps no longer all the records since it.
        if late and (self._hot_base_dropped or self._steps_now() - self._hot_since > HOT_RECORDS_STEPS):
            self._post(feeder.id, m.HotFeed(op=self._hot_op, stop=True))
            if not self._start_hot_feed():
                return
            feeder = self.workers[self._hot_feeder or ""]
        for spare in self._ready_spares():
            if self._hot_told.get(spare.id) != self._hot_op:
                self._hot_told[spare.id] = self._hot_op
                self._post(spare.id, m.Follow(op=self._hot_op, source=feeder.transfer_addr, feeder=feeder.rank))

    def _start_hot_feed(self) -> bool:
        healthy = [r for r, info in sorted(self.ranks.items())
                   if info.worker and self.workers[info.worker].role == WorkerRole.RANK
                   and self.slots[self.workers[info.worker].slot].healthy]
        if not healthy:
            return False
        self._hot_op += 1
        self._hot_feeder = self.ranks[healthy[0]].worker
        self._hot, self._hot_stopped, self._hot_base_dropped = {}, False, False
        self._hot_since = self._steps_now()
        assert self._hot_feeder
        self._post(self._hot_feeder, m.HotFeed(op=self._hot_op))
        self._emit("hot-feed", {"op": self._hot_op, "rank": healthy[0], "worker": self._hot_feeder})
        return True

    def _hot_after_op(self) -> None:
        """An operation ended: the next feed starts from the new generation (its old feeder,
        if still a rank, stops serving the old one)."""
        if not self.config.hot_spares:
            return
        old = self.workers.get(self._hot_feeder or "")
        if old is not None and old.role == WorkerRole.RANK:
            self._post(old.id, m.HotFeed(op=self._hot_op, stop=True))
        self._hot_feeder = None
        self._refresh_hot_spares()

    def _on_hot_state(self, w: Worker, rep: m.HotState) -> None:
        if rep.op != self._hot_op or w.role != WorkerRole.SPARE:
            return
        self._hot[w.id] = rep
        told = [wid for wid, op in self._hot_told.items() if op == self._hot_op and wid in self.workers
                and self.workers[wid].role == WorkerRole.SPARE]
        feeder = self.workers.get(self._hot_feeder or "")
        if not self._hot_base_dropped and all(wid in self._hot for wid in told) and feeder is not None \
                and feeder.role == WorkerRole.RANK:
            self._hot_base_dropped = True  # every spare told has it (or gave up): the feeder frees its copy
            self._post(feeder.id, m.HotFeed(op=self._hot_op, drop_base=True))
        if rep.ok and rep.replay_s > 0:  # keeping pace: what it took and takes (bench/overhead.py reads it)
            self._emit("hot-spare", {"worker": w.id, "feeder_rank": self.workers[self._hot_feeder or ""].rank
                                     if self._hot_feeder in self.workers else None,
                                     "since_step": rep.pos[0], "base_bytes": rep.base_bytes,
                                     "base_s": rep.base_s, "replay_s": rep.replay_s,
                                     "bytes_per_step": rep.bytes_per_step})
        if not rep.ok:
            self._emit("note", {"message": f"spare {w.id} cannot mirror the replicated state ({rep.detail}): an "
                                           "ordinary spare until the next feed"})
            following = [s for s in self._ready_spares()
                         if self._hot_told.get(s.id) == self._hot_op and (s.id not in self._hot or self._hot[s.id].ok)]
            feeder = self.workers.get(self._hot_feeder or "")
            if not following and feeder is not None and feeder.role == WorkerRole.RANK:
                self._post(feeder.id, m.HotFeed(op=self._hot_op, stop=True))  # nobody left to feed
                self._hot_stopped = True

    def _steps_now(self) -> int:
        return min((info.step for info in self.ranks.values()), default=0)

    def _hot_current(self, w: Worker) -> bool:
        rep = self._hot.get(w.id)
        return rep is not None and rep.ok and rep.op == self._hot_op and rep.replay_s > 0

    def _hot_first(self, spares: list[Worker]) -> list[Worker]:
        """The spares a lost rank goes to, those with a current mirror first."""
        return sorted(spares, key=lambda w: not self._hot_current(w))

    def _hot_view(self, w: Worker) -> dict[str, object]:
        """A spare's mirror, for status."""
        if not self.config.hot_spares:
            return {}
        if self.loop is not None and self.loop.sharded:
            return {"hot": {"state": "ordinary", "detail": "an FSDP2 job: each rank's shards are its own (its buddies "
                                                           "hold their copies), no replicated state to mirror"}}
        if self.config.world_size < 2:
            return {"hot": {"state": "ordinary", "detail": "one rank: no survivor to rebuild it from"}}
        rep = self._hot.get(w.id)
        if rep is None:
            told = self._hot_op and self._hot_told.get(w.id) == self._hot_op and not self._hot_stopped
            return {"hot": {"state": "taking its base" if told else "not following"}}
        if not rep.ok:
            return {"hot": {"state": "ordinary", "detail": rep.detail}}
        return {"hot": {"state": "current" if self._hot_current(w) else "following", "since_step": rep.pos[0],
                        "base_mb": round(rep.base_bytes / 2**20, 2), "replay_s": rep.replay_s}}
