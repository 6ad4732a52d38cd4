"""Hot spares (`baton run --hot-spares`): a spare keeps a mirror of the replicated state
current at every step, so that when a rank is lost, only that rank's own state (random
streams, data position, buffers) and the small state (schedulers, scalers) move.

One rank, the feeder, serves what a pre-copied planned move's leaver serves (precopy.Feed):
its replicated state at one boundary, then each optimizer step's gradients and settings and
each step's small state. A spare waiting for a rank builds the mirror from that without the
script (it has no rank yet, and a script's setup depends on its rank): the models' tensors,
and for each optimizer a torch.optim optimizer of the same class over them, which it steps
with the feeder's gradients on a thread. On the same device type that is the feeder's own
arithmetic, so the mirror follows it bit for bit; what it cannot follow (an optimizer outside
torch.optim, a tensor changed by something other than the optimizer) is refused with the
reason and the spare stays an ordinary one.

When the spare takes a lost rank over, the script's setup runs as usual; its state comes from
the mirror brought to the recovery's boundary and, from the survivors, the small rest that
they publish apart (FETCH_OWN). If the mirror cannot be at that boundary (the feeder was the
rank lost before its last records were taken, or a boundary function ran there), the spare
fetches the whole state as any spare would; the ledger says which happened and why. The
state check after the recovery compares the joiner's replicated state with the others'.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from baton.control import messages as m
from baton.transfer import FetchStats, TransferError
from baton.transfer.server import FETCH_OWN, hot_ids
from baton.worker import discover
from baton.worker.precopy import (KEEP_UP_STEPS, Feed, Follower, _cannot_keep_up, replay_optimizer_step,
                                  replayed_grads, served_apart, small_state)
from baton.worker.tracked import _BATON_OWNED

if TYPE_CHECKING:
    from baton.worker.tracked import Tracked

log = logging.getLogger("baton.worker")

# How long a recovery waits for the mirror's next step before it fetches the whole state
# instead: the records it lacks were served before the survivors got there, unless their
# feeder is the rank lost or hung (then they never come).
MIRROR_WAIT_S = 2.0


def mirror_plan(tracked: "Tracked") -> dict[str, Any]:
    """How a spare rebuilds the optimizers over the models' tensors, without the script: for
    each optimizer its class and, per group, the (model, state_dict key) of each parameter;
    the keys that name a tensor another key names too (tied weights); or why it cannot."""
    where: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[str, str]] = {}
    aliases: dict[str, dict[str, str]] = {}
    for name, obj in tracked.objects.items():
        if name in tracked.sharded or not isinstance(obj, torch.nn.Module):
            continue
        for key, t in obj.state_dict().items():
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            ident = (t.data_ptr(), tuple(t.shape), t.dtype)
            if ident in where:
                aliases.setdefault(name, {})[key] = where[ident][1]
            else:
                where[ident] = (name, key)
    optimizers = []
    for name, obj in tracked.objects.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        cls = type(obj)
        path = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.__module__.startswith("torch.optim."):
            return {"refused": f"optimizer {name!r} is a {path}: a hot spare steps its mirror without the script, "
                               "with torch.optim's optimizers only"}
        groups = []
        for group in obj.param_groups:
            refs = []
            for p in group["params"]:
                ref = where.get((p.data_ptr(), tuple(p.shape), p.dtype))
                if ref is None:
                    return {"refused": f"optimizer {name!r} steps a tensor ({tuple(p.shape)}) outside the tracked "
                                       "models' state: a hot spare could not mirror it"}
                refs.append(list(ref))
            groups.append(refs)
        optimizers.append({"name": name, "cls": path, "groups": groups})
    return {"refused": "", "optimizers": optimizers, "aliases": aliases}


def _optimizer_class(path: str) -> type:
    module, _, qualname = path.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{path} is not a torch optimizer")
    return cls


class Mirror:
    """A spare's mirror of the replicated state the feeder serves, kept current on a thread."""

    def __init__(self, cmd: m.Follow, token: str, timeout: float, report: Callable[[m.HotState], None]):
        self.op, self.feeder = cmd.op, cmd.feeder
        self.follower = Follower(tuple(cmd.source), token, cmd.feeder, timeout, op=cmd.op,  # type: ignore[arg-type]
                                 ids=hot_ids(cmd.feeder))
        self._report = report
        self.pos: tuple[int, int] = (0, 0)
        self.dirty = False  # an optimizer step of the step at `pos` applied, its step end not yet
        self.failed = ""  # the mirror is wrong or incomplete: never taken
        self.ended = ""  # no more records will come: the mirror stays at `pos`
        self.steps = 0
        self.replay_s = 0.0
        self.bytes_per_step = 0
        self.models: dict[str, dict[str, Any]] = {}  # model name -> its state_dict's tensors
        self.objects: dict[str, Any] = {}  # the small objects' state (schedulers, scalers)
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = []
        self._cond = threading.Condition()
        self._taken = False
        self._thread = threading.Thread(target=self._run, name="baton-hot-mirror", daemon=True)

    def start(self) -> "Mirror":
        self._thread.start()
        return self

    # ---------------------------------------------------------------- the mirror's thread
    def _run(self) -> None:
        f = self.follower
        try:
            base = f.fetch_base()
            with self._cond:
                if self._taken:  # closed while the base was on its way
                    return
                self._build(base)
        except Exception as exc:  # noqa: BLE001 - whatever stops the base stops this mirror, said why
            self._fail(f"the feeder's replicated state did not make a mirror: {type(exc).__name__}: {exc}")
            return
        log.info("hot spare: mirror of rank %d's replicated state at %s (%.1f MB in %.3fs)", self.feeder,
                 self.pos, f.base_bytes / 2**20, f.base_s)
        self._report(self._state())
        busy, wire, paces, sizes, reported = 0.0, 0, [], [], False
        while not self._taken and not self.failed:
            record = f.next_record(0.2)
            if f.failed and f.ended:  # the feeder stopped (lost, or a recovery): the mirror stands where it is
                with self._cond:
                    self.ended = f.failed
                    self._cond.notify_all()
                log.info("hot spare: the feeder's records stopped at %s: %s", self.pos, f.failed)
                return
            if f.failed:
                self._fail(f.failed)
                return
            if record is None:
                continue
            t0 = time.perf_counter()
            with self._cond:
                if self._taken:
                    return
                try:
                    self._apply(record)
                except Exception as exc:  # noqa: BLE001 - a record it cannot apply ends the mirror, said why
                    self.failed = f"a step record could not be applied: {type(exc).__name__}: {exc}"
                self._cond.notify_all()
            if self.failed:
                self._fail(self.failed)
                return
            busy += time.perf_counter() - t0
            wire += int(record.get("nbytes", 0))
            if record["kind"] != "step_end":
                continue
            paces.append((busy, float(record["step_s"])))
            sizes.append(wire)
            busy, wire = 0.0, 0
            slow = _cannot_keep_up(paces)
            if slow:
                self._fail(slow)
                return
            if not reported and len(paces) >= KEEP_UP_STEPS:
                reported = True
                recent = sorted(p for p, _ in paces[-KEEP_UP_STEPS:])
                self.replay_s = recent[len(recent) // 2]
                self.bytes_per_step = sorted(sizes[-KEEP_UP_STEPS:])[KEEP_UP_STEPS // 2]
                self._report(self._state())
                log.info("hot spare: keeping pace with rank %d at %s (replay %.4fs a step)", self.feeder, self.pos,
                         self.replay_s)

    def _build(self, base: dict[str, Any]) -> None:
        plan = base["plan"]
        if plan.get("refused"):
            raise ValueError(plan["refused"])
        replicated = base["replicated"]
        opt_names = {spec["name"] for spec in plan["optimizers"]}
        small = set(base["small"]["objects"])
        for name, sd in replicated.items():
            if name in opt_names:
                continue
            if name in small:
                self.objects[name] = sd
            else:
                self.models[name] = sd
        for name, keys in plan["aliases"].items():  # tied weights: one tensor under each key
            for alias, key in keys.items():
                self.models[name][alias] = self.models[name][key]
        for spec in plan["optimizers"]:
            groups = [{"params": [self.models[model][key] for model, key in refs]} for refs in spec["groups"]]
            with discover.paused():  # baton's own, never the script's (on this thread only)
                opt = _optimizer_class(spec["cls"])(groups)
            _BATON_OWNED.append(opt)  # not the script's (a scan for optimizers made before init); until _release
            opt.load_state_dict(replicated[spec["name"]])
            self.optimizers.append((spec["name"], opt))
        self.pos = tuple(base["pos"])  # type: ignore[assignment]
        # each step's gradients arrive in memory mapped once, not in fresh pages every step
        self.follower.buffers.prepare([[(p.shape, p.dtype) for g in opt.param_groups for p in g["params"]]
                                       for _, opt in self.optimizers], count=2)

    def _apply(self, record: dict[str, Any]) -> None:
        """One of the feeder's optimizer steps, or a step's end (as PreCopying._apply_record)."""
        if int(record["step"]) != self.pos[0]:
            self.failed = f"the feeder's record of step {record['step']} does not follow step {self.pos[0]}"
            return
        if record["kind"] == "optimizer_step":
            opt = self.optimizers[int(record["opt"])][1]
            replay_optimizer_step(opt, record)
            self.follower.buffers.give_back(replayed_grads(opt, record))
            self.steps += 1
            self.dirty = True
            return
        small = record["small"]
        self.objects.update(small["objects"])
        for (_, opt), settings in zip(self.optimizers, small["settings"]):
            for group, values in zip(opt.param_groups, settings):
                group.update(values)
        self.pos, self.dirty = (int(record["step"]) + 1, 0), False

    def _fail(self, why: str) -> None:
        with self._cond:
            self.failed = self.failed or why
            self._cond.notify_all()
        log.warning("hot spare: the mirror of rank %d's state stopped: %s", self.feeder, self.failed)
        self._report(self._state())
        self.follower.close()

    def _state(self) -> m.HotState:
        f = self.follower
        return m.HotState(op=self.op, ok=not self.failed, pos=self.pos, detail=self.failed[:2000],
                          base_bytes=f.base_bytes, base_s=round(f.base_s, 4), steps=self.steps,
                          step_bytes=f.step_bytes, replay_s=round(self.replay_s, 4),
                          bytes_per_step=self.bytes_per_step)

    # ---------------------------------------------------------------- the recovery's side
    def take(self, target: tuple[int, int], wait_s: float = MIRROR_WAIT_S) -> dict[str, Any] | str:
        """The replicated state at `target` (models and optimizers; the mirror stops there), or
        why the mirror cannot give it."""
        if target[1] != 0:
            return f"the recovery's boundary {list(target)} follows a boundary function, which the mirror does not run"
        deadline = time.monotonic() + wait_s  # moved on each step applied: a busy machine is slow, not stuck
        with self._cond:
            seen = (self.pos, self.dirty)
            while not self.failed and not self.ended and (self.pos < target or self.dirty) and \
                    time.monotonic() < deadline:
                self._cond.wait(0.05)
                if (self.pos, self.dirty) != seen:
                    seen, deadline = (self.pos, self.dirty), time.monotonic() + wait_s
            if self.failed:
                return self.failed
            if self.pos != target or self.dirty:
                if self.pos < target:
                    why = f"its records stopped ({self.ended})" if self.ended else \
                        f"no record of the steps between came for {wait_s:g}s"
                    return (f"the mirror was at {list(self.pos)}, short of the recovery's boundary {list(target)}: "
                            f"the feeder, rank {self.feeder}: {why}")
                return f"the mirror is past the recovery's boundary {list(target)} (at {list(self.pos)})"
            self._taken = True
        self.follower.close()
        out: dict[str, Any] = {name: dict(sd) for name, sd in self.models.items()}
        for name, opt in self.optimizers:
            out[name] = opt.state_dict()
        self._release()
        return out

    def close(self) -> None:
        with self._cond:
            self._taken = True
        self.follower.close()
        self._release()

    def _release(self) -> None:
        """Nothing of baton's keeps the mirror's tensors alive once it is taken or closed."""
        with self._cond:
            for _, opt in self.optimizers:
                if any(o is opt for o in _BATON_OWNED):
                    _BATON_OWNED.remove(opt)
            self.optimizers, self.models, self.objects = [], {}, {}


class HotSpares:
    """Mixed into Runtime: a rank feeding the hot spares, and a hot spare taking a rank over."""

    hot_spares = False  # the job runs with --hot-spares (Registered)
    hot_feed: Feed | None = None
    hot_feed_frozen: Feed | None = None  # a recovery stopped it: its records stay for the spares until the next
    mirror: Mirror | None = None  # a hot spare's, until it has taken its rank over
    hot_use: m.HotUse | None = None

    # ---------------------------------------------------------------- the feeder
    def _start_hot_feed(self, op: int) -> None:
        self._stop_hot_feed()
        feed = Feed(self.server, self.rank, self.tracked, op=op, ids=hot_ids(self.rank))
        state = self._state(full=False, digest=False)
        state["plan"] = mirror_plan(self.tracked)
        feed.serve_base(state, self.pos)
        self.hot_feed = feed
        log.info("feeding the hot spares from %s (op %d)", self.pos, op)

    def _stop_hot_feed(self) -> None:
        for feed in (self.hot_feed, self.hot_feed_frozen):
            if feed is not None:
                feed.close()
        self.hot_feed = self.hot_feed_frozen = None

    def _freeze_hot_feed(self) -> None:
        """A recovery: no more records (the steps may run again), but those served stay, for a
        hot spare taking a lost rank over, until the feed after the recovery starts."""
        if self.hot_feed is not None:
            if self.hot_feed_frozen is not None:
                self.hot_feed_frozen.close()
            self.hot_feed_frozen, self.hot_feed = self.hot_feed, None

    def _hot_part(self, state: dict[str, Any]) -> dict[str, Any]:
        """A hot spare's share of what this rank serves: everything but the models' and
        optimizers' tensors (a planned move's leaver: with its own state, the bundle)."""
        return {**served_apart(state), "small": small_state(self.tracked)}

    # ---------------------------------------------------------------- the hot spare
    def _state_from_mirror(self, cmd: m.Form) -> tuple[dict[str, Any], FetchStats] | None:
        """The rank's state from the mirror and the rest from its sources (a planned move's
        leaver: its own state and the small state; a recovery's survivors: the small state, the
        rank's own coming from its buddy); None: fetch it whole."""
        mirror = self.mirror
        if mirror is None or cmd.snapshot or not (cmd.full_state or cmd.lost is not None):
            return None
        target: tuple[int, int] = tuple(cmd.pos)  # type: ignore[assignment]
        t0 = time.perf_counter()
        got = mirror.take(target)
        waited = time.perf_counter() - t0
        if isinstance(got, str):
            return self._mirror_unused(got)
        try:
            own, stats = self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s,
                                           kind=FETCH_OWN)
        except (OSError, TransferError) as exc:
            return self._mirror_unused(f"the survivors' small state did not arrive: {exc}")
        self.hot_use = m.HotUse(used=True, mirror_steps=mirror.steps, catch_up_s=round(waited, 4))
        log.info("hot spare: the replicated state at %s from the mirror (%d steps followed, %.3fs to reach it); "
                 "%d bytes from the survivors", target, mirror.steps, waited, stats.bytes)
        self.mirror = None
        return {**own, "replicated": {**got, **own["small"]["objects"]}}, stats

    def _mirror_unused(self, why: str) -> None:
        log.warning("hot spare: %s: fetching the whole state", why)
        mirror = self.mirror
        self.hot_use = m.HotUse(used=False, detail=why[:2000], mirror_steps=mirror.steps if mirror else 0)
        if mirror is not None:
            mirror.close()
        self.mirror = None
        return None
