"""Test helper: a `baton serve` process that a test can kill -9 and start again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `baton serve` process, killable and restartable on the same port and store."""

    def __init__(self, tmp: Path, store: str, token_file: Path, name: str = "serve", port: int | None = None,
                 host: str = "127.0.0.1"):
        self.tmp, self.store, self.token_file, self.name, self.host = tmp, store, token_file, name, host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--listen",
                                      f"{self.host}:{self.port}", "--store", self.store,
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


def run_args(servers: list[Server], job_id: str, *extra: str) -> list[str]:
    return ["--server", ",".join(s.url for s in servers), "--server-token-file", str(servers[0].token_file),
            "--job-id", job_id, "--heartbeat-timeout", "2", "--op-timeout", "3", *extra]
