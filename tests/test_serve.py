"""`baton serve`: the control plane as a service that survives its own crash.

Real servers (subprocesses, SQLite or a real etcd), real jobs attached with
`baton run --server`, real `kill -9` of the server, of a rank while the server is down, and
of the leader of two servers sharing one etcd. Training must go on while the control plane
is away, the failure must be handled once it is back, and every rank must end bit-for-bit
equal to the failure-free run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from baton.rundir import RunDir
from tests.gpt_job import check_equal, gpt_job, in_eval
from tests.jobs import Job, assert_ranks_equal
from tests.served import Server, free_port, run_args

pytestmark = pytest.mark.timeout(400)


def _two_jobs_one_server(server: Server, job: Job, other: Job) -> None:
    """Both jobs are listed (higher priority first); a job's token acts on that job only."""
    listed = server.jobs().json()["jobs"]
    assert [(j["job_id"], j["priority"]) for j in listed] == [("other", 5), ("crash", 0)], listed
    assert job.client.status()["jobs"][0]["id"] == "crash" and other.client.status()["jobs"][0]["id"] == "other"
    own, theirs = RunDir(job.run_dir).read()[1], RunDir(other.run_dir).read()[1]
    for path in ("/v1/status", "/v1/events"):
        r = httpx.get(f"{server.url}/v1/jobs/other{path}", headers={"Authorization": f"Bearer {own}"})
        assert r.status_code == 401, r.text
        r = httpx.get(f"{server.url}/v1/jobs/other{path}", headers={"Authorization": f"Bearer {server.token}"})
        assert r.status_code == 401, r.text  # the admin token is not a job's token
    r = httpx.post(f"{server.url}/v1/jobs/crash/v1/migrate", json={"rank": 0},
                   headers={"Authorization": f"Bearer {theirs}"})
    assert r.status_code == 401, r.text
    r = httpx.get(f"{server.url}/v1/jobs/nope/v1/status", headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 404 and "unknown job" in r.json()["error"], r.text
    r = httpx.post(f"{server.url}/v1/jobs", json={"job_id": "crash", "world_size": 1, "spares": 0, "slots": ["x"]},
                   headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 409 and "attached already" in r.json()["error"], r.text


def _progress(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_server_killed_mid_job_and_a_rank_killed_while_it_is_down(tmp_path, train_reference):
    """kill -9 of `baton serve` mid-job: training goes on meanwhile; a rank killed while the
    server is down is recovered once it is back (from its SQLite state); every rank ends bit
    for bit equal to the failure-free run, 0 steps lost."""
    reference = train_reference(3, 60, ["--step-sleep", "0.05"])  # shared with the straggler test

    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token")
    jobs: list[Job] = []
    try:
        progress = tmp_path / "progress"
        other = Job(tmp_path, nproc=1, spares=0, steps=200, name="other",
                    run_args=run_args([server], "other", "--priority", "5"), script_args=["--step-sleep", "0.05"])
        job = Job(tmp_path, nproc=3, spares=1, steps=60, name="attached", run_args=run_args([server], "crash"),
                  script_args=["--step-sleep", "0.05", "--progress-file", str(progress)])
        jobs += [other, job]
        job.wait_step(10)
        _two_jobs_one_server(server, job, other)
        victim = job.rank_pid(1)
        server.kill9()
        at_kill = _progress(progress)
        time.sleep(2.0)
        during = _progress(progress) - at_kill
        os.kill(victim, signal.SIGKILL)  # a failure nobody is there to handle
        time.sleep(2.0)
        server.start()
        assert job.wait(timeout=180) == 0, job.log() + server.log()
        assert during >= 5, f"training stalled while the control plane was down ({during} steps in 2 s)"
        assert_ranks_equal(job, reference)
        events = job.events()
        assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == \
            [("unplanned", 1, "resolved", 0)], events
        assert "restored life=1" in server.log()
        assert other.wait(timeout=120) == 0, other.log()
    finally:
        for j in jobs:
            j.kill()  # attached jobs would wait out their --control-grace for a server that is gone
        server.stop()


class Etcd:
    """A real etcd (Debian's etcd-server) on free loopback ports, in a temporary directory."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        peer = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "etcd.log", "w")
        self.proc = subprocess.Popen(
            ["etcd", "--name", "test", "--data-dir", str(tmp / "etcd-data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=self.log, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.post(self.url + "/v3/kv/range", json={"key": "eA=="}, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError("etcd did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.mark.skipif(shutil.which("etcd") is None,
                    reason="etcd not installed (Debian's etcd-server; `make setup` installs it as root)")
def test_two_servers_on_one_etcd_one_leads_and_the_standby_takes_over(tmp_path, gpt_reference):
    """Two `baton serve` against one etcd: only the lease holder acts (the other answers 503).
    kill -9 of the leader during the nanoGPT-shaped job's evaluation, and a rank killed before
    the standby's lease lets it lead: the standby reloads the job from etcd, the rank is
    recovered, every rank and the checkpoint end bit-for-bit equal to the failure-free run."""
    etcd = Etcd(tmp_path)
    token = tmp_path / "token"
    a = Server(tmp_path, f"etcd://127.0.0.1:{etcd.port}", token, name="serve-a")
    a.wait_leading()
    b = Server(tmp_path, f"etcd://127.0.0.1:{etcd.port}", token, name="serve-b")
    job = None
    try:
        standby = b.jobs()
        assert standby.status_code == 503 and "standby" in standby.json()["error"], standby.text
        job = gpt_job(tmp_path, "attached", run_args=run_args([a, b], "gpt"))
        in_eval(job)
        victim = job.rank_pid(2)
        a.kill9()
        os.kill(victim, signal.SIGKILL)
        b.wait_leading(timeout=30)
        events = check_equal(job, gpt_reference)
        assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == \
            [("unplanned", 2, "resolved", 0)], events
        listed = b.jobs().json()
        assert [(j["job_id"], j["state"], j["exit_code"]) for j in listed["jobs"]] == [("gpt", "ended", 0)]
        assert listed["leader"] == b.url
    finally:
        if job is not None:
            job.kill()
        a.stop()
        b.stop()
        etcd.stop()


def _rank_slot(job: Job, rank: int) -> str:
    return next(r["slot"] for r in job.status()["ranks"] if r["rank"] == rank)


def test_a_contested_spare_goes_to_the_higher_priority_job(tmp_path, train_reference):
    """Three jobs on one server. `low` (priority 1) keeps the only spare, with no free slot for
    another; `mid` (5) and `high` (9) keep none. Both lose rank 1 (`mid` first) while `low`'s
    spare is restarting (held until both wait: BATON_TEST_HOLD_SPARE): once it is ready it is
    lent to `high`, not to `mid` that asked first. `high` takes its rank home (--return-home),
    the slot goes back to `low`, whose new spare is then lent to `mid`, which goes home too.
    Both end bit-for-bit equal to the failure-free run, 0 steps lost; `low` never moved a rank."""
    steps, args = 250, ["--step-sleep", "0.05"]
    reference = train_reference(2, steps, args)
    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token")
    hold = tmp_path / "hold-spare"
    jobs: list[Job] = []
    try:
        low = Job(tmp_path, nproc=2, spares=1, steps=3000, name="low", script_args=args,
                  run_args=run_args([server], "low", "--priority", "1", "--slots", "3"),  # no slot to spare
                  env={"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"),
                       "BATON_TEST_HOLD_SPARE": str(hold)})
        jobs.append(low)
        low.wait_step(5)
        mid, high = (Job(tmp_path, nproc=2, spares=0, steps=steps, name=n, script_args=args,
                         run_args=run_args([server], n, "--priority", p, "--return-home"))
                     for n, p in (("mid", "5"), ("high", "9")))
        jobs += [mid, high]
        for j in (mid, high):
            j.wait_step(10)
        spare = low.status()["spares"][0]
        assert spare["state"] == "spare", spare
        hold.touch()
        os.kill(spare["pid"], signal.SIGKILL)  # `low` starts another, held until both jobs wait
        for j in (mid, high):
            j.signal_rank(1, signal.SIGKILL)
            j.wait_until(lambda st: st["state"] == "waiting-for-spare", timeout=60, what=f"{j.dir.name} waiting for a spare")
        hold.unlink()
        lent = f"low:{spare['slot']}"
        # What the ledgers say, not a look at an instant: once the spare is back, `high`'s move
        # onto it, its move home and `mid`'s turn can all land between two status polls.
        for j in (high, mid):
            assert j.wait(timeout=120) == 0, j.log() + server.log()
            assert_ranks_equal(j, reference)
            events = j.events()
            assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == \
                [("unplanned", 1, "resolved", 0), ("planned", 1, "resolved", 0)], events
            assert events[0]["to_slot"] == lent and "return home" in events[1]["cause"], events
        (high_lost, high_home), (mid_lost, _) = high.events(), mid.events()
        assert mid_lost["detected_at"] < high_lost["detected_at"], (mid_lost, high_lost)  # mid asked first
        # high (9) took the spare first; mid (5) had it only once high had gone home and given it back
        assert high_lost["resumed_at"] < high_home["resumed_at"] <= mid_lost["resumed_at"], (high.events(), mid.events())
        low.wait_until(lambda st: not any(s.get("lent_to") for s in st["slots"])
                       and any(s["state"] == "spare" for s in st["spares"]), timeout=60,
                       what="low's slot back and a spare on it")
        listed = {j["job_id"]: j for j in server.jobs().json()["jobs"]}
        assert listed["low"]["events"] == 0 and listed["low"]["state"] == "running", listed  # no rank of low moved
    finally:
        for j in jobs:
            j.kill()
        server.stop()


def test_a_script_with_no_code_change_attached_to_a_server_survives_a_kill(tmp_path):
    """`baton run --server URL train.py` for an unmodified torchrun script (the DDP tutorial's
    Trainer shape): the server runs it in the no-code mode, a rank killed mid-training is
    replaced, and every rank ends bit for bit equal to the same file under torchrun."""
    from tests.nocode_runs import NOCODE, differences, exports, torchrun

    script, args = NOCODE / "trainer_ddp.py", ["60", "7", "--snapshot-path", "{d}/snapshot.pt", "--export",
                                               "{d}/export"]
    ref = tmp_path / "torchrun"
    ref.mkdir()
    torchrun(script, [a.format(d=ref) for a in args], 2, ref)
    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token")
    run = tmp_path / "baton"
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, name="baton",
              run_args=run_args([server], "nocode"), script_args=[a.format(d=run) for a in args])
    try:
        st = job.wait_step(20)
        assert st["mode"] == "no-code", st
        job.signal_rank(1, signal.SIGKILL)
        assert job.wait(timeout=180) == 0, job.log() + server.log()
    finally:
        job.kill()
        server.stop()
    for rank, (a, b) in enumerate(zip(exports(ref / "export", 2), exports(run / "export", 2))):
        assert differences(a, b) == [], f"rank {rank}"
    events = job.events()
    assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == \
        [("unplanned", 1, "resolved", 0)], events
