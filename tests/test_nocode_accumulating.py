"""Losses at every place of a step that spans several iterations, in a script shaped as the
recipes people run (tests/nocode/accumulating_amp.py): gradient accumulation with DDP's
no_sync(), fp16 autocast with GradScaler skipping the steps whose gradients overflow,
BatchNorm and dropout, clipping, a OneCycle schedule stepped per optimizer step, a
validation that all-reduces after each epoch's step loop, rank 0's checkpoint, and a resume
block that a successor finds an older checkpoint for. Each loss ends with every rank, and
the checkpoint, bit for bit equal to the same file under torchrun, exit 0, one unplanned
move resolved."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.jobs import Job
from tests.nocode_runs import NOCODE, compare, differences, faulted

SCRIPT = NOCODE / "accumulating_amp.py"
ARGS = ["--epochs", "3"]  # 8 optimizer steps an epoch, of 2 micro-batches each; 6 of the 24 skipped by GradScaler


@pytest.mark.parametrize("where, fault", [
    ("AFTER_STEP", "1:5:SIGKILL"),  # after an optimizer step: the successor runs both micro-batches again
    ("MID_STEP", "0:10:SIGKILL"),  # rank 0, in the first micro-batch's backward, inside no_sync()
    ("MID_STEP", "1:13:SIGSTOP"),  # hung in a step
    ("IN_REGION", "1:8:SIGKILL"),  # in the validation's all_reduce after the epoch's step loop
    ("IN_SAVE", "0:16:SIGKILL"),  # rank 0 writing its checkpoint
])
def test_a_rank_lost_anywhere_in_an_accumulating_amp_trainer_is_replaced_bit_for_bit(
        tmp_path, torchrun_reference, where, fault):
    ref = torchrun_reference(SCRIPT, [*ARGS, "--checkpoint", "{d}/ckpt.pt", "--export", "{d}/export"])
    assert torch.load(ref / "export" / "rank0.pt", weights_only=False)["skipped"] > 0  # GradScaler skipped steps
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, SCRIPT, fault, where=where,
                        script_args=[*ARGS, "--checkpoint", str(run / "ckpt.pt"), "--export", str(run / "export")])
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    written = [torch.load(d / "ckpt.pt", weights_only=False) for d in (ref, run)]
    assert differences(*written) == [], "ckpt.pt"
    events = job.events()
    assert [(e["kind"], e["status"], e["steps_lost"]) for e in events] == [("unplanned", "resolved", 0)], events


def test_a_rank_moved_where_its_epoch_ends_takes_what_the_epoch_carried(tmp_path, torchrun_reference):
    """With one optimizer step an epoch (16 micro-batches accumulated), each move's boundary is
    the head after an epoch's last item, where the successor's loop runs out as soon as it
    arrives: the epoch's meter and skipped-step count it carried come back after the loop,
    before train() returns them (seen: the successor returned a fresh meter and count, an
    exit-0 divergence of the history every rank exports)."""
    args = ["--epochs", "200", "--accum", "16"]
    ref = torchrun_reference(SCRIPT, [*args, "--checkpoint", "{d}/ckpt.pt", "--export", "{d}/export"])
    run = tmp_path / "job"
    job = Job(tmp_path, nproc=2, spares=2, script=SCRIPT, out_arg=False, name="job",
              script_args=[*args, "--checkpoint", str(run / "ckpt.pt"), "--export", str(run / "export")])
    try:
        job.wait_step(4, timeout=120)
        for n, request in enumerate((["migrate", "--rank", "1"], ["migrate", "--rank", "0"]), start=1):
            out = subprocess.run([sys.executable, "-m", "baton.cli", *request, "--run-dir", str(job.run_dir)],
                                 capture_output=True, text=True, timeout=60, cwd=job.dir)
            assert out.returncode == 0, out.stderr
            job.wait_until(lambda st, n=n: st["operation"] is None and len(
                [e for e in job.events() if e["status"] == "resolved"]) >= n, timeout=120, what=f"{n} moves")
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("planned", "resolved")] * 2, job.events()
