"""Local scheduler: worker processes on this machine, one per slot (`local/0`, `local/1`, ...).

It only does what it is told (start a worker on a slot, kill a worker) and
reports what it sees (a process exited, with its code) back to the
orchestrator, which decides what that means.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from baton.schedulers.spawner import Spawner


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
        # A worker asks the kernel to kill it when its parent *thread* ends (see
        # baton.worker.orphan): every worker is started from one long-lived thread.
        self._spawner = Spawner()

    def slots(self) -> list[str]:
        return [f"local/{i}" for i in range(self.num_slots)]

    def start(self, worker_id: str, slot: str) -> int:
        env = {**self.base_env, "BATON_WORKER_ID": worker_id, "BATON_SLOT": slot,
               "BATON_PARENT_PID": str(os.getpid())}
        proc = self._spawner.popen([self.python, self.script, *self.script_args], env=env, start_new_session=True)
        with self._lock:
            self._procs[worker_id] = proc
        # One waiter per process: a death is reported the instant it happens, at no idle cost.
        threading.Thread(target=self._wait, args=(worker_id, proc), name=f"baton-wait-{worker_id}",
                         daemon=True).start()
        return proc.pid

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
