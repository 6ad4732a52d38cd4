"""The rendezvous store (torch's TCPStore) that process groups form on, and a worker's
connection to it that survives the store's restart.

A running generation never touches the store (gloo uses it only to connect), so when
the store process dies the ranks keep training; only the next formation needs it. The
job's launcher restarts it on the same port (`baton.store.rendezvous_process`), empty,
and `RendezvousClient` reconnects: a formation that meets a dead connection opens a new
one and announces itself again, within the formation's own deadline. Generations use
their own key prefix, so nothing a new generation needs was in the lost store.

The store's timeout bounds every blocking store call, including the connection the master
makes to itself at start. That must never be the user's --formation-timeout: a
short one (0.2 s in a test) made a loaded launcher fail to reach its own store.
Formation keeps its own deadline (it polls the store), so the store can wait longer.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    import torch.distributed as dist

MIN_TIMEOUT_S = 60.0
CONNECT_TRY_S = 2.0  # one connection attempt to a store that may be restarting
log = logging.getLogger("baton.store")
T = TypeVar("T")


def rendezvous_store(host: str, port: int, *, master: bool, formation_timeout_s: float) -> "dist.TCPStore":
    import torch.distributed as dist  # lazily: the CLI starts without importing torch

    timeout = timedelta(seconds=max(MIN_TIMEOUT_S, float(formation_timeout_s)))
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timeout)


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer before the caller's deadline."""


class RendezvousClient:
    """A worker's connection to the job's store, opened again when the store comes back."""

    def __init__(self, host: str, port: int, formation_timeout_s: float):
        self.host, self.port, self.formation_timeout_s = host, port, formation_timeout_s
        self.store = rendezvous_store(host, port, master=False, formation_timeout_s=formation_timeout_s)
        self.reconnects = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def call(self, op: Callable[["dist.Store"], T], deadline: float,
             give_up: Callable[[], bool] = lambda: False) -> T:
        """`op(store)`, retried on a new connection while the store is down, until `deadline`
        (time.monotonic()) or `give_up()`. `op` must be safe to repeat; it gets the store it
        runs on, so it can tell a new connection (a restarted store, which lost every key)
        from the old."""
        import torch.distributed as dist

        while True:
            try:
                return op(self.store)
            except dist.DistNetworkError as exc:
                log.warning("rendezvous store %s unreachable (%s): reconnecting", self.address, exc)
                self._reconnect(deadline, str(exc), give_up)

    def _reconnect(self, deadline: float, why: str, give_up: Callable[[], bool]) -> None:
        import torch.distributed as dist

        while True:
            left = deadline - time.monotonic()
            if give_up():
                raise StoreUnreachable(f"gave up reconnecting to the rendezvous store at {self.address}: {why}")
            if left <= 0:
                raise StoreUnreachable(f"the rendezvous store at {self.address} is unreachable: {why}")
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=max(0.1, min(CONNECT_TRY_S, left))))
                store.set_timeout(timedelta(seconds=max(MIN_TIMEOUT_S, self.formation_timeout_s)))
                self.store = store
                self.reconnects += 1
                log.warning("reconnected to the rendezvous store %s", self.address)
                return
            except dist.DistNetworkError as exc:
                why = str(exc)
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
