"""The launcher's side of the zygote (`baton.schedulers.zygote`): start it, ask it for
workers, and hand out each worker as a process handle shaped like `subprocess.Popen`.

`baton run` starts it before the store (a scheduler without one given starts its own from its
spawner thread, see `processes`); it dies with the launcher, and what it forked dies with
it. If it cannot start, or dies, workers are
started as their own `python` again (`subprocess.Popen`), with one line saying so: slower,
never wrong. `BATON_ZYGOTE=0` asks for that from the start.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from baton import procfs
from baton.schedulers import warm
from baton.schedulers.zygote import Exited, Lines, Ready, Refused, Spawn, Started, can_fork, read_at_start, send

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a cold torch import on a loaded node can take tens of seconds
ENV_SWITCH = "BATON_ZYGOTE"


class ZygoteGone(RuntimeError):
    """The zygote is not there to fork a worker (it did not start, or it died)."""


class ForkedProcess:
    """A worker the zygote forked: the parts of `subprocess.Popen` the schedulers use."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.cpu_s = 0.0  # the CPU-seconds it used, once it has ended
        self._ended = threading.Event()

    def ended(self, code: int, cpu_s: float = 0.0) -> None:
        if self.returncode is None:
            self.returncode, self.cpu_s = code, cpu_s
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """Starts workers by forking them from one warm process; see the module docstring."""

    def __init__(self, python: str, env: dict[str, str]):
        self.python = python
        self.env = env
        self._proc: subprocess.Popen | None = None  # ours; None when the warm process forked it
        self._pid: int | None = None
        self.warm = False  # forked by the machine's warm process (`baton warm`)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one request in flight: its answer is the next Started/Refused
        self._answer: Future[ForkedProcess | Refused] | None = None
        self._children: dict[int, ForkedProcess] = {}
        self._gone: str | None = None
        self._told = False

    def start(self) -> None:
        """Start the zygote (or have the machine's warm process fork it, `BATON_WARM`) and wait
        until it has imported what workers import (once)."""
        if self._proc is not None or self._pid is not None or self._gone is not None:
            return
        if os.environ.get(ENV_SWITCH, self.env.get(ENV_SWITCH, "1")) == "0":
            self._gone = f"{ENV_SWITCH}=0"
            return
        ours, theirs = socket.socketpair()
        env = {**self.env, "BATON_PARENT_PID": str(os.getpid())}
        try:
            if not self._ask_warm(env, theirs):
                self._proc = subprocess.Popen([self.python, "-m", "baton.schedulers.zygote", str(theirs.fileno())],
                                              env=env, pass_fds=(theirs.fileno(),))
                self._pid = self._proc.pid
        except OSError as exc:
            self._gone = f"it could not start: {exc}"
            return
        finally:
            theirs.close()
        lines = Lines(ours)
        ready, _, _ = select.select([ours], [], [], READY_TIMEOUT_S)
        first = lines.read() if ready else None
        if not first or not isinstance(first[0], Ready):
            self._stop_process()
            ours.close()
            self._gone = f"it did not start (exit code {self._proc.returncode if self._proc else '?'})"
            return
        self._sock = ours
        threading.Thread(target=self._read, args=(lines,), name="baton-zygote", daemon=True).start()

    def _ask_warm(self, env: dict[str, str], theirs: socket.socket) -> bool:
        """Whether the machine's warm process (`baton warm`, at $BATON_WARM) forked our zygote;
        when it would not, one line says why (and we start our own)."""
        path = os.environ.get(warm.ENV_SWITCH) or self.env.get(warm.ENV_SWITCH)
        if not path:
            return False
        try:
            self._pid = warm.request_zygote(path, self.python, env, theirs)
        except warm.WarmRefused as exc:
            print(f"[baton] the warm process did not fork this job's zygote, starting one (slower start): {exc}",
                  file=sys.stderr, flush=True)
            return False
        self.warm = True
        return True

    def _stop_process(self) -> None:
        """Kill the zygote's process and wait for its end."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        elif self._pid is not None:  # the warm process's child: it reaps it
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(self._pid)

    def spawn(self, argv: list[str], env: dict[str, str], start_new_session: bool = False,
              stdout: int | None = None, **popen: Any) -> ForkedProcess:
        """Fork `argv` from the zygote (its stdout the descriptor `stdout`, when given);
        ZygoteGone when it cannot (start it as a process then)."""
        if popen or not can_fork(argv):
            raise ZygoteGone(f"it does not fork {argv[:2]} with {sorted(popen)}")
        if differ := read_at_start(env, self.env):
            raise ZygoteGone(f"it started with other values of {', '.join(differ)}, read only at start")
        with self._lock:
            if self._gone is not None or self._sock is None:
                raise ZygoteGone(self._gone or "not started")
            answer: Future[ForkedProcess | Refused] = Future()
            self._answer = answer
            try:
                send(self._sock, Spawn(argv=argv, env=env, cwd=os.getcwd(), new_session=start_new_session,
                                       stdout=stdout is not None), fds=[stdout] if stdout is not None else None)
            except OSError as exc:
                raise ZygoteGone(f"it is unreachable: {exc}") from None
            try:
                got = answer.result(timeout=READY_TIMEOUT_S)
            except (TimeoutError, ZygoteGone) as exc:
                raise ZygoteGone(str(exc) or "it did not answer") from None
            if isinstance(got, Refused):
                raise ZygoteGone(got.error)
            return got

    def fell_back(self, reason: str) -> None:
        """Say once that workers start as their own processes from now on, and why."""
        if not self._told and reason != f"{ENV_SWITCH}=0":
            self._told = True
            print(f"[baton] starting workers as new processes (slower start): the zygote {reason}",
                  file=sys.stderr, flush=True)

    def cpu_s(self) -> float:
        """The zygote's own CPU-seconds (its imports): part of the launcher's cost."""
        if self._pid is None or self._proc is not None and self._proc.returncode is not None:
            return 0.0
        return procfs.cpu_s(self._pid)

    def close(self) -> None:
        """Stop the zygote (any worker still alive dies with it)."""
        with self._lock:
            self._gone = self._gone or "closed"
            if self._sock is not None:
                try:  # shutdown, not only close: our reader thread's recv holds the socket open
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._stop_process()
        elif self._pid is not None:
            _wait_gone(self._pid, limit_s=5.0)
            self._stop_process()

    def _read(self, lines: Lines) -> None:
        try:
            while (msgs := lines.read()) is not None:
                for msg in msgs:
                    if isinstance(msg, Started):  # known before its Exited can be read
                        self._children[msg.pid] = ForkedProcess(msg.pid)
                    if isinstance(msg, (Started, Refused)) and self._answer is not None:
                        self._answer.set_result(self._children[msg.pid] if isinstance(msg, Started) else msg)
                        self._answer = None
                    elif isinstance(msg, Exited) and msg.pid in self._children:
                        self._children.pop(msg.pid).ended(msg.code, msg.cpu_s)
        except (OSError, ValueError) as exc:
            if self._gone is None:  # not closed by us
                log.warning("the zygote's channel failed: %s", exc)
        self._gone = self._gone or (f"exited (code {self._proc.wait()})" if self._proc else "exited")
        if self._answer is not None:
            self._answer.set_exception(ZygoteGone(self._gone))
        # Its workers die with it (PR_SET_PDEATHSIG): report them as killed.
        for proc in list(self._children.values()):
            _wait_gone(proc.pid)
            proc.ended(-signal.SIGKILL)
        self._children.clear()


def start_process(zygote: Zygote | None, argv: list[str], **popen: Any) -> ForkedProcess | subprocess.Popen:
    """`argv` forked from `zygote` when it can, else (saying so once) as its own process."""
    if zygote is not None:
        try:
            return zygote.spawn(argv, **popen)
        except ZygoteGone as exc:
            zygote.fell_back(str(exc))
    return subprocess.Popen(argv, **popen)


def _wait_gone(pid: int, limit_s: float = 10.0) -> None:
    """Until `pid` no longer runs (its parent's death kills it; a moment for the kernel, more
    on a busy machine). Dead and not yet reaped counts as gone: nobody here can reap it."""
    deadline = time.monotonic() + limit_s
    while procfs.running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
