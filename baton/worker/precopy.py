"""Pre-copied planned moves: the joiner takes the replicated state while training goes on,
then follows the leaver's optimizer steps, so that the pause moves only the rank's own state.

The leaver (`Feed`), asked at a boundary, copies its replicated state there (one copy, the
one cost the move puts on a step) and serves it; from then on, at each optimizer step it
takes, it serves the gradients that step is about to apply and the optimizer's settings,
and at each step's end the small state the step left (an LR scheduler, a GradScaler, the
optimizers' settings). The joiner (`Follower`) loads the copy and applies the same optimizer
steps to the same gradients: on the same device type that is the same arithmetic, so its
parameters and optimizer state follow the leaver's bit for bit. Gradients are served before
the leaver's own optimizer step runs, so the joiner's step of the last step before the pause
runs beside the leaver's, not inside the pause.

What the joiner cannot follow is found, never guessed: the leaver compares the version
counters of its parameters and optimizer state (torch bumps them at every in-place change)
between its optimizer steps; anything that changed them elsewhere (an EMA update, a clamp,
a load) marks the feed `touched`, and the move takes the whole state in its pause instead.
The state check after the move compares the joiner's replicated state with the others'.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from baton import selfcost
from baton.control import messages as m
from baton.transfer import codec
from baton.transfer.client import SnapshotLink, discard
from baton.transfer.protocol import FlatState, TransferError
from baton.transfer.server import FETCH_OWN, PUBLISH_WAIT_S, pre_copy_ids, snapshot_key
from baton.worker.exit import exit_quietly

if TYPE_CHECKING:
    from baton.transfer.server import TransferServer
    from baton.worker.tracked import Tracked

log = logging.getLogger("baton.worker")

# The leaver keeps this many of its latest step records for a joiner that lags (at least
# the two of the step running), within this many bytes; a joiner further behind gives up.
KEEP_RECORDS = 64
KEEP_BYTES = 1 << 30
WAKE = "wake"  # a record queue's item that is no record
# A joiner further behind than this many steps when the ranks pause takes the whole state
# instead: it never caught up (the pre-copy's deadline passed), and each step it replays
# inside the pause costs about what the step cost the ranks.
MAX_BEHIND = 2
# The joiner gives up when its replay of a step takes more than this share of the step, over
# this many steps (medians): it would not be done when the ranks pause.
KEEP_UP, KEEP_UP_STEPS = 0.8, 3


def record_key(op: int, seq: int) -> int:
    """A step record's snapshot step: the move's id above its sequence number (a newer move's
    records make an older move's missing ones gone for good, see TransferServer)."""
    return (op << 24) | seq


def _settings(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """An optimizer's settings by group (its learning rate as a scheduler left it, ...)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def replayed_grads(opt: torch.optim.Optimizer, record: dict[str, Any]) -> list[torch.Tensor]:
    """The gradients of an applied record that nothing holds any more, each once (a tensor
    listed twice must not serve two receives): not one an optimizer kept in its state, as a
    custom optimizer keeping last step's gradient by reference would (a built-in one copies)."""
    kept = {t.data_ptr() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    return list({g.data_ptr(): g for g in record["grads"] if g is not None and g.data_ptr() not in kept}.values())


def replay_optimizer_step(opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    """Apply a fed optimizer step: the feeder's gradients and settings, then the same step()
    (the feeder's arithmetic on the same device type, so the same bits)."""
    params = _params(opt)
    for p, g in zip(params, record["grads"]):
        p.grad = None if g is None else g.to(p.device)
    for group, values in zip(opt.param_groups, record["settings"]):
        group.update(values)
    opt.step()
    for p in params:
        p.grad = None


# What a rank serves apart from the models' and optimizers' tensors (FETCH_OWN), where present:
# its position and own state, and what its DDP and late-registered buffers need.
SERVED_APART = ("pos", "bundle", "loop_start", "ddp", "late_buffers")


def served_apart(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in SERVED_APART if k in state}


def small_state(tracked: "Tracked") -> dict[str, Any]:
    """The replicated state outside the models and optimizers' tensors: what a step changes
    besides its optimizer step (schedulers, scalers, the script's own objects), and every
    optimizer's settings."""
    opts = tracked.optimizers()
    out: dict[str, Any] = {"objects": {}, "settings": [_settings(o) for o in opts]}
    for name, obj in tracked.objects.items():
        if name in tracked.sharded or isinstance(obj, torch.nn.Module) or any(obj is o for o in opts):
            continue
        out["objects"][name] = obj.state_dict()
    return out


def load_small_state(tracked: "Tracked", state: dict[str, Any]) -> None:
    for name, sd in state["objects"].items():
        tracked.objects[name].load_state_dict(sd)
    for opt, settings in zip(tracked.optimizers(), state["settings"]):
        for group, values in zip(opt.param_groups, settings):
            group.update(values)


def _versions(tracked: "Tracked") -> list[int]:
    """The in-place change counters of the parameters and optimizer state."""
    modules = [o for o in tracked.objects.values() if isinstance(o, torch.nn.Module)]
    out = [p._version for module in modules for p in module.parameters()]
    for opt in tracked.optimizers():
        for st in opt.state.values():
            out.extend(v._version for v in st.values() if isinstance(v, torch.Tensor))
    return out


def _frozen(state: Any) -> FlatState:
    """Encoded with its own copies of the tensors: served while the state goes on changing."""
    meta, tensors = codec.encode(state)
    return FlatState(meta=meta, tensors=[t.detach().clone() for t in tensors])


class RecordBuffers:
    """Memory for a feed's records, mapped before the records need it and reused once they are
    dropped. A step's gradients copied into fresh memory cost the feeding rank its page faults
    on the step (333 MB: 0.20-0.68 s, against 0.05 s into memory already mapped, 2-core dev
    machine), and the step a pause waits for is one of them."""

    POOLED = 1 << 20  # smaller tensors are cloned: a pool would save nothing

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def prepare(self, sets: list[list[tuple[torch.Size, torch.dtype]]], count: int | None = None) -> None:
        """Map, on a thread, `count` buffers for each optimizer's gradients; by default as many
        as a feed keeps records of them, and one more for the record being made."""
        grad_bytes = sum(math.prod(shape) * dtype.itemsize for shapes in sets for shape, dtype in shapes)
        if grad_bytes < self.POOLED:
            return
        if count is None:
            count = min(KEEP_RECORDS // 2, max(2, KEEP_BYTES // grad_bytes)) + 1
        threading.Thread(target=self._map, args=(sets, count), name="baton-feed-buffers", daemon=True).start()

    def _map(self, sets: list[list[tuple[torch.Size, torch.dtype]]], count: int) -> None:
        for _ in range(count):
            for shapes in sets:
                made = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes
                        if math.prod(shape) * dtype.itemsize >= self.POOLED]
                with self._lock:
                    if self._closed:
                        return
                    for t in made:
                        self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The record's own copies of `tensors` (a mapped buffer of the same shape where one is free)."""
        out = []
        for t in tensors:
            with self._lock:
                free = self._free.get((tuple(t.shape), t.dtype))
                buf = free.pop() if free else None
            out.append(buf.copy_(t) if buf is not None else t.detach().clone())
        return out

    def carve(self, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
        """Tensors to receive a record into (transfer.protocol.alloc_tensors' pool): a mapped
        buffer for each large one where one of its shape is free, new ones for the rest."""
        out = []
        for dtype, shape in specs:
            buf = None
            if math.prod(shape) * dtype.itemsize >= self.POOLED:
                with self._lock:
                    free = self._free.get((tuple(shape), dtype))
                    buf = free.pop() if free else None
            out.append(buf if buf is not None else torch.empty(shape, dtype=dtype))
        return out

    def give_back(self, tensors: list[torch.Tensor]) -> None:
        """A dropped record's tensors, nobody reading them any more."""
        with self._lock:
            if self._closed:
                return
            for t in tensors:
                if t.numel() * t.element_size() >= self.POOLED:
                    self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def close(self) -> None:
        """Drop the buffers, their pages given back on a thread: a joiner closes its follower
        in the pause, where freeing its buffers (three sets of a 333 MB step's gradients) took
        88-137 ms, the GIL held through each tensor's free; madvise through ctypes lets it go
        (4.5-9 ms left on the closing thread)."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, {}
        tensors = [t for ts in free.values() for t in ts]
        if tensors:
            selfcost.spawn(_release, "baton-feed-release", (tensors,))


def _release(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        discard(t.data_ptr(), t.numel() * t.element_size())
    tensors.clear()  # their mappings hold no pages now: unmapped at once


@dataclass
class Feed:
    """A planned move's leaver serving its joiner: the base, then a record per optimizer step
    and per step end, by sequence number."""

    server: "TransferServer"
    rank: int
    tracked: "Tracked"
    op: int = 0  # the move it feeds: its records' keys hold it, so no joiner takes another move's
    ids: tuple[int, int] = (0, 0)  # the snapshot ids of its base and its records (pre_copy_ids by default)
    base_s: float = 0.0
    capture_s: float = 0.0
    steps: int = 0
    touched: str = ""  # why the joiner cannot follow (empty: it can)
    _seq: int = 0
    _kept: list[tuple[int, int]] = field(default_factory=list)  # (seq, bytes)
    buffers: RecordBuffers = field(default_factory=RecordBuffers)
    _versions: list[int] | None = None
    _step_t0: float = 0.0

    def __post_init__(self) -> None:
        if self.ids == (0, 0):
            self.ids = pre_copy_ids(self.rank)

    def serve_base(self, state: dict[str, Any], pos: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        flat = _frozen({**state, "small": small_state(self.tracked)})
        self.server.put_snapshot(self.ids[0], self.op, flat)
        self._versions = _versions(self.tracked)
        self.base_s = time.perf_counter() - t0
        self.buffers.prepare([[(p.shape, p.dtype) for p in _params(opt) if p.requires_grad]
                              for opt in self.tracked.optimizers()])
        self._step_t0 = time.perf_counter()
        log.info("pre-copy: serving the replicated state at %s (%.1f MB, copied in %.3fs)", pos,
                 flat.nbytes / 2**20, self.base_s)

    def before_optimizer_step(self, opt_index: int, opt: torch.optim.Optimizer, step: int, closure: bool) -> None:
        t0 = time.perf_counter()
        self._check_versions("between optimizer steps")
        if closure and not self.touched:
            self.touched = "an optimizer step with a closure (it evaluates the model again)"
        grads = [p.grad for p in _params(opt)]
        self._put({"kind": "optimizer_step", "step": step, "opt": opt_index, "settings": _settings(opt),
                   "grads": [g.detach() if g is not None else None for g in grads], "touched": self.touched})
        self.steps += 1
        self.capture_s += time.perf_counter() - t0

    def after_optimizer_step(self) -> None:
        self._versions = _versions(self.tracked)

    def end_step(self, step: int) -> None:
        t0 = time.perf_counter()
        self._check_versions("after the optimizer step")
        self._put({"kind": "step_end", "step": step, "small": small_state(self.tracked), "touched": self.touched,
                   "step_s": t0 - self._step_t0})
        self._step_t0 = time.perf_counter()
        self.capture_s += time.perf_counter() - t0

    def own_part(self) -> dict[str, Any]:
        """What the pause hands over besides the rank's own state: the small state as the
        boundary holds it, and whether the joiner could follow."""
        self._check_versions("before the pause")
        return {"small": small_state(self.tracked), "touched": self.touched}

    def drop_base(self) -> None:
        """Its joiners (the hot spares) have the base: free the copy; the records go on."""
        self.server.drop_snapshots(self.ids[0], set())

    def close(self) -> None:
        base, steps = self.ids
        self.buffers.close()
        self.server.drop_snapshots(base, set())
        self.server.drop_snapshots(steps, set())

    def _check_versions(self, where: str) -> None:
        if self.touched or self._versions is None:
            return
        if _versions(self.tracked) != self._versions:
            self.touched = (f"the parameters or optimizer state were changed {where} by something other than "
                            "the optimizer (an EMA update, a clamp, a load): a joiner cannot follow that from the "
                            "gradients")

    def _put(self, record: dict[str, Any]) -> None:
        meta, tensors = codec.encode(record)
        flat = FlatState(meta=meta, tensors=self.buffers.copies(tensors))
        steps = self.ids[1]
        key = record_key(self.op, self._seq)
        self.server.put_snapshot(steps, key, flat)
        self._kept.append((key, flat.nbytes))
        self._seq += 1
        total = sum(b for _, b in self._kept)
        while len(self._kept) > 2 and (len(self._kept) > KEEP_RECORDS or total > KEEP_BYTES):
            old, nbytes = self._kept.pop(0)
            total -= nbytes
            taken = self.server.take_snapshot(steps, old)  # None while a joiner still reads it: dropped below
            if taken is not None:
                self.buffers.give_back(taken.tensors)
        self.server.drop_snapshots(steps, {s for s, _ in self._kept})


@dataclass
class Follower:
    """A planned move's joiner following its leaver: records fetched on a thread, applied on
    the training thread (which is otherwise waiting for its Form)."""

    source: tuple[str, int]
    token: str
    rank: int
    timeout: float
    op: int = 0
    ids: tuple[int, int] = (0, 0)  # the leaver's (pre_copy_ids by default)
    pos: tuple[int, int] = (0, 0)
    steps: int = 0
    base_bytes: int = 0
    base_s: float = 0.0
    step_bytes: int = 0
    failed: str = ""
    ended: bool = False  # `failed` because the records stopped coming (what was applied stands)
    woken_at: float = 0.0  # when the Form came (perf_counter), maybe while a record was being applied
    _records: "queue.Queue[tuple[dict[str, Any] | None, str]]" = field(default_factory=queue.Queue)
    # Where the records' gradients arrive: a step's into fresh memory cost the joiner its page
    # faults on every step (333 MB: as long as the copy), the last one inside the pause.
    buffers: RecordBuffers = field(default_factory=RecordBuffers)
    _link: SnapshotLink | None = None
    _records_link: SnapshotLink | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _late: threading.Event = field(default_factory=threading.Event)  # a Form came before the base

    def __post_init__(self) -> None:
        if self.ids == (0, 0):
            self.ids = pre_copy_ids(self.rank)

    @property
    def _wait_s(self) -> float:
        """How long a fetch waits for the source to hold what it asks for: as long as its server would."""
        return PUBLISH_WAIT_S + self.timeout

    def fetch_base(self) -> dict[str, Any]:
        """The source's replicated state, once it has reached a boundary and copied it there:
        a large state's copy, on a busy machine, takes longer than a connection's timeout.
        wake() (a Form came) or close() ends the wait."""
        t0 = time.perf_counter()
        self._link = SnapshotLink(self.source, self.token, self.timeout)
        if self._stop.is_set() or self._late.is_set():  # (set before they look for the link)
            raise TransferError("a Form came before the source's replicated state did")
        flat, n = self._link.fetch(snapshot_key(self.ids[0], self.op), wait_s=self._wait_s)
        self.base_bytes, self.base_s = n, time.perf_counter() - t0
        state = codec.decode(flat.meta, list(flat.tensors))
        self.pos = tuple(state["pos"])  # type: ignore[assignment]
        threading.Thread(target=self._fetch_records, name="baton-pre-copy", daemon=True).start()
        return state

    def _fetch_records(self) -> None:
        steps = self.ids[1]
        link = self._records_link = SnapshotLink(self.source, self.token, self.timeout)
        seq = 0
        try:
            while not self._stop.is_set():  # the next record comes with the source's next step, however long
                t0 = time.perf_counter()
                flat, n = link.fetch(snapshot_key(steps, record_key(self.op, seq)), wait_s=self._wait_s,
                                     pool=self.buffers)
                self.step_bytes += n
                record = codec.decode(flat.meta, list(flat.tensors))
                record["nbytes"] = n  # what it took on the wire
                record["fetch_s"] = time.perf_counter() - t0  # its transfer, and any wait for the source to make it
                self._records.put((record, ""))
                seq += 1
        except Exception as exc:  # noqa: BLE001 - any end of the records is the follower's end
            if not self._stop.is_set():
                self._records.put((None, f"the step records stopped: {type(exc).__name__}: {exc}"))
        finally:
            link.close()

    def next_record(self, timeout: float) -> dict[str, Any] | None:
        """The next record, or None if none came within `timeout`; sets `failed` when none will."""
        try:
            record, why = self._records.get(timeout=timeout)
        except queue.Empty:
            return None
        if record is None and why == WAKE:
            return None
        if record is None:
            self.failed, self.ended = why, True
        elif record.get("touched"):
            self.failed = str(record["touched"])
            record = None
        return record

    def wake(self, *_: Any) -> None:
        """A Form arrived: the training thread stops waiting for a record (or for the base,
        which is then too late to use) and reads it."""
        self.woken_at = self.woken_at or time.perf_counter()
        if not self.base_bytes:
            self._late.set()
            if self._link is not None:
                self._link.close()
        self._records.put((None, WAKE))

    def close(self) -> None:
        self._stop.set()
        self.buffers.close()
        if self._link is not None:
            self._link.close()
        if self._records_link is not None:
            self._records_link.close()


def _at_head(fetched_s: float, step_s: float) -> bool:
    """Whether the joiner is within a step of its leaver: the fetches of the step's records
    took half the leaver's step or more, so they waited for the leaver to make them (a joiner
    behind gets each at once). Durations on one side only, where a record's age (one host's
    clock read on another) would be off by their skew, and on a busy machine by the
    scheduler's delays: a joiner that was following never said so, and the move waited for
    its pre-copy's deadline (120 s)."""
    return fetched_s >= 0.5 * step_s


def _cannot_keep_up(paces: list[tuple[float, float]]) -> str:
    """Why the joiner would still be replaying when the ranks pause (empty: it keeps up). A
    replay as slow as the steps themselves (the joiner sharing the ranks' CPU cores, say)
    would put its last steps inside the pause, making it longer than a copy of the whole
    state; better to say so and take the whole state."""
    if len(paces) < KEEP_UP_STEPS:
        return ""
    recent = paces[-KEEP_UP_STEPS:]
    replay = sorted(p for p, _ in recent)[len(recent) // 2]
    step = sorted(s for _, s in recent)[len(recent) // 2]
    if replay <= KEEP_UP * step:
        return ""
    return (f"it cannot keep up: replaying one of the leaver's steps takes {replay:.3f}s, the steps "
            f"themselves {step:.3f}s (does the spare share the ranks' devices or CPU cores?)")


class PreCopying:
    """Mixed into Runtime: both sides of a pre-copied planned move."""

    pre_copy: Feed | None = None  # a leaver's, while its joiner follows it
    follower: Follower | None = None
    pre_copy_op = 0  # the move it feeds

    # ---------------------------------------------------------------- the leaver
    def _start_feed(self, op: int) -> None:
        if self.pre_copy is not None:
            self.pre_copy.close()
        self.pre_copy, self.pre_copy_op = Feed(self.server, self.rank, self.tracked, op=op), op
        self.pre_copy.serve_base(self._state(full=False, digest=False), self.pos)

    def _feed_before_optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer pre-hook, the last one: the step's collectives have all succeeded. It
        feeds a planned move's joiner and the hot spares (hot.py)."""
        feeds = [f for f in (self.pre_copy, self.hot_feed) if f is not None]  # type: ignore[attr-defined]
        if not feeds or self.loading or self.scope != "step":
            return
        index = next(i for i, o in enumerate(self.tracked.optimizers()) if o is opt)
        closure = len(args) > 1 or kwargs.get("closure") is not None  # args: (optimizer, *step's own)
        for feed in feeds:
            feed.before_optimizer_step(index, opt, self.pos[0], closure=closure)

    def _feed_parts(self, state: dict[str, Any]) -> dict[str, Any]:
        """The pause's share of a pre-copied move (served apart: FETCH_OWN), and the cost report."""
        assert self.pre_copy is not None
        own = served_apart(state)
        own.update(self.pre_copy.own_part())
        feed = self.pre_copy
        self.ctl.report(m.PreCopyCost(op=self.pre_copy_op, base_s=round(feed.base_s, 4), steps=feed.steps,
                                      capture_s=round(feed.capture_s, 4)))
        return own

    def _stop_feed(self) -> None:
        if self.pre_copy is not None:
            self.pre_copy.close()
            self.pre_copy = None

    # ---------------------------------------------------------------- the joiner
    def _follow(self, cmd: m.CatchUp) -> m.Form | None:
        """Take the leaver's replicated state and follow its optimizer steps until this rank's
        Form comes (returned), or give up (None: the move then takes the whole state)."""
        f = Follower(tuple(cmd.source), self.token, self.rank, self.op_timeout, op=cmd.op)  # type: ignore[arg-type]
        self.follower = f
        self.ctl.watch_forms(f.wake)  # its Form ends the wait for the base or the next record at once
        try:
            base = f.fetch_base()
            self._load_replicated(base)
            load_small_state(self.tracked, base["small"])
        except (OSError, TransferError) as exc:
            f.failed = f"the leaver's replicated state did not arrive: {exc}"
        # one step's gradients being received while the one before is applied
        f.buffers.prepare([[(p.shape, p.dtype) for p in _params(opt) if p.requires_grad]
                           for opt in self.tracked.optimizers()], count=2)
        self.pos = f.pos
        log.info("pre-copy: the replicated state at %s arrived (%.1f MB in %.3fs); following the leaver",
                 f.pos, f.base_bytes / 2**20, f.base_s)
        reported = False
        busy, fetched, paces = 0.0, 0.0, []  # this step's replay and fetches so far; (replay, the leaver's step)
        while True:
            got = self.ctl.wait_command(0)
            if isinstance(got, m.Form):
                return got
            if isinstance(got, m.Stop):
                exit_quietly(0)
            record = f.next_record(0.05) if not f.failed else None
            if f.failed:
                self.ctl.report(self._caught_up(f))
                self._stop_following()
                return None
            if record is None:
                continue
            t0 = time.perf_counter()
            self._apply_record(record)
            busy += time.perf_counter() - t0
            fetched += float(record["fetch_s"])
            if record["kind"] != "step_end":
                continue
            step_s = float(record["step_s"])
            paces.append((busy, step_s))
            at_head = _at_head(fetched, step_s)
            busy = fetched = 0.0
            slow = _cannot_keep_up(paces)
            if slow:
                f.failed = slow
                continue  # reported above, at the next turn
            # Caught up: the replay has kept pace for long enough to judge (else the ranks would
            # pause while it still replays), and this step's records were waited for.
            if not reported and len(paces) >= KEEP_UP_STEPS and at_head:
                reported = True
                self.ctl.report(self._caught_up(f))

    def _caught_up(self, f: Follower) -> m.CaughtUp:
        return m.CaughtUp(op=f.op, ok=not f.failed, pos=f.pos, detail=f.failed[:2000], base_bytes=f.base_bytes,
                          base_s=round(f.base_s, 4), steps=f.steps, step_bytes=f.step_bytes)

    def _apply_record(self, record: dict[str, Any]) -> None:
        """One of the leaver's optimizer steps, with its gradients and settings; or a step's end."""
        f = self.follower
        assert f is not None
        if int(record["step"]) != self.pos[0]:  # never applied out of order: the whole state instead
            f.failed = f"the leaver's record of step {record['step']} does not follow step {self.pos[0]}"
            return
        if record["kind"] == "optimizer_step":
            self.loading = True  # baton's own hooks stand aside: this is not a step of this rank's loop
            opt = self.tracked.optimizers()[int(record["opt"])]
            try:
                replay_optimizer_step(opt, record)
            finally:
                self.loading = False
            f.steps += 1
            f.buffers.give_back(replayed_grads(opt, record))
            return
        load_small_state(self.tracked, record["small"])
        self.pos = f.pos = (int(record["step"]) + 1, 0)
        self.params_step = self.pos[0]

    def _finish_following(self, cmd: m.Form) -> tuple[dict[str, Any], Any, float] | None:
        """At the pause: the last optimizer steps up to its boundary, then only the rank's own
        state and the small state from the leaver, and when the last step was applied. None:
        follow no further (the whole state)."""
        f = self.follower
        if f is None:
            return None
        if not cmd.full_state or cmd.snapshot:  # a recovery's Form (the leaver was lost): its state
            self._stop_following()
            return None
        target = tuple(cmd.pos)
        if target[0] - self.pos[0] > MAX_BEHIND:  # replaying them would hold the pause longer than a copy
            self._give_up_following(f"{target[0] - self.pos[0]} steps behind the pause's boundary {list(target)}")
            return None
        deadline = time.monotonic() + (cmd.formation_timeout_s or self.formation_timeout)
        while self.pos[0] < target[0] and not f.failed and time.monotonic() < deadline:
            record = f.next_record(0.05)
            if record is not None:
                self._apply_record(record)
        if f.failed or self.pos[0] != target[0]:
            self._give_up_following(f.failed or f"not at the pause's boundary {list(target)} in time "
                                                f"(at {list(self.pos)})")
            return None
        followed_at = time.perf_counter()
        self.ctl.report(self._caught_up(f))  # its final figures, ahead of its Formed
        own, stats = self._fetch_state(cmd.fetch_from, cmd.generation, target, cmd.formation_timeout_s,  # type: ignore[arg-type]
                                       kind=FETCH_OWN)
        if own.get("touched"):
            self._give_up_following(str(own["touched"]))
            return None
        self._stop_following()
        return own, stats, followed_at

    def _give_up_following(self, why: str) -> None:
        """At the pause: take the whole state, and say why in the move's ledger entry."""
        f = self.follower
        assert f is not None
        log.warning("pre-copy: %s: taking the whole state", why)
        f.failed = f.failed or why
        self.ctl.report(self._caught_up(f))
        self._stop_following()

    def _load_followed(self, own: dict[str, Any], target: tuple[int, int]) -> None:
        """The pause's share, over the replicated state the joiner followed to its boundary."""
        from baton.worker.ddp import adopt_state

        added = self.tracked.adopt_late_buffers(own.get("late_buffers", {}))
        if added:
            log.info("registered the buffers the source's forward made, which this rank's model lacked: %s",
                     ", ".join(added[:10]))
        load_small_state(self.tracked, own["small"])
        self.params_step = target[0]
        for ddp, ddp_state in zip(self.tracked.ddps, own["ddp"]):
            adopt_state(ddp, ddp_state)

    def _stop_following(self) -> None:
        if self.follower is not None:
            self.ctl.watch_forms(None)
            self.follower.close()
            self.follower = None
