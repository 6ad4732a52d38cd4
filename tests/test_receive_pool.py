"""A spare's receive memory, mapped before a move needs it (baton.transfer.pool): a fetch
carves the state's tensors out of it, and after the load the pages of what the load copied
go back to the kernel."""

from __future__ import annotations

import ctypes
import io
import os
import time

import torch

from baton.transfer.codec import tensors_in
from baton.transfer.pool import ReceivePool, release_unadopted


def _resident_mb(t: torch.Tensor) -> float:
    """How much of `t`'s memory is resident, page by page (mincore), not the process's RSS:
    that depends on what earlier tests in the same worker left mapped (CI read the same
    process RSS before and after a pool had mapped its 64 MB, in one test order out of
    several), and on kernels before 6.2 VmRSS lags by each thread's cached fault counts."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page / 2**20


def _filled(pool: ReceivePool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pool.mapped < pool.nbytes:
        assert time.monotonic() < deadline, f"{pool.mapped} of {pool.nbytes} bytes mapped"
        time.sleep(0.01)


def test_a_pool_maps_its_memory_ahead_and_a_fetch_carves_the_states_tensors_from_it():
    pool = ReceivePool(64 << 20)
    _filled(pool)
    assert _resident_mb(pool._buf) > 60  # mapped: resident before anything is written
    specs = [(torch.float32, [1000, 1000]), (torch.bfloat16, [3]), (torch.int64, []), (torch.float64, [0, 4]),
             (torch.bfloat16, [1 << 20])]
    tensors = pool.carve(specs)
    assert tensors is not None and pool.used
    assert [(t.dtype, list(t.shape)) for t in tensors] == specs
    assert [pool.holds(t) for t in tensors] == [True, False, False, False, True]  # small ones stay their own
    # each a storage of its own over its span: a torch.save writes its bytes, not the pool's
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    saved = io.BytesIO()
    torch.save(tensors[4], saved)
    assert len(saved.getvalue()) < (2 << 20) + 4096, len(saved.getvalue())
    assert tensors[4].data_ptr() % 64 == 0
    tensors[0].fill_(1.5)
    tensors[4].fill_(2.0)
    assert tensors[0].sum().item() == 1.5e6 and tensors[4][:3].tolist() == [2.0, 2.0, 2.0]  # no overlap
    assert pool.carve(specs) is None  # one fetch per pool


def test_a_state_larger_than_the_pool_is_not_carved_and_the_pool_stays_for_another():
    pool = ReceivePool(2 << 20)
    assert pool.carve([(torch.float32, [1 << 20])]) is None and not pool.used
    assert pool.carve([(torch.float32, [1 << 19])]) is not None


def test_a_fetch_of_small_tensors_only_leaves_the_pool_to_the_next():
    """A no-code planned move fetches its predecessor's own record first (random streams,
    scalars: nothing large enough to carve), then the replicated state: the first once took
    the pool, and the 100 MB that followed landed in fresh memory inside the pause (its
    chunks 0.18 s against 0.06 s, a move 2.5x the model-aware port's)."""
    pool = ReceivePool(8 << 20)
    small = pool.carve([(torch.uint8, [5056]), (torch.int64, [])])
    assert small is not None and not pool.used and not any(pool.holds(t) for t in small)
    big = pool.carve([(torch.float32, [1 << 20])])
    assert big is not None and pool.used and pool.holds(big[0])


def test_the_pages_of_what_the_load_copied_go_back_and_what_it_adopted_stays():
    pool = ReceivePool(96 << 20)
    _filled(pool)
    params, moments = pool.carve([(torch.float32, [8 << 20]), (torch.float32, [8 << 20])])
    params.fill_(1.0)
    moments.fill_(3.0)
    model = torch.zeros(8 << 20)
    model.copy_(params)  # a module's load copies; an optimizer's keeps the tensor it was given
    state = {"model": {"w": params}, "optimizer": {"state": {0: {"exp_avg": moments}}}}
    before = _resident_mb(pool._buf)
    freed = release_unadopted(tensors_in(state), [model, moments], pool)
    assert freed >= (32 << 20) - 8192 and before - _resident_mb(pool._buf) > 25
    assert moments.eq(3.0).all() and model.eq(1.0).all()


def test_a_joiners_parameters_take_the_memory_their_state_arrived_in():
    """adopt_parameters: each parameter points at its arrived tensor (no copy), as the same
    Parameter object the optimizer holds; a parameter tied under two keys takes one; a
    parameter that is a view into a flat buffer, or an arrived tensor of another dtype, is
    copied as before; training goes on from the loaded values and a checkpoint of the model
    writes its own bytes only."""
    from baton.worker.adopt import adopt_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    model[1].weight = model[0].weight  # tied
    flat = torch.zeros(512 * 4 + 4)
    model[2].weight = torch.nn.Parameter(flat[:2048].view(4, 512))  # a view into a flat buffer
    model[2].bias = torch.nn.Parameter(flat[2048:])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = [id(p) for p in model.parameters()]
    pool = ReceivePool(16 << 20)
    _filled(pool)
    source = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    arrived = dict(zip(source, pool.carve([(v.dtype, list(v.shape)) for v in source.values()])))
    for k, v in source.items():
        arrived[k].copy_(v)
    arrived["1.bias"] = source["1.bias"].double()  # another dtype: load_state_dict casts it into its own
    adopted = adopt_parameters(model, arrived)
    model.load_state_dict(arrived)
    assert adopted == (512 * 512 + 512) * 4, adopted  # 0.weight (and 1.weight, the same), 0.bias
    assert model[0].weight.data_ptr() == arrived["0.weight"].data_ptr()  # taken, once for both keys
    assert model[0].bias.data_ptr() == arrived["0.bias"].data_ptr()
    assert model[1].bias.data_ptr() != arrived["1.bias"].data_ptr()
    assert model[2].weight.data_ptr() == flat.data_ptr()  # stays in its flat buffer
    assert [id(p) for p in model.parameters()] == held
    for k, v in model.state_dict().items():
        assert torch.equal(v, source[k].to(v.dtype)), k
    model(torch.randn(8, 512)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, source["0.weight"])
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    assert len(saved.getvalue()) < 2 * (512 * 512 + 3 * 512 + 2048 + 4) * 4 + 65536, len(saved.getvalue())
