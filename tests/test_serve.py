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


def _progress(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_server_killed_mid_job_and_a_rank_killed_while_it_is_down(tmp_path):
    """kill -9 of `baton serve` mid-job: training goes on meanwhile; a rank killed while the
    server is down is recovered once it is back (from its SQLite state); every rank ends bit
    for bit equal to the failure-free run, 0 steps lost."""
    ref = Job(tmp_path, nproc=2, spares=0, steps=120, name="ref", script_args=["--step-sleep", "0.05"])
    assert ref.wait(timeout=180) == 0, ref.log()
    reference = ref.all_rank_params(2)

    server = Server(tmp_path, f"sqlite:{tmp_path / 'state'}", tmp_path / "token")
    try:
        progress = tmp_path / "progress"
        job = Job(tmp_path, nproc=2, spares=1, steps=120, name="attached", run_args=_run_args([server], "crash"),
                  script_args=["--step-sleep", "0.05", "--progress-file", str(progress)])
        job.wait_step(10)
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
    finally:
        server.stop()
