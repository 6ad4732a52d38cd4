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
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from baton.rundir import RunDir
from tests.gpt_job import check_equal, gpt_job, in_eval
from tests.jobs import Job, assert_ranks_equal

pytestmark = pytest.mark.timeout(400)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `baton serve` process, killable and restartable on the same port and store."""

    def __init__(self, tmp: Path, store: str, token_file: Path, name: str = "serve", port: int | None = None):
        self.tmp, self.store, self.token_file, self.name = tmp, store, token_file, name
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--listen",
                                      f"127.0.0.1:{self.port}", "--store", self.store,
                                      "--token-file", str(self.token_file)],
                                     cwd=self.tmp, stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"baton serve exited:\n{self.log()}")
            try:
                httpx.get(self.url + "/v1/jobs", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"baton serve did not come up:\n{self.log()}")

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def jobs(self) -> httpx.Response:
        return httpx.get(self.url + "/v1/jobs", headers={"Authorization": f"Bearer {self.token}"}, timeout=10)

    def wait_leading(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while self.jobs().status_code == 503:
            if time.time() > deadline:
                raise AssertionError(f"{self.name} never took the lead:\n{self.log()}")
            time.sleep(0.2)

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill9()

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]


def _run_args(servers: list[Server], job_id: str, *extra: str) -> list[str]:
    return ["--server", ",".join(s.url for s in servers), "--server-token-file", str(servers[0].token_file),
            "--job-id", job_id, "--heartbeat-timeout", "2", "--op-timeout", "3", *extra]


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
                    run_args=_run_args([server], "other", "--priority", "5"), script_args=["--step-sleep", "0.05"])
        job = Job(tmp_path, nproc=3, spares=1, steps=60, name="attached", run_args=_run_args([server], "crash"),
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
        self.port = _free_port()
        peer = _free_port()
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
        job = gpt_job(tmp_path, "attached", run_args=_run_args([a, b], "gpt"))
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
