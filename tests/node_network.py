"""Test "nodes" with addresses of their own: one network namespace per node on a private
bridge, so nothing that crosses nodes can hide on 127.0.0.1.

The bridge (in this host's namespace) holds 10.X.Y.1, which is where the launcher and
slurmctld are reached; node K lives in namespace `<tag>-nK` at 10.X.Y.(10+K). A node is lost the way a machine is: every process in its
namespace killed and its link cut, so peers get no answer at all (not a reset).
"""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import subprocess


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check, timeout=20)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show").stdout
    return [ipaddress.ip_interface(f.split()[3]).network for f in out.splitlines() if len(f.split()) > 3]


class NodeNetwork:
    def __init__(self, nodes: list[str]):
        self.tag = f"bt{random.randrange(16 ** 4):04x}"
        used = _used_networks()
        for _ in range(100):
            net = ipaddress.ip_network(f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        self.net = net
        self.bridge = f"{self.tag}br"
        self.host_addr = str(net.network_address + 1)
        self.nodes = list(nodes)
        self.addrs = {n: str(net.network_address + 10 + i) for i, n in enumerate(self.nodes, start=1)}

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def _veth(self, node: str) -> str:
        return f"{self.tag}v{self.nodes.index(node) + 1}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, veth = self.ns(node), self._veth(node)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # No default route: everything a node talks to is on the bridge's /24, and a DNS
            # lookup (the host's nameserver is elsewhere) fails at once instead of timing out.

    def run_in(self, node: str) -> list[str]:
        """The argv prefix that runs a command on `node`."""
        # nsenter, not `ip netns exec`: that also remounts /sys, hiding the cgroup tree slurmd needs
        return ["nsenter", f"--net=/run/netns/{self.ns(node)}"]

    def pids(self, node: str) -> list[int]:
        out = _ip("netns", "pids", self.ns(node), check=False).stdout
        return [int(p) for p in out.split()]

    def lose(self, node: str) -> list[int]:
        """Power the node off: cut its link, then kill every process on it. Returns the pids."""
        _ip("link", "set", self._veth(node), "down", check=False)
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

    def restore(self, node: str) -> None:
        _ip("link", "set", self._veth(node), "up", check=False)

    def down(self) -> None:
        for node in self.nodes:
            for pid in self.pids(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", self.ns(node), check=False)
        _ip("link", "del", self.bridge, check=False)
