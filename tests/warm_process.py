"""Test helper: a real `baton warm` process, started as a user starts it, and its socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class WarmProcess:
    """`baton warm` in the background, with `env` (default: this process's, as a job's launcher
    gets it); ready once its socket exists (it listens after its imports)."""

    def __init__(self, env: dict[str, str] | None = None, log: Path | None = None):
        # AF_UNIX paths are limited to 108 bytes: pytest's temporary folders can be longer.
        self.socket = Path(tempfile.mkdtemp(prefix="baton-warm-")) / "warm.sock"
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1", "BATON_PARENT_PID": str(os.getpid())}
        env.pop("BATON_WARM", None)
        self.log = log or self.socket.with_suffix(".log")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "warm", "--socket", str(self.socket)],
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, limit_s: float = 300.0) -> WarmProcess:
        """Until it listens. Bounded by its progress: it fails at once if the process ends; the
        limit only catches an import that never ends."""
        deadline = time.monotonic() + limit_s
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"baton warm did not come up (exit {self.proc.poll()}):\n"
                                     f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop it and remove its folder (its socket and, unless given another, its log)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.socket.parent, ignore_errors=True)
