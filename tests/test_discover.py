"""`--data-paths auto`: which of a node's interfaces are data paths, read in a network
namespace the test builds (a control link, two data links, a bridge, a link down, one with
no address), as the worker reads them."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from baton.net.discover import candidates

REPO = Path(__file__).resolve().parent.parent


def test_the_rule_leaves_out_loopback_the_control_link_bridges_tunnels_links_down_and_unaddressed_ones():
    def link(name, flags=("UP", "LOWER_UP"), kind=None, inet=("10.1.0.1",)):
        return {"ifname": name, "flags": list(flags), **({"linkinfo": {"info_kind": kind}} if kind else {}),
                "addr_info": [{"family": "inet", "local": a, "scope": "global"} for a in inet]}

    found = candidates([
        {"ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"],
         "addr_info": [{"family": "inet", "local": "127.0.0.1", "scope": "host"}]},
        link("eth0", inet=("192.0.2.2",)), link("ib1"), link("ib0", kind="ipoib"), link("docker0", kind="bridge"),
        link("wg0", kind="wireguard"), link("ens3", flags=("UP",)), link("ens4", inet=()),
    ], control_addr="192.0.2.2")
    assert found.names == ["ib0", "ib1"]
    assert found.detail == ("not data paths: eth0 (the control plane's), docker0 (bridge), wg0 (wireguard), "
                            "ens3 (down), ens4 (no IPv4 address)")


@pytest.mark.skipif(os.geteuid() != 0, reason="building a network namespace needs root")
def test_a_nodes_interfaces_are_read_in_its_network_namespace():
    ns, tag = f"batond{secrets.token_hex(3)}", secrets.token_hex(2)
    net = f"10.{200 + secrets.randbelow(40)}.{secrets.randbelow(256)}"

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=20)

    ip("netns", "add", ns)
    try:
        ip("link", "add", f"c{tag}", "type", "veth", "peer", "name", "ctl0", "netns", ns)  # the control link
        ip("addr", "add", f"{net}.1/30", "dev", f"c{tag}")
        ip("link", "set", f"c{tag}", "up")
        batch = [f"addr add {net}.2/30 dev ctl0", "link set ctl0 up", "link set lo up",
                 "link add data1 type veth peer name bare1", f"addr add {net}.9/30 dev data1",
                 "link set data1 up", "link set bare1 up",  # bare1: up, no address
                 "link add data2 type veth peer name data2p", f"addr add {net}.13/30 dev data2",  # left down
                 "link add br0 type bridge", f"addr add {net}.17/30 dev br0", "link set br0 up"]
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(batch) + "\n", text=True, check=True,
                       capture_output=True, timeout=20)
        code = (f"from baton.net.discover import discover; f = discover('{net}.1'); "
                "print(','.join(f.names)); print(f.detail)")
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], cwd=REPO, text=True,
                             capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr
        names, detail = out.stdout.splitlines()
        assert names == "data1", out.stdout
        for why in ("ctl0 (the control plane's)", "br0 (bridge)", "data2 (down)", "bare1 (no IPv4 address)"):
            assert why in detail, detail
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", f"c{tag}"], capture_output=True, timeout=20)
