"""Data rails for the test nodes of `NodeNetwork`: each node gets one interface per rail
(`rail1`, `rail2`, ...), the same names on every node, as a cluster's NICs, each with an
address of that rail's own subnet; the control path stays NodeNetwork's.

A rail is a switch: a veth pair in the host namespace (the switch's backplane, both ends up)
and one macvlan in bridge mode per node on it, moved into the node's namespace. The
macvlan driver switches between them itself (no bridge module, no forwarding: a sandbox's
kernel may refuse both). A node's port fails as a NIC does: `down` sets its interface down
(the node sees its link go, the others see nothing and just stop hearing from it);
`blackhole` keeps the carrier up and silently drops what the node sends to its peers on
that rail (a permanent neighbour entry to a MAC no port has: no error anywhere, packets
vanish, as on a bad cable or a misrouted switch).
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
import time

from tests.node_network import NodeNetwork, _ip, _used_networks

NOWHERE = "02:00:00:00:0b:ad"  # a MAC no port of the rail holds


class RailNetwork:
    def __init__(self, network: NodeNetwork, rails: int = 2):
        self.network = network
        self.rails = [f"rail{i}" for i in range(1, rails + 1)]
        used = _used_networks() + [network.net]
        self.subnets: dict[str, ipaddress.IPv4Network] = {}
        for rail in self.rails:
            while True:
                net = ipaddress.ip_network(f"10.{150 + secrets.randbelow(50)}.{secrets.randbelow(256)}.0/24")
                if not any(net.overlaps(u) for u in used):
                    break
            used.append(net)
            self.subnets[rail] = net

    def addr(self, node: str, rail: str) -> str:
        return str(self.subnets[rail].network_address + 10 + self.network.nodes.index(node) + 1)

    def _switch(self, rail: str) -> tuple[str, str]:
        return f"{self.network.tag}s{rail[4:]}a", f"{self.network.tag}s{rail[4:]}b"

    def up(self) -> None:
        for rail in self.rails:
            a, b = self._switch(rail)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "up")
            _ip("link", "set", b, "up")
            for i, node in enumerate(self.network.nodes):
                port, ns = f"{self.network.tag}p{rail[4:]}x{i}", self.network.ns(node)
                _ip("link", "add", "link", a, "name", port, "type", "macvlan", "mode", "bridge")
                _ip("link", "set", port, "netns", ns)
                _ip("-n", ns, "link", "set", port, "name", rail)
                _ip("-n", ns, "addr", "add", f"{self.addr(node, rail)}/{self.subnets[rail].prefixlen}", "dev", rail)
                _ip("-n", ns, "link", "set", rail, "up")

    def down(self) -> None:
        """Remove the switches (the nodes' ports go with their namespaces, or with them)."""
        for rail in self.rails:
            _ip("link", "del", self._switch(rail)[0], check=False)

    # ---------------------------------------------------------------- faults
    def set_link(self, node: str, rail: str, up: bool) -> float:
        """Take a node's port on a rail down or up; returns when (time.time())."""
        _ip("-n", self.network.ns(node), "link", "set", rail, "up" if up else "down")
        return time.time()

    def set_links(self, node: str, rails: list[str], up: bool) -> float:
        """Several of a node's ports at once (one `ip -batch`: a NIC or its driver lost)."""
        state = "up" if up else "down"
        subprocess.run(["ip", "-n", self.network.ns(node), "-batch", "-"], check=True, timeout=20, text=True,
                       input="".join(f"link set {r} {state}\n" for r in rails), capture_output=True)
        return time.time()

    def blackhole(self, node: str, rail: str, on: bool = True) -> float:
        """What the node sends to its peers on `rail` vanishes, its carrier up (or no longer)."""
        ns = self.network.ns(node)
        for peer in self.network.nodes:
            if peer == node:
                continue
            if on:
                _ip("-n", ns, "neigh", "replace", self.addr(peer, rail), "lladdr", NOWHERE, "nud", "permanent",
                    "dev", rail)
            else:
                _ip("-n", ns, "neigh", "del", self.addr(peer, rail), "dev", rail, check=False)
        return time.time()
