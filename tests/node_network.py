"""Test "nodes" with addresses of their own: one network namespace per node, so nothing
that crosses nodes can hide on 127.0.0.1.

The host (this namespace, where the launcher and slurmctld run) holds 10.X.Y.1 and node K,
in namespace `<tag>-nK`, holds 10.X.Y.(10+K). Every pair of them is joined by a veth pair
of its own with a /32 route over it: a full mesh, with no bridge and no forwarding, because
neither the bridge module nor a writable ip_forward can be counted on in a sandbox (CI's
kernel refused `ip link add ... type bridge`). A node is lost the way a machine is: every
process in its namespace killed and its links' carrier cut, so peers get no answer at all
(not a reset, not "network unreachable").
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import secrets
import signal
import subprocess

HOST = "host"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check, timeout=20)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show").stdout
    return [ipaddress.ip_interface(f.split()[3]).network for f in out.splitlines() if len(f.split()) > 3]


def _unused_tag() -> str:
    """A namespace prefix no other run on this machine holds. Drawn from the OS, not from
    `random`: a test that seeds the global generator would make every run pick the same
    one, and a run killed before its teardown leaves its namespaces behind."""
    taken = _ip("netns", "list").stdout
    while True:
        tag = f"bt{secrets.token_hex(2)}"
        if f"{tag}-" not in taken:
            return tag


class NodeNetwork:
    def __init__(self, nodes: list[str]):
        self.tag = _unused_tag()
        used = _used_networks()
        for _ in range(100):
            net = ipaddress.ip_network(f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        self.net = net
        self.host_addr = str(net.network_address + 1)
        self.nodes = list(nodes)
        self.addrs = {n: str(net.network_address + 10 + i) for i, n in enumerate(self.nodes, start=1)}

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def _addr(self, end: str) -> str:
        return self.host_addr if end == HOST else self.addrs[end]

    def _link(self, a: str, b: str) -> str:
        """The name of a's end of the a-b link (unique on the host, at most 15 characters)."""
        index = {HOST: 0, **{n: i for i, n in enumerate(self.nodes, start=1)}}
        return f"{self.tag}l{index[a]}x{index[b]}"

    def _ip_on(self, end: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip(*argv, check=check) if end == HOST else _ip("-n", self.ns(end), *argv, check=check)

    def up(self) -> None:
        for node in self.nodes:
            _ip("netns", "add", self.ns(node))
            _ip("-n", self.ns(node), "link", "set", "lo", "up")
            _ip("-n", self.ns(node), "addr", "add", f"{self.addrs[node]}/32", "dev", "lo")
        _ip("addr", "add", f"{self.host_addr}/32", "dev", "lo")
        for a, b in itertools.combinations([HOST, *self.nodes], 2):
            end_a, end_b = self._link(a, b), self._link(b, a)
            _ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
            for end, dev, peer in ((a, end_a, b), (b, end_b, a)):
                if end != HOST:
                    _ip("link", "set", dev, "netns", self.ns(end))
                self._ip_on(end, "link", "set", dev, "up")
                self._ip_on(end, "route", "add", f"{self._addr(peer)}/32", "dev", dev, "src", self._addr(end))
        # No default route in a node: everything it talks to has a route of its own, and a DNS
        # lookup (the host's nameserver is elsewhere) fails at once instead of timing out.

    def run_in(self, node: str) -> list[str]:
        """The argv prefix that runs a command on `node`."""
        # nsenter, not `ip netns exec`: that also remounts /sys, hiding the cgroup tree slurmd needs
        return ["nsenter", f"--net=/run/netns/{self.ns(node)}"]

    def pids(self, node: str) -> list[int]:
        out = _ip("netns", "pids", self.ns(node), check=False).stdout
        return [int(p) for p in out.split()]

    def _set_links(self, node: str, state: str) -> None:
        for peer in [HOST, *self.nodes]:
            if peer != node:
                self._ip_on(node, "link", "set", self._link(node, peer), state, check=False)

    def lose(self, node: str) -> list[int]:
        """Power the node off: cut its links, then kill every process on it. Returns the pids."""
        self._set_links(node, "down")  # its peers' ends lose carrier and keep their routes
        killed = []
        for _ in range(5):  # processes may be forking while they die
            pids = self.pids(node)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed

    def set_control_link(self, node: str, up: bool) -> None:
        """Cut (or mend) only the node's link to the host, where the launcher and the control
        plane are: its links to the other nodes stay."""
        self._ip_on(node, "link", "set", self._link(node, HOST), "up" if up else "down")
        if up:  # a link set down lost its route
            self._ip_on(node, "route", "replace", f"{self.host_addr}/32", "dev", self._link(node, HOST),
                        "src", self._addr(node), check=False)

    def restore(self, node: str) -> None:
        self._set_links(node, "up")
        for peer in [HOST, *self.nodes]:  # a link set down lost its route
            if peer != node:
                self._ip_on(node, "route", "replace", f"{self._addr(peer)}/32",
                            "dev", self._link(node, peer), "src", self._addr(node), check=False)

    def down(self) -> None:
        for node in self.nodes:
            for pid in self.pids(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", self.ns(node), check=False)  # takes its links' both ends with it
        _ip("addr", "del", f"{self.host_addr}/32", "dev", "lo", check=False)
