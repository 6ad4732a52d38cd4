"""Start processes from one long-lived thread.

A child that asks the kernel to kill it when its parent dies (`PR_SET_PDEATHSIG`) is killed
when the *thread* that forked it ends, not the process. Effects are applied by whichever
thread decided them (an API worker thread that may go away), so every start goes through
this one thread, which lives as long as the launcher.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from concurrent.futures import Future
from typing import Any


class Spawner:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[list[str], dict[str, Any], Future]] = queue.Queue()
        threading.Thread(target=self._run, name="baton-spawner", daemon=True).start()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        done: Future[subprocess.Popen] = Future()
        self._queue.put((argv, kwargs, done))
        return done.result()

    def _run(self) -> None:
        while True:
            argv, kwargs, done = self._queue.get()
            try:
                done.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)
