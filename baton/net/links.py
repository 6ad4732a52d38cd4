"""The state of this node's data links, as the kernel sees them: a link is usable when it
is up (set so by an administrator) and running (its carrier is there).

Read with one ioctl per interface (SIOCGIFFLAGS, on a socket of this process's network
namespace: /sys/class/net may show another namespace's view), and watched without polling:
a netlink socket subscribed to link events wakes the watcher, which then reads the flags
again. So a carrier loss is seen within milliseconds, and nothing runs while links are quiet
(a slow poll stays as a safety net, should an event be missed).
"""

from __future__ import annotations

import fcntl
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

log = logging.getLogger("baton.net")

SIOCGIFFLAGS = 0x8913
IFF_UP = 0x1
IFF_RUNNING = 0x40
RTMGRP_LINK = 0x1


def link_state(name: str) -> bool | None:
    """True: up and running; False: down or without carrier; None: no such interface here."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH14x", name.encode()[:15], 0))
        except OSError:
            return None
    flags = struct.unpack("16sH14x", raw)[1]
    return bool(flags & IFF_UP) and bool(flags & IFF_RUNNING)


class LinkWatcher:
    """Calls `changed(name, up, at)` (on its own thread) when a watched link goes down or
    comes back; `at` is when it was seen (time.time())."""

    def __init__(self, names: list[str], changed: Callable[[str, bool, float], None], safety_poll_s: float = 1.0):
        self.names = list(names)
        self.changed = changed
        self.safety_poll_s = safety_poll_s
        self.state = {n: bool(link_state(n)) for n in self.names}
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self._sock.bind((0, RTMGRP_LINK))
        self._thread = threading.Thread(target=self._run, name="baton-links", daemon=True)

    def start(self) -> "LinkWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], self.safety_poll_s)
            if ready:
                try:
                    while self._sock.recv(65536, socket.MSG_DONTWAIT):  # drained: the flags say the rest
                        pass
                except BlockingIOError:
                    pass
                except OSError as exc:  # ENOBUFS: events were dropped; the flags are read anyway
                    log.debug("link events: %s", exc)
            self._check()

    def _check(self) -> None:
        """Read every link first, then tell each change: a report then says all that is down
        (links lost together are decided together)."""
        now = time.time()
        seen = {name: bool(link_state(name)) for name in self.names}
        changed = [name for name in self.names if seen[name] != self.state[name]]
        self.state.update(seen)
        for name in changed:
            log.info("data link %s %s", name, "up" if seen[name] else "down")
            self.changed(name, seen[name], now)
