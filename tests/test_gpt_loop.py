"""A nanoGPT-shaped loop (iteration-based, `torch.randint` batches drawn inside the step,
gradient accumulation with `no_sync()`, hand-set warm-up + cosine LR, bf16 autocast,
clipping, an evaluation every 15 steps with random batches and an `all_reduce`, rank 0's
best validation loss and checkpoint, a resume block): planned, taint, kill -9 and SIGSTOP,
inside a step and during evaluation, end with every rank's state bit-for-bit equal to the
failure-free run."""

from __future__ import annotations

import shutil
import signal

import pytest
import torch

from tests.gpt_job import NPROC, check_equal, gpt_job, in_eval, states
from tests.jobs import state_diff


def _check(job, reference, kinds: list[str]) -> list[dict]:
    events = check_equal(job, reference)
    assert [e["kind"] for e in events] == kinds, events
    assert all(e["status"] == "resolved" and e["steps_lost"] == 0 and e["resolved_without_rollback"]
               for e in events), events
    return events


def test_planned_move_inside_a_step(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "planned")
    try:
        job.wait_step(4)
        job.client.migrate(2)
        _check(job, gpt_reference, ["planned"])
    finally:
        job.kill()


def test_taint_during_evaluation(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "taint")
    try:
        in_eval(job)
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 0)
        job.client.taint(slot, "ecc")
        events = _check(job, gpt_reference, ["pre-emptive"])
        assert events[0]["rank"] == 0 and events[0]["from_slot"] == slot
    finally:
        job.kill()


def test_kill_9_rank_0_inside_a_step(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "kill0")
    try:
        job.wait_step(5)
        job.signal_rank(0, signal.SIGKILL)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 0
    finally:
        job.kill()


def test_kill_9_during_evaluation(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "kill1eval")
    try:
        in_eval(job)
        job.signal_rank(1, signal.SIGKILL)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 1
    finally:
        job.kill()


def test_sigstop_during_evaluation(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "stop2eval", run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        in_eval(job)
        job.signal_rank(2, signal.SIGSTOP)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 2 and "hung" in events[0]["cause"]
    finally:
        job.kill()


@pytest.mark.timeout(480)
def test_resumed_run_survives_a_kill(tmp_path):
    """A run resumed from rank 0's checkpoint (`job.steps(total, start=...)`); the joiner skips
    the resume block (job.joined) and still starts where its rank was, with the same LR."""
    first = gpt_job(tmp_path, "first", spares=0, extra=["--max-iters", "30"])
    assert first.wait(timeout=180) == 0, first.log()
    ckpt = first.dir / "ckpt" / "ckpt.pt"
    assert torch.load(ckpt)["iter_num"] == 30
    runs = {}
    for name, spares in (("resumed-ref", 0), ("resumed-kill", 1)):
        (tmp_path / name / "ckpt").mkdir(parents=True)
        shutil.copy(ckpt, tmp_path / name / "ckpt" / "ckpt.pt")
        job = gpt_job(tmp_path, name, spares=spares, extra=["--max-iters", "60", "--resume"])
        try:
            if spares:
                job.wait_step(36)
                job.signal_rank(1, signal.SIGKILL)
            assert job.wait(timeout=180) == 0, job.log()
            runs[name] = states(job)
            if spares:
                assert [e["kind"] for e in job.events()] == ["unplanned"]
        finally:
            job.kill()
    for rank in range(NPROC):
        d = state_diff(runs["resumed-ref"][rank], runs["resumed-kill"][rank])
        assert not d, f"rank {rank} differs after a kill in a resumed run: {d}"
