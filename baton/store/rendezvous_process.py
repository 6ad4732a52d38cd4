"""The rendezvous store as a process of its own, restarted on the same port when it dies.

Held inside the launcher (or the agent of an attached job), the store would die with it
and take every future formation with it. As a supervised child it can be killed, crash
or be OOM-killed on its own: the running generation keeps training (gloo does not use the
store once connected), the supervisor starts a new, empty store on the same address, and
the next formation meets there (`RendezvousClient` reconnects). The child dies with its
supervisor (PR_SET_PDEATHSIG), so a killed launcher leaves no store behind.

Run as `python -m baton.store.rendezvous_process HOST PORT` by `RendezvousProcess` only.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

from baton import procfs
from baton.schedulers.forked import ForkedProcess, Zygote, ZygoteGone
from baton.store.rendezvous import rendezvous_store

READY_TIMEOUT_S = 120.0  # a cold torch import on a loaded node can take tens of seconds
BIND_RETRY_S = 10.0  # the old store's port can stay busy a moment after it died
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)  # between restarts that keep failing


class StoreStartError(RuntimeError):
    """The rendezvous store process did not come up."""


class RendezvousProcess:
    def __init__(self, host: str, *, say=None, zygote: Zygote | None = None):  # noqa: ANN001 - say(str) prints
        self.host = host
        self.port = 0
        self.restarts = 0
        self._say = say or (lambda text: print(f"[baton] {text}", file=sys.stderr, flush=True))
        self._zygote = zygote  # forks the store, which then skips torch's import; else a new process
        self._proc: subprocess.Popen[str] | ForkedProcess | None = None
        self._past_cpu_s = 0.0  # what the store processes that died used
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def cpu_s(self) -> float:
        """CPU-seconds of every store process so far: part of the control plane's cost."""
        proc = self._proc
        live = procfs.cpu_s(proc.pid) if proc is not None and proc.returncode is None else 0.0
        return self._past_cpu_s + live

    def start(self) -> "RendezvousProcess":
        self._proc, self.port = self._spawn(0)
        self._watcher = threading.Thread(target=self._watch, name="baton-store-watch", daemon=True)
        self._watcher.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _spawn(self, port: int) -> tuple[subprocess.Popen[str] | ForkedProcess, int]:
        argv = [sys.executable, "-m", "baton.store.rendezvous_process", self.host, str(port)]
        proc: subprocess.Popen[str] | ForkedProcess | None = None
        if self._zygote is not None:
            r, w = os.pipe()
            try:
                proc = self._zygote.spawn(argv, {**self._zygote.env, "BATON_PARENT_PID": str(os.getpid())}, stdout=w)
            except ZygoteGone:
                os.close(r)
            finally:
                os.close(w)
        forked = proc is not None
        if proc is None:
            env = dict(os.environ, BATON_PARENT_PID=str(os.getpid()))
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
            assert proc.stdout is not None
        out = open(r, encoding="utf-8") if forked else proc.stdout  # noqa: SIM115 - a pipe of ours: closed below
        try:
            ready, _, _ = select.select([out], [], [], READY_TIMEOUT_S)
            line = out.readline() if ready else ""
        finally:
            if forked:
                out.close()
        if not line.startswith("ready "):
            proc.kill()
            proc.wait()
            raise StoreStartError(f"the rendezvous store on {self.host}:{port or 'any port'} did not start "
                                  f"(exit code {proc.returncode}; its error is above)")
        return proc, int(line.split()[1])

    def _watch(self) -> None:
        while True:
            proc = self._proc
            assert proc is not None
            if isinstance(proc, ForkedProcess):  # the zygote reaps it, and says what it used
                code = proc.wait()
                self._past_cpu_s += proc.cpu_s
            else:
                try:  # reaped here, not by Popen.wait, for the dead process's CPU usage
                    _, status, usage = os.wait4(proc.pid, 0)
                except ChildProcessError:  # reaped by stop()
                    return
                proc.returncode = code = os.waitstatus_to_exitcode(status)
                self._past_cpu_s += usage.ru_utime + usage.ru_stime
            if self._stopping.is_set():
                return
            self._say(f"the rendezvous store (pid {self._proc.pid}) exited with code {code}: "
                      f"restarting it on {self.host}:{self.port}; training goes on meanwhile")
            if not self._restart():
                return

    def _restart(self) -> bool:
        """Start the store again on its port, backing off while that fails; False if stopped."""
        t0 = time.monotonic()
        failures = 0
        while not self._stopping.is_set():
            time.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            try:
                proc, _ = self._spawn(self.port)
            except StoreStartError as exc:
                failures += 1
                if failures in (1, 5) or failures % 30 == 0:
                    self._say(f"{exc}; retrying (attempt {failures + 1}); a new generation cannot form until then")
                continue
            self._proc = proc
            if self._stopping.is_set():  # stop() ran while it started
                proc.kill()
                proc.wait()
                return False
            self.restarts += 1
            self._say(f"the rendezvous store is back on {self.host}:{self.port} "
                      f"(pid {proc.pid}, {time.monotonic() - t0:.1f}s)")
            return True
        return False


def main(argv: list[str]) -> int:
    from baton.worker.orphan import die_with_parent

    import torch.distributed as dist

    die_with_parent()
    host, port = argv[0], int(argv[1])
    try:  # TCPStore listens on every address, then times out connecting to a foreign one: check first
        with socket.create_server((host, 0)):
            pass
    except OSError as exc:
        print(f"[baton] cannot serve the rendezvous store on {host}: {exc}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            store = rendezvous_store(host, port, master=True, formation_timeout_s=0.0)
            break
        except dist.DistNetworkError as exc:
            if port == 0 or time.monotonic() > deadline:
                print(f"[baton] cannot serve the rendezvous store on {host}:{port}: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    print(f"ready {store.port}", flush=True)
    parent = int(os.environ["BATON_PARENT_PID"])
    while os.getppid() == parent:  # PDEATHSIG is best effort: watch too
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
