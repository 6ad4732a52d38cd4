"""Reaching a control plane that may be away for a while (restarting, or failing over to a
standby `baton serve`): every request is tried again, across the given URLs, until it gets
an answer or the control plane has been away longer than the grace. Used by workers and by
a job's agent alike."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

log = logging.getLogger("baton.reach")


class OrchestratorGone(RuntimeError):
    """The control plane cannot be reached (for longer than the grace), or said the caller
    is no longer part of the job."""


class Reach:
    def __init__(self, urls: str, token: str, grace_s: float = 10.0):
        # Several URLs (comma-separated): servers sharing one store, one of them the leader.
        self.urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not self.urls:
            raise ValueError("no control-plane URL given")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.grace_s = grace_s
        self.stopped = False  # the caller is shutting down: give up at the first failure
        self.outages = 0  # times the control plane was away
        self._index = 0
        self._since: float | None = None  # when the current outage began
        self._clients: list[httpx.Client] = []

    @property
    def url(self) -> str:
        return self.urls[self._index]

    def client(self, timeout: float) -> httpx.Client:
        c = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)
        self._clients.append(c)
        return c

    def request(self, client: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request, tried until it gets an answer other than 'unavailable' (503: restarting
        or a standby); OrchestratorGone once the outage is longer than the grace."""
        while True:
            try:
                resp = client.request(method, path, **kw)
                if resp.status_code != 503:
                    self._reached()
                    return resp
                why = f"HTTP 503: {resp.text[:200]}"
            except httpx.TransportError as exc:
                why = f"{type(exc).__name__}: {exc}"
            self._failed(why)
            time.sleep(0.25)

    def _failed(self, why: str) -> None:
        now = time.time()
        if self._since is None:
            self._since = now
            self.outages += 1
            log.warning("control plane unreachable (%s): retrying for up to %.0fs", why, self.grace_s)
        if len(self.urls) > 1:
            self._index = (self._index + 1) % len(self.urls)
            for c in self._clients:
                c.base_url = self.url
        if self.stopped or now - self._since > self.grace_s:
            raise OrchestratorGone(f"cannot reach the control plane for {now - self._since:.0f}s: {why}")

    def _reached(self) -> None:
        if self._since is not None:
            log.warning("control plane back after %.1fs", time.time() - self._since)
            self._since = None

    @property
    def away(self) -> bool:
        return self._since is not None
