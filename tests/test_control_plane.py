"""Faults around the moves themselves and around the control plane: a joiner, a bystander
or a serving survivor lost in the middle of a move, a stopped spare, the launcher paused,
`baton run` killed, the run directory reused. Training ends bit-for-bit equal to the
failure-free run, or the job ends promptly with a clear message; nothing hangs, nothing
is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from baton import procfs
from tests.gpt_job import GPT, check_equal, gpt_job
from tests.jobs import Job, ended_equal, state_diff


def _spare_pids(job: Job, n: int) -> list[int]:
    st = job.wait_until(lambda s: sum(1 for x in s["spares"] if x["state"] == "spare" and x.get("pid")) >= n,
                        what=f"{n} warm spares")
    return [x["pid"] for x in st["spares"] if x["state"] == "spare" and x.get("pid")]


def _assigned_spare(job: Job, spares: list[int]) -> int:
    """The spare the orchestrator just chose as a joiner: it leaves the spare list the moment
    it is assigned, long before it holds the rank."""
    st = job.wait_until(lambda s: len({x["pid"] for x in s["spares"]} & set(spares)) < len(spares),
                        what="a spare assigned as joiner")
    (pid,) = set(spares) - {x["pid"] for x in st["spares"]}
    return pid


def _kinds(events: list[dict]) -> list[tuple[str, str]]:
    return [(e["kind"], e["status"]) for e in events]


def test_joiner_killed_during_a_planned_move_is_replaced(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "planned-joiner", spares=2)
    try:
        job.wait_step(4)
        spares = _spare_pids(job, 2)
        job.client.migrate(1)
        os.kill(_assigned_spare(job, spares), signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        # The first attempt failed with its joiner; the move ran again with the other spare.
        assert "another spare takes its place" in job.log()
        assert _kinds(events) == [("planned", "failed"), ("planned", "resolved")], events
        assert all(e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()


def test_bystander_killed_during_a_planned_move(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "planned-bystander", spares=2)
    try:
        job.wait_step(4)
        _spare_pids(job, 2)
        job.client.migrate(1)
        job.signal_rank(0, signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        assert ("unplanned", "resolved") in _kinds(events), events
        # The move that the failure superseded is still wanted: it runs again once a spare is
        # warm (two new ones start), unless training finishes first: before it starts again
        # (the log says it was still waiting) or before its agreed boundary (cancelled).
        last = events[-1]
        again = last["kind"] == "planned" and last["rank"] == 1 and (
            last["status"] == "resolved"
            or (last["status"] == "cancelled" and "finished before the agreed step boundary" in last["note"]))
        assert again or "move of rank 1 (requested) was still waiting to run again" in job.log(), events
        assert all(e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()


def test_a_lost_peer_that_escapes_the_script_replaces_the_rank_not_fails_the_job(tmp_path, gpt_reference):
    """A lost-peer error that surfaces after the step committed cannot be absorbed: the rank
    exits with code 75, which the orchestrator treats as a lost rank (never a script bug)."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"),
           "BATON_TEST_PEER_LOST_AFTER_COMMIT": "1:9"}
    job = gpt_job(tmp_path, "escape", spares=1, env=env)
    try:
        events = check_equal(job, gpt_reference)
        log = job.log(tail=None)
        assert "injected: a lost peer surfaces on rank 1" in log and "could not absorb it here" in log
        assert "user-error" not in log
        assert _kinds(events) == [("unplanned", "resolved")] and events[0]["rank"] == 1, events
        assert "exited after a lost peer" in events[0]["cause"] and events[0]["steps_lost"] == 0, events
    finally:
        job.kill()


def test_rank_hung_in_its_own_code_while_the_others_wait_to_pause(tmp_path, gpt_reference):
    """During a planned move of rank 0, rank 2 hangs in its own code (not in a collective:
    the others wait at the agreed boundary, and its heartbeats go on). The pausing phase's
    deadline declares it hung; the move becomes a recovery, then runs again."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_TEST_STALL_WHILE_PAUSING": "2",
           "BATON_TEST_STALL_MARK": str(tmp_path / "stalled")}
    job = gpt_job(tmp_path, "pause-stall", spares=3, env=env,
                  run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        job.wait_step(4)
        _spare_pids(job, 3)  # the move's joiner is stopped, one replaces rank 2, one runs the move again
        job.client.migrate(0)
        events = check_equal(job, gpt_reference)
        assert "injected: rank 2 hangs" in job.log(tail=None)  # the hung rank's stack dump follows
        lost = [e for e in events if e["kind"] == "unplanned"]
        assert len(lost) == 1 and lost[0]["rank"] == 2 and "did not reach the agreed step" in lost[0]["cause"], events
        assert _kinds(events)[-1] == ("planned", "resolved") and events[-1]["rank"] == 0, events
        assert all(e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()


def test_joiner_killed_during_a_recovery_is_replaced(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "recovery-joiner", spares=2)
    try:
        job.wait_step(4)
        spares = _spare_pids(job, 2)
        job.signal_rank(2, signal.SIGKILL)
        os.kill(_assigned_spare(job, spares), signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        assert "another spare takes its place" in job.log()
        assert _kinds(events) == [("unplanned", "resolved")] * len(events) and events, events
        assert all(e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()


def test_serving_survivor_killed_during_a_recovery(tmp_path, gpt_reference):
    """Rank 1 dies; while rank 2 serves the state, it dies too: rank 0 alone serves both."""
    job = gpt_job(tmp_path, "recovery-server", spares=2)
    try:
        job.wait_step(4)
        _spare_pids(job, 2)
        pid2 = job.rank_pid(2)
        job.signal_rank(1, signal.SIGKILL)
        time.sleep(0.3)
        os.kill(pid2, signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        assert sorted(e["rank"] for e in events) == [1, 2] and all(e["status"] == "resolved" for e in events)
    finally:
        job.kill()


def test_survivor_that_fetched_a_completed_step_loses_its_sources_before_forming(tmp_path, gpt_reference):
    """Deterministic: rank 0 loses step 15 after its all-reduce (ranks 1 and 2 complete it)
    and fetches their result; both are killed before the new generation forms. Rank 0 is the
    only copy left: it must still hold step 15's start (the fetched state is applied only once
    formed), and everyone runs step 15 once. Before, it reported step 15 with step 16's state
    and the job ended with exit 0 one optimizer step ahead (seen in CI), or failed."""
    mark, go = tmp_path / "held", tmp_path / "go"
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"),
           "BATON_TEST_FAIL_AFTER_ALLREDUCE": "0:15", "BATON_TEST_FAIL_AFTER_ALLREDUCE_GO": str(go),
           "BATON_TEST_HOLD_AFTER_TAKING_STEP": "0", "BATON_TEST_HOLD_MARK": str(mark)}
    job = gpt_job(tmp_path, "sources-lost", spares=2, env=env)
    try:
        _spare_pids(job, 2)
        # Rank 0 fails only once ranks 1 and 2 are past step 15 (seen in CI: without this,
        # its failure could reach them inside the all-reduce's tail and all re-ran step 15).
        job.wait_until(lambda s: all(r["step"] >= 16 for r in s["ranks"] if r["rank"] in (1, 2)),
                       timeout=120, what="ranks 1 and 2 past step 15")
        go.touch()
        deadline = time.time() + 120
        while not mark.exists():
            assert time.time() < deadline and job.proc.poll() is None, job.log()
            time.sleep(0.05)
        for r in (1, 2):
            job.signal_rank(r, signal.SIGKILL)
        time.sleep(0.5)
        mark.unlink()
        events = check_equal(job, gpt_reference)
        log = job.log(tail=None)
        assert "injected: rank 0 holds after fetching" in log
        assert {e["rank"] for e in events} >= {1, 2}, events
        assert all(e["status"] == "resolved" and e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()


def test_a_rank_whose_parameters_are_a_step_ahead_stops_the_job_loudly(tmp_path):
    """baton counts the steps each rank's parameters hold and checks it before every step:
    a step applied twice (every replica agreeing, so no digest sees it) ends the job with a
    divergence, never with exit 0."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_TEST_STEP_COUNT_SKEW": "1:6"}
    job = Job(tmp_path, nproc=2, spares=0, steps=12, env=env, name="skew")
    try:
        assert job.wait(timeout=120) == 1, job.log()
        log = job.log(tail=None)
        assert "injected: rank 1 miscounts" in log
        assert "rank 1's parameters hold the updates of 8 steps but it is about to run step 7" in log, log
        assert [e["kind"] for e in job.events()] == ["divergence"]
    finally:
        job.kill()


def test_a_straggling_slot_is_tainted_and_its_rank_moved_bitwise(tmp_path, train_reference):
    """Rank 1's machine slows down from step 10 (+0.25 s of its own work per step, as a
    throttling GPU; the others take a few ms): the straggler detector (5x the median for 5
    steps) taints its slot and rank 1
    moves pre-emptively to the spare; training ends bit-for-bit equal to a run without it."""
    reference = train_reference(3, 60, ["--step-sleep", "0.05"])[0]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_TEST_SLOW_SLOT": "local/1:0.25:10"}
    job = Job(tmp_path, nproc=3, spares=1, steps=60, script_args=["--step-sleep", "0.05"], name="slow", env=env,
              run_args=["--straggler-factor", "5", "--straggler-steps", "5"])
    try:
        assert job.wait(timeout=150) == 0, job.log()
        assert not state_diff(reference, job.params()), job.log()
        events = job.events()
        assert [(e["kind"], e["status"], e["rank"], e["from_slot"]) for e in events] == \
            [("pre-emptive", "resolved", 1, "local/1")], events
        assert events[0]["cause"].startswith("taint: straggler:") and events[0]["steps_lost"] == 0, events
        assert "straggler rank=1" in job.log(tail=None)
    finally:
        job.kill()


def test_stopped_spare_then_a_kill(tmp_path, gpt_reference):
    """The only spare is SIGSTOPped, then a rank dies: the stopped spare is detected, killed
    and replaced by a new one, and training continues exactly."""
    job = gpt_job(tmp_path, "stopped-spare", spares=1, run_args=["--heartbeat-timeout", "2"])
    try:
        job.wait_step(4)
        (spare,) = _spare_pids(job, 1)
        os.kill(spare, signal.SIGSTOP)
        job.signal_rank(1, signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        assert _kinds(events) == [("unplanned", "resolved")], events
        assert not procfs.running(spare)
    finally:
        job.kill()


def test_launcher_paused_for_longer_than_the_heartbeat_timeout(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "launcher-paused", spares=1, run_args=["--heartbeat-timeout", "3"])
    try:
        job.wait_step(4)
        os.kill(job.proc.pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(job.proc.pid, signal.SIGCONT)
        events = check_equal(job, gpt_reference)
        assert events == [], events
    finally:
        job.kill()


def test_the_rendezvous_store_killed_twice_and_a_rank_lost_before_it_is_back(tmp_path, train_reference):
    """kill -9 of the job's rendezvous store: training goes on (a formed generation does not
    use it) and `baton run` restarts it on the same port. Killed again, and a rank with it:
    the recovery's new generation waits for the store to come back and forms there. Every
    rank ends bit-for-bit equal to the failure-free run, 0 steps lost."""
    steps, args = 250, ["--step-sleep", "0.05"]
    reference = train_reference(2, steps, args)
    job = Job(tmp_path, nproc=2, spares=1, steps=steps, script_args=args, name="store-killed")
    try:
        job.wait_step(5)
        first = job.store_pid()
        os.kill(first, signal.SIGKILL)
        at_kill = min(r["step"] for r in job.status()["ranks"])
        job.wait_until(lambda st: "the rendezvous store is back" in job.log(tail=None), what="the store restarted")
        job.wait_step(at_kill + 1)  # training went on (forked by the zygote, the store is back within a step)
        second = job.store_pid()
        assert second != first
        os.kill(second, signal.SIGKILL)
        job.signal_rank(1, signal.SIGKILL)
        events = ended_equal(job, reference, timeout=120)
        assert [(e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events] == \
            [("unplanned", "resolved", 1, 0)], events
        assert job.log(tail=None).count("the rendezvous store is back") == 2, job.log()
    finally:
        job.kill()


def test_sigstopped_rank_is_replaced_and_never_comes_back(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "stop-cont", spares=1, run_args=["--heartbeat-timeout", "2", "--op-timeout", "2"])
    try:
        job.wait_step(4)
        pid = job.signal_rank(0, signal.SIGSTOP)
        job.wait_until(lambda st: job.rank_pid(0) != pid, what="rank 0 replaced")
        try:
            os.kill(pid, signal.SIGCONT)  # a replaced process must not touch anything again
        except ProcessLookupError:
            pass
        events = check_equal(job, gpt_reference)
        assert _kinds(events) == [("unplanned", "resolved")]
        assert not procfs.running(pid)
    finally:
        job.kill()


def test_every_rank_lost_at_once_fails_promptly_and_the_ledger_says_so(tmp_path):
    job = gpt_job(tmp_path, "all-lost", spares=1)
    try:
        job.wait_step(8)
        pids = [job.rank_pid(r) for r in range(3)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        code = job.wait(timeout=60)
        assert code != 0 and time.time() - t0 < 30, (code, job.log())
        log = job.log()
        assert "no copy of the training state survived" in log, log
        # each rank's cause is named
        assert all(f"rank {r}: process killed by signal 9" in log for r in range(3)), log
        events = job.events()
        assert events and all(e["status"] == "failed" and e["resolved_without_rollback"] is False
                              and e["steps_lost"] >= 8 for e in events), events
        out = subprocess.run([sys.executable, "-m", "baton.cli", "events", "--json", "--run-dir",
                              str(job.run_dir)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["yoco_ratio"] == 0.0, out.stdout
    finally:
        job.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])  # SIGINT: the same handler as SIGTERM
def test_killing_baton_run_leaves_no_worker_behind(tmp_path, sig):
    job = gpt_job(tmp_path, f"stop-{sig.name}", spares=1)
    try:
        job.wait_step(4)
        pids = [job.rank_pid(r) for r in range(3)] + _spare_pids(job, 1) + [job.store_pid()]
        os.kill(pids[1], signal.SIGSTOP)  # a stopped worker must go too
        os.kill(job.proc.pid, sig)
        job.wait(timeout=30)
        deadline = time.time() + 15
        while time.time() < deadline and any(procfs.running(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if procfs.running(p)], "workers or the store outlived baton run"
    finally:
        job.kill()


def test_run_directory_is_locked_and_never_wiped(tmp_path):
    first = gpt_job(tmp_path, "locked", spares=1, extra=["--step-sleep", "0.15", "--max-iters", "24"])
    try:
        first.wait_step(2)
        second = subprocess.run([sys.executable, "-m", "baton.cli", "run", "--nproc", "1", "--run-dir",
                                 str(first.run_dir), str(GPT)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "in use by a running job" in second.stderr, second.stderr
        first.client.migrate(0)  # something for the ledger
        assert first.wait(timeout=180) == 0, first.log()
    finally:
        first.kill()
    ledger = first.events()
    assert [e["kind"] for e in ledger] == ["planned"]
    # A second job in the same directory keeps the first one's ledger under history/.
    again = gpt_job(tmp_path, "locked", spares=0, extra=["--max-iters", "3"])
    assert again.wait(timeout=180) == 0, again.log()
    assert again.events() == []
    (kept,) = (first.run_dir / "history").iterdir()
    from baton.store.sqlite import SqliteStore

    assert [e["id"] for e in SqliteStore(kept / "state.db").events()] == [e["id"] for e in ledger]


def test_a_full_disk_under_the_state_store_is_survived(tmp_path, gpt_reference):
    """The run directory lives on a 2 MB tmpfs that the test fills mid-job: SQLite writes
    fail, the job says so once and goes on; training ends exact."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        job = gpt_job(tmp_path, "disk-full", spares=1, run_dir=mnt / "run")
        try:
            job.wait_step(4)
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 65536):
                    pass
            except OSError:
                pass  # the disk is full
            finally:
                os.close(fd)
            job.client.migrate(1)  # a move whose ledger rows cannot be written
            job.wait_until(lambda st: st["generation"] >= 1 and all(r["state"] == "running" for r in st["ranks"]),
                           what="the move to finish")
            (mnt / "filler").unlink()  # space again: what was kept in memory is written
            events = check_equal(job, gpt_reference)
            assert _kinds(events) == [("planned", "resolved")], events
            assert "store-error" in job.log() and "disk is full" in job.log()
        finally:
            job.kill()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_short_formation_timeout_neither_hangs_nor_fails(tmp_path):
    job = Job(tmp_path, nproc=3, spares=1, steps=40, script_args=["--step-sleep", "0.05"],
              run_args=["--formation-timeout", "0.2"])
    try:
        job.wait_step(5)
        job.signal_rank(1, signal.SIGKILL)
        assert job.wait(timeout=120) == 0, job.log()
        assert _kinds(job.events()) == [("unplanned", "resolved")]
    finally:
        job.kill()


@pytest.mark.parametrize("script", ["gpt", "train"])
def test_a_rank_that_lost_a_step_the_others_completed_takes_their_result(tmp_path, script):
    """Deterministic: rank 0 fails a step after its all-reduce completed (the others complete
    it). It must take the completed step, never re-run it: parameters, DDP's buffer-sync flag
    (gpt.py: step 15 is the first after an evaluation) and the next batch (train.py tracks a
    DataLoader). Found by the chaos test; both ended wrong before (a livelock, a silent
    divergence with exit 0)."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"),
           "BATON_TEST_FAIL_AFTER_ALLREDUCE": "0:15" if script == "gpt" else "0:20"}
    fast = ["--step-sleep", "0", "--eval-sleep", "0"]
    timeouts = ["--op-timeout", "2", "--heartbeat-timeout", "2"]
    if script == "gpt":
        ref = gpt_job(tmp_path, "ref", spares=0, extra=fast)
    else:
        ref = Job(tmp_path, nproc=3, spares=0, steps=30, name="ref")
    try:
        assert ref.wait(timeout=150) == 0, ref.log()
    finally:
        ref.kill()
    if script == "gpt":
        job = gpt_job(tmp_path, "inj", spares=1, extra=fast, run_args=timeouts, env=env)
    else:
        job = Job(tmp_path, nproc=3, spares=1, steps=30, name="inj", env=env, run_args=timeouts)
    try:
        assert job.wait(timeout=150) == 0, job.log()
        assert "injected: rank 0 loses step" in job.log()
        for r in range(3):
            d = state_diff(torch.load(f"{ref.out}.rank{r}"), torch.load(f"{job.out}.rank{r}"))
            assert not d, f"rank {r} diverged in {d}"
    finally:
        job.kill()


def test_silent_corruption_is_caught_by_verify_every(tmp_path):
    """One ulp of one parameter on rank 1 changes after step 12: --verify-every 5 finds it at the
    step-15 boundary, records a divergence naming the entry, and the job exits non-zero."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_TEST_CORRUPT": "1:12"}
    job = Job(tmp_path, nproc=3, spares=0, steps=40, env=env, run_args=["--verify-every", "5"],
              script_args=["--step-sleep", "0.02"])
    try:
        code = job.wait(timeout=120)
        log = job.log()
        assert "injected: rank 1 corrupted" in log
        assert code != 0 and "state check failed" in log, log
        (ev,) = [e for e in job.events() if e["kind"] == "divergence"]
        assert ev["status"] == "failed" and ev["step"] == 15 and "model" in ev["note"], ev
    finally:
        job.kill()


def test_a_joiner_loaded_wrong_is_caught_by_the_deferred_state_check_before_its_first_commit(tmp_path):
    """A move's state check digests the large tensors on a thread while the next step runs
    (it left the pause), and compares before that step's optimizer step. A joiner whose load
    changed one ulp of its 512x512 weight (digested on that thread) stops the job there: a
    divergence at the move's step, and exit non-zero."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_TEST_CORRUPT_JOINER": "1",
           "BATON_LOG": "INFO"}
    job = Job(tmp_path, nproc=2, spares=1, steps=400, env=env, name="joiner",
              script_args=["--width", "512", "--step-sleep", "0.02"])
    try:
        job.wait_step(3, timeout=120)
        job.client.migrate(0)
        code = job.wait(timeout=120)
        log = job.log(tail=None)
        events = job.events()
    finally:
        job.kill()
    assert "injected: joiner of rank 0 corrupted one value of a (512, 512) parameter" in log, log[-3000:]
    assert code != 0 and "state check failed" in log, log[-3000:]
    planned, divergence = events[0], events[-1]
    assert planned["kind"] == "planned" and divergence["kind"] == "divergence", events
    assert divergence["status"] == "failed" and divergence["step"] == planned["step"], events
    assert "differs on ranks" in divergence["cause"] and ".weight" in divergence["note"], divergence
    assert "training finished" not in log, log[-3000:]


def test_rank_killed_after_the_step_loop_before_finish(tmp_path, gpt_reference):
    """Training is over but the script still runs its closing code: a lost rank is replaced at
    the final position and the replacement runs that code too (saving its state here)."""
    job = gpt_job(tmp_path, "after-loop", spares=1, extra=["--end-sleep", "3"])
    try:
        job.wait_until(lambda st: min(r["step"] for r in st["ranks"]) >= 45, timeout=120, what="loop end")
        time.sleep(1.5)  # past the last evaluation (1 s), inside the 3 s of closing code
        job.signal_rank(2, signal.SIGKILL)
        events = check_equal(job, gpt_reference)
        assert _kinds(events) == [("unplanned", "resolved")] and events[0]["steps_lost"] == 0, events
    finally:
        job.kill()
