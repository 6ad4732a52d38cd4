"""Fault injection for tests, loaded by putting this directory on PYTHONPATH (its
sitecustomize.py imports this module in each process that runs worker code).

BATON_TEST_FAIL_AFTER_ALLREDUCE="rank:step": that rank loses that step after its gradient
all-reduce completed everywhere, just before its optimizer.step(), as a rank does when a
peer is lost at the very end of the all-reduce. The others complete the step; this rank
must take their result, never re-run it. Random signals reach this path rarely; this
reaches it every time. A gloo all-reduce can end on this rank before the others have
their last bytes: with BATON_TEST_FAIL_AFTER_ALLREDUCE_GO (a file path), the rank waits for
that file (at most 60 s) before it fails, so the test can see the others past the step.

BATON_TEST_CORRUPT="rank:step": after that rank's optimizer step at that step, one float of
its first parameter changes by one ulp, as silent data corruption in memory would.

BATON_TEST_PEER_LOST_AFTER_COMMIT="rank:step": right after that rank's optimizer step in
that step, a lost-peer error surfaces in the script. The step has committed, so it cannot
be absorbed: the rank exits as one that died of a lost peer (75), not as a script bug,
and is replaced.

BATON_TEST_STALL_WHILE_PAUSING="rank" (with BATON_TEST_STALL_MARK, a file path that makes it
fire once per job): that rank reaches the agreed boundary
of a move but its main thread hangs there, as one stuck in its own code between steps (a
hung filesystem read, say) would. Its heartbeats go on and no collective is pending for the
others, who wait at the boundary: only the pausing phase's deadline can find it.

BATON_TEST_HOLD_AFTER_TAKING_STEP="rank" (with BATON_TEST_HOLD_MARK, a file path): once, when
that rank, a survivor that abandoned a step the others completed, has fetched their result,
it creates the mark and waits until the test removes it (at most 60 s), so that the test can
kill the sources before the new generation forms.

BATON_TEST_SIGNAL_MID_STEP="rank:joined+N:SIGNAME" (with BATON_TEST_SIGNAL_MARK): once, in a
process that took that rank over (its first step was not 0), before the backward of its
Nth step after the one it joined at.

BATON_TEST_SIGNAL_MID_STEP="rank:rebuddied:SIGNAME" (with BATON_TEST_SIGNAL_MARK): once, in
that rank's process, before the backward of its first step after a move gave it a new buddy
(its head record there is the first it sends that buddy, on a new connection).

BATON_TEST_SLOW_NEW_BUDDY="seconds": a bundle pusher's connection to a buddy that replaced
another (after a move) takes that many seconds longer to open, as over a busy network.

BATON_TEST_LINK_DOWN_MID_STEP="rank:step:IFACE" (with BATON_TEST_SIGNAL_MARK): once, that rank
takes its node's link IFACE down (`ip link set IFACE down`, in its own network namespace)
in that step, after its forward and before its backward: a data path lost mid-step.

BATON_TEST_LEAVER_DIES_SERVING=1 (with BATON_TEST_SIGNAL_MARK): once, a planned move's leaver
in the no-code mode is killed -9 when its successor, which has its own record and is
walking to the rank's place, asks for the rest of its state. BATON_TEST_LEAVER_DIES_SERVING=own:
killed -9 instead as its successor asks for its own record, before serving it (the successor
has not begun its walk).

BATON_TEST_SLOW_SLOT="slot:seconds:step": the process on that slot (the machine, not the
rank: a replacement elsewhere is fast) spends that many more seconds in every forward of a
wrapped model from that step on, as a throttling GPU would.

BATON_TEST_CORRUPT_IN_RECOVERY="rank": the first time that rank checks its state after a
recovery (a survivor, not a joiner), one float of its first parameter's shard changes by one
ulp just before the check, as a corruption of memory, or a bug in going back to a boundary,
would leave it. In pure FSDP no other rank holds those shards; the check must compare them
with the buddy's copy of the rank's snapshot and stop the job.

BATON_TEST_NO_BUDDY_COPY=1: no buddy offers its copy of a ward's snapshot to the state check
after a recovery, as when the failure came before the buddy had pulled the newest: each
rank must then compare its shards with its own snapshot of the boundary.

BATON_TEST_SIGNAL_MID_STEP="rank:step:SIGNAME": that rank sends itself the signal (SIGKILL, SIGSTOP)
in that step, after its forward and before its backward, once per job (BATON_TEST_SIGNAL_MARK, a
file path, is made when it fires); "rank:go:SIGNAME" with BATON_TEST_SIGNAL_GO (a file path): in
the first step of that rank's once the test has made that file: a real kill -9 or hang landing inside a step, at a point a
test can name (one from outside lands anywhere).

BATON_TEST_SIGNAL_IN_REGION="rank:step:SIGNAME" (with BATON_TEST_SIGNAL_MARK): the same, in the
script's first dist.all_reduce after its step loop (an evaluation) once that rank is past that
step (an evaluation).

BATON_TEST_GLITCH_IN_REGION="rank:step" (with BATON_TEST_SIGNAL_MARK): once, that rank's first
recorded collective in the region after its step loop past that step completes, and then
fails there as a data path dropping its last bytes would: every other rank has its result and
goes on to its next collective; this one has none, recovers in place and issues it again. It
fails only once the other rank has recorded that collective's result (files beside the mark).
BATON_TEST_GLITCH_AFTER_STEP="rank:step": the same, for that rank's first recorded collective
after its optimizer step in a step past that one (a loss all-reduced for the log).

BATON_TEST_SIGNAL_IN_SAVE="rank:step:SIGNAME" (with BATON_TEST_SIGNAL_MARK): the same, in the
script's first torch.save in the region after its step loop once that rank is past that step
(rank 0 writing its checkpoint).

BATON_TEST_SIGNAL_AT_EXIT="rank:step:SIGNAME" (with BATON_TEST_SIGNAL_MARK): the same, as that
rank's step loop ends (its iterator ran out) past that step, once every other rank has left its
loop there too and its record of the head it left from has gone to its buddies: its successor
takes over at that head while the others stand in the region after the loop.

BATON_TEST_LAG_AT_HEAD="rank:step" (with BATON_TEST_SIGNAL_MARK): that rank waits at its
boundary before that step until the fault of another variable has fired (the mark exists) and
the orchestrator's command for it has reached the rank (at most 120 s): a survivor that is
slower than the rank lost just past that head (in the region after the step loop, say) learns
of the loss still standing at the head, as a busy machine can have it.

BATON_TEST_SIGNAL_AFTER_STEP="rank:step:SIGNAME" (with BATON_TEST_SIGNAL_MARK): the same, right
after that rank's optimizer step in that step, once every other rank has finished its own: after
its last collective, before the next head (the lines after the optimizer step never run).

BATON_TEST_HOLD_AT_STEP="step" (with BATON_TEST_HOLD_FILE, a file path): while that file
exists, every rank waits at the boundary before that step, still taking the orchestrator's
commands there (a pause, an abort), so a test's faults land before the job can end however
fast or slow the machine: the test removes the file to let training finish (at most 600 s).
"step+" holds at every boundary from that step on: each command lets the ranks run one step
(the step a re-formed group needs to show it works) and they hold again, so a test can run
several operations one after another in a short run.

BATON_TEST_LEASH=path: while that file exists and holds a step no later than the rank's next
one, the rank waits at that boundary, still taking the orchestrator's commands there: the
test (`Job(leash=N)`) moves the step on as it sees the job's progress, so the ranks run at
most N steps ahead of the test's last look and cannot finish before its faults, however
slow or busy the machine. The test removes the file to let training finish. A rank held
there says it is outside its steps (Heartbeat.outside_steps), as a rank in an evaluation
does, so a planned move aims at the boundary after it, not past the leash.

BATON_TEST_CORRUPT_JOINER=1: a joiner of a planned move, right after it loads the replicated
state that arrived, changes one float of its largest parameter by one ulp, as a bug in the
load would. The move's state check (its pass over the large tensors deferred into the next
step) must stop the job before that step commits.

BATON_TEST_HOLD_FOLLOWING=path (with BATON_TEST_FOLLOWING_MARK, a file path): a planned move's
joiner, once it holds the leaver's copy of the replicated state and before it follows any
optimizer step, writes its pid into the mark and waits while `path` exists (at most 120 s): the move stays
in its pre-copy for as long as the test needs to kill someone there.

BATON_TEST_HOLD_HOT_TAKE=path (with BATON_TEST_HOT_TAKE_MARK, a file path): the first hot spare
to take a lost rank over (the mark does not exist yet) writes its pid into the mark as it is
about to take the state from its mirror, and waits while `path` exists (at most 120 s): the
recovery stays there for as long as the test needs to kill it.

BATON_TEST_STEP_COUNT_SKEW="rank:step": after that rank's optimizer step at that step, baton's
count of the steps its parameters hold is one too many, as a bug that applied a step twice
would leave it. baton's own check must stop the job loudly (never exit 0).

BATON_TEST_HOLD_SPARE=path: a worker that starts while that file exists waits before its
warm-up (so before it registers as a spare) until the test removes it (at most 120 s): the
test decides when the job's next spare is ready, however fast spares start.
"""

import os
import sys


def _records_handed_over(rt, timeout: float = 30.0) -> None:  # noqa: ANN001
    """Wait until the rank's records pushed so far are with the kernel (it delivers them after
    a kill): a fault injected in step N then finds its buddy holding head N, however busy the
    machine (a frame still queued for the pusher's thread would die with the rank)."""
    import time

    deadline = time.time() + timeout
    pushers = list(getattr(rt.pusher, "_pushers", {}).values()) if rt is not None else []
    while any(p._backlog or p._busy for p in pushers) and time.time() < deadline:
        time.sleep(0.01)


def _once_at(spec: str):  # noqa: ANN202
    """A predicate true exactly once: on rank `r` in step `k` of the spec "r:k", once per
    process, or once per job where BATON_TEST_ONCE_MARK names a file (a successor that runs
    step k again, its predecessor's last record being of that step's head, does not fire)."""
    rank, step = map(int, spec.split(":"))
    fired = [False]
    mark = os.environ.get("BATON_TEST_ONCE_MARK")

    def due() -> bool:
        from baton.worker import job

        rt = job._RUNTIME[0]
        if fired[0] or rt is None or rt.rank != rank or rt.pos[0] != step or rt.scope != "step" or \
                (mark and os.path.exists(mark)):
            return False
        fired[0] = True
        if mark:
            open(mark, "w").close()
        return True

    return due


def _lose_peer_at(spec: str, register, what: str, go: str | None = None) -> None:  # noqa: ANN001
    """Once, at rank:step `spec`, an optimizer hook (`register`) raises a lost-peer error
    (once the file `go` exists, when given)."""
    due = _once_at(spec)

    def lose(opt, args, kwargs):  # noqa: ANN001
        if not due():
            return
        import time

        from baton.worker.group import CollectiveFailure

        deadline = time.time() + 60
        while go and not os.path.exists(go) and time.time() < deadline:
            time.sleep(0.02)

        print(f"injected: {what}", file=sys.stderr, flush=True)
        raise CollectiveFailure(f"injected: {what}")

    register(lose)


_fail = os.environ.get("BATON_TEST_FAIL_AFTER_ALLREDUCE")
if _fail:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _lose_peer_at(_fail, register_optimizer_step_pre_hook,
                  f"rank {_fail.split(':')[0]} loses step {_fail.split(':')[1]} after its all-reduce",
                  os.environ.get("BATON_TEST_FAIL_AFTER_ALLREDUCE_GO"))

_corrupt = os.environ.get("BATON_TEST_CORRUPT")
if _corrupt:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _corrupt_due = _once_at(_corrupt)

    def _flip(opt, args, kwargs):  # noqa: ANN001
        if not _corrupt_due():
            return
        with torch.no_grad():
            first = opt.param_groups[0]["params"][0]
            flat = (first.to_local() if hasattr(first, "to_local") else first).view(-1)  # a DTensor: its shard
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        print(f"injected: rank {_corrupt.split(':')[0]} corrupted one value at step {_corrupt.split(':')[1]}",
              file=sys.stderr, flush=True)

    register_optimizer_step_post_hook(_flip)

_corrupt_in_recovery = os.environ.get("BATON_TEST_CORRUPT_IN_RECOVERY")
if _corrupt_in_recovery:
    import torch
    from baton.worker import runtime as _runtime

    _original_verify = _runtime.Runtime.verify_state
    _corrupted = [False]

    def _verify_corrupted(self, generation, expected, periodic=False, **kw):  # noqa: ANN001, ANN202
        if not _corrupted[0] and not periodic and self.rank == int(_corrupt_in_recovery) and not self.joiner:
            _corrupted[0] = True
            with torch.no_grad():
                first = self.tracked.optimizers()[0].param_groups[0]["params"][0]
                flat = (first.to_local() if hasattr(first, "to_local") else first).view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
            print(f"injected: rank {self.rank} corrupted one value of its shards in a recovery at {self.pos}",
                  file=sys.stderr, flush=True)
        return _original_verify(self, generation, expected, periodic=periodic, **kw)

    _runtime.Runtime.verify_state = _verify_corrupted

_escape = os.environ.get("BATON_TEST_PEER_LOST_AFTER_COMMIT")
if _escape:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _lose_peer_at(_escape, register_optimizer_step_post_hook,
                  f"a lost peer surfaces on rank {_escape.split(':')[0]} after its step committed")

_stall = os.environ.get("BATON_TEST_STALL_WHILE_PAUSING")
if _stall:
    import time

    from baton.worker.runtime import Runtime

    _pause = Runtime._paused

    _mark = os.environ["BATON_TEST_STALL_MARK"]  # exists once one process has hung (joiners inherit the env)

    def _hang_instead(self, op):  # noqa: ANN001, ANN202
        if self.rank == int(_stall) and not os.path.exists(_mark):
            open(_mark, "w").close()
            print(f"injected: rank {_stall} hangs in its own code before the agreed step {self.ctl.pause_at}",
                  file=sys.stderr, flush=True)
            time.sleep(3600)
        return _pause(self, op)

    Runtime._paused = _hang_instead

_hold = os.environ.get("BATON_TEST_HOLD_AFTER_TAKING_STEP")
if _hold:
    import time

    from baton.worker.runtime import Runtime

    _fetch = Runtime._fetch_state
    _hold_mark = os.environ["BATON_TEST_HOLD_MARK"]
    _held = [False]

    def _fetch_then_hold(self, *args, **kwargs):  # noqa: ANN001, ANN202
        got = _fetch(self, *args, **kwargs)
        if self.rank == int(_hold) and not self.joiner and not _held[0]:
            _held[0] = True
            open(_hold_mark, "w").close()
            print(f"injected: rank {_hold} holds after fetching the completed step", file=sys.stderr, flush=True)
            deadline = time.time() + 60
            while os.path.exists(_hold_mark) and time.time() < deadline:
                time.sleep(0.05)
        return got

    Runtime._fetch_state = _fetch_then_hold

def _when_imported(name: str, patch) -> None:  # noqa: ANN001
    """Run `patch(module)` once `name` is imported, without importing it here: every Python
    process of the job loads this file, inductor's compile workers included, and importing
    baton (and torch) in each of those made a compiled job's first steps miss gloo's timeout.
    Already imported (a zygote that `baton warm` forked imported baton before this ran): now."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):  # noqa: ANN001, ANN202
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


_hold_at = os.environ.get("BATON_TEST_HOLD_AT_STEP")
if _hold_at:
    def _patch_hold(runtime) -> None:  # noqa: ANN001
        import time

        boundary = runtime.Runtime._boundary
        hold_file = os.environ["BATON_TEST_HOLD_FILE"]
        until = [0.0]

        step, onwards = int(_hold_at.rstrip("+")), _hold_at.endswith("+")

        def _hold_then_boundary(self):  # noqa: ANN001, ANN202
            if self.pos[0] == step or (onwards and self.pos[0] > step):
                if not until[0]:
                    until[0] = time.time() + 600
                    if os.path.exists(hold_file):
                        print(f"injected: rank {self.rank} holds before step {_hold_at} until the test lets go",
                              file=sys.stderr, flush=True)
                while os.path.exists(hold_file) and time.time() < until[0] and not self.ctl.attention:
                    time.sleep(0.05)
            return boundary(self)

        runtime.Runtime._boundary = _hold_then_boundary

    _when_imported("baton.worker.runtime", _patch_hold)

_lag_at_head = os.environ.get("BATON_TEST_LAG_AT_HEAD")
if _lag_at_head:
    def _patch_lag(runtime) -> None:  # noqa: ANN001
        import time

        boundary = runtime.Runtime._boundary
        lag_rank, lag_step = (int(x) for x in _lag_at_head.split(":"))
        mark = os.environ["BATON_TEST_SIGNAL_MARK"]
        lagged = [False]

        def _lagging_boundary(self):  # noqa: ANN001, ANN202
            if self.rank == lag_rank and self.pos[0] == lag_step and not lagged[0]:
                lagged[0] = True
                print(f"injected: rank {self.rank} lags at the head of step {lag_step} until the fault fired "
                      "and the orchestrator's command reached it", file=sys.stderr, flush=True)
                deadline = time.time() + 120
                while not (os.path.exists(mark) and self.ctl.attention) and time.time() < deadline:
                    time.sleep(0.02)
            return boundary(self)

        runtime.Runtime._boundary = _lagging_boundary

    _when_imported("baton.worker.runtime", _patch_lag)

_leash = os.environ.get("BATON_TEST_LEASH")
if _leash:
    def _gate() -> int | None:
        try:
            with open(_leash) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):  # removed (let go), or read while the test rewrote it
            return None if not os.path.exists(_leash) else 0

    def _wait_on_leash(rt) -> None:  # noqa: ANN001
        import time

        deadline = time.time() + 600
        held = False
        while not rt.ctl.attention and time.time() < deadline:
            gate = _gate()
            if gate is None or rt.pos[0] < gate:
                break
            if not held:  # as a rank held in an evaluation says: a planned target is not
                held = True  # extrapolated past it (seen: a move aimed 40 steps past a leash
                rt.ctl.outside_steps(True)  # the ranks then ran through, and the job ended first)
            time.sleep(0.02)

    def _patch_leash(runtime) -> None:  # noqa: ANN001
        boundary = runtime.Runtime._boundary

        def _leashed_boundary(self):  # noqa: ANN001, ANN202
            _wait_on_leash(self)
            return boundary(self)

        runtime.Runtime._boundary = _leashed_boundary

    _when_imported("baton.worker.runtime", _patch_leash)

if os.environ.get("BATON_TEST_CORRUPT_JOINER"):
    def _patch_joiner_load(recovery) -> None:  # noqa: ANN001
        load = recovery.Recovery._load_replicated

        def _load_then_flip(self, state, **kw):  # noqa: ANN001, ANN003, ANN202
            load(self, state, **kw)
            if not self.joiner:
                return
            import torch

            p = max((p for d in self.tracked.ddps for p in d.parameters()), key=lambda p: p.numel())
            with torch.no_grad():
                flat = p.view(-1)
                flat[0] = torch.nextafter(flat[0], flat[0] + 1)
            print(f"injected: joiner of rank {self.rank} corrupted one value of a {tuple(p.shape)} parameter",
                  file=sys.stderr, flush=True)

        recovery.Recovery._load_replicated = _load_then_flip

    _when_imported("baton.worker.recovery", _patch_joiner_load)

if os.environ.get("BATON_TEST_HOLD_FOLLOWING"):
    def _patch_follower(precopy) -> None:  # noqa: ANN001
        import time

        fetch_base = precopy.Follower.fetch_base

        def _fetch_then_hold(self):  # noqa: ANN001, ANN202
            state = fetch_base(self)
            with open(os.environ["BATON_TEST_FOLLOWING_MARK"], "w") as mark:
                mark.write(str(os.getpid()))
            print("injected: the joiner holds the leaver's copy and waits before following", file=sys.stderr,
                  flush=True)
            deadline = time.time() + 120
            while os.path.exists(os.environ["BATON_TEST_HOLD_FOLLOWING"]) and time.time() < deadline:
                time.sleep(0.05)
            return state

        precopy.Follower.fetch_base = _fetch_then_hold

    _when_imported("baton.worker.precopy", _patch_follower)

if os.environ.get("BATON_TEST_HOLD_HOT_TAKE"):
    def _patch_hot_take(hot) -> None:  # noqa: ANN001
        import time

        take = hot.HotSpares._state_from_mirror

        def _hold_then_take(self, cmd):  # noqa: ANN001, ANN202
            mark = os.environ["BATON_TEST_HOT_TAKE_MARK"]
            if self.mirror is not None and not os.path.exists(mark):
                with open(mark, "w") as f:
                    f.write(str(os.getpid()))
                print("injected: the hot spare holds before it takes its mirror's state", file=sys.stderr, flush=True)
                deadline = time.time() + 120
                while os.path.exists(os.environ["BATON_TEST_HOLD_HOT_TAKE"]) and time.time() < deadline:
                    time.sleep(0.05)
            return take(self, cmd)

        hot.HotSpares._state_from_mirror = _hold_then_take

    _when_imported("baton.worker.hot", _patch_hot_take)

_hold_spare = os.environ.get("BATON_TEST_HOLD_SPARE")
if _hold_spare:
    def _patch_hold_spare(job_module):  # noqa: ANN001, ANN202
        warm_up = job_module._warm_up

        def _held_then_warm_up():  # noqa: ANN202
            import time

            deadline = time.time() + 120
            while os.path.exists(_hold_spare) and time.time() < deadline:
                time.sleep(0.05)
            warm_up()

        job_module._warm_up = _held_then_warm_up

    _when_imported("baton.worker.job", _patch_hold_spare)

_skew = os.environ.get("BATON_TEST_STEP_COUNT_SKEW")
if _skew:
    from baton.worker.runtime import Runtime

    _end_step = Runtime._end_step
    _skew_rank, _skew_step = map(int, _skew.split(":"))

    def _end_then_skew(self, step):  # noqa: ANN001, ANN202
        due = self.rank == _skew_rank and step.index == _skew_step and not step.failed
        _end_step(self, step)
        if due:
            self.params_step += 1
            print(f"injected: rank {_skew_rank} miscounts its steps at step {_skew_step}", file=sys.stderr, flush=True)

    Runtime._end_step = _end_then_skew

_slow = os.environ.get("BATON_TEST_SLOW_SLOT")
if _slow:
    import time

    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.nn.parallel import DistributedDataParallel

    _slow_slot, _slow_s, _slow_from = _slow.rsplit(":", 2)[0], float(_slow.rsplit(":", 2)[1]), int(_slow.rsplit(":", 2)[2])

    def _throttle(module, args):  # noqa: ANN001, ANN202
        from baton.worker import job

        rt = job._RUNTIME[0]
        # The slot is read here, not at import: this file runs once, in the zygote that forks every worker.
        if isinstance(module, DistributedDataParallel) and rt is not None and rt.pos[0] >= _slow_from \
                and rt.scope == "step" and os.environ.get("BATON_SLOT") == _slow_slot:
            time.sleep(_slow_s)

    register_module_forward_pre_hook(_throttle)

if os.environ.get("BATON_TEST_NO_BUDDY_COPY"):
    from baton.worker import runtime as _runtime_no_copy

    _runtime_no_copy.Runtime._copy_digests = lambda self: []

_REBUDDIED: list[bool] = []  # a move gave this process a new buddy (in place of another)
_slow_new_buddy = os.environ.get("BATON_TEST_SLOW_NEW_BUDDY")
if os.environ.get("BATON_TEST_SIGNAL_MID_STEP", "").count(":rebuddied:") or _slow_new_buddy:
    from baton.worker import bundle as _bundle

    _set_buddies = _bundle.BundlePushers.set_buddies

    def _note_new_buddies(self, addrs):  # noqa: ANN001, ANN202
        had = set(self._pushers)
        _set_buddies(self, addrs)
        replacing = [a for a in self._pushers if a not in had] if had else []
        if replacing:
            _REBUDDIED.append(True)
        for addr in replacing if _slow_new_buddy else ():
            pusher, connect = self._pushers[addr], self._pushers[addr]._connect

            def slow(a, connect=connect):  # noqa: ANN001, ANN202
                import time

                time.sleep(float(_slow_new_buddy))
                return connect(a)
            pusher._connect = slow

    _bundle.BundlePushers.set_buddies = _note_new_buddies

_signal_mid_step = os.environ.get("BATON_TEST_SIGNAL_MID_STEP")
if _signal_mid_step:
    import signal

    import torch

    _sig_rank, _sig_step, _sig_name = _signal_mid_step.split(":")
    _sig_due = _once_at(f"{_sig_rank}:{_sig_step}") if _sig_step.isdigit() else None
    _first_step: list[int] = []  # the step this process first ran (0 in a rank that started the job)

    def _joined_due() -> bool:
        """"joined+N": in a process that took its rank over, once it has run N steps of its own."""
        from baton.worker import job

        rt = job._RUNTIME[0]
        if rt is None or rt.rank != int(_sig_rank):
            return False
        if not _first_step:  # its first backward (before the no-code mode finds the step loop, in a rank
            _first_step.append(rt.pos[0])  # that started the job)
        return rt.scope == "step" and _first_step[0] > 0 and rt.pos[0] >= _first_step[0] + int(_sig_step.split("+")[1])
    _backward = torch.Tensor.backward

    def _rebuddied_due() -> bool:
        from baton.worker import job

        rt = job._RUNTIME[0]
        return rt is not None and rt.rank == int(_sig_rank) and rt.scope == "step" and bool(_REBUDDIED)

    _sig_mark = os.environ["BATON_TEST_SIGNAL_MARK"]  # made when it fires: the rank's successor inherits the env

    _sig_go = os.environ.get("BATON_TEST_SIGNAL_GO")  # with it, "rank:go:SIGNAME": once that file exists

    def _go_due() -> bool:
        from baton.worker import job

        rt = job._RUNTIME[0]
        return rt is not None and rt.rank == int(_sig_rank) and rt.scope == "step" and os.path.exists(_sig_go)

    def _signal_then_backward(self, *args, **kwargs):  # noqa: ANN001, ANN202
        due = _go_due if _sig_step == "go" else _rebuddied_due if _sig_step == "rebuddied" else \
            _joined_due if "+" in _sig_step else _sig_due
        if not os.path.exists(_sig_mark) and due():
            from baton.worker import job as _job

            _records_handed_over(_job._RUNTIME[0])
            open(_sig_mark, "w").close()
            print(f"injected: {_sig_name} to rank {_sig_rank} in step {_sig_step}, before its backward",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), getattr(signal, _sig_name))
        return _backward(self, *args, **kwargs)

    torch.Tensor.backward = _signal_then_backward


def _signal_once_in(spec: str, scope: str, what: str, exact: bool = False) -> None:
    """Send "rank:step:SIGNAME" once per job (BATON_TEST_SIGNAL_MARK), in that rank, in `scope`,
    at that step (`exact`) or once past it."""
    import signal

    from baton.worker import job

    rank, step, name = spec.split(":")
    mark = os.environ["BATON_TEST_SIGNAL_MARK"]
    rt = job._RUNTIME[0]
    if rt is None or rt.rank != int(rank) or rt.scope != scope or os.path.exists(mark) or \
            (rt.pos[0] != int(step) if exact else rt.pos[0] < int(step)):
        return
    open(mark, "w").close()
    print(f"injected: {name} to rank {rank} {what} {rt.pos[0]}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), getattr(signal, name))


def _signal_before(owner, name: str, spec: str, what: str) -> None:  # noqa: ANN001
    """`owner.name` signals once (`spec`, in the region after the step loop) before it runs."""
    original = getattr(owner, name)

    def signalled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        _signal_once_in(spec, "region", what)
        return original(*args, **kwargs)

    setattr(owner, name, signalled)


_signal_in_region = os.environ.get("BATON_TEST_SIGNAL_IN_REGION")
if _signal_in_region:
    import torch.distributed as _dist

    _signal_before(_dist, "all_reduce", _signal_in_region, "in the region after step")

_glitch_in_region = os.environ.get("BATON_TEST_GLITCH_IN_REGION")
_glitch_after_step = os.environ.get("BATON_TEST_GLITCH_AFTER_STEP")
if _glitch_in_region or _glitch_after_step:
    from baton.worker import collectives as _collectives

    _run = _collectives.RecordingGroup._run

    def _glitch_after(self, op, outputs, inputs, issue):  # noqa: ANN001, ANN202
        import time

        rank, step = (_glitch_in_region or _glitch_after_step).split(":")
        rt, mark = self.rt, os.environ["BATON_TEST_SIGNAL_MARK"]
        armed, peer_done = mark + ".armed", mark + ".peer"  # the glitching rank's collective: its number
        if rt.rank != int(rank):  # the other rank: says when it has completed that collective
            out = _run(self, op, outputs, inputs, issue)
            if os.path.exists(armed) and not os.path.exists(peer_done):
                with open(armed) as f:
                    if f.read() == str(len(rt.collective_record()[0].ops)):
                        open(peer_done, "w").close()
            return out
        where = rt.scope == "region" if _glitch_in_region else (rt.scope == "step" and rt.committed)
        if not where or rt.pos[0] < int(step) or os.path.exists(mark):
            return _run(self, op, outputs, inputs, issue)
        with open(armed, "w") as f:
            f.write(str(len(rt.collective_record()[0].ops) + 1))

        def completes_then_fails(group):  # noqa: ANN001, ANN202
            issue(group).wait()
            if not os.path.exists(mark):
                # Fails only once the other rank has the result too (else its own collective
                # could fail as this one breaks the connection, and no rank would be ahead).
                deadline = time.time() + 60
                while not os.path.exists(peer_done) and time.time() < deadline:
                    time.sleep(0.002)
                open(mark, "w").close()
                print(f"injected: rank {rank}'s {op} {'in the region after' if _glitch_in_region else 'after the optimizer step of'} "
                      f"step {rt.pos[0]} completed, then failed", file=sys.stderr, flush=True)
                from baton.worker.group import CollectiveFailure

                raise CollectiveFailure("injected: the data path dropped the collective's last bytes")
            return issue(group)
        return _run(self, op, outputs, inputs, completes_then_fails)

    _collectives.RecordingGroup._run = _glitch_after

_signal_in_save = os.environ.get("BATON_TEST_SIGNAL_IN_SAVE")
if _signal_in_save:
    import torch as _torch

    _signal_before(_torch, "save", _signal_in_save, "saving in the region after step")

_signal_at_exit = os.environ.get("BATON_TEST_SIGNAL_AT_EXIT")
if _signal_at_exit:
    from baton.transparent import script_runtime as _script_runtime

    _at_exit = _script_runtime.ScriptRuntime.at_exit

    def _signal_at_loop_exit(self, section):  # noqa: ANN001, ANN202
        import time

        exits = os.environ["BATON_TEST_SIGNAL_MARK"] + f".exit{self.pos[0]}.rank"
        open(f"{exits}{self.rank}", "w").close()  # every rank, at every exit of its step loop
        rank, step = map(int, _signal_at_exit.split(":")[:2])
        if self.rank == rank and self.pos[0] >= step and not os.path.exists(os.environ["BATON_TEST_SIGNAL_MARK"]):
            # the others past this exit too (in the region after it, however slow the machine),
            # and this rank's record of its last head with the kernel
            deadline = time.time() + 60
            while not all(os.path.exists(f"{exits}{r}") for r in range(self.world_size)) and time.time() < deadline:
                time.sleep(0.01)
            _records_handed_over(self)
            _signal_once_in(_signal_at_exit, "step", "at its step loop's exit at step")
        return _at_exit(self, section)

    _script_runtime.ScriptRuntime.at_exit = _signal_at_loop_exit

_signal_after_step = os.environ.get("BATON_TEST_SIGNAL_AFTER_STEP")
if _signal_after_step:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _after_every_rank_stepped(*_: object) -> None:
        """The signal lands once every other rank has finished its optimizer step of that step
        too (files beside the mark, at most 60 s): on a busy machine a peer still short of its
        optimizer step took the Abort there and ran the whole step again, another path than
        the one the test names (CI: a successor that never ran the step again)."""
        import time

        from baton.worker import job

        rank, step, _ = _signal_after_step.split(":")
        rt, mark = job._RUNTIME[0], os.environ["BATON_TEST_SIGNAL_MARK"]
        if rt is None or rt.scope != "step" or rt.pos[0] != int(step) or os.path.exists(mark):
            return
        if rt.rank != int(rank):
            open(f"{mark}.stepped.{rt.rank}", "w").close()
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(f"{mark}.stepped.{r}") for r in range(rt.world_size) if r != rt.rank):
            time.sleep(0.01)
        _signal_once_in(_signal_after_step, "step", "after its optimizer step in step", exact=True)

    register_optimizer_step_post_hook(_after_every_rank_stepped)

_leaver_dies = os.environ.get("BATON_TEST_LEAVER_DIES_SERVING")
if _leaver_dies:
    import signal as _signal

    from baton.transfer import server as _server

    import threading as _threading

    _wait_published = _server.TransferServer._wait_published
    _send_state = _server.TransferServer._send_state
    _own_sent = _threading.Event()

    def _note_own_sent(self, conn, state, chunks, views):  # noqa: ANN001, ANN202
        _send_state(self, conn, state, chunks, views)  # returns once the successor acknowledged every chunk
        own = self._published.get(_server.FETCH_OWN)
        if own is not None and own[1] is state:
            _own_sent.set()

    def _die_serving_the_rest(self, generation, kind=_server.FETCH):  # noqa: ANN001, ANN202
        """A planned move's leaver (no-code mode) dies once its successor has its own record
        and asks for the rest: the successor is walking to the rank's place by then. (It asks
        for the rest first, to overlap the two: the death waits until the own record is sent.)
        With "own": as the successor asks for that own record, which it never gets."""
        mark = os.environ["BATON_TEST_SIGNAL_MARK"]
        found = _wait_published(self, generation, kind)  # the ask may come before the leaver published
        own = self._published.get(_server.FETCH_OWN)
        if _leaver_dies == "own":
            dies = found is not None and kind == _server.FETCH_OWN and not os.path.exists(mark)
        else:
            dies = found is not None and kind == _server.FETCH and own is not None and own[0] == generation \
                and not os.path.exists(mark)
            if dies:
                _own_sent.wait(60)
        if dies:
            open(mark, "w").close()
            print(f"injected: SIGKILL to a leaver serving generation {generation}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), _signal.SIGKILL)
        return found

    _server.TransferServer._wait_published = _die_serving_the_rest
    _server.TransferServer._send_state = _note_own_sent

_slow_joiner_setup = os.environ.get("BATON_TEST_SLOW_JOINER_SETUP")
if _slow_joiner_setup:
    def _patch_slow_setup(module):  # noqa: ANN001, ANN202
        setup_done = module.ScriptRuntime.setup_done

        def _slowly_done(self):  # noqa: ANN001, ANN202
            """A joiner's script setup that takes as long as building a large model would."""
            if self.joiner and not self.setup_s:
                import time

                time.sleep(float(_slow_joiner_setup))
            setup_done(self)

        module.ScriptRuntime.setup_done = _slowly_done

    _when_imported("baton.transparent.script_runtime", _patch_slow_setup)

_link_down = os.environ.get("BATON_TEST_LINK_DOWN_MID_STEP")
if _link_down:
    import subprocess as _subprocess

    import torch as _torch_ld

    _ld_rank, _ld_step, _ld_iface = _link_down.split(":")
    _ld_due = _once_at(f"{_ld_rank}:{_ld_step}")
    _ld_backward = _torch_ld.Tensor.backward

    def _link_down_then_backward(self, *args, **kwargs):  # noqa: ANN001, ANN202
        mark = os.environ["BATON_TEST_SIGNAL_MARK"]
        if not os.path.exists(mark) and _ld_due():
            open(mark, "w").close()
            _subprocess.run(["ip", "link", "set", _ld_iface, "down"], check=True)
            print(f"injected: {_ld_iface} down on rank {_ld_rank}'s node in step {_ld_step}, before its backward",
                  file=sys.stderr, flush=True)
        return _ld_backward(self, *args, **kwargs)

    _torch_ld.Tensor.backward = _link_down_then_backward
