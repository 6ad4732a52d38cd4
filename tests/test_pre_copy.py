"""Pre-copied planned moves (baton/worker/precopy.py): the joiner copies the replicated state
while training goes on and follows the leaver's optimizer steps; the pause moves only the
rank's own state. What it cannot follow, and every death during it, falls back to the paths
without it: bitwise, never a hang, never exit 0 with other state.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.jobs import Job, bitwise_equal

NPROC, STEPS = 3, 150
ARGS = ["--width", "128", "--step-sleep", "0.02"]
INJECT = str(Path(__file__).resolve().parent / "inject")


def _equal_to(job: Job, reference: list) -> None:
    for rank, (got, want) in enumerate(zip(job.all_rank_params(NPROC), reference)):
        assert bitwise_equal(got, want), f"rank {rank} differs from the run without a move:\n{job.log()}"


def test_a_joiner_that_cannot_follow_takes_the_whole_state_bitwise(tmp_path, train_reference):
    """The script clips its weights after each optimizer step (as WGAN's critic does): the
    leaver's version counters see the parameters change outside the optimizer, the joiner
    says it cannot follow, and the move takes the whole state in its pause, bitwise."""
    args = [*ARGS, "--clamp", "0.05"]
    reference = train_reference(NPROC, STEPS, args)
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=args, name="clamp", run_args=["--pre-copy"])
    try:
        job.wait_step(5)
        job.wait_spare()
        job.client.migrate(1)
        assert job.wait(timeout=180) == 0, job.log()
        _equal_to(job, reference)
        (ev,) = job.events()
    finally:
        job.kill()
    assert ev["kind"] == "planned" and ev["status"] == "resolved" and ev["steps_lost"] == 0, ev
    assert ev["pre_copy"]["ok"] is False and "other than the optimizer" in ev["pre_copy"]["detail"], ev
    assert "follow" not in ev["phases"] and ev["state_bytes"] > ev["pre_copy"]["base_bytes"] / 2, ev


@pytest.mark.parametrize("victim", ["joiner", "leaver", "survivor", "leaver-hung"])
def test_a_kill_during_a_pre_copy_falls_back_bitwise(tmp_path, train_reference, victim):
    """kill -9 while the joiner holds the leaver's copy and has not followed a step yet:
    - the joiner: the move is called off before any rank paused and runs again with the
      other spare (which follows and moves only the rank's own state);
    - the leaver: its rank is rebuilt from the survivors, the joiner taking it over;
    - a survivor: its rank is rebuilt, the move waits for the job to re-form and runs again;
    - the leaver hung (SIGSTOP): found by its missing heartbeats, then as killed.
    Each ends bitwise equal to the run without failures, exit 0."""
    reference = train_reference(NPROC, STEPS, ARGS)
    hold, mark = tmp_path / "hold", tmp_path / "following"
    hold.touch()
    env = {"PYTHONPATH": INJECT, "BATON_TEST_HOLD_FOLLOWING": str(hold), "BATON_TEST_FOLLOWING_MARK": str(mark)}
    job = Job(tmp_path, nproc=NPROC, spares=2, steps=STEPS, script_args=ARGS, name=victim, env=env,
              run_args=["--pre-copy"])
    try:
        job.wait_step(5)
        job.wait_until(lambda st: sum(s["state"] == "spare" for s in st["spares"]) == 2, timeout=120,
                       what="two spares ready")
        job.client.migrate(1)
        job.wait_until(lambda st: mark.exists() and mark.read_text(), timeout=120,
                       what="the joiner holding the leaver's copy")
        if victim == "joiner":
            os.kill(int(mark.read_text()), signal.SIGKILL)
        elif victim == "leaver-hung":
            job.signal_rank(1, signal.SIGSTOP)
        else:
            job.signal_rank(1 if victim == "leaver" else 2, signal.SIGKILL)
        hold.unlink()
        assert job.wait(timeout=240) == 0, job.log()
        _equal_to(job, reference)
        events = job.events()
    finally:
        job.kill()
    shape = [(e["kind"], e["status"]) for e in events]
    if victim == "joiner":
        assert shape == [("planned", "failed"), ("planned", "resolved")], events
        assert events[1]["pre_copy"]["ok"] and "follow" in events[1]["phases"], events[1]
    elif victim.startswith("leaver"):
        assert shape == [("planned", "failed"), ("unplanned", "resolved")], events
        assert "superseded by the loss of its leaver" in events[0]["note"], events[0]
    else:
        assert shape == [("planned", "failed"), ("unplanned", "resolved"), ("planned", "resolved")], events
        assert events[1]["rank"] == 2 and events[2]["rank"] == 1, events
    assert all(e["steps_lost"] == 0 for e in events if e["status"] == "resolved"), events


def test_a_joiner_still_far_behind_when_the_ranks_pause_takes_the_whole_state(tmp_path, train_reference):
    """The joiner holds the leaver's copy but follows no step until after the pre-copy's
    deadline (--formation-timeout) has passed and the ranks have paused: replaying the steps
    it lacks inside the pause would cost about what they cost the ranks, so it takes the
    whole state instead. Bitwise, exit 0."""
    reference = train_reference(NPROC, STEPS, ARGS)
    hold, mark, end = tmp_path / "hold", tmp_path / "following", tmp_path / "end"
    hold.touch()
    end.touch()  # the ranks wait two steps before the end until the move is over, however fast they are
    env = {"PYTHONPATH": INJECT, "BATON_TEST_HOLD_FOLLOWING": str(hold), "BATON_TEST_FOLLOWING_MARK": str(mark),
           "BATON_TEST_HOLD_AT_STEP": str(STEPS - 2), "BATON_TEST_HOLD_FILE": str(end)}
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, name="behind", env=env,
              run_args=["--pre-copy", "--formation-timeout", "4"])
    try:
        job.wait_step(5)
        job.wait_spare()
        job.client.migrate(1)
        job.wait_until(lambda st: mark.exists(), timeout=120, what="the joiner holding the leaver's copy")
        job.wait_until(lambda st: all(r["state"] == "paused" for r in st["ranks"]), timeout=120,
                       what="the ranks paused for a joiner that never caught up")
        hold.unlink()
        job.wait_until(lambda st: any(e["status"] == "resolved" for e in job.events()), timeout=120,
                       what="the move resolved")
        end.unlink()
        assert job.wait(timeout=180) == 0, job.log()
        _equal_to(job, reference)
        (ev,) = job.events()
        log = job.log(tail=None)
    finally:
        job.kill()
    assert "did not catch up with their leavers" in log and "steps behind the pause's boundary" in log, log[-3000:]
    assert ev["kind"] == "planned" and ev["status"] == "resolved" and "follow" not in ev["phases"], ev


def test_a_joiner_whose_replay_is_as_slow_as_the_steps_gives_up():
    """A replay that takes most of a step (a spare sharing the ranks' CPU cores) would still be
    running when the ranks pause: after three steps the joiner says so and why."""
    from baton.worker.precopy import _cannot_keep_up

    assert _cannot_keep_up([(0.9, 1.0), (0.95, 1.0)]) == ""  # too early to judge
    assert _cannot_keep_up([(0.1, 1.0), (0.2, 1.0), (0.15, 0.9)]) == ""
    why = _cannot_keep_up([(0.1, 1.0), (0.9, 1.0), (0.95, 1.0), (1.2, 1.1)])
    assert "cannot keep up" in why and "0.950s" in why and "1.000s" in why, why
