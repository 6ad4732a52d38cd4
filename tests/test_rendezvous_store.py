"""The rendezvous store as a supervised process: killed, it comes back on the same port,
empty; a worker's client reconnects within its deadline, or says clearly that it could not."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from baton import procfs
from baton.schedulers.forked import ForkedProcess, Zygote
from baton.store.rendezvous import RendezvousClient, StoreUnreachable
from baton.store.rendezvous_process import RendezvousProcess, StoreStartError


def _wait_restarted(store: RendezvousProcess, restarts: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while store.restarts < restarts:
        assert time.monotonic() < deadline, "the store did not come back"
        time.sleep(0.05)


@pytest.mark.parametrize("forked", [False, True], ids=["process", "forked-by-the-zygote"])
def test_a_killed_store_comes_back_on_its_port_and_clients_reconnect(forked):
    said: list[str] = []
    zygote = Zygote(sys.executable, dict(os.environ)) if forked else None
    if zygote is not None:
        zygote.start()
    store = RendezvousProcess("127.0.0.1", say=said.append, zygote=zygote).start()
    try:
        client = RendezvousClient("127.0.0.1", store.port, formation_timeout_s=30.0)
        forever = time.monotonic() + 60
        client.call(lambda s: s.set("gen1/ready/0", b"1"), forever)
        first, port = store.pid, store.port
        os.kill(first, signal.SIGKILL)
        _wait_restarted(store, 1)
        assert store.port == port and store.pid != first
        assert "exited with code -9" in said[0] and "is back on 127.0.0.1:%d" % port in said[1], said
        seen: list[object] = []

        def announce(s):  # noqa: ANN001, ANN202 - a dist.Store
            seen.append(s)
            s.set("gen2/ready/0", b"1")
            return s.check(["gen1/ready/0"])

        assert client.call(announce, forever) is False  # the restarted store is empty
        assert client.reconnects == 1 and len(seen) == 2 and seen[0] is not seen[1]
        if zygote is None:
            assert store.cpu_s() > 0.5  # two torch imports, one of them in a process that is gone
        else:  # no import: the zygote's; its parent, which reaped the first, says what that one used
            assert isinstance(store._proc, ForkedProcess) and store._proc.pid != first and store.cpu_s() > 0
    finally:
        store.stop()
        if zygote is not None:
            zygote.close()
    assert not procfs.running(store.pid)


def test_a_client_gives_up_at_its_deadline_or_when_told():
    store = RendezvousProcess("127.0.0.1").start()
    client = RendezvousClient("127.0.0.1", store.port, formation_timeout_s=30.0)
    store.stop()  # stopped for good: nobody restarts it
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{store.port} is unreachable"):
        client.call(lambda s: s.check(["k"]), time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(StoreUnreachable, match="gave up"):
        client.call(lambda s: s.check(["k"]), time.monotonic() + 60, give_up=lambda: True)


def test_a_store_whose_port_was_taken_retries_and_says_so():
    said: list[str] = []
    store = RendezvousProcess("127.0.0.1", say=said.append).start()
    squatter = None
    try:
        pid, port = store.pid, store.port
        os.kill(pid, signal.SIGKILL)
        # Take its port before the restart can (the restart backs off 0 s, so race it hard).
        deadline = time.monotonic() + 5
        while squatter is None and time.monotonic() < deadline:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
                squatter = sock
            except OSError:
                sock.close()
        assert squatter is not None, "could not take the port"
        deadline = time.monotonic() + 60
        while not any("did not start" in s for s in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
        assert store.restarts == 0 and "a new generation cannot form until then" in said[-1], said
        squatter.close()
        squatter = None
        _wait_restarted(store, 1)
        assert store.port == port
    finally:
        if squatter is not None:
            squatter.close()
        store.stop()


def test_a_store_that_cannot_start_is_a_clear_error():
    with pytest.raises(StoreStartError, match="203.0.113.7:any port did not start"):
        RendezvousProcess("203.0.113.7").start()  # not an address of this machine
