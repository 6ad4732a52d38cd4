"""The processes a scheduler started, one per worker, and the report of each one's end.

Every process is started from one long-lived thread: a child that asks the kernel to kill
it when its parent dies (`PR_SET_PDEATHSIG`) is killed when the *thread* that forked it
ends, and effects are applied by whichever thread decided them (an API worker thread that
may go away). Each process then has a waiter thread of its own, so a death is reported the
instant it happens, at no idle cost. With a zygote (`forked`), that thread starts it first
and workers are forked from it; a process the zygote cannot fork is started as before.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from baton.schedulers.forked import Zygote, start_process


class Process(Protocol):
    """What the schedulers use of a worker's process: `subprocess.Popen`, or a forked one."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...


class WorkerProcesses:
    def __init__(self, on_exit: Callable[[str, int], None] | None,
                 exit_code: Callable[[int], int] = lambda code: code, zygote: Zygote | None = None):
        self.on_exit = on_exit
        self.zygote = zygote
        self._exit_code = exit_code  # how a scheduler's wrapper reports a signal (srun: 128 + n)
        self._procs: dict[str, Process] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._spawns: queue.Queue[tuple[list[str], dict[str, Any], Future]] = queue.Queue()
        threading.Thread(target=self._spawner, name="baton-spawner", daemon=True).start()

    def start(self, worker_id: str, argv: list[str], **popen: Any) -> Process:
        done: Future[Process] = Future()
        self._spawns.put((argv, popen, done))
        proc = done.result()
        with self._lock:
            self._procs[worker_id] = proc
        threading.Thread(target=self._wait, args=(worker_id, proc), name=f"baton-wait-{worker_id}",
                         daemon=True).start()
        return proc

    def running(self, worker_id: str) -> Process | None:
        with self._lock:
            proc = self._procs.get(worker_id)
        return proc if proc is not None and proc.poll() is None else None

    def pid(self, worker_id: str) -> int | None:
        with self._lock:
            proc = self._procs.get(worker_id)
        return proc.pid if proc else None

    def alive(self) -> list[str]:
        with self._lock:
            return [w for w, p in self._procs.items() if p.poll() is None]

    def shutdown(self, terminate: Callable[[dict[str, Process]], None],
                 kill: Callable[[dict[str, Process]], None], grace_s: float) -> None:
        """Ask every remaining process to stop (`terminate`), `kill` what is left after the
        grace, and report no more ends: the job is over."""
        with self._lock:
            procs = {w: p for w, p in self._procs.items() if p.poll() is None}
        terminate(procs)
        deadline = time.time() + grace_s
        left = {}
        for wid, p in procs.items():
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                left[wid] = p
        if left:
            kill(left)
            for p in left.values():
                p.kill()
                p.wait()
        self._stopped.set()

    def _spawner(self) -> None:
        if self.zygote is not None:
            self.zygote.start()
        while True:
            argv, popen, done = self._spawns.get()
            try:
                done.set_result(start_process(self.zygote, argv, **popen))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)


    def _wait(self, worker_id: str, proc: Process) -> None:
        code = proc.wait()
        with self._lock:
            self._procs.pop(worker_id, None)
        if self.on_exit is not None and not self._stopped.is_set():
            self.on_exit(worker_id, self._exit_code(code))
