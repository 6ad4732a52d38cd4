"""An epoch loop in the shape of real training scripts (BatchNorm, dropout, StepLR, GradScaler
with bf16 autocast, validation with an all_reduce in a boundary function, rank 0's best
accuracy as rank-local state, a shuffled sampler): every kind of failure, inside a step and
during validation, ends with every rank's full state bit-for-bit equal to the failure-free
run, including its random stream."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.jobs import Job, check_resolved_exact, state_diff

EPOCHS = Path(__file__).resolve().parent.parent / "baton" / "examples" / "epochs.py"
NPROC = 3
STEPS_PER_EPOCH = 16  # 384 samples / 3 ranks / batch 8
ARGS = ["--epochs", "4", "--step-sleep", "0.04", "--val-sleep", "0.4"]


def _job(tmp: Path, name: str, spares: int = 1, run_args: list[str] | None = None) -> Job:
    job = Job(tmp, nproc=NPROC, spares=spares, steps=0, script_args=ARGS, run_args=run_args, name=name,
              script=EPOCHS)
    return job


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("ref"), "ref", spares=0)
    assert job.wait(timeout=180) == 0, job.log()
    states = job.all_rank_params(NPROC)
    # BatchNorm statistics and random streams are each rank's own; parameters are shared.
    assert not [k for k in state_diff(states[0], states[1]) if k.startswith("model.conv")]
    return states


def _check(job: Job, reference) -> list[dict]:
    return check_resolved_exact(job, reference, timeout=240)


def test_planned_move_mid_epoch(tmp_path, reference):
    job = _job(tmp_path, "planned")
    try:
        job.wait_step(5)
        job.client.migrate(1)
        events = _check(job, reference)
        assert [e["kind"] for e in events] == ["planned"]
    finally:
        job.kill()


@pytest.mark.parametrize("rank", [0, 2])
def test_kill_9_inside_a_step(tmp_path, reference, rank):
    job = _job(tmp_path, f"kill{rank}")
    try:
        job.wait_step(6)
        job.signal_rank(rank, signal.SIGKILL)
        events = _check(job, reference)
        assert [e["kind"] for e in events] == ["unplanned"] and events[0]["rank"] == rank
    finally:
        job.kill()


@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_during_validation(tmp_path, reference, rank):
    """Validation (a boundary function with an all_reduce) runs ~1 s after each epoch's last step."""
    job = _job(tmp_path, f"val{rank}")
    try:
        job.wait_until(lambda st: min(r["step"] for r in st["ranks"]) >= STEPS_PER_EPOCH, what="epoch end")
        job.signal_rank(rank, signal.SIGKILL)
        events = _check(job, reference)
        assert events[0]["kind"] == "unplanned" and events[0]["rank"] == rank
    finally:
        job.kill()


def test_sigstop_is_detected_and_replaced(tmp_path, reference):
    job = _job(tmp_path, "stop", run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        job.wait_step(6)
        job.signal_rank(1, signal.SIGSTOP)
        events = _check(job, reference)
        assert events[0]["kind"] == "unplanned" and "hung" in events[0]["cause"]
    finally:
        job.kill()


def test_taint_during_validation(tmp_path, reference):
    job = _job(tmp_path, "taint-val")
    try:
        job.wait_until(lambda st: min(r["step"] for r in st["ranks"]) >= STEPS_PER_EPOCH, what="epoch end")
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 2)
        job.client.taint(slot, "thermal")
        events = _check(job, reference)
        assert [e["kind"] for e in events] == ["pre-emptive"] and events[0]["from_slot"] == slot
    finally:
        job.kill()


def test_sigstop_during_validation(tmp_path, reference):
    job = _job(tmp_path, "stop-val", run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        job.wait_until(lambda st: min(r["step"] for r in st["ranks"]) >= STEPS_PER_EPOCH, what="epoch end")
        job.signal_rank(0, signal.SIGSTOP)
        events = _check(job, reference)
        assert events[0]["kind"] == "unplanned" and events[0]["rank"] == 0 and "hung" in events[0]["cause"]
    finally:
        job.kill()
