"""This worker's address: where its peers and the launcher reach it.

On one machine that is loopback. Across machines it is the address of this node on the
route to the launcher (so nothing needs configuring on a cluster), or BATON_NODE_ADDR
where a site wants another interface.
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
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((launcher, 9))  # no packet is sent: this asks the kernel for the route
        return s.getsockname()[0]
