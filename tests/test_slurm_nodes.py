"""Whole nodes on a real Slurm cluster whose nodes have their own addresses (a network
namespace each, slurmd and every task inside it): a node lost with two ranks on it, and a
node tainted by the operator. Both end bit-for-bit equal to the same four ranks run
locally without failures, and Slurm's view is kept honest (the node drained with baton's
reason, resumed on untaint)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.jobs import Job, state_diff
from tests.served import Server
from tests.slurm_cluster import SlurmCluster, skip_reason

# One Slurm cluster at a time on this host: every Slurm test runs on the same xdist worker.
pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.xdist_group("slurm")]

STEPS = 80
ARGS = ["--step-sleep", "0.15"]
FAST = ["--heartbeat-timeout", "2", "--op-timeout", "3"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm-nodes"), nodes=4, netns=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(train_reference):
    """Four ranks on this machine, no Slurm, no failures (rank 0's)."""
    return train_reference(4, STEPS, ARGS)[0]


def _job(tmp_path, slurm: SlurmCluster, extra: list[str] | None = None, step_sleep: float = 0.15,
         **leash: int) -> Job:
    """2 nodes x 2 ranks + 1 spare node with 2 spares; --no-kill keeps the allocation alive
    when Slurm marks a node down (as a job that wants to survive a node must ask). The
    sleep per step sets only how long the job runs, not its state (the same reference);
    `leash`, `leash_cap`: see Job."""
    return Job(tmp_path, nproc=2, steps=STEPS, script_args=["--step-sleep", str(step_sleep)], env=slurm.env,
               run_args=["--nodes", "2", "--spare-nodes", "1", *FAST, *(extra or [])],
               launch=["salloc", "-N3", "--no-kill", "--quiet"], **leash)


def _cli(job: Job, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args, "--run-dir", str(job.run_dir)],
                          capture_output=True, text=True, timeout=30)


def _node_of_rank(st: dict, rank: int) -> str:
    return next(r["slot"] for r in st["ranks"] if r["rank"] == rank).split("/")[0]


def _peers_seen_from(slurm: SlurmCluster, node: str) -> set[str]:
    """Addresses that processes on `node` hold established TCP connections to."""
    out = subprocess.run([*slurm.network.run_in(node), "ss", "-tnH", "state", "established"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for line in out.splitlines()
            if line.split()}


def test_a_lost_node_recovers_both_its_ranks_onto_the_spare_node_bitwise(tmp_path, slurm, reference):
    job = _job(tmp_path, slurm)
    lost = None
    try:
        st = job.wait_step(5)
        lost, spare_node = _node_of_rank(st, 2), st["spares"][0]["slot"].split("/")[0]
        assert _node_of_rank(st, 3) == lost and _node_of_rank(st, 0) not in (lost, spare_node)
        # Gloo connects ranks directly, node address to node address (and each to the launcher
        # on the host's test address): nothing crosses nodes on 127.0.0.1.
        seen = _peers_seen_from(slurm, _node_of_rank(st, 0))
        assert slurm.network.addrs[lost] in seen and slurm.network.host_addr in seen, seen
        slurm.lose_node(lost)  # slurmd and every process on it killed, its link cut
        assert job.wait(timeout=180) == 0, job.log()
        assert not state_diff(job.params(), reference), job.log()
        events = job.events()
        assert sorted((e["kind"], e["status"], e["rank"]) for e in events) == \
            [("unplanned", "resolved", 2), ("unplanned", "resolved", 3)], events
        assert all(e["steps_lost"] == 0 and e["to_slot"].startswith(spare_node + "/") for e in events), events
        assert len({e["step"] for e in events}) == 1, events  # one recovery for the node, not two
        log = job.log(tail=None)
        assert f"node-lost node={lost}" in log, log
        state, reason = slurm.node_reasons()[lost]
        assert "drain" in state and reason.startswith("baton: node lost"), (state, reason)
    finally:
        job.kill()
        if lost is not None:
            slurm.revive_node(lost)


def test_taint_of_a_node_moves_its_ranks_in_one_move_and_they_return_after_untaint(tmp_path, slurm, reference):
    """`baton taint NODE`: both ranks move in one pre-emptive move and Slurm drains the node;
    `baton untaint NODE` resumes it, spares start there, and --return-home moves both ranks
    back in one planned move."""
    # The ranks hold two steps before the end until the test has seen them back home: the
    # spares' start on the resumed node (Slurm job steps) took longer than the job's last
    # steps on a busy machine, at 0.15 s a step and at 0.35 s (three tests at a time).
    job = _job(tmp_path, slurm, extra=["--return-home"], leash=4, leash_cap=STEPS - 2)
    node = None
    try:
        st = job.wait_step(5)
        node = _node_of_rank(st, 0)
        out = _cli(job, "taint", node, "--reason", "ecc")
        assert out.returncode == 0 and "moving ranks [0, 1]" in out.stdout, out
        job.wait_until(lambda s: not s["operation"] and _node_of_rank(s, 0) != node, what="the node's ranks moved")
        state, reason = slurm.node_reasons()[node]
        assert "drain" in state and reason == "baton: ecc", (state, reason)
        assert {n["node"]: n["state"] for n in job.status()["nodes"]}[node] == "tainted"
        out = _cli(job, "untaint", node)
        assert out.returncode == 0, out
        assert "drain" not in slurm.node_reasons()[node][0]
        job.wait_until(lambda s: not s["operation"] and _node_of_rank(s, 0) == node == _node_of_rank(s, 1),
                       timeout=120, what="ranks 0 and 1 back home")
        assert job.wait(timeout=180) == 0, job.log()
        assert not state_diff(job.params(), reference), job.log()
        events = job.events()
        assert [(e["kind"], e["status"], e["rank"]) for e in sorted(events, key=lambda e: (e["id"]))] == \
            [("pre-emptive", "resolved", 0), ("pre-emptive", "resolved", 1),
             ("planned", "resolved", 0), ("planned", "resolved", 1)], events
        assert events[2]["cause"].startswith("return home") and events[2]["to_slot"].startswith(node + "/")
        assert len({e["step"] for e in events[:2]}) == 1 and len({e["step"] for e in events[2:]}) == 1, events
        assert all(e["steps_lost"] == 0 for e in events), events
    finally:
        job.kill()
        if node is not None:
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def _steps_in_slurm(slurm: SlurmCluster, but_on: str) -> set[str]:
    """The workers Slurm runs as job steps (`squeue -s`) by baton's step names, leaving out
    those on `but_on` (a dead node's steps stay listed until Slurm declares it down)."""
    out = slurm.run("squeue", "-h", "-s", "-o", "%j %N").stdout.splitlines()
    return {name.removeprefix("baton-") for name, node in (line.split() for line in out if line.strip())
            if name.startswith("baton-w") and node != but_on}


def _live_workers(st: dict) -> set[str]:
    return {r["worker"] for r in st["ranks"]} | {s["worker"] for s in st["spares"]}


def test_server_killed_and_a_node_lost_while_it_is_down(tmp_path, slurm, reference):
    """`baton serve` (on the host's test address) kill -9ed mid-job, a node with two ranks lost
    while it is down. Restarted, it reloads the job, reconciles with the agent and Slurm,
    finds both ranks silent, probes the node through Slurm, drains it and recovers both onto
    the spare node in one move: bitwise, 0 steps lost. Slurm then runs exactly the job steps
    baton counts live."""
    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token", host=slurm.network.host_addr)
    job = _job(tmp_path, slurm, extra=["--server", server.url, "--server-token-file", str(server.token_file),
                                       "--job-id", "slurm-crash"])
    lost = None
    try:
        st = job.wait_step(5)
        lost, spare_node = _node_of_rank(st, 2), st["spares"][0]["slot"].split("/")[0]
        server.kill9()
        slurm.lose_node(lost)
        time.sleep(2.0)
        server.start()
        st = job.wait_until(lambda s: not s["operation"] and s["generation"] >= 1 and
                            {_node_of_rank(s, 2), _node_of_rank(s, 3)} == {spare_node}, timeout=120,
                            what="ranks 2 and 3 recovered onto the spare node")
        deadline = time.time() + 30
        while (steps := _steps_in_slurm(slurm, lost)) != (live := _live_workers(job.status())):
            assert time.time() < deadline, f"Slurm runs {sorted(steps)}, baton counts {sorted(live)} live"
            time.sleep(0.5)
        assert job.wait(timeout=180) == 0, job.log() + server.log()
        assert not state_diff(job.params(), reference), job.log()
        events = job.events()
        assert sorted((e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events) == \
            [("unplanned", "resolved", 2, 0), ("unplanned", "resolved", 3, 0)], events
        assert len({e["step"] for e in events}) == 1, events
        state, reason = slurm.node_reasons()[lost]
        assert "drain" in state and reason.startswith("baton: node lost"), (state, reason)
        assert "restored life=1" in server.log()
    finally:
        job.kill()
        server.stop()
        if lost is not None:
            slurm.revive_node(lost)
