"""Local scheduler: worker processes on this machine, one per slot (`local/0`, `local/1`, ...).

It only does what it is told (start a worker on a slot, kill a worker) and
reports what it sees (a process exited, with its code) back to the
orchestrator, which decides what that means.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

from baton.schedulers.forked import Zygote
from baton.schedulers.processes import Process, WorkerProcesses


class LocalScheduler:
    def __init__(self, script: str, script_args: list[str], env: dict[str, str], num_slots: int,
                 on_exit: Callable[[str, int], None] | None = None, python: str = sys.executable,
                 zygote: Zygote | None = None):
        self.script = script
        self.script_args = script_args
        self.base_env = env
        self.num_slots = num_slots
        self.python = python
        self._own_zygote = zygote is None  # else its owner (the launcher) closes it
        self.zygote = zygote or Zygote(python, env)  # forks the workers: each skips torch's import
        self._procs = WorkerProcesses(on_exit, zygote=self.zygote)

    def slots(self) -> list[str]:
        return [f"local/{i}" for i in range(self.num_slots)]

    def start(self, worker_id: str, slot: str) -> int:
        # A worker asks the kernel to kill it when this process dies (see baton.worker.orphan).
        env = {**self.base_env, "BATON_WORKER_ID": worker_id, "BATON_SLOT": slot,
               "BATON_PARENT_PID": str(os.getpid())}
        return self._procs.start(worker_id, [self.python, self.script, *self.script_args], env=env,
                                 start_new_session=True).pid

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        proc = self._procs.running(worker_id)
        if proc is None:
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
        return self._procs.pid(worker_id)

    def alive(self) -> list[str]:
        return self._procs.alive()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every remaining worker to stop (SIGTERM), then kill what is left."""
        self._procs.shutdown(_terminate, lambda _left: None, grace_s)
        if self._own_zygote:
            self.zygote.close()


def _terminate(procs: dict[str, Process]) -> None:
    for p in procs.values():
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
        except ProcessLookupError:
            pass
