"""A joiner's state, pulled while its script is still building the model.

At a failure the orchestrator sends a joiner its Form right after its Assign, so the Form
names where the lost rank's state is while the script is still constructing (and sharding)
its model (half a second and more for a real one, and it grows with the model). Fetching
then, on a thread, takes the transfer off the recovery's critical path: the step loop
finds the bytes in memory, checked chunk by chunk as always, and only loads them. A
sharded rank's sources (a buddy's copy, another replica group's snapshot) hold its state
already; DDP survivors publish theirs as their own Form arrives, sent with the joiner's
(the server holds a fetch that comes first until they do).
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


class Fetch:
    """One Form's fetch on a thread of its own (`name`): `result()` waits for the state, or
    raises what the fetch raised."""

    def __init__(self, form: m.Form, fetch: Callable[[m.Form], Fetched], name: str):
        self.form = form
        self.done = threading.Event()
        self._result: Fetched | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        threading.Thread(target=self._run, args=(fetch,), daemon=True, name=name).start()

    def _run(self, fetch: Callable[[m.Form], Fetched]) -> None:
        t0 = time.perf_counter()
        try:
            self._result = fetch(self.form)
        except BaseException as exc:  # handed to whoever waits, who decides what it means
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def result(self) -> Fetched:
        self.done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Prefetch:
    """Starts a joiner's fetch when its Form arrives, until the step loop takes over."""

    def __init__(self, fetch: Callable[[m.Form], Fetched], replicated: Callable[[], bool] = lambda: False):
        self._fetch = fetch
        self._replicated = replicated  # whether a DDP recovery's state is fetched here too
        self._lock = threading.Lock()
        self._by_generation: dict[int, Fetch] = {}
        self._closed = False

    def offer(self, form: m.Form) -> None:
        """Start fetching what `form` names (called on the control thread, once or more per Form):
        a lost rank's rebuild (a sharded rank's, or, where `replicated` says so, a DDP rank's);
        a planned move's joiner is at its step loop already."""
        if not form.fetch_from or not (form.snapshot or (form.lost is not None and self._replicated())):
            return
        with self._lock:
            if self._closed or form.generation in self._by_generation:
                return
            log.info("generation %s: fetching rank state while the script sets up", form.generation)
            self._by_generation[form.generation] = Fetch(form, self._fetch, f"baton-prefetch-{form.generation}")

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
        return job.result()
