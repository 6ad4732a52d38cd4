"""Which data path drops everything while its link looks fine (a bad cable, a misrouted
switch port: the carrier stays up, the packets vanish, gloo waits for --op-timeout).

Every worker of a job with several data paths answers TCP connections on each path's
address (`Responder`: accepted and closed at once). After a collective fails, a rank
connects to each peer over each path (`probe`, all at once, a second at most). A refused
connection proves the path as well as an accepted one; only silence counts against it, and
only where another path to the same peer answered: a peer silent on every path is a lost
peer (a dead node), not a path fault. A path found silent is reported down, and re-probed
until it answers again (`Reprober`), when it is reported up.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("baton.net")

SIOCGIFADDR = 0x8915
PROBE_TIMEOUT_S = 1.0


def interface_addr(name: str) -> str | None:
    """The IPv4 address of `name` in this process's network namespace, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


class Responder:
    """Accepts and closes connections on each path's address: what a peer's probe reaches."""

    def __init__(self, names: list[str]):
        self.addrs: dict[str, tuple[str, int]] = {}
        self._socks: list[socket.socket] = []
        for name in names:
            ip = interface_addr(name)
            if ip is None:
                log.warning("data path %s has no IPv4 address here: it cannot be probed", name)
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, 0))
            sock.listen(64)
            self._socks.append(sock)
            self.addrs[name] = (ip, sock.getsockname()[1])
            threading.Thread(target=self._serve, args=(sock,), name=f"baton-probe-{name}", daemon=True).start()

    @staticmethod
    def _serve(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _answers(addr: tuple[str, int], timeout_s: float) -> bool:
    """True when the path carries packets there: accepted, or refused (the peer's host
    answered); False on silence (a timeout) or no route."""
    try:
        with socket.create_connection(addr, timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def silent_paths(peers: list[dict[str, tuple[str, int]]], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, list[str]]:
    """The paths silent towards some peer that another path reached: path -> those peers."""
    jobs = [(i, name, tuple(addr)) for i, paths in enumerate(peers) for name, addr in paths.items()]
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(jobs)), thread_name_prefix="baton-probe") as pool:
        results = list(pool.map(lambda j: _answers(j[2], timeout_s), jobs))
    answered = {(i, name): ok for (i, name, _), ok in zip(jobs, results)}
    silent: dict[str, list[str]] = {}
    for (i, name, addr), ok in zip(jobs, results):
        reached_otherwise = any(answered[(i, other)] for other in peers[i] if other != name)
        if not ok and reached_otherwise:
            silent.setdefault(name, []).append(addr[0])
    return silent


class Reprober:
    """Probes a silent path again every `every_s` until every peer answers on it, then calls
    `back(name)` once (on its own thread)."""

    def __init__(self, name: str, peers: list[tuple[str, int]], back: Callable[[str], None], every_s: float = 1.0):
        self.name, self.peers, self.back, self.every_s = name, peers, back, every_s
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=f"baton-reprobe-{name}", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if all(_answers(addr, PROBE_TIMEOUT_S) for addr in self.peers):
                log.info("data path %s answers again", self.name)
                self.back(self.name)
                return

    def stop(self) -> None:
        self._stop.set()
