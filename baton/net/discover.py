"""Which of a node's interfaces can be data paths (`baton run --data-paths auto`).

The rule, the same one the README states: an interface is a candidate when it is up with its
carrier (running), holds an IPv4 address of global scope, is not loopback, is not a bridge
or a tunnel (docker0, virbr0, cni0, wg0, vxlan: a host's virtual networks, not its NICs),
and is not the interface this node reaches the control plane through (the front-end
network stays the control plane's). The job then runs over the candidates whose names
every node of its first generation has, in name order (the orchestrator decides that).

Read with iproute2's JSON output (`ip -j -d addr show`), in this process's network
namespace: every Linux node has it, and it names an interface's kind (bridge, veth,
macvlan, ...), which the kernel's flags alone do not.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from baton.address import addr_towards

VIRTUAL_KINDS = frozenset({"bridge", "tun", "tap", "wireguard", "vxlan", "geneve", "gre", "gretap", "ipip",
                           "sit", "ip6tnl", "dummy", "ifb", "vrf"})


@dataclass(frozen=True)
class Found:
    names: list[str]  # the candidates, in name order
    detail: str  # what was left out and why (for the ledger), or why nothing could be read


def candidates(links: list[dict], control_addr: str) -> Found:
    """The data-path candidates among `links` (`ip -j -d addr show`'s records)."""
    names, skipped = [], []
    for link in links:
        name = str(link.get("ifname", ""))
        flags = set(link.get("flags", []))
        kind = (link.get("linkinfo") or {}).get("info_kind", "")
        inet = [a.get("local") for a in link.get("addr_info", [])
                if a.get("family") == "inet" and a.get("scope") == "global"]
        if not name or "LOOPBACK" in flags:
            continue
        if control_addr in inet:
            skipped.append(f"{name} (the control plane's)")
        elif kind in VIRTUAL_KINDS:
            skipped.append(f"{name} ({kind})")
        elif not {"UP", "LOWER_UP"} <= flags:
            skipped.append(f"{name} (down)")
        elif not inet:
            skipped.append(f"{name} (no IPv4 address)")
        else:
            names.append(name)
    return Found(sorted(names), "not data paths: " + ", ".join(skipped) if skipped else "")


def discover(control_host: str) -> Found:
    """This node's data-path candidates, the control plane at `control_host`."""
    try:
        control_addr = addr_towards(control_host)
    except OSError as exc:
        return Found([], f"no route to the control plane at {control_host}: {exc}")
    try:
        out = subprocess.run(["ip", "-j", "-d", "addr", "show"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        links = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return Found([], f"could not read the node's interfaces with `ip -j -d addr show`: {exc}")
    return candidates(links, control_addr)
