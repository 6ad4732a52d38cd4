"""Shard snapshots in shared memory (baton/transfer/shared.py): a buddy on the same machine
maps its ward's snapshot instead of pulling a copy. What that must guarantee, with a real
ward process: the snapshot outlives the ward's kill -9; a ward killed while overwriting a
block leaves nothing usable there; bytes changed after the commit fail the check and are
never reported as held; a block on another machine is refused (the buddy pulls instead)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from baton.transfer import TransferServer
from baton.transfer.protocol import FlatState
from baton.transfer.shared import SharedBlock, SharedRef, available
from baton.worker.snapshots import Snapshots

pytestmark = pytest.mark.skipif(not available(), reason="needs Linux memfd_create and /proc")

WARD = r"""
import json, sys, time, torch
from baton.transfer.shared import SharedBlock, WRITING
torch.manual_seed(int(sys.argv[1]))
tensors = [torch.randn(300, 70), torch.arange(1000), torch.tensor(5.0), torch.randn(3, dtype=torch.float64)]
block = SharedBlock.create(tensors, b'{"pos":[7,0]}')
block.write((7, 0), b'{"pos":[7,0]}', tensors)
if sys.argv[2] == "overwrite":  # the next boundary's snapshot, cut short
    block._write_header(WRITING, -1, 0, 0, 0, 0, 0)
    block._tensors[0].fill_(0.5)
print(json.dumps(block.ref.to_json()), flush=True)
time.sleep(600)
"""


def _expected(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(300, 70), torch.arange(1000), torch.tensor(5.0), torch.randn(3, dtype=torch.float64)]


def _ward(mode: str) -> tuple[subprocess.Popen, SharedRef]:
    proc = subprocess.Popen([sys.executable, "-c", WARD, "11", mode], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the ward process did not start"
    return proc, SharedRef.from_json(json.loads(line))


def _mapped_then_killed(mode: str) -> tuple[SharedBlock, SharedRef]:
    """A real ward's block, mapped here, then the ward killed with SIGKILL."""
    proc, ref = _ward(mode)
    try:
        block = SharedBlock.attach(ref)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    return block, ref


def test_a_wards_snapshot_outlives_its_process_killed_9():
    block, ref = _mapped_then_killed("commit")
    time.sleep(0.2)
    pos, meta, tensors = block.read(7)
    assert pos == (7, 0) and meta == b'{"pos":[7,0]}'
    assert all(torch.equal(a, b) for a, b in zip(tensors, _expected(11)))
    assert block.holds(7, check=True) and not block.holds(8)
    with pytest.raises(OSError):  # the ward is gone: a new buddy cannot find the block any more
        SharedBlock.attach(ref)


def test_a_ward_killed_while_overwriting_a_block_leaves_nothing_usable_there():
    block, _ = _mapped_then_killed("overwrite")
    assert block.read(7) is None and not block.holds(7) and not block.holds(7, check=True)


def test_bytes_changed_after_the_commit_are_never_reported_as_held():
    tensors = _expected(3)
    ward_block = SharedBlock.create(tensors, b"{}")
    ward_block.write((7, 0), b"{}", tensors)
    mapped = SharedBlock.attach(ward_block.ref)
    server = TransferServer("tok")
    try:
        buddy = Snapshots(server, "tok", rank=1, timeout_s=5)
        _, meta, views = mapped.read(7)
        server.put_snapshot(0, 7, FlatState(meta=meta, tensors=views, shared=mapped))
        buddy._held[0] = {7: (7, 0)}
        assert buddy.report()[1] == {0: [(7, 0)]}
        assert server.snapshot_bytes() == 0  # the ward's memory, not the buddy's
        flat = ward_block._tensors[0].view(-1)
        flat[123] = torch.nextafter(flat[123], torch.tensor(float("inf")))  # one ulp, after the commit
        assert buddy.report()[1] == {}
    finally:
        server.close()


def test_bytes_changed_before_the_buddy_mapped_them_fail_the_wards_own_digest():
    tensors = _expected(4)
    ward_block = SharedBlock.create(tensors, b"{}")
    ward_block.write((7, 0), b"{}", tensors)
    ward_block._tensors[1].view(-1)[999] += 1  # after the commit, before any buddy looked
    mapped = SharedBlock.attach(ward_block.ref)
    assert mapped.read(7) is not None and mapped.holds(7)
    assert not mapped.holds(7, check=True)
    ward_block.write((8, 0), b"{}", tensors)  # the ward's next commit is whole again
    assert mapped.read(8) is not None and mapped.holds(8, check=True)


def test_a_block_on_another_machine_or_of_another_process_is_refused():
    tensors = _expected(5)
    block = SharedBlock.create(tensors, b"{}")
    block.write((1, 0), b"{}", tensors)
    elsewhere = dataclasses.replace(block.ref, boot_id="another-machine")
    with pytest.raises(OSError, match="another machine"):
        SharedBlock.attach(elsewhere)
    stale = dataclasses.replace(block.ref, nonce="00" * 16)  # the descriptor now names another block
    with pytest.raises(OSError, match="no longer names"):
        SharedBlock.attach(stale)


def test_a_layout_that_changes_gets_a_new_block_and_the_tcp_transport_uses_none(monkeypatch):
    server = TransferServer("tok")
    try:
        snaps = Snapshots(server, "tok", rank=0, timeout_s=5)
        first = snaps.fill((1, 0), b"{}", [torch.ones(4)], None)
        again = snaps.fill((2, 0), b"{}", [torch.full((4,), 2.0)], first)
        assert again.shared is first.shared and torch.equal(again.tensors[0], torch.full((4,), 2.0))
        grown = snaps.fill((3, 0), b"{}", [torch.ones(4), torch.zeros(2)], again)
        assert grown.shared is not None and grown.shared is not first.shared
        monkeypatch.setenv("BATON_SNAPSHOT_TRANSPORT", "tcp")
        private = Snapshots(server, "tok", rank=0, timeout_s=5).fill((1, 0), b"{}", [torch.ones(4)], None)
        assert private.shared is None
        monkeypatch.setenv("BATON_SNAPSHOT_TRANSPORT", "shm")
        with pytest.raises(ValueError, match="expected 'auto' or 'tcp'"):
            Snapshots(server, "tok", rank=0, timeout_s=5)
    finally:
        server.close()


def test_a_buddy_asks_over_one_connection_and_a_timed_out_answer_is_never_taken_for_the_next():
    from baton.transfer.client import SnapshotLink
    from baton.transfer.server import snapshot_key

    server = TransferServer("tok")
    try:
        snaps = Snapshots(server, "tok", rank=0, timeout_s=5)
        first = snaps.fill((1, 0), b"{}", [torch.ones(4)], None)
        server.put_snapshot(0, 1, first)
        refs = SnapshotLink(server.address, "tok", timeout=0.5)
        assert SharedRef.from_json(refs.ref(snapshot_key(0, 1))) == first.shared.ref
        sock = refs._sock
        assert SharedRef.from_json(refs.ref(snapshot_key(0, 1))) == first.shared.ref and refs._sock is sock
        with pytest.raises(OSError):  # step 2 is not there yet: the wait times out
            refs.ref(snapshot_key(0, 2))
        assert refs._sock is None
        second = snaps.fill((2, 0), b"{}", [torch.ones(4)], None)
        server.put_snapshot(0, 2, second)  # the first connection's late answer goes nowhere
        assert SharedRef.from_json(refs.ref(snapshot_key(0, 2))) == second.shared.ref
        private = FlatState(meta=b"{}", tensors=[torch.ones(2)])
        server.put_snapshot(0, 3, private)
        assert refs.ref(snapshot_key(0, 3)) is None  # in private memory: the buddy must fetch it
        refs.close()
    finally:
        server.close()
