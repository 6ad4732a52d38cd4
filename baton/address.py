"""Addresses across machines, found from the routes so nothing needs configuring.

A worker's address (where its peers and the launcher reach it) is loopback on one machine;
across machines it is the address of its node on the route to the launcher, or
BATON_NODE_ADDR where a site wants another interface. The launcher's is found the same way,
on the route to a node.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


@functools.cache
def node_address() -> str:
    explicit = os.environ.get("BATON_NODE_ADDR")
    if explicit:
        return explicit
    launcher = urlparse(os.environ.get("BATON_URL", "")).hostname or "127.0.0.1"
    if launcher.startswith("127.") or launcher == "localhost":
        return "127.0.0.1"
    return addr_towards(launcher)


def addr_towards(host: str) -> str:
    """This machine's address on the route to `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this asks the kernel for the route
        return s.getsockname()[0]
