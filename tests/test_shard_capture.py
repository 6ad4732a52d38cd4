"""The learned FSDP2 state dict (baton/worker/shard_capture.py) is the DCP helpers' answer,
entry for entry and byte for byte, across steps, loads and schedulers; what it cannot
reproduce goes through the helpers. One process, a 1-rank gloo group, real FSDP2."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_sd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from baton.examples.llama import ModelArgs, Transformer
from baton.transfer import codec
from baton.worker import shard_capture, shards
from baton.worker.tracked import Tracked


@pytest.fixture(scope="module")
def mesh():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _job(mesh, model: nn.Module | None = None):
    torch.manual_seed(0)
    model = model or Transformer(ModelArgs(dim=32, n_layers=2))
    for block in getattr(model, "layers", {}).values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tracked = Tracked()
    tracked.objects.update(model=model, optimizer=opt)
    tracked.sharded = {"model", "optimizer"}
    return model, opt, sched, tracked


def _train(model, opt, sched, n: int) -> None:
    for _ in range(n):
        x = torch.randint(96, (4, 32)) if isinstance(model, Transformer) else torch.randn(4, 8)
        model(x).float().pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _helpers(model, opt) -> dict:
    return {"model": shards._to_local(get_model_state_dict(model)),
            "optimizer": shards._to_local(get_optimizer_state_dict(model, opt))}


def _equal_bitwise(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal_bitwise(x, y) for x, y in zip(a, b))
    return a == b


def test_the_learned_answer_is_the_helpers_across_steps_loads_and_a_scheduler(mesh):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 1)
    for _ in range(4):
        got = shards.capture(tracked)
        assert _equal_bitwise(got, _helpers(model, opt))
        assert shard_capture.same(got["optimizer"], _helpers(model, opt)["optimizer"])
        _train(model, opt, sched, 1)  # the LR changes every step: param_groups are read live
    assert tracked.shard_capture["model"].rebuilt >= 2 and tracked.shard_capture["optimizer"].rebuilt >= 2

    # A load replaces the optimizer's state tensors: the learned answer follows the live ones.
    other_model, other_opt, other_sched, other = _job(mesh)
    _train(other_model, other_opt, other_sched, 3)
    shards.load(tracked, shards.capture(other))
    got = shards.capture(tracked)
    assert _equal_bitwise(got, _helpers(model, opt))
    assert _equal_bitwise(got["model"], _helpers(other_model, other_opt)["model"])
    assert _equal_bitwise(got["optimizer"]["state"], _helpers(other_model, other_opt)["optimizer"]["state"])


def test_a_replaced_parameter_is_learned_again_and_revalidation_catches_a_wrong_answer(mesh, monkeypatch):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 1)
    shards.capture(tracked)
    cap = tracked.shard_capture["model"]
    before = cap.rebuilt
    shards.capture(tracked)
    assert cap.rebuilt == before + 1
    # A new local tensor under a parameter (what an assigning load does): the fingerprint changes.
    p = next(model.parameters())
    p._local_tensor = p._local_tensor.clone()
    assert _equal_bitwise(shards.capture(tracked), _helpers(model, opt))
    assert cap.rebuilt == before + 1  # asked the helpers, learned anew
    # A learned answer that stops matching the helpers is caught at the next revalidation.
    learned = cap._learned
    real = learned.rebuild
    learned.rebuild = lambda: {**real(), "extra": torch.zeros(1)}
    learned.uses = shard_capture.REVALIDATE_EVERY
    assert _equal_bitwise(shards.capture(tracked), _helpers(model, opt))
    assert cap.disabled


class _WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        self.calls += 1
        return {"calls": self.calls}

    def set_extra_state(self, state) -> None:
        self.calls = state["calls"]


def test_what_the_rebuild_cannot_reproduce_goes_through_the_helpers(mesh):
    model, opt, sched, tracked = _job(mesh, _WithExtraState())
    _train(model, opt, sched, 1)
    for _ in range(3):
        got = shards.capture(tracked)
        assert "_extra_state" in got["model"]
    assert tracked.shard_capture["model"].rebuilt == 0
    assert tracked.shard_capture["optimizer"].rebuilt >= 1


def _decoded(tracked: Tracked) -> dict:
    """A snapshot's round trip: the encoded capture inside a larger state, through the codec."""
    meta, tensors = codec.encode({"pos": [3, 0], "sharded": shards.capture(tracked, encoded=True), "tail": [1.5]})
    state = codec.decode(meta, [t.clone() for t in tensors])
    assert state["pos"] == [3, 0] and state["tail"] == [1.5]
    return state["sharded"]


def test_the_encoded_capture_decodes_to_the_helpers_answer_without_walking_it(mesh):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 1)
    for _ in range(4):
        assert _equal_bitwise(_decoded(tracked), _helpers(model, opt))
        _train(model, opt, sched, 1)  # new values and a new LR under the same skeleton
    for name in ("model", "optimizer"):
        learned = tracked.shard_capture[name]._learned
        assert learned is not None and learned.encode is not None, name
    # The fast encoding hands over the live shards themselves (the snapshot copies them).
    fast = tracked.shard_capture["optimizer"].encoded()
    live = {shard_capture._local(t).data_ptr() for st in opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)}
    assert live <= {t.data_ptr() for t in fast.tensors}


def test_state_the_skeleton_cannot_hold_is_encoded_by_walking_it(mesh):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 1)
    p = next(iter(opt.state))
    for i in range(4):
        opt.state[p]["seen"] = i  # a plain number that changes every step: no fixed skeleton holds it
        assert _equal_bitwise(_decoded(tracked), _helpers(model, opt))
        _train(model, opt, sched, 1)
    assert tracked.shard_capture["optimizer"].rebuilt >= 2


def _optimizer_tensors(captured: dict) -> list[torch.Tensor]:
    return [v[shards.LOCAL] if isinstance(v, dict) else v for st in captured["optimizer"]["state"].values()
            for v in st.values()]


def _storage(model, opt) -> list[int]:
    return [shard_capture._local(p).data_ptr() for p in model.parameters()] + \
        [shard_capture._local(t).data_ptr() for st in opt.state.values() for t in st.values()]


def test_a_load_copies_into_the_live_shards_and_sets_the_lr_as_the_helpers_would(mesh):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 2)
    other_model, other_opt, other_sched, other = _job(mesh)
    _train(other_model, other_opt, other_sched, 5)  # other values, another LR
    before = _storage(model, opt)
    arrived = shards.cloned(shards.capture(other))
    shards.load(tracked, arrived, owned=False)
    assert _storage(model, opt) == before  # the same storage: copied in, nothing replaced
    assert _equal_bitwise(_helpers(model, opt), _helpers(other_model, other_opt))
    assert opt.param_groups[0]["lr"] == other_opt.param_groups[0]["lr"] != 1e-2
    for t in _optimizer_tensors(arrived):  # the arrived tensors were not taken over
        t.add_(1)
    assert _equal_bitwise(_helpers(model, opt), _helpers(other_model, other_opt))


@pytest.mark.parametrize("owned", [True, False])
def test_a_fresh_optimizer_takes_the_arrived_state_and_trains_on_bitwise(mesh, owned):
    """A joiner's optimizer never stepped: it adopts a fetched state (no step at lr 0, no
    copy), or, given tensors it must not keep, gets its state created and copied into."""
    torch.manual_seed(5)
    batches = [torch.randint(96, (4, 32)) for _ in range(2)]
    other_model, other_opt, other_sched, other = _job(mesh)
    _train(other_model, other_opt, other_sched, 3)
    model, opt, sched, tracked = _job(mesh)  # a joiner: a model and an optimizer that never stepped
    assert not opt.state
    arrived = shards.cloned(shards.capture(other))
    loaded = shards.load(tracked, arrived, owned=owned)
    assert loaded == ["model", "optimizer"]
    sched.load_state_dict(other_sched.state_dict())
    assert _equal_bitwise(_helpers(model, opt), _helpers(other_model, other_opt))
    theirs = {t.data_ptr() for t in _optimizer_tensors(arrived)}
    mine = {shard_capture._local(t).data_ptr() for st in opt.state.values() for t in st.values()}
    assert (mine == theirs) if owned else not (mine & theirs)
    for m, o, s in ((model, opt, sched), (other_model, other_opt, other_sched)):
        for x in batches:
            m(x).float().pow(2).mean().backward()
            o.step()
            s.step()
            o.zero_grad()
    assert _equal_bitwise(_helpers(model, opt), _helpers(other_model, other_opt))


def test_an_arrival_of_another_structure_goes_through_the_helpers_and_is_never_aliased(mesh, monkeypatch):
    model, opt, sched, tracked = _job(mesh)
    _train(model, opt, sched, 1)
    other_model, other_opt, other_sched, other = _job(mesh)
    _train(other_model, other_opt, other_sched, 2)
    arrived = shards.cloned(shards.capture(other))
    arrived["optimizer"]["param_groups"][0]["note"] = 1  # a key this rank's groups lack: not copied in place
    used = []
    orig = dcp_sd.set_optimizer_state_dict
    monkeypatch.setattr(dcp_sd, "set_optimizer_state_dict", lambda *a, **k: (used.append(1), orig(*a, **k))[1])
    shards.load(tracked, arrived, owned=False)
    assert used and opt.param_groups[0]["note"] == 1  # the helpers loaded it
    assert _equal_bitwise(_helpers(model, opt)["model"], _helpers(other_model, other_opt)["model"])
    held = [t for st in opt.state.values() for t in st.values()]
    assert not {shard_capture._local(t).data_ptr() for t in held} & {t.data_ptr() for t in _optimizer_tensors(arrived)}
