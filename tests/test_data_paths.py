"""Data paths (`baton run --data-paths rail1,rail2`) on a real Slurm cluster whose nodes have
addresses and NICs of their own (a network namespace each, two data rails beside the
control network, tests/rail_network.py).

The ranks' collectives run over both rails in turn; a node's rail going down is routed
around inside the job: the groups re-form over the other rail, no rank is replaced, no
spare is used, and the run ends bit for bit equal to the same unmodified script under
torchrun without failures."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import Job
from tests.nocode_runs import INJECT, NOCODE, compare
from tests.served import Server
from tests.slurm_cluster import SlurmCluster, skip_reason

pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
              pytest.mark.xdist_group("slurm")]

FAST = ["--heartbeat-timeout", "2", "--op-timeout", "5"]
# imagenet's shape: DataLoader workers with random crops, dropout, StepLR, validation that
# all-reduces its meters, rank 0's checkpoint; 8 steps an epoch at -b 16. The jobs on it are
# leashed (LEASH steps ahead of what the test saw, never past step CAP of the 96 until the test
# lets go, tests/jobs.py): their faults land mid-run on a slow machine and on a fast one.
ARGS = ["--epochs", "12", "--out-dir", "{d}/out"]
LEASH, CAP = 6, 80
SCRIPT = NOCODE / "imagenet_main.py"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm-rails"), nodes=3, netns=True, rails=2) as cluster:
        yield cluster


def _node_of_rank(st: dict, rank: int) -> str:
    return next(r["slot"] for r in st["ranks"] if r["rank"] == rank).split("/")[0]


def _over(job: Job, paths: list[str], what: str) -> dict:
    """Wait until the job runs over `paths` with nothing moving; its status then."""
    return job.wait_until(lambda s: s["data_paths"]["in_use"] == paths and not s["operation"], timeout=120, what=what)


@pytest.fixture
def reference(torchrun_reference):
    """The unmodified script under torchrun, 2 ranks on this machine, no failures."""
    return torchrun_reference(SCRIPT, [*ARGS, "--export", "{d}/export"])


def _job(tmp_path, slurm: SlurmCluster, env: dict[str, str] | None = None, extra: list[str] | None = None,
         args: list[str] = ARGS, paths: str = "rail1,rail2", leash: int = LEASH) -> Job:
    """The same script with no code change, one rank on each of two nodes and a spare node,
    its collectives over both rails (named, or found: `auto`)."""
    run = tmp_path / "baton"
    return Job(tmp_path, nproc=1, script=SCRIPT, out_arg=False, name="baton", env={**slurm.env, **(env or {})},
               script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")],
               run_args=["--nodes", "2", "--spare-nodes", "1", "--data-paths", paths, "--path-hold-down", "1",
                         *FAST, *(extra or [])],
               launch=["salloc", "-N3", "--no-kill", "--quiet"], leash=leash, leash_cap=CAP)


def test_a_watcher_in_a_node_sees_its_rail_go_down_and_come_back(slurm):
    """The watcher reads the links of its own network namespace (a process in the node's)."""
    rails = slurm.rails
    code = ("import sys, time\nfrom baton.net.links import LinkWatcher\n"
            "w = LinkWatcher(['rail1', 'rail2'], lambda n, up, at: print(n, up, flush=True)).start()\n"
            "print('ready', w.state, flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([*slurm.network.run_in("n1"), sys.executable, "-c", code], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready {'rail1': True, 'rail2': True}"
        rails.set_link("n1", "rail1", False)
        assert proc.stdout.readline().split() == ["rail1", "False"]
        rails.set_link("n1", "rail1", True)
        assert proc.stdout.readline().split() == ["rail1", "True"]
    finally:
        proc.kill()
        rails.set_link("n1", "rail1", True)


def test_a_rail_down_mid_step_is_routed_around_and_used_again_once_back(tmp_path, slurm, reference):
    """With `--data-paths auto`, the job finds both rails on every node (the control link,
    loopback and the links without an address left out). Rank 1 takes its node's rail1 down in step 30, between its forward and its backward:
    the backward's gradient all-reduces (over both rails in turn) stall on it until the
    orchestrator, told by the node's watcher, aborts the generation. Every rank goes back to
    the step's head and runs it again over rail2; the spare node's spare is not used. The
    rail back up for the hold-down, the job re-forms over both at a planned boundary,
    running nothing again."""
    job = _job(tmp_path, slurm, env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired"),
                                     "BATON_TEST_LINK_DOWN_MID_STEP": "1:30:rail1"}, paths="auto")
    node = None
    try:
        st = job.wait_step(1, timeout=180)
        assert st["data_paths"]["configured"] == st["data_paths"]["in_use"] == ["rail1", "rail2"], st["data_paths"]
        node = _node_of_rank(st, 1)
        _over(job, ["rail2"], "the job re-formed over rail2")
        status = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--run-dir", str(job.run_dir)],
                                capture_output=True, text=True, timeout=30).stdout
        assert f"data paths: rail1, rail2; in use: rail2; down: rail1 on {node}" in status, status
        slurm.rails.set_link(node, "rail1", True)
        _over(job, ["rail1", "rail2"], "the job re-formed over both rails again")
        assert job.wait_progress() == 0, job.log()
        events = job.events()
    finally:
        job.kill()
        if node is not None:
            slurm.rails.set_link(node, "rail1", True)
    assert (tmp_path / "fired").exists(), job.log()
    assert [(e["kind"], e["status"], e["rank"], e["node"], e["interface"], e["steps_lost"], e["steps_rerun"],
             e["step"]) for e in events][:1] == [("path-failover", "resolved", None, node, "rail1", 0, 1, 30)], events
    assert [(e["kind"], e["status"], e["interface"], e["steps_lost"], e["steps_rerun"]) for e in events][1:] == \
        [("path-restored", "resolved", "rail1", 0, 0)], events
    compare(reference, tmp_path / "baton")


def test_the_control_link_alone_down_does_not_disturb_training(tmp_path, slurm, reference):
    """Rank 1's node loses its link to the host (the launcher, the control plane) for a few
    heartbeat timeouts: its heartbeats stop, but rank 0 keeps training with it, so it is not
    hung. Nothing moves, and once the link is back its reports arrive (they are retried)."""
    job = _job(tmp_path, slurm)
    node = None
    try:
        st = job.wait_step(10, timeout=180)
        node = _node_of_rank(st, 1)
        slurm.network.set_control_link(node, False)
        # rank 0 is heard; its steps go on while rank 1 is silent past the heartbeat timeout
        silent = job.wait_until(lambda s: s["ranks"][1].get("unheard_s") is not None, timeout=120,
                                what="rank 1 unheard while rank 0 trains on")
        job.wait_until(lambda s: s["ranks"][0]["step"] > silent["ranks"][0]["step"] + 10, timeout=120,
                       what="rank 0 training on")
        slurm.network.set_control_link(node, True)
        node = None
        assert job.wait_progress() == 0, job.log()
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
        if node is not None:
            slurm.network.set_control_link(node, True)
    assert events == [], events
    assert "control path is down, not the rank" in log and "is heard from again" in log, log[-3000:]
    compare(reference, tmp_path / "baton")


def test_a_blackholed_rail_is_found_by_probes_routed_around_and_used_again_once_it_answers(tmp_path, slurm,
                                                                                           reference):
    """Rank 1's node's rail1 keeps its carrier and silently drops everything it sends: the
    collectives on it stall until --op-timeout, then every rank probes its peer over each
    rail before it reports where it stands; rail1 is silent where rail2 answered, so the job
    re-forms over rail2 with no rank moved. Once the rail carries packets again the probes
    say so and, after the hold-down, the job uses it again."""
    job = _job(tmp_path, slurm)
    node = None
    try:
        st = job.wait_step(20, timeout=180)
        node = _node_of_rank(st, 1)
        slurm.rails.blackhole(node, "rail1")
        _over(job, ["rail2"], "the job re-formed over rail2")
        slurm.rails.blackhole(node, "rail1", on=False)
        node = None
        _over(job, ["rail1", "rail2"], "the job re-formed over both rails again")
        assert job.wait_progress() == 0, job.log()
        events = job.events()
    finally:
        job.kill()
        if node is not None:
            slurm.rails.blackhole(node, "rail1", on=False)
    assert [(e["kind"], e["status"], e["interface"], e["steps_lost"]) for e in events] == \
        [("path-failover", "resolved", "rail1", 0), ("path-restored", "resolved", "rail1", 0)], events
    assert "silent towards" in events[0]["cause"], events  # found by the probes, its carrier up
    compare(reference, tmp_path / "baton")


# A move away and one back, or a rail's flaps, take longer than a short run on a fast
# machine and far longer on a slow one: the ranks hold at each boundary from HOLD_FROM on
# (taking commands, running one step after each) until the test lets them finish.
LONG = ["--epochs", "24", "--out-dir", "{d}/out"]  # 192 steps: held from HOLD_FROM, a planned target far ahead still fits
HOLD_FROM = 40


def _holding(tmp_path) -> tuple[dict[str, str], Path]:
    """The env that holds the ranks from HOLD_FROM while the returned file exists."""
    hold = tmp_path / "hold"
    hold.touch()
    return {"PYTHONPATH": str(INJECT), "BATON_TEST_HOLD_AT_STEP": f"{HOLD_FROM}+",
            "BATON_TEST_HOLD_FILE": str(hold)}, hold


def test_a_rail_down_past_the_grace_moves_the_nodes_rank_and_it_returns_once_the_rail_is_back(
        tmp_path, slurm, torchrun_reference):
    """Rank 1's node keeps rail1 down past --path-grace: after the failover, the node is
    tainted `network: rail1 ...` and rank 1 moves pre-emptively to the spare node, where the
    job runs over both rails again. With rail1 back, the node's links are read there (a job
    step the job's agent runs: this job is attached to `baton serve`), it is untainted after
    the hold-down, and --return-home moves rank 1 back."""
    reference = torchrun_reference(SCRIPT, [*LONG, "--export", "{d}/export"])
    env, hold = _holding(tmp_path)
    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token", host=slurm.network.host_addr)
    job = _job(tmp_path, slurm, env=env, args=LONG, extra=["--path-grace", "2", "--return-home", "--server", server.url,
                                                  "--server-token-file", str(server.token_file), "--job-id", "grace"],
               leash=0)
    node = None
    try:
        st = job.wait_step(20, timeout=180)
        node = _node_of_rank(st, 1)
        slurm.rails.set_link(node, "rail1", False)
        st = job.wait_until(lambda s: _node_of_rank(s, 1) != node and not s["operation"]
                            and s["data_paths"]["in_use"] == ["rail1", "rail2"], timeout=120,
                            what="rank 1 moved off its node, the job on both rails again")
        tainted = {n["node"]: n for n in st["nodes"]}[node]
        assert tainted["state"] == "tainted" and tainted["reason"].startswith("network: rail1 down"), tainted
        slurm.rails.set_link(node, "rail1", True)
        node_back = node
        node = None
        job.wait_until(lambda s: _node_of_rank(s, 1) == node_back and not s["operation"], timeout=180,
                       what="rank 1 back on its node")
        hold.unlink()
        assert job.wait_progress() == 0, job.log() + server.log()
        events = job.events()
    finally:
        job.kill()
        server.stop()
        if node is not None:
            slurm.rails.set_link(node, "rail1", True)
    assert [(e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events] == [
        ("path-failover", "resolved", None, 0), ("pre-emptive", "resolved", 1, 0), ("planned", "resolved", 1, 0)], events
    assert "network: rail1 down" in events[1]["cause"], events
    compare(reference, tmp_path / "baton")


def test_both_rails_of_a_node_down_lose_its_rank_at_once_and_it_is_rebuilt_on_the_spare_node(
        tmp_path, slurm, reference):
    """With every data path of rank 1's node down, its rank can take part in no collective:
    the node is tainted and the rank lost at once (not after --op-timeout), rebuilt on the
    spare node from rank 0's state and its buddy's copy of its own, bitwise."""
    job = _job(tmp_path, slurm)
    node = None
    try:
        st = job.wait_step(20, timeout=180)
        node, spare_node = _node_of_rank(st, 1), st["spares"][0]["slot"].split("/")[0]
        slurm.rails.set_links(node, ["rail1", "rail2"], False)  # the node's NICs lost together
        st = job.wait_until(lambda s: _node_of_rank(s, 1) != node and not s["operation"], timeout=120,
                            what="rank 1 rebuilt off its node")
        assert job.wait_progress() == 0, job.log()
        events = job.events()
    finally:
        job.kill()
        if node is not None:
            slurm.rails.set_link(node, "rail1", True)
            slurm.rails.set_link(node, "rail2", True)
            # baton drained it in Slurm with its taint: give it back for the tests after this one
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    lost = [e for e in events if e["kind"] == "unplanned"]
    assert [(e["status"], e["rank"], e["steps_lost"]) for e in lost] == [("resolved", 1, 0)], events
    assert lost[0]["to_slot"].startswith(spare_node + "/") and "every data path" in lost[0]["cause"], lost
    assert all(e["status"] == "resolved" for e in events), events
    tainted = {n["node"]: n for n in st["nodes"]}[node]
    assert tainted["state"] == "tainted" and "every data path down" in tainted["reason"], tainted
    compare(reference, tmp_path / "baton")


def test_two_nodes_left_with_no_rail_in_common_cut_one_off_and_it_is_rebuilt_on_the_spare_node(
        tmp_path, slurm, reference):
    """Rank 1's node loses rail2 (the job fails over to rail1), then rank 0's node loses
    rail1: each node still has a rail, but none in common, so no collective can include
    both. Rank 0's node, whose loss split them, is tainted and its rank lost at once and
    rebuilt on the spare node, which has both rails; the job runs on over rail1, bitwise."""
    job = _job(tmp_path, slurm)
    downs: list[tuple[str, str]] = []
    try:
        st = job.wait_step(20, timeout=180)
        node0, node1 = _node_of_rank(st, 0), _node_of_rank(st, 1)
        slurm.rails.set_link(node1, "rail2", False)
        downs.append((node1, "rail2"))
        _over(job, ["rail1"], "the job failed over to rail1")
        slurm.rails.set_link(node0, "rail1", False)
        downs.append((node0, "rail1"))
        st = job.wait_until(lambda s: _node_of_rank(s, 0) not in (node0, node1) and not s["operation"], timeout=120,
                            what="rank 0 rebuilt on the spare node")
        assert st["data_paths"]["in_use"] == ["rail1"], st["data_paths"]
        assert job.wait_progress() == 0, job.log()
        events = job.events()
    finally:
        job.kill()
        for node, rail in downs:
            slurm.rails.set_link(node, rail, True)
        if downs:
            slurm.run("scontrol", "update", f"nodename={downs[-1][0]}", "state=resume", check=False)
    assert [(e["kind"], e["status"], e["rank"], e["steps_lost"]) for e in events] == [
        ("path-failover", "resolved", None, 0), ("unplanned", "resolved", 0, 0)], events
    assert "shares no working data path with" in events[1]["cause"], events
    tainted = {n["node"]: n for n in st["nodes"]}[node0]
    assert tainted["state"] == "tainted" and "no data path shared with" in tainted["reason"], tainted
    compare(reference, tmp_path / "baton")


def test_a_flapping_rail_costs_one_failover_and_is_damped(tmp_path, slurm, torchrun_reference):
    """Rank 1's node's rail1 goes down for a second and up for a second, six times, the ranks
    held from HOLD_FROM so that the flaps land mid-run: the first down fails over; it
    never stays up for the 3 s hold-down, so the job does not re-form at each flap; by its
    third down it is damped, which the ledger says. Bitwise, as ever."""
    reference = torchrun_reference(SCRIPT, [*LONG, "--export", "{d}/export"])
    env, hold = _holding(tmp_path)
    job = _job(tmp_path, slurm, env=env, args=LONG, extra=["--path-hold-down", "3"], leash=0)
    node, flaps = None, 0
    try:
        st = job.wait_step(20, timeout=180)
        node = _node_of_rank(st, 1)
        for flaps in range(1, 7):
            slurm.rails.set_link(node, "rail1", False)
            time.sleep(1.0)
            slurm.rails.set_link(node, "rail1", True)
            time.sleep(1.0)
        flapped = node
        node = None
        assert job.proc.poll() is None, job.log()  # still training: the flaps landed mid-run
        st = job.status()
        link = next(x for x in st["data_paths"]["links"] if x["node"] == flapped and x["interface"] == "rail1")
        assert link["damped"] and link["downs"] == flaps, link
        hold.unlink()
        assert job.wait_progress() == 0, job.log()
        events = job.events()
    finally:
        job.kill()
        if node is not None:
            slurm.rails.set_link(node, "rail1", True)
    # A rank found hung and rebuilt (resolved, bitwise: checked below) is not the flapping's
    # doing: the script's DataLoader forks its workers each epoch, and CPython 3.11 can leave a
    # child forked from a process with threads stuck in PyOS_AfterFork_Child (plain torchrun
    # too, tests/nocode_runs.py), so its rank waits for a batch forever and is lost as hung.
    kept = [e for e in events if not (e["kind"] == "unplanned" and e["cause"].endswith("(hung)")
                                      and e["status"] == "resolved")]
    kinds = [e["kind"] for e in kept]
    assert kinds[:2] == ["path-failover", "path-damped"] and "path-failover" not in kinds[2:], events
    assert set(kinds[2:]) <= {"path-restored"}, events  # once its penalty decays, if the job is still running
    assert "flapping (down 3 times" in kept[1]["cause"], events
    compare(reference, tmp_path / "baton")
