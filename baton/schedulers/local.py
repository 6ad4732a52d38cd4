"""Local scheduler: worker processes on this machine, one per slot (`local/0`, `local/1`, ...).

It only does what it is told (start a worker on a slot, kill a worker) and
reports what it sees (a process exited, with its code) back to the
orchestrator, which decides what that means.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable


class LocalScheduler:
    def __init__(self, script: str, script_args: list[str], env: dict[str, str], num_slots: int,
                 on_exit: Callable[[str, int], None] | None = None, python: str = sys.executable):
        self.script = script
        self.script_args = script_args
        self.base_env = env
        self.num_slots = num_slots
        self.python = python
        self.on_exit = on_exit
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # Every worker is started from this one long-lived thread: a worker asks the kernel
        # to kill it when its parent *thread* ends (PR_SET_PDEATHSIG, see baton.worker.orphan),
        # so that thread must live exactly as long as the launcher.
        self._spawn_queue: queue.Queue[tuple[list[str], dict[str, str], Future]] = queue.Queue()
        threading.Thread(target=self._spawner, name="baton-spawner", daemon=True).start()

    def slots(self) -> list[str]:
        return [f"local/{i}" for i in range(self.num_slots)]

    def start(self, worker_id: str, slot: str) -> int:
        env = {**self.base_env, "BATON_WORKER_ID": worker_id, "BATON_SLOT": slot,
               "BATON_PARENT_PID": str(os.getpid())}
        done: Future[subprocess.Popen] = Future()
        self._spawn_queue.put(([self.python, self.script, *self.script_args], env, done))
        proc = done.result()
        with self._lock:
            self._procs[worker_id] = proc
        # One waiter per process: a death is reported the instant it happens, at no idle cost.
        threading.Thread(target=self._wait, args=(worker_id, proc), name=f"baton-wait-{worker_id}",
                         daemon=True).start()
        return proc.pid

    def _spawner(self) -> None:
        while True:
            argv, env, done = self._spawn_queue.get()
            try:
                done.set_result(subprocess.Popen(argv, env=env, start_new_session=True))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        with self._lock:
            proc = self._procs.get(worker_id)
        if proc is None or proc.poll() is not None:
            return
        if dump_stacks:
            # Let a hung-but-running process print where it is stuck (baton.init() registers
            # faulthandler on SIGUSR1); a SIGSTOPped one cannot, and is killed right away.
            try:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.2)
            except ProcessLookupError:
                return
        try:
            os.kill(proc.pid, signal.SIGKILL)  # also ends a SIGSTOPped (hung) process
        except ProcessLookupError:
            pass

    def pid(self, worker_id: str) -> int | None:
        with self._lock:
            proc = self._procs.get(worker_id)
        return proc.pid if proc else None

    def alive(self) -> list[str]:
        with self._lock:
            return [w for w, p in self._procs.items() if p.poll() is None]

    def _wait(self, worker_id: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._procs.pop(worker_id, None)
        if self.on_exit is not None and not self._stopped.is_set():
            self.on_exit(worker_id, code)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every remaining worker to stop (SIGTERM), then kill what is left."""
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._stopped.set()
