"""Hot spares (`baton run --hot-spares`): the spare mirrors the replicated state from one rank's
gradients at every step, and a lost rank's replacement takes only its own state and the
small state. Scripts in the shape of real ones (BatchNorm, dropout, SGD + StepLR, GradScaler
with bf16 autocast, validation with an all_reduce, rank 0's checkpoint; the nanoGPT-shaped
loop with AdamW, accumulation and clipping), bitwise against the failure-free run, exit 0.

A kill of the feeding rank or of the hot spare itself falls back to the ordinary paths:
another spare, or the whole state from a survivor; never a hang, never exit 0 with other
state."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.jobs import Job, check_resolved_exact
from tests.once import once

EPOCHS = Path(__file__).resolve().parent.parent / "baton" / "examples" / "epochs.py"
NPROC = 3
ARGS = ["--epochs", "3", "--augment", "--step-sleep", "0.04", "--val-sleep", "0.4"]


def _job(tmp: Path, name: str, spares: int = 1, hot: bool = True) -> Job:
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script_args=ARGS, name=name, script=EPOCHS,
               run_args=["--hot-spares"] if hot else None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "hot-spares", _reference)


def _reference(tmp):
    job = _job(tmp, "ref", spares=0, hot=False)
    assert job.wait(timeout=180) == 0, job.log()
    return job.all_rank_params(NPROC)


def _hot(job: Job, timeout: float = 120.0) -> dict:
    """Wait until a spare's mirror keeps pace with the feeding rank; the job's status then."""
    return job.wait_until(lambda s: any(sp.get("hot", {}).get("state") == "current" for sp in s["spares"]),
                          timeout=timeout, what="a hot spare keeping pace")


def test_a_rank_lost_mid_step_is_rebuilt_from_the_hot_spares_mirror(tmp_path, reference):
    """kill -9 of a rank that does not feed: its replacement takes the replicated state from its
    mirror (only its own and the small state move), bitwise."""
    job = _job(tmp_path, "hot")
    try:
        job.wait_step(4)
        _hot(job)
        job.signal_rank(2, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 2)], events
    hot = events[0]["hot_spare"]
    assert hot and hot["used"], events[0]
    assert events[0]["state_bytes"] < 20_000, events[0]  # the rank's own and the small state, not the model


def test_the_feeding_rank_lost_falls_back_or_uses_what_it_served(tmp_path, reference):
    """kill -9 of the rank that feeds the spare (rank 0, the lowest): the mirror holds every step it served;
    if it lacks the last, the replacement fetches the whole state from a survivor. Bitwise."""
    job = _job(tmp_path, "feeder")
    try:
        job.wait_step(4)
        _hot(job)
        job.signal_rank(0, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 0)], events
    hot = events[0]["hot_spare"]
    assert hot is not None and (hot["used"] or hot["detail"]), events[0]


def test_a_hot_spare_killed_while_it_follows_is_replaced_and_the_next_loss_is_still_exact(tmp_path, reference):
    """kill -9 of the hot spare itself: a new spare starts and mirrors the state from the
    current feed; then a rank lost is rebuilt, bitwise."""
    job = _job(tmp_path, "spare-lost")
    try:
        job.wait_step(3)
        st = _hot(job)
        os.kill(st["spares"][0]["pid"], signal.SIGKILL)
        job.wait_until(lambda s: any(sp["pid"] != st["spares"][0]["pid"] and sp.get("hot", {}).get("state") ==
                                     "current" for sp in s["spares"]), timeout=120, what="a new hot spare")
        job.signal_rank(1, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 1)], events
    assert events[0]["hot_spare"]["used"], events[0]
