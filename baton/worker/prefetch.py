"""A joiner's state, pulled while its script is still building the model.

At a failure the orchestrator sends a joiner its Form right after its Assign, so the Form
names where the lost (sharded) rank's state is while the script is still constructing and sharding
its model (half a second and more for a real one, and it grows with the model). Fetching
then, on a thread, takes the transfer off the recovery's critical path: the step loop
finds the bytes in memory, checked chunk by chunk as always, and only loads them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from baton.control import messages as m
from baton.transfer import FetchStats

log = logging.getLogger("baton.worker")

Fetched = tuple[dict[str, Any], FetchStats]


class _Fetch:
    """One Form's fetch on its own thread: the state, or what the fetch raised."""

    def __init__(self, form: m.Form):
        self.form = form
        self.done = threading.Event()
        self.result: Fetched | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self, fetch: Callable[[m.Form], Fetched]) -> None:
        t0 = time.perf_counter()
        try:
            self.result = fetch(self.form)
        except BaseException as exc:  # handed to the step loop, which decides what it means
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self.done.set()


class Prefetch:
    """Starts a joiner's fetch when its Form arrives, until the step loop takes over."""

    def __init__(self, fetch: Callable[[m.Form], Fetched]):
        self._fetch = fetch
        self._lock = threading.Lock()
        self._by_generation: dict[int, _Fetch] = {}
        self._closed = False

    def offer(self, form: m.Form) -> None:
        """Start fetching what `form` names (called on the control thread, once or more per Form).
        Only a sharded rank's rebuild: its sources (a buddy's copy, another replica group's own
        snapshot) hold the state already. DDP survivors publish theirs only as they form, so a
        DDP joiner fetches in its step loop, as before."""
        if not form.fetch_from or not form.snapshot:
            return
        with self._lock:
            if self._closed or form.generation in self._by_generation:
                return
            job = self._by_generation[form.generation] = _Fetch(form)
        log.info("generation %s: fetching rank state while the script sets up", form.generation)
        threading.Thread(target=job.run, args=(self._fetch,), daemon=True,
                         name=f"baton-prefetch-{form.generation}").start()

    def close(self) -> None:
        """The script reached its step loop: Forms from now on are fetched there."""
        with self._lock:
            self._closed = True

    def take(self, form: m.Form) -> Fetched | None:
        """What was fetched for this very Form, waiting for a fetch under way; None when none
        was started for it. Raises what the fetch raised. Fetches for older generations are
        dropped (their threads end on their own timeouts)."""
        with self._lock:
            job = self._by_generation.get(form.generation)
            self._by_generation.clear()
        if job is None or job.form != form:
            return None
        t0 = time.perf_counter()
        job.done.wait()
        log.info("generation %s: the fetch started during setup took %.3fs, %.3fs of it after setup",
                 form.generation, job.seconds, time.perf_counter() - t0)
        if job.error is not None:
            raise job.error
        return job.result
