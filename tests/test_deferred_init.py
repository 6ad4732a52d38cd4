"""A joiner's setup leaves out the random initialisation its rank's state overwrites
(baton/transparent/deferred_init.py), and nothing the script reads changes.

Each setup below runs twice in this process, in the shapes training scripts build their
models in: as the script runs it, and under the joiner's mode, which is then finished with
the tensors the arriving state would be loaded into (every model's `state_dict()`). What the
script kept besides the models, the default generator (or the replay of the draws left
out), and the models' values where any of their initialisation had to run, must be bitwise
equal. The kill-and-rebuild tests (test_nocode_moves) run the mode inside real joiners.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from baton.transparent.deferred_init import DeferredInit


class _Block(torch.nn.Module):
    """nanoGPT's shape: an attention projection and an MLP, initialised by `apply` and a
    scaled normal for the residual projections."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.1)
        for m in (self.attn, self.proj):
            torch.nn.init.normal_(m.weight, std=0.02)
            torch.nn.init.zeros_(m.bias)
        torch.nn.init.normal_(self.proj.weight, std=0.02 / math.sqrt(2 * layers))


class _Gpt(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d, layers) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.head.weight  # tied
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))


def _plain_then_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return {"model": model}, {"data": torch.randn(8, 16)}  # a draw after: the recorded ones run first


def _gpt_with_ema():
    torch.manual_seed(1337)
    model = _Gpt()
    return {"model": model}, {"ema": copy.deepcopy(model).head.weight.detach().clone()}


def _seeded_twice():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    torch.manual_seed(1)
    other = torch.nn.Linear(8, 8)
    return {"model": model}, {"other": other.weight.detach().clone()}


def _models_only():
    torch.manual_seed(0)
    return {"model": _Gpt(), "conv": torch.nn.Conv2d(3, 4, 3), "bn": torch.nn.BatchNorm1d(4)}, {}


def _models_only_seeded_between():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    torch.manual_seed(7)
    return {"model": model, "head": torch.nn.Linear(32, 2)}, {}


def _saved_at_init():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return {"model": model}, {"saved": torch.load(io.BytesIO(buf.getvalue()))["weight"]}


def _read_as_list_and_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    listed = torch.tensor(model.weight.tolist())
    return {"model": model}, {"listed": listed, "state": torch.get_rng_state()}


def _fork_rng():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        inside = torch.rand(3)
    return {"model": model}, {"inside": inside, "after": torch.rand(3)}


def _views_and_an_untracked_tensor():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(10, 10))
    with torch.no_grad():
        p[:5].normal_()
        p[5:].uniform_()
        p.mul_(2.0)
    noise = torch.empty(4).normal_()  # not a model's: it runs at the step loop
    return {"model": torch.nn.ParameterList([p])}, {"noise": noise}


SETUPS = [_plain_then_data, _gpt_with_ema, _seeded_twice, _models_only, _models_only_seeded_between,
          _saved_at_init, _read_as_list_and_state, _fork_rng, _views_and_an_untracked_tensor]


def _tensors(models: dict) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t for k, m in models.items() for n, t in m.state_dict().items()}


@pytest.mark.parametrize("setup", SETUPS, ids=lambda f: f.__name__.strip("_"))
def test_what_the_script_reads_is_what_it_would_have_read(setup):
    ref_models, ref_kept = setup()
    ref_stream = torch.get_rng_state()

    mode = DeferredInit().install()
    models, kept = setup()
    replay = mode.finish(list(_tensors(models).values()))
    stream = replay.result() if replay is not None else torch.get_rng_state()

    assert not isinstance(torch.Tensor.__dict__.get("tolist"), type(lambda: 0)), "a reader left patched"
    assert torch.save.__module__ == "torch.serialization"
    for name, value in ref_kept.items():
        assert torch.equal(kept[name], value), name
    assert torch.equal(stream, ref_stream), "the stream the setup leaves (or its replay) differs"
    for name, model in models.items():  # what was left out, the arriving state overwrites
        model.load_state_dict(ref_models[name].state_dict())
    ref, got = _tensors(ref_models), _tensors(models)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_only_what_the_arriving_state_overwrites_is_left_out():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 64)
    mode = DeferredInit().install()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    replay = mode.finish(list(model.state_dict().values()))
    assert replay is not None and mode.ran == 0
    assert not torch.equal(model.weight, ref.weight), "the draws ran: nothing was left out"
    model.load_state_dict(ref.state_dict())  # the arriving state
    assert torch.equal(model.weight, ref.weight)

    # memory the state does not cover (a buffer left out of state_dict) runs at the step loop
    mode = DeferredInit().install()
    torch.manual_seed(0)
    other = torch.nn.Linear(64, 64)
    other.register_buffer("proj", torch.empty(64).normal_(), persistent=False)
    assert mode.finish(list(other.state_dict().values())) is None
    torch.manual_seed(0)
    expected = torch.nn.Linear(64, 64)
    assert torch.equal(other.weight, expected.weight)
    assert torch.equal(other.proj, torch.empty(64).normal_())


def test_a_tensor_subclass_runs_what_was_recorded_first():
    """A subclass (FSDP2's DTensor, say) reads its inner tensors in its own dispatch, unseen."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8).weight.detach().clone()
    mode = DeferredInit().install()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    torch.add(TwoTensor(torch.zeros(1), torch.ones(1)), 1)
    mode.finish(list(model.state_dict().values()))
    assert mode.ran > 0 and torch.equal(model.weight.detach(), ref)


def test_the_same_seed_set_again_is_seen():
    """After a seed, the generator's state reads as before the left-out draws: only the call says so."""
    def setup():
        torch.manual_seed(0)
        first = torch.nn.Linear(16, 16)
        torch.manual_seed(0)
        return {"first": first}, {"again": torch.nn.Linear(16, 16).weight.detach().clone()}

    ref_models, ref_kept = setup()
    mode = DeferredInit().install()
    models, kept = setup()
    mode.finish(list(models["first"].state_dict().values()))
    assert torch.equal(kept["again"], ref_kept["again"]) and torch.equal(kept["again"], ref_models["first"].weight)


def test_memory_given_to_a_tensor_later_is_not_drawn_into():
    """`param.data = pretrained` (a frozen teacher's weights, say): the recorded fill was of
    the memory the tensor had, which no one holds now; the teacher keeps its weights."""
    pretrained = torch.arange(64.0).reshape(8, 8)
    mode = DeferredInit().install()
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
    teacher.weight.data = pretrained.clone()
    assert mode.finish(list(student.state_dict().values())) is not None  # all left out: the stream replayed
    assert torch.equal(teacher.weight.detach(), pretrained)


def test_armed_it_waits_for_the_first_module_and_can_be_turned_off(monkeypatch):
    from baton.transparent import deferred_init

    torch.manual_seed(0)
    ref = torch.nn.Linear(32, 32)
    data_ref = torch.randn(4)
    for off in (False, True):
        if off:
            monkeypatch.setenv(deferred_init.OFF, "0")
        mode = deferred_init.arm()
        torch.manual_seed(0)
        before = torch.empty(4)
        before.normal_()  # before any module: not the mode's (it is not installed yet)
        assert not mode.entries
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        assert bool(mode.entries) is not off
        data = torch.randn(4)
        mode.finish(list(model.state_dict().values()))
        assert torch.nn.Module.__init__ is deferred_init._MODULE_INIT
        assert torch.equal(data, data_ref) and torch.equal(model.weight, ref.weight)


def test_a_model_moved_to_another_dtype_is_copied_only_when_read():
    """`model.to(device)` of a model built on the CPU (here the dtype moves: no GPU here): the
    copy is recorded after the fills it copies, and the CPU memory it came from, which no one
    holds after `Module._apply`, is dropped with it."""
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).to(torch.float64)
        half = torch.nn.Linear(8, 8).half()
        return {"model": model, "half": half}

    ref = setup()
    ref_stream = torch.get_rng_state()
    mode = DeferredInit().install()
    models = setup()
    assert models["model"][0].weight.dtype == torch.float64 and models["half"].weight.dtype == torch.float16
    replay = mode.finish(list(_tensors(models).values()))
    assert replay is not None and mode.ran == 0, "all left out: the copies and what they copied"
    assert torch.equal(replay.result(), ref_stream)

    mode = DeferredInit().install()
    models = setup()
    read = models["half"].weight.detach().clone()  # read after the copy: fills, then the copy, run
    mode.finish(list(_tensors(models).values()))
    assert mode.ran > 0 and torch.equal(read, ref["half"].weight.detach())
    assert torch.equal(models["model"][0].weight, ref["model"][0].weight)


def test_a_resume_blocks_load_makes_the_initialisation_dead_but_not_its_draws():
    """`model.load_state_dict(checkpoint)` in the setup writes every parameter whole: the fills
    before it are never needed, but the stream still moves on past their draws."""
    saved = {k: v + 1 for k, v in torch.nn.Linear(16, 16).state_dict().items()}

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        model.load_state_dict(saved)  # a resume block
        return {"model": model}, {"after": torch.randn(5), "loaded": model.weight.detach().clone()}

    ref_models, ref_kept = setup()
    mode = DeferredInit().install()
    models, kept = setup()  # the randn: the dead fills' draws run into scratch, then it draws
    assert mode.ran > 0 and torch.equal(kept["after"], ref_kept["after"])
    assert torch.equal(kept["loaded"], saved["weight"])
    mode.finish([])

    def setup_then_loop():
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        model.load_state_dict(saved)
        return model

    setup_then_loop()
    ref_stream = torch.get_rng_state()
    mode = DeferredInit().install()
    model = setup_then_loop()
    replay = mode.finish([])  # nothing covers it: it was written whole, which is enough
    assert replay is not None and mode.ran == 0 and mode.left_out_bytes == 16 * 16 * 4 + 16 * 4
    assert torch.equal(replay.result(), ref_stream) and torch.equal(model.weight.detach(), saved["weight"])


def test_a_process_started_in_the_setup_gets_the_memory_as_it_would_be():
    """A DataLoader's workers started before the loop (`iter(loader)` with its own generator,
    so no draw runs what was recorded) read a dataset the setup filled in place: the fork
    copies memory as it is, so what was recorded runs first."""
    def setup():
        torch.manual_seed(0)
        data = torch.empty(64, 4)
        data.normal_()  # in place, with the default generator: recorded
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=64, num_workers=1,
                                             generator=torch.Generator().manual_seed(0), shuffle=True)
        return next(iter(loader))[0]

    ref = setup()
    mode = DeferredInit().install()
    got = setup()
    mode.finish([])
    assert torch.equal(got.sort(0).values, ref.sort(0).values) and torch.equal(got, ref)
