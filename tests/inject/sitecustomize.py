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
