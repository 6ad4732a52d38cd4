"""The rendezvous store (torch's TCPStore) that process groups form on.

Its timeout bounds every blocking store call, including the connection the master
makes to itself at start. That must never be the user's --formation-timeout: a
short one (0.2 s in a test) made a loaded launcher fail to reach its own store.
Formation keeps its own deadline (it polls the store), so the store can wait longer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

MIN_TIMEOUT_S = 60.0


def rendezvous_store(host: str, port: int, *, master: bool, formation_timeout_s: float) -> "dist.TCPStore":
    import torch.distributed as dist  # lazily: the CLI starts without importing torch

    timeout = timedelta(seconds=max(MIN_TIMEOUT_S, float(formation_timeout_s)))
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timeout)
