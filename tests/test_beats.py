"""Heartbeat datagrams: a real UDP socket between a worker's sender and the orchestrator.

Only datagrams signed with the job's token and newer than the last one from that worker
reach the orchestrator; anything else is dropped before it changes anything.
"""

from __future__ import annotations

import math
import socket
import time

import pytest

from baton.control import messages as m
from baton.control.beats import BeatReceiver, BeatSender, seal
from tests.test_orchestrator import _running

TOKEN = "job-token"


@pytest.fixture
def live(tmp_path):
    orch, _ = _running(tmp_path)
    receiver = BeatReceiver(orch, TOKEN)
    receiver.start()
    yield orch, receiver
    receiver.stop()


def _rank0(orch) -> dict:
    return orch.status()["jobs"][0]["ranks"][0]


def _arrives(orch, predicate, timeout: float = 5.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate(_rank0(orch)):
            return True
        time.sleep(0.01)
    return False


def _raw(addr, datagram: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(datagram, addr)


def test_a_signed_beat_reaches_the_orchestrator_with_its_values(live):
    orch, receiver = live
    sender = BeatSender(TOKEN, "w0", receiver.addr)
    seen = orch.workers["w0"].last_seen
    sender.send(m.Heartbeat(step=11, step_time=0.25, metrics={"loss": float("nan"), "tokens": 7.0}))
    assert _arrives(orch, lambda r: r["step"] == 11)
    metrics = _rank0(orch)["metrics"]
    assert math.isnan(metrics["loss"]) and metrics["tokens"] == 7.0 and metrics["step_time"] == 0.25
    assert orch.workers["w0"].last_seen > seen
    sender.close()


def test_forged_replayed_and_malformed_beats_change_nothing(live):
    orch, receiver = live
    addr = receiver.addr
    genuine = seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w0", seq=5, beat=m.Heartbeat(step=12)))
    _raw(addr, genuine)
    assert _arrives(orch, lambda r: r["step"] == 12)
    seen = orch.workers["w0"].last_seen

    bogus = m.Heartbeat(step=999)
    _raw(addr, seal(b"wrong-token", m.BeatEnvelope(worker_id="w0", seq=6, beat=bogus)))  # forged
    _raw(addr, genuine)  # replayed (same seq)
    _raw(addr, seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w0", seq=4, beat=bogus)))  # older
    _raw(addr, seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w99", seq=1, beat=bogus)))  # unknown worker
    tampered = bytearray(seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w0", seq=7, beat=m.Heartbeat(step=13))))
    tampered[-3] ^= 1
    _raw(addr, bytes(tampered))
    good_mac_bad_body = seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w0", seq=8, beat=m.Heartbeat(step=14)))
    _raw(addr, good_mac_bad_body.replace(b'"step":14', b'"step":-1'))  # also breaks the MAC
    _raw(addr, b"BHB1" + b"\0" * 40)
    _raw(addr, b"GET / HTTP/1.1\r\n\r\n")
    _raw(addr, b"")

    # A genuine newer beat still gets through, and it is the only change made.
    _raw(addr, seal(TOKEN.encode(), m.BeatEnvelope(worker_id="w0", seq=9, beat=m.Heartbeat(step=15))))
    assert _arrives(orch, lambda r: r["step"] == 15)
    assert receiver._refused == 9, receiver._refused  # every datagram above but the genuine one
    assert orch.status()["jobs"][0]["ranks"][0]["step"] == 15
    assert all(info.step != 999 for info in orch.ranks.values())
    assert orch.workers["w0"].last_seen >= seen
    assert "w99" not in orch.workers
