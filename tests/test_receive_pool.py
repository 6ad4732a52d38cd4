"""A spare's receive memory, mapped before a move needs it (baton.transfer.pool): a fetch
carves the state's tensors out of it, and after the load the pages of what the load copied
go back to the kernel."""

from __future__ import annotations

import time

import torch

from baton.transfer.codec import tensors_in
from baton.transfer.pool import ReceivePool, release_unadopted


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _filled(pool: ReceivePool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pool.mapped < pool.nbytes:
        assert time.monotonic() < deadline, f"{pool.mapped} of {pool.nbytes} bytes mapped"
        time.sleep(0.01)


def test_a_pool_maps_its_memory_ahead_and_a_fetch_carves_the_states_tensors_from_it():
    before = _rss_mb()
    pool = ReceivePool(64 << 20)
    _filled(pool)
    assert _rss_mb() - before > 60  # mapped: resident before anything is written
    specs = [(torch.float32, [1000, 1000]), (torch.bfloat16, [3]), (torch.int64, []), (torch.float64, [0, 4]),
             (torch.bfloat16, [1 << 20])]
    tensors = pool.carve(specs)
    assert tensors is not None and pool.used
    assert [(t.dtype, list(t.shape)) for t in tensors] == specs
    inside = [t.untyped_storage().data_ptr() == pool._buf.data_ptr() for t in tensors]
    assert inside == [True, False, False, False, True]  # the large ones: small tensors stay their own
    assert tensors[4].data_ptr() % 64 == 0
    tensors[0].fill_(1.5)
    tensors[4].fill_(2.0)
    assert tensors[0].sum().item() == 1.5e6 and tensors[4][:3].tolist() == [2.0, 2.0, 2.0]  # no overlap
    assert pool.carve(specs) is None  # one fetch per pool


def test_a_state_larger_than_the_pool_is_not_carved_and_the_pool_stays_for_another():
    pool = ReceivePool(2 << 20)
    assert pool.carve([(torch.float32, [1 << 20])]) is None and not pool.used
    assert pool.carve([(torch.float32, [1 << 19])]) is not None


def test_the_pages_of_what_the_load_copied_go_back_and_what_it_adopted_stays():
    pool = ReceivePool(96 << 20)
    _filled(pool)
    params, moments = pool.carve([(torch.float32, [8 << 20]), (torch.float32, [8 << 20])])
    params.fill_(1.0)
    moments.fill_(3.0)
    model = torch.zeros(8 << 20)
    model.copy_(params)  # a module's load copies; an optimizer's keeps the tensor it was given
    state = {"model": {"w": params}, "optimizer": {"state": {0: {"exp_avg": moments}}}}
    before = _rss_mb()
    freed = release_unadopted(tensors_in(state), [model, moments])
    assert freed >= (32 << 20) - 8192 and before - _rss_mb() > 25
    assert moments.eq(3.0).all() and model.eq(1.0).all()
