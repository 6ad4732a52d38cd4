"""baton on a real Slurm cluster (slurmctld + slurmd "nodes" on this host): ranks and spares
are job steps of the allocation `baton run` runs in, and a move is exact as it is locally."""

from __future__ import annotations

import os
import signal

import pytest

from tests.jobs import Job, state_diff
from tests.slurm_cluster import SlurmCluster, skip_reason

# One Slurm cluster at a time on this host: every Slurm test runs on the same xdist worker.
pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.xdist_group("slurm")]

STEPS = 30
ARGS = ["--step-sleep", "0.15"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(train_reference):
    """The same two ranks on this machine without Slurm and without failures (rank 0's)."""
    return train_reference(2, STEPS, ARGS)[0]


def _slurm_job(tmp_path, slurm: SlurmCluster, nodes: int = 2, spare_nodes: int = 1) -> Job:
    return Job(tmp_path, nproc=1, steps=STEPS, script_args=ARGS, env=slurm.env,
               run_args=["--nodes", str(nodes), "--spare-nodes", str(spare_nodes)],
               launch=["salloc", f"-N{nodes + spare_nodes}", "--quiet"])


def test_ranks_and_spares_are_job_steps_on_their_nodes(tmp_path, slurm, reference):
    job = _slurm_job(tmp_path, slurm)
    try:
        st = job.wait_step(2)
        assert [r["slot"] for r in sorted(st["ranks"], key=lambda r: r["rank"])] == ["n1/0", "n2/0"]
        assert [s["slot"] for s in st["spares"]] == ["n3/0"]
        steps = slurm.run("squeue", "-h", "-s", "-o", "%j %N").stdout.split("\n")
        names = sorted(line.split()[1] for line in steps if line.startswith("baton-"))
        assert names == ["n1", "n2", "n3"], steps
        assert job.wait() == 0, job.log()
        assert not state_diff(job.params(), reference), job.log()
    finally:
        job.kill()


def test_kill_of_a_rank_on_slurm_recovers_onto_the_spare_node_bitwise(tmp_path, slurm, reference):
    job = _slurm_job(tmp_path, slurm)
    try:
        job.wait_step(5)
        os.kill(job.rank_pid(1), signal.SIGKILL)
        assert job.wait() == 0, job.log()
        assert not state_diff(job.params(), reference), job.log()
        events = job.events()
        assert [(e["kind"], e["status"], e["rank"]) for e in events] == [("unplanned", "resolved", 1)], events
        assert events[0]["from_slot"] == "n2/0" and events[0]["to_slot"] == "n3/0"
        assert events[0]["steps_lost"] == 0
    finally:
        job.kill()
