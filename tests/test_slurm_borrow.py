"""Floating spares on a real Slurm cluster: with no dedicated spare, baton borrows a whole
node from a lower-priority job through Slurm's own preemption (partition priority tiers,
PreemptMode=REQUEUE), the borrowed node takes the lost rank, and when baton gives it back
the low-priority job, requeued rather than lost, runs again and finishes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.jobs import Job, state_diff
from tests.slurm_cluster import SlurmCluster, skip_reason

# One Slurm cluster at a time on this host: every Slurm test runs on the same xdist worker.
pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.xdist_group("slurm")]

STEPS = 30  # as test_slurm.py: one shared failure-free run
ARGS = ["--step-sleep", "0.15"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm-borrow"), nodes=4, netns=True) as cluster:
        yield cluster


def _low_priority_job(slurm: SlurmCluster, node: str, log) -> str:
    """A requeueable job in the low tier holding `node` whole: its first run would take 10
    minutes, a rerun after a requeue a second. Preemption may signal the sleep before the
    shell, so a run whose sleep was killed exits without writing "done"."""
    script = (f"trap 'exit 1' TERM; n=${{SLURM_RESTART_COUNT:-0}}; echo start $n >> {log}; "
              f"if [ $n = 0 ]; then sleep 600 & wait $! || exit 1; else sleep 1; fi; echo done $n >> {log}")
    out = slurm.run("sbatch", "--parsable", "-p", "low", "--exclusive", "-N1", "-w", node, "--requeue",
                    "-J", f"lowprio-{node}", "-o", "/dev/null", "--wrap", script)
    return out.stdout.strip()


def test_a_node_borrowed_from_a_low_priority_job_takes_the_lost_rank_and_is_given_back(tmp_path, slurm,
                                                                                     train_reference):
    reference = train_reference(2, STEPS, ARGS)[0]
    logs = {n: tmp_path / f"low-{n}.log" for n in ("n3", "n4")}
    jobs = {n: _low_priority_job(slurm, n, logs[n]) for n in logs}
    deadline = time.time() + 30
    while not all(p.exists() for p in logs.values()):
        assert time.time() < deadline, slurm.run("squeue", check=False).stdout
        time.sleep(0.2)
    job = Job(tmp_path, nproc=1, steps=STEPS, script_args=ARGS, env=slurm.env, name="borrower",
              run_args=["--nodes", "2", "--spare-nodes", "0", "--borrow-spares", "--heartbeat-timeout", "2"],
              launch=["salloc", "-N2", "--no-kill", "--quiet"])
    try:
        st = job.wait_step(5)
        assert st["spares"] == [] and sorted(r["slot"] for r in st["ranks"]) == ["n1/0", "n2/0"], st
        os.kill(job.rank_pid(1), signal.SIGKILL)
        st = job.wait_until(lambda s: not s["operation"] and any(r["slot"][:2] in ("n3", "n4") for r in s["ranks"]),
                            timeout=90, what="rank 1 on a borrowed node")
        borrowed = next(n for n in st["nodes"] if n.get("borrowed_from"))
        lender = jobs[borrowed["node"]]
        assert borrowed["ranks"] == [1] and f"job {lender} (lowprio-{borrowed['node']}" in borrowed["borrowed_from"]
        assert "partition low" in borrowed["borrowed_from"]
        assert job.wait(timeout=120) == 0, job.log()
        assert not state_diff(reference, job.params()), job.log()
        events = job.events()
        assert [(e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events] == \
            [("unplanned", "resolved", 1, 0)], events
        assert events[0]["to_slot"] == f"{borrowed['node']}/0"
        log = job.log(tail=None)
        assert f"borrowed node={borrowed['node']}" in log, log
        # Given back at the end: the lender, requeued (not lost), runs again there and finishes.
        deadline = time.time() + 90
        while "done 1" not in logs[borrowed["node"]].read_text():
            assert time.time() < deadline, (logs[borrowed["node"]].read_text(),
                                            slurm.run("squeue", "-o", "%i %j %T %r %N", check=False).stdout)
            time.sleep(0.5)
        assert logs[borrowed["node"]].read_text().split("\n")[:2] == ["start 0", "start 1"]
    finally:
        job.kill()
        for j in jobs.values():
            slurm.run("scancel", j, check=False)
