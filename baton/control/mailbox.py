"""Per-worker command queues that workers long-poll.

The orchestrator appends; a worker's control thread asks for everything after
the last sequence number it saw. Sequence numbers make redelivery after a
dropped HTTP response harmless.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Mailboxes:
    """`base` lifts every sequence number: a control plane restarted from its store numbers
    its commands above any its previous life handed out, so a worker's `after` from before
    the restart asks for everything new."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self._cond = threading.Condition()
        self._boxes: dict[str, list[dict[str, Any]]] = {}
        self._closed = False

    def post(self, worker_id: str, command: dict[str, Any]) -> None:
        with self._cond:
            box = self._boxes.setdefault(worker_id, [])
            box.append({**command, "seq": self.base + len(box) + 1})
            self._cond.notify_all()

    def wait(self, worker_id: str, after: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                box = self._boxes.get(worker_id, [])
                seen = max(0, after - self.base)
                if len(box) > seen:
                    return box[seen:]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return []
                self._cond.wait(remaining)

    def close(self) -> None:
        """Release every waiting poll now (the job is over and the API is shutting down)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
