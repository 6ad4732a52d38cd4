"""A model on the GPU: run only where CUDA is (a lent GPU machine, `bash bench/gpu_session.sh`
with `CUDA_TESTS=1`); skipped everywhere else, CI included.

The recipe-shaped trainer (tests/nocode/accumulating_amp.py: BatchNorm, dropout, fp16 autocast
with a GradScaler, accumulation under no_sync(), OneCycle, a validation all-reduce, rank 0's
checkpoint) with `--device cuda`, unchanged, under `baton run`: a planned move of rank 1, a
taint of rank 0's slot and a kill -9 of rank 1 mid-step, against the same file under torchrun,
bit for bit (parameters, optimizer, scheduler, scaler, CPU and CUDA random streams, the
checkpoint). Both ranks share the one GPU over gloo (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.nocode_runs import compare, differences
from tests.test_nocode_moves import _relative, _torchrun_then_job, planned_taint_then_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_a_gpu_model_moves_planned_preemptive_and_unplanned_bit_for_bit(tmp_path, torchrun_reference):
    go = tmp_path / "go"
    args = ["--epochs", "150", "--checkpoint", "{d}/ckpt.pt", "--device", "cuda"]
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, "accumulating_amp.py", args,
                                       {"BATON_TEST_SIGNAL_MID_STEP": "1:go:SIGKILL", "BATON_TEST_SIGNAL_GO": str(go)})
    try:
        st = job.wait_step(8, timeout=120)
        assert st["mode"] == "no-code", st
        planned_taint_then_loss(job, go)  # the kill lands in rank 1's next step, after its forward
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    written = [_relative(torch.load(d / "ckpt.pt", weights_only=False), d) for d in (ref, run)]
    assert differences(*written) == []
    events = job.events()
    assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == [
        ("planned", 1, "resolved", 0), ("pre-emptive", 0, "resolved", 0), ("unplanned", 1, "resolved", 0)], events
    print("ledger:", [(e["kind"], e["downtime_s"], e.get("phases")) for e in events])
