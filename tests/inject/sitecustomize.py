"""Fault injection for tests, loaded by putting this directory on PYTHONPATH.

BATON_TEST_FAIL_AFTER_ALLREDUCE="rank:step": that rank loses that step after its gradient
all-reduce completed everywhere, just before its optimizer.step(), as a rank does when a
peer is lost at the very end of the all-reduce. The others complete the step; this rank
must take their result, never re-run it. Random signals reach this path rarely; this
reaches it every time.
"""

import os
import sys

_spec = os.environ.get("BATON_TEST_FAIL_AFTER_ALLREDUCE")
if _spec:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _rank, _step = map(int, _spec.split(":"))
    _fired = [False]

    def _hook(opt, args, kwargs):  # noqa: ANN001
        from baton.worker import job
        from baton.worker.group import CollectiveFailure

        rt = job._RUNTIME[0]
        if rt is None or _fired[0] or rt.rank != _rank or rt.pos[0] != _step or rt.scope != "step":
            return
        _fired[0] = True
        print(f"injected: rank {_rank} loses step {_step} after its all-reduce", file=sys.stderr, flush=True)
        raise CollectiveFailure("injected: this rank lost the step after its all-reduce completed")

    register_optimizer_step_pre_hook(_hook)

# BATON_TEST_CORRUPT="rank:step": after that rank's optimizer step at that step, one float of
# its first parameter changes by one ulp, as silent data corruption in memory would.
_corrupt = os.environ.get("BATON_TEST_CORRUPT")
if _corrupt:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _c_rank, _c_step = map(int, _corrupt.split(":"))
    _c_fired = [False]

    def _flip(opt, args, kwargs):  # noqa: ANN001
        from baton.worker import job

        rt = job._RUNTIME[0]
        if rt is None or _c_fired[0] or rt.rank != _c_rank or rt.pos[0] != _c_step:
            return
        _c_fired[0] = True
        p = opt.param_groups[0]["params"][0]
        with torch.no_grad():
            flat = p.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        print(f"injected: rank {_c_rank} corrupted one value at step {_c_step}", file=sys.stderr, flush=True)

    register_optimizer_step_post_hook(_flip)
