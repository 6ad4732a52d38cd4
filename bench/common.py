"""Small helpers shared by the benchmark drivers and workloads (no torch import here)."""

from __future__ import annotations

import socket
from typing import Any, Iterator


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cycle(loader: Any) -> Iterator[Any]:
    """Batches of `loader` forever, reshuffling its DistributedSampler each epoch."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
