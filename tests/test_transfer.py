"""The state stream: checksummed chunks, striping over sources, corrupt chunks re-sent, never loaded."""

from __future__ import annotations

import json
import time

import pytest
import torch

from baton.transfer import FlatState, TransferError, TransferServer, fetch_state
from baton.transfer.protocol import plan_chunks
from baton.transfer import codec
from baton.worker import rng
from tests.jobs import Job, bitwise_equal


def _state() -> FlatState:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300_000, generator=g), torch.arange(7), torch.ones(5, dtype=torch.bfloat16),
               torch.empty(0), torch.randn(3, 4, generator=g).t().contiguous()]
    return FlatState(meta=b"skeleton", tensors=tensors)


def test_chunk_plan_covers_every_byte():
    sizes = [10, 0, 25, 3, 64]
    chunks = plan_chunks(sizes, 16)
    assert all(sum(p.length for p in c) <= 16 for c in chunks)
    covered = {}
    for c in chunks:
        for p in c:
            covered.setdefault(p.segment, 0)
            covered[p.segment] += p.length
    assert covered == {0: 10, 2: 25, 3: 3, 4: 64}


def test_corrupt_chunks_are_detected_and_resent(monkeypatch):
    monkeypatch.setenv("BATON_FAULT_CORRUPT_CHUNKS", "0,2")
    server = TransferServer("secret", chunk_bytes=64 << 10)
    monkeypatch.delenv("BATON_FAULT_CORRUPT_CHUNKS")
    state = _state()
    server.publish(1, state)
    out, stats = fetch_state([server.address], 1, "secret")
    assert stats.corrupt_chunks == 2 and stats.resent_chunks == 2
    assert out.meta == state.meta
    assert all(torch.equal(a, b) for a, b in zip(state.tensors, out.tensors))
    server.close()


def test_striping_over_several_sources_and_a_dead_one():
    state = _state()
    servers = [TransferServer("secret", chunk_bytes=32 << 10) for _ in range(3)]
    for s in servers:
        s.publish(4, state)
    dead = ("127.0.0.1", 1)  # nothing listens there: the fetch carries on with the others
    out, stats = fetch_state([servers[0].address, dead, servers[1].address, servers[2].address], 4, "secret")
    assert stats.sources == 3
    assert sum(1 for v in stats.per_source.values() if v > 0) >= 2
    assert all(torch.equal(a, b) for a, b in zip(state.tensors, out.tensors))
    for s in servers:
        s.close()


def test_wrong_token_and_wrong_generation_are_refused():
    server = TransferServer("secret", publish_wait_s=0.5)
    server.publish(2, _state())
    with pytest.raises(TransferError, match="authentication failed"):
        fetch_state([server.address], 2, "not-the-token")
    with pytest.raises(TransferError, match="no state published"):
        fetch_state([server.address], 3, "secret")
    server.close()


def test_a_state_readied_before_its_generation_is_served_only_once_promoted():
    """A leaver encodes what it serves at its pause, before the Publish names the generation:
    a fetch for that generation waits for the promotion, then gets it bitwise; a state that
    was never promoted is never served."""
    import threading

    from baton.transfer.server import STAGED

    server = TransferServer("secret", publish_wait_s=0.5)
    state = _state()
    server.publish(STAGED, state)
    with pytest.raises(TransferError, match="no state published"):
        fetch_state([server.address], 4, "secret")
    server.publish_wait_s = 10.0
    threading.Timer(0.3, server.promote, args=(4,)).start()
    got, _ = fetch_state([server.address], 4, "secret")
    assert len(got.tensors) == len(state.tensors) and all(torch.equal(a, b) for a, b in zip(got.tensors, state.tensors))
    server.close()


def test_persistently_corrupt_chunk_is_never_loaded(monkeypatch):
    server = TransferServer("secret", chunk_bytes=64 << 10)
    server._corrupt_once = set()

    original = server._send_chunk

    def always_corrupt(conn, index, chunks, views):
        server._corrupt_once.add(1)
        return original(conn, index, chunks, views)

    server._send_chunk = always_corrupt
    server.publish(1, _state())
    with pytest.raises(TransferError, match="checksum"):
        fetch_state([server.address], 1, "secret")
    server.close()


def test_a_buddy_link_fetches_snapshot_after_snapshot_over_one_connection(monkeypatch):
    """A buddy's pulls, one per boundary, share one connection: each chunk checked, a corrupt
    one asked for again on it, one that stays corrupt never returned, and a refusal (a
    snapshot the ward does not hold) closes the link so no late answer is read as the next."""
    from baton.transfer.client import SnapshotLink
    from baton.transfer.server import snapshot_key

    monkeypatch.setenv("BATON_FAULT_CORRUPT_CHUNKS", "1")
    server = TransferServer("secret", chunk_bytes=64 << 10, publish_wait_s=0.3)
    monkeypatch.delenv("BATON_FAULT_CORRUPT_CHUNKS")
    try:
        state = _state()
        server.put_snapshot(3, 7, state)
        link = SnapshotLink(server.address, "secret", timeout=5)
        out, nbytes = link.fetch(snapshot_key(3, 7))
        assert out.meta == state.meta and all(torch.equal(a, b) for a, b in zip(state.tensors, out.tensors))
        assert nbytes == len(state.meta) + sum(t.numel() * t.element_size() for t in state.tensors)
        sock = link._sock
        server.put_snapshot(3, 8, FlatState(meta=b"next", tensors=[t + 1 for t in state.tensors[:3]]))
        again, _ = link.fetch(snapshot_key(3, 8), into=[torch.empty_like(t) for t in state.tensors[:3]])
        assert link._sock is sock and again.meta == b"next"  # the same connection
        assert torch.equal(again.tensors[0], state.tensors[0] + 1)
        with pytest.raises(TransferError, match="no snapshot of rank 3 at step 9"):
            link.fetch(snapshot_key(3, 9))
        assert link._sock is None
        original = server._send_chunk

        def always_corrupt(conn, index, chunks, views):
            server._corrupt_once.add(0)
            return original(conn, index, chunks, views)

        server._send_chunk = always_corrupt
        with pytest.raises(TransferError, match="checksum"):
            link.fetch(snapshot_key(3, 7))
        assert link._sock is None
        with pytest.raises(TransferError, match="authentication failed"):
            SnapshotLink(server.address, "not-the-token", timeout=5).fetch(snapshot_key(3, 7))
        link.close()
    finally:
        server.close()


def test_a_skeleton_part_dumped_once_encodes_as_the_walk_does():
    """A learned capture's fixed skeleton is serialized once (codec.Dumped): what encode makes
    of it is byte for byte what walking the state makes, wherever it sits and however many."""
    parts = [{"w": {"$t": i}, "k": [1, "x\x00", None]} for i in range(12)]
    plain = {"a": [dict(p) for p in parts], "b": {"$at": 0, "$enc": parts[3]}}
    dumped = {"a": [codec.Dumped(p) for p in parts], "b": {"$at": 0, "$enc": codec.Dumped(parts[3])}}
    assert codec._dumps(dumped) == codec._dumps(plain) == json.dumps(plain, separators=(",", ":")).encode()
    assert codec.Dumped(parts[0]) == parts[0] and parts[0] == codec.Dumped(parts[0]) != parts[1]
    assert dumped == plain  # a learned encoding is still checked against the codec's own walk


def test_nested_state_round_trips_bitwise():
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    state = {"replicated": {"model": model.state_dict(), "optimizer": opt.state_dict()},
             "local": {"rng": rng.capture(), "data": {"epoch": 1, "index": 3}}}
    meta, tensors = codec.encode(state)
    assert b"pickle" not in meta and meta.startswith(b"{")  # JSON skeleton: nothing to unpickle
    back = codec.decode(meta, tensors)
    assert rng.equal(back["local"]["rng"], state["local"]["rng"])
    assert bitwise_equal(back["replicated"]["model"], state["replicated"]["model"])
    assert back["replicated"]["optimizer"]["param_groups"] == state["replicated"]["optimizer"]["param_groups"]
    assert back["local"]["data"] == {"epoch": 1, "index": 3}


def test_corrupted_chunk_during_a_real_migration_is_resent(tmp_path):
    """A planned move where the leaver corrupts a chunk on the wire: the joiner re-fetches it
    and the run still ends bit for bit equal to an uninterrupted one."""
    args = ["--step-sleep", "0.03", "--width", "256"]
    ref = Job(tmp_path, nproc=2, spares=0, steps=80, script_args=args, name="ref")
    assert ref.wait() == 0, ref.log()
    job = Job(tmp_path, nproc=2, spares=1, steps=80, script_args=args, name="corrupt",
              env={"BATON_FAULT_CORRUPT_CHUNKS": "0"})
    try:
        job.wait_step(5)
        job.client.migrate(0)
        assert job.wait() == 0, job.log()
        assert "corrupted chunk 0" in job.log()
        assert bitwise_equal(job.params(), ref.params())
        assert job.events()[0]["status"] == "resolved"
    finally:
        job.kill()


def _bundle(seq: int = 0):
    from baton.transfer.bundles import Bundle

    state = {"rng": rng.capture(), "buffers": {"bn.running_mean": torch.randn(8)}, "local": {"best": 1.5},
             "data": {"epoch": 1, "index": 4, "record": None}}
    return Bundle.of(2, (7, 0), 3, seq, state)


def test_a_step_frame_written_directly_is_the_bundles_frame_byte_for_byte():
    """The hot path writes a step's state straight to its wire frame; it must be exactly the
    frame of the same state made the long way (Bundle.of, then encode_bundle_frame)."""
    import numpy as np

    from baton.transfer.bundles import Bundle, encode_bundle_frame, encode_frame

    bn = torch.nn.BatchNorm1d(3)
    bn(torch.randn(4, 3))
    state = {"rng": rng.capture({"g": torch.Generator().manual_seed(3)}),
             "buffers": {"bn.running_mean": bn.running_mean, "bn.num_batches_tracked": bn.num_batches_tracked,
                         "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1],  # not contiguous
                         "empty": torch.empty(0)},
             "local": {"best": 1.5, "seen": [1, 2], "blob": b"", "tup": (1, "a")},
             "data": {"epoch": 2, "index": 8, "record": {"epoch": 2, "states": [torch.Generator().get_state()]},
                      "arr": np.arange(5, dtype=np.int64)}}
    frame = encode_frame(2, (7, 0), 3, 1, state)
    long_way = Bundle.of(2, (7, 0), 3, 1, state)
    assert frame.raw == encode_bundle_frame(long_way)
    assert (frame.rank, frame.pos, frame.generation, frame.seq) == (2, (7, 0), 3, 1) and frame.checksum_ok()
    assert frame.bundle().digest() == long_way.digest()
    back = frame.state()
    assert rng.equal(back["rng"], state["rng"]) and back["local"] == state["local"]
    assert bitwise_equal(back["buffers"], state["buffers"])


def test_a_corrupt_bundle_frame_is_refused_and_the_good_one_kept():
    """A step bundle damaged in transit is answered with a NACK naming it and never stored;
    sent again, it is. Good bundles get no answer (the buddy's gate is what waits)."""
    from baton.transfer.protocol import recv_exact
    from baton.transfer.server import PUSH, connect
    from baton.transfer.bundles import NACK, encode_bundle_frame

    server = TransferServer("secret")
    b = _bundle()
    frame = encode_bundle_frame(b)
    bad = bytearray(frame)
    bad[-100] ^= 0x01  # one bit of one RNG tensor
    sock = connect(server.address, "secret", PUSH)
    try:
        sock.sendall(bytes(bad))
        # Pushes are read when the ward store is next used (the gate, a joiner's request).
        assert _until(lambda: server.wards.get(2, (7, 0)) is None and _readable(sock))
        assert NACK.unpack(recv_exact(sock, NACK.size)) == (b"-", 3, 7, 0, b.seq)
        assert server.wards.get(2, (7, 0)) is None
        sock.sendall(frame)
        assert _until(lambda: server.wards.get(2, (7, 0)) is not None)
    finally:
        sock.close()
    held = server.wards.get(2, (7, 0))
    assert held is not None and held.digest() == b.digest()
    assert rng.equal(held.state()["rng"], b.state()["rng"]) and held.state()["local"] == {"best": 1.5}
    server.close()


def test_a_pusher_sends_a_refused_bundle_again(monkeypatch):
    """The pusher's side of a NACK: the bundle is encoded afresh and sent again, and the
    steps after it keep flowing on the same connection."""
    from baton.transfer.server import PUSH, connect
    from baton.worker import bundle as bundle_mod

    real = bundle_mod.encode_bundle_frame
    calls = []

    def damaged_once(b):
        frame = real(b)
        calls.append(b.pos)
        if len(calls) == 1:
            frame = frame[:-100] + bytes([frame[-100] ^ 0x01]) + frame[-99:]
        return frame

    monkeypatch.setattr(bundle_mod, "encode_bundle_frame", damaged_once)
    server = TransferServer("secret")
    pushers = bundle_mod.BundlePushers(lambda addr: connect(addr, "secret", PUSH))
    pushers.set_buddies([server.address])
    first = _bundle()
    try:
        pushers.push(first)
        assert _until(lambda: server.wards.get(2, (7, 0)) is not None)
        later = bundle_mod.Bundle(2, (8, 0), 3, 0, first.meta, first.tensors)
        pushers.push(later)
        assert _until(lambda: server.wards.get(2, (8, 0)) is not None)
        assert server.wards.get(2, (7, 0)).digest() == first.digest()
        pusher = next(iter(pushers._pushers.values()))
        assert pusher.resent == 1 and calls == [(7, 0), (7, 0), (8, 0)]
    finally:
        pushers.close()
        server.close()


def _readable(sock) -> bool:
    import select as _select

    return bool(_select.select([sock], [], [], 0)[0])


def _until(pred, timeout: float = 10.0) -> bool:
    import time as _time

    deadline = _time.monotonic() + timeout
    while _time.monotonic() < deadline:
        if pred():
            return True
        _time.sleep(0.01)
    return False


def test_a_bundle_frame_with_impossible_sizes_is_an_error_not_a_huge_allocation():
    import socket as _socket

    from baton.transfer.bundles import HEAD, MAGIC, read_bundle_frame
    from baton.transfer.protocol import TransferError as _TE

    a, b = _socket.socketpair()
    a.sendall(HEAD.pack(MAGIC, 0, 0, 1, 0, 0, 10, 1 << 40, 0))
    with pytest.raises(_TE, match="impossible sizes"):
        read_bundle_frame(b)
    a.sendall(HEAD.pack(b"JUNK", 0, 0, 1, 0, 0, 10, 10, 0))
    with pytest.raises(_TE, match="not a bundle frame"):
        read_bundle_frame(b)
    a.close()
    b.close()


def test_a_snapshot_being_sent_is_never_reused_and_a_reused_buffer_receives_bitwise():
    """Snapshot buffers are reused (a copy into mapped memory instead of a fresh allocation
    every step): one that a connection is still sending is not handed back, and a fetch into
    reused buffers lands the same bytes as one into new ones."""
    from baton.transfer.client import _Source
    from baton.transfer.server import SNAPSHOT, snapshot_key

    server = TransferServer("t")
    try:
        state = _state()
        server.put_snapshot(3, 7, state)
        reader = _Source(server.address, snapshot_key(3, 7), "t", 10.0, SNAPSHOT)  # mid-transfer
        assert server.take_snapshot(3, 7) is None, "handed back while a connection sends it"
        reader.close()
        deadline = time.monotonic() + 10
        while server.take_snapshot(3, 7) is None:
            assert time.monotonic() < deadline, "never handed back after the reader left"
            time.sleep(0.01)
        server.put_snapshot(3, 8, state)
        reuse = [torch.full_like(t, 5) for t in state.tensors]
        got, _ = fetch_state([server.address], snapshot_key(3, 8), "t", kind=SNAPSHOT, into=reuse)
        assert all(a is b for a, b in zip(got.tensors, reuse)), "the given buffers were not used"
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, state.tensors))
        wrong = [torch.zeros(2) for _ in state.tensors]
        got, _ = fetch_state([server.address], snapshot_key(3, 8), "t", kind=SNAPSHOT, into=wrong)
        assert not any(a is b for a, b in zip(got.tensors, wrong))
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, state.tensors))
    finally:
        server.close()
