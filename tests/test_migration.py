"""End to end: a deterministic 3-rank CPU job survives each kind of failure with final
parameters bit-for-bit equal to an uninterrupted run, and the ledger says how."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.jobs import Job, bitwise_equal
from tests.once import once

NPROC = 3
STEPS = 40
# A little sleep per step keeps the job alive long enough to act on it, on 2 noisy cores.
ARGS = ["--step-sleep", "0.03"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "migration", _reference)


def _reference(tmp):
    job = Job(tmp, nproc=NPROC, spares=0, steps=STEPS, script_args=ARGS)
    assert job.wait() == 0, job.log()
    params = job.params()
    for other in job.all_rank_params(NPROC):
        assert bitwise_equal(params, other), "replicas diverged in the reference run"
    return params


def _check(job: Job, reference, kind: str, rerun_max: int, same_slot_ok: bool = False) -> list[dict]:
    assert job.wait() == 0, job.log()
    assert bitwise_equal(job.params(), reference), f"final parameters differ after {kind}:\n{job.log()}"
    for other in job.all_rank_params(NPROC):
        assert bitwise_equal(other, reference)
    events = job.events()
    assert events, "no event recorded"
    for ev in events:
        assert ev["kind"] == kind, ev
        assert ev["status"] == "resolved", ev
        assert ev["steps_lost"] == 0, ev
        assert ev["steps_rerun"] <= rerun_max, ev
        assert ev["resolved_without_rollback"] is True
        assert ev["downtime_s"] is not None and ev["downtime_s"] >= 0
        assert ev["to_slot"] and ev["from_slot"]
        assert same_slot_ok or ev["to_slot"] != ev["from_slot"]
    return events


@pytest.mark.parametrize("pre_copy", [True, False], ids=["pre-copied", "whole-state"])
def test_planned_migration_is_bitwise_identical(tmp_path, reference, pre_copy):
    """A planned move, bitwise. Pre-copied (the default): the joiner takes the replicated
    state while training goes on and applies the leaver's optimizer steps to their gradients,
    so the pause moves only the rank's own state (`--pre-copy`); without, the whole state."""
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS,
              run_args=["--pre-copy"] if pre_copy else [])
    try:
        job.wait_step(5)
        job.client.migrate(1)
        events = _check(job, reference, "planned", rerun_max=0)
        assert events[0]["rank"] == 1
        phases = events[0]["phases"]  # where the downtime went, summing to it
        # the joiner's part, then the last rank's way to the boundary after the first paused
        expected = ["follow", "fetch", "load", "form", "verify", "boundary", "rest"] if pre_copy else \
            ["fetch", "load", "form", "verify", "boundary", "rest"]
        assert list(phases) == expected, phases
        assert abs(sum(phases.values()) - events[0]["downtime_s"]) < 0.01, (phases, events[0])
        assert phases["fetch"] > 0
        if pre_copy:  # what went on beside training: the state copied, the optimizer steps followed
            pc = events[0]["pre_copy"]
            assert pc["ok"] and pc["base_bytes"] > 0 and pc["steps"] >= 1 and pc["step_bytes"] > 0, pc
            assert pc["leaver_steps"] >= pc["steps"] and pc["leaver_base_s"] > 0, pc
            assert events[0]["state_bytes"] < pc["base_bytes"] / 2, events[0]  # the pause moved the rank's own
        else:
            assert events[0]["pre_copy"] is None, events[0]
        shown = subprocess.run([sys.executable, "-m", "baton.cli", "events", "--run-dir", str(job.run_dir)],
                               capture_output=True, text=True, timeout=60).stdout
        assert "MB moved; " in shown and ", rest " in shown, shown
    finally:
        job.kill()


def test_taint_moves_rank_off_slot(tmp_path, reference):
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS)
    try:
        st = job.wait_step(5)
        slot = next(r["slot"] for r in st["ranks"] if r["rank"] == 2)
        job.client.taint(slot, "ecc")
        st = job.wait_until(lambda s: all(r["slot"] != slot for r in s["ranks"]), what="rank 2 moved off")
        assert st["taints"] == [{"slot": slot, "reason": "ecc", "since": st["taints"][0]["since"]}]
        # Nothing new is scheduled on the tainted slot.
        assert all(s["slot"] != slot for s in st["spares"])
        job.client.untaint(slot)
        assert job.status()["taints"] == []
        events = _check(job, reference, "pre-emptive", rerun_max=0)
        assert events[0]["from_slot"] == slot and "ecc" in events[0]["cause"]
    finally:
        job.kill()


@pytest.mark.parametrize("rank", [1])  # rank 0 inside a step: test_gpt_loop, test_real_loops
def test_kill_9_recovers_from_replicas(tmp_path, reference, rank):
    # The replica check at every boundary: the joiner's check as it joins stands for the
    # periodic one at its first boundary, on every rank (run by it alone, it would hang).
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, run_args=["--verify-every", "1"])
    try:
        job.wait_step(8)
        job.signal_rank(rank, signal.SIGKILL)
        events = _check(job, reference, "unplanned", rerun_max=1)
        assert events[0]["rank"] == rank
        # where the downtime went, summing to it: the survivors' reports until the plan went
        # out, the spare's script setup after its assignment, the joiner's part, the rest
        phases = events[0]["phases"]
        assert list(phases) == ["collect", "setup", "fetch", "load", "form", "verify", "rest"], phases
        assert abs(sum(phases.values()) - events[0]["downtime_s"]) < 0.01, (phases, events[0])
        assert phases["setup"] > 0 and phases["setup"] <= events[0]["joiner_setup_s"] + 1e-3, events[0]
        log = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
        recoveries = [e["data"] for e in log if e["event"] == "recovery"]
        assert len(recoveries) == 1, recoveries  # the loss, and nothing after it
    finally:
        job.kill()


def test_sigstop_hang_is_detected_and_replaced(tmp_path, reference):
    # The script also all_reduces its loss on job.group inside the step: user collectives
    # blocked on the frozen peer are absorbed like DDP's own.
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS + ["--user-allreduce"],
              run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        job.wait_step(8)
        stopped_at = time.time()
        job.signal_rank(1, signal.SIGSTOP)
        events = _check(job, reference, "unplanned", rerun_max=1)
        assert events[0]["rank"] == 1 and "hung" in events[0]["cause"]
        # Its downtime starts where the others blocked on it, not at its last heartbeat (up to
        # half a second earlier here, before the hang)
        assert events[0]["detected_at"] >= stopped_at - 0.15, (events[0]["detected_at"], stopped_at)
    finally:
        job.kill()


def test_two_ranks_lost_in_the_same_step(tmp_path, reference):
    job = Job(tmp_path, nproc=NPROC, spares=2, steps=STEPS, script_args=ARGS)
    try:
        job.wait_until(lambda s: len([x for x in s["spares"] if x["state"] == "spare"]) == 2
                       and min(r["step"] for r in s["ranks"]) >= 8, what="two spares ready")
        pids = [job.rank_pid(0), job.rank_pid(2)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        events = _check(job, reference, "unplanned", rerun_max=1)
        assert sorted(e["rank"] for e in events) == [0, 2]
    finally:
        job.kill()


def test_no_spare_pauses_with_a_message_then_resumes(tmp_path, reference):
    """The only spare's slot is tainted, then a rank dies: the job waits (it does not crash)
    until a new spare has started on a free slot, then recovers bit for bit."""
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, run_args=["--slots", "4"])
    try:
        st = job.wait_step(5)
        spare_slot = st["spares"][0]["slot"]
        job.client.taint(spare_slot, "maintenance")
        job.wait_until(lambda s: not s["spares"], what="spare stopped")
        job.signal_rank(1, signal.SIGKILL)
        _check(job, reference, "unplanned", rerun_max=1, same_slot_ok=True)
        kinds = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
        waiting = [e["data"] for e in kinds if e["event"] == "waiting-for-spare"]
        assert waiting and "no spare is available" in waiting[0]["message"]
        order = [e["event"] for e in kinds]
        assert order.index("waiting-for-spare") < order.index("resolved")
    finally:
        job.kill()


def test_leaver_killed_during_a_planned_move(tmp_path, reference):
    """kill -9 of the leaving rank while its planned move is under way: the move is
    superseded, the spare already chosen takes the rank with state from the survivors."""
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=["--step-sleep", "0.3"])
    try:
        job.wait_step(4)
        pid = job.rank_pid(1)
        job.client.migrate(1)
        os.kill(pid, signal.SIGKILL)
        assert job.wait() == 0, job.log()
        assert bitwise_equal(job.params(), reference), job.log()
        events = job.events()
        assert [e["kind"] for e in events] == ["planned", "unplanned"], events
        assert events[0]["status"] == "failed" and "superseded" in events[0]["note"]
        assert events[1]["status"] == "resolved" and events[1]["rank"] == 1
        assert events[1]["steps_lost"] == 0
    finally:
        job.kill()


def test_a_rank_lost_as_soon_as_its_buddy_has_moved_is_rebuilt_bitwise(tmp_path, reference):
    """Rank 2's buddy (the holder of its own state's copies) is rank 0. Rank 0 moves, planned,
    and rank 2 is killed -9 the moment the move resolves, before it has run a step beside the
    joiner, which holds no copy from before it joined. Rank 2 is rebuilt and the job ends
    bitwise equal to the run without failures. (Under FSDP2 a ward's shards exist only on it
    and its buddies: lost in that window, they stop the job and say why.)"""
    job = Job(tmp_path, nproc=NPROC, spares=2, steps=STEPS, script_args=ARGS, run_args=["--redundancy", "1"],
              leash=2)
    try:
        # not pulled on: the ranks wait at step 2 (the leash), where the move pauses them and
        # where they still stand when the kill comes
        job.wait_until(lambda s: min(r["step"] for r in s["ranks"]) >= 1 and
                       sum(x["state"] == "spare" for x in s["spares"]) == 2, timeout=120,
                       what="the ranks at the leash, two spares ready", pull=False)
        job.client.migrate(0)
        job.wait_until(lambda s: any(e["status"] == "resolved" for e in job.events()), timeout=120,
                       what="rank 0's move", pull=False)
        job.signal_rank(2, signal.SIGKILL)
        assert job.wait() == 0, job.log()
        for got in job.all_rank_params(NPROC):
            assert bitwise_equal(got, reference), job.log()
        events = job.events()
    finally:
        job.kill()
    assert [(e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events] == \
        [("planned", "resolved", 0, 0), ("unplanned", "resolved", 2, 0)], events
    assert events[0]["step"] == events[1]["step"], events  # lost at the boundary the move resolved at


def test_planned_move_of_the_only_rank_is_checked_against_the_leavers_digest(tmp_path):
    """A world of one has no replica to compare the joiner with: the leaver's digest of its
    full state is the check, and the move is still exact."""
    ref = Job(tmp_path / "ref1", nproc=1, spares=0, steps=STEPS, script_args=ARGS)
    assert ref.wait() == 0, ref.log()
    job = Job(tmp_path / "one", nproc=1, spares=1, steps=STEPS, script_args=ARGS)
    try:
        job.wait_until(lambda st: st["state"] == "running" and any(s["state"] == "spare" for s in st["spares"]),
                       what="the spare ready")  # one rank may start stepping before the spare is warm
        job.client.migrate(0)
        assert job.wait() == 0, job.log()
        assert bitwise_equal(job.params(), ref.params()), job.log()
        events = job.events()
        assert [(e["kind"], e["status"]) for e in events] == [("planned", "resolved")], events
        assert "divergence" not in job.log()
    finally:
        job.kill()
