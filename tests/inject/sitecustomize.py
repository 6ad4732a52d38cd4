"""Fault injection for tests, loaded by putting this directory on PYTHONPATH.

BATON_TEST_FAIL_AFTER_ALLREDUCE="rank:step": that rank loses that step after its gradient
all-reduce completed everywhere, just before its optimizer.step(), as a rank does when a
peer is lost at the very end of the all-reduce. The others complete the step; this rank
must take their result, never re-run it. Random signals reach this path rarely; this
reaches it every time.

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
"""

import os
import sys


def _once_at(spec: str):  # noqa: ANN202
    """A predicate true exactly once: on rank `r` in step `k` of the spec "r:k"."""
    rank, step = map(int, spec.split(":"))
    fired = [False]

    def due() -> bool:
        from baton.worker import job

        rt = job._RUNTIME[0]
        if fired[0] or rt is None or rt.rank != rank or rt.pos[0] != step or rt.scope != "step":
            return False
        fired[0] = True
        return True

    return due


def _lose_peer_at(spec: str, register, what: str) -> None:  # noqa: ANN001
    """Once, at rank:step `spec`, an optimizer hook (`register`) raises a lost-peer error."""
    due = _once_at(spec)

    def lose(opt, args, kwargs):  # noqa: ANN001
        if not due():
            return
        from baton.worker.group import CollectiveFailure

        print(f"injected: {what}", file=sys.stderr, flush=True)
        raise CollectiveFailure(f"injected: {what}")

    register(lose)


_fail = os.environ.get("BATON_TEST_FAIL_AFTER_ALLREDUCE")
if _fail:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _lose_peer_at(_fail, register_optimizer_step_pre_hook,
                  f"rank {_fail.split(':')[0]} loses step {_fail.split(':')[1]} after its all-reduce")

_corrupt = os.environ.get("BATON_TEST_CORRUPT")
if _corrupt:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _corrupt_due = _once_at(_corrupt)

    def _flip(opt, args, kwargs):  # noqa: ANN001
        if not _corrupt_due():
            return
        with torch.no_grad():
            flat = opt.param_groups[0]["params"][0].view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        print(f"injected: rank {_corrupt.split(':')[0]} corrupted one value at step {_corrupt.split(':')[1]}",
              file=sys.stderr, flush=True)

    register_optimizer_step_post_hook(_flip)

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
