"""A joiner takes what its model holds outside any state_dict from its predecessor: each
module's train/eval flag (a script that froze BatchNorm inside its step loop), and a check
of its non-persistent buffers (a joiner whose buffers differ stops the job, naming them,
instead of training on to exit code 0 with other weights)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from baton.worker import module_state
from baton.worker.module_state import ModuleState
from baton.worker.tracked import Tracked, UsageError
from tests.jobs import Job, assert_ranks_equal, check_resolved_exact
from tests.once import once

SCRIPT = Path(__file__).resolve().parent / "modes_job.py"
NPROC = 2


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Dropout())
        self.register_buffer("table", torch.arange(6.0), persistent=False)


def test_a_registration_inside_compiled_code_that_broke_a_graph_makes_the_rank_unmovable():
    """compile_watch: a buffer registered in a step that broke a graph, by a module inside a
    compiled one, is flagged (and named in what the rank serves); a buffer registered outside
    compiled code, one registered in a step without a break, and a break in a step that
    registered nothing are not. Dynamo's counter is moved by hand: compiling costs seconds
    (tests/test_fsdp_group.py runs the real one)."""
    from torch._dynamo.utils import counters

    from baton.worker.compile_watch import compiled_module_ids

    net = _Net()
    net.body[0] = torch.compile(net.body[0])
    net.body[2].compile()
    compiled = compiled_module_ids([net])
    assert id(net.body[0]._orig_mod) in compiled and id(net.body[2]) in compiled and id(net.body[1]) not in compiled

    tracked = Tracked()
    tracked.objects["model"], tracked.sharded = net, {"model"}
    tracked.note_loop_start()
    reason = "HOP: Unsafe side effect\n  Explanation: a test's"
    saved = dict(counters["graph_break"])
    try:
        tracked.note_step_end()
        net.body[1].register_buffer("plain", torch.zeros(1))  # outside compiled code, in a step with a break
        counters["graph_break"][reason] += 1
        tracked.note_step_end()
        net.body[0]._orig_mod.register_buffer("quiet", torch.zeros(1))  # compiled, no break in its step
        tracked.note_step_end()
        counters["graph_break"][reason] += 1  # a break, nothing registered
        tracked.note_step_end()
        net.body[0]._orig_mod.register_buffer("stats", torch.zeros(1))
        net.body[2].register_buffer("mask", torch.ones(1))
        counters["graph_break"][reason] += 1
        tracked.note_step_end()
    finally:
        counters["graph_break"].clear()
        counters["graph_break"].update(saved)
    broke = tracked.late_buffers()["broke_compile"]
    assert sorted(broke) == ["model/body.0._orig_mod.stats", "model/body.2.mask"], broke
    assert set(broke.values()) == {"HOP: Unsafe side effect"}


def test_flags_travel_module_by_module_and_buffer_digests_follow_every_change():
    state = ModuleState()
    src, dst = _Net(), _Net()
    src.body[1].eval()
    modes = state.modes({"model": src})
    assert modes == {"model": "11101"}  # the model, its Sequential, Linear, BatchNorm (frozen), Dropout
    state.set_modes({"model": dst}, modes)
    assert [m.training for m in dst.modules()] == [m.training for m in src.modules()]
    assert dst.training and not dst.body[1].training  # set one by one: eval() on the parent was not called

    first = state.volatile({"model": src})
    assert list(first) == ["model.table"] and first == ModuleState().volatile({"model": dst})
    src.table.add_(1)  # in place: the version counter moves
    assert state.volatile({"model": src}) != first
    src.table = torch.arange(6.0)  # reassigned, same values: the same digest again
    assert state.volatile({"model": src}) == first
    src.body[0].register_buffer("cache", torch.ones(2), persistent=False)  # made later (a first forward)
    later = state.volatile({"model": src})
    assert list(later) == ["model.table", "model.body.0.cache"]
    src.body.append(torch.nn.Dropout())  # a module added: its flag is found too
    assert state.modes({"model": src}) == {"model": "111011"}
    # A buffer only one side holds yet is not compared; one both hold is, by value.
    assert module_state.differing_buffers(later, first) == []
    assert module_state.differing_buffers(later, {**first, "model.table": "other"}) == ["model.table"]

    with pytest.raises(UsageError, match="different models"):
        state.set_modes({"model": torch.nn.Linear(2, 2)}, modes)
    with pytest.raises(UsageError, match="has none"):
        state.set_modes({"other": dst}, modes)


def _job(tmp: Path, name: str, spares: int = 1, args: list[str] | None = None, **leash: int) -> Job:
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script=SCRIPT, name=name, script_args=args, **leash)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "module-state", _reference)


def _reference(tmp):
    job = _job(tmp, "ref", spares=0)
    assert job.wait(timeout=120) == 0, job.log()
    states = job.all_rank_params(NPROC)
    assert all(not bool(s["bn_training"]) for s in states)
    return states


def test_a_rank_lost_after_the_script_froze_batchnorm_is_rebuilt_with_it_frozen(tmp_path, reference):
    job = _job(tmp_path, "kill")
    try:
        job.wait_step(14)
        job.signal_rank(1, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=120)
        assert [e["kind"] for e in events] == ["unplanned"]
    finally:
        job.kill()


def test_a_buffer_an_abandoned_first_forward_registered_is_made_afresh_under_ddp(tmp_path, reference):
    """Rank 1 killed -9 in step 0, after the forward that registered `gain` and before its
    backward: rank 0's gradient all-reduce fails and it goes back to the step's start, where
    `gain` did not exist. It is unregistered, the step run again makes it afresh (DDP reads
    the module's buffers again), and the job ends bitwise equal to the run without failures."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject"), "BATON_LOG": "INFO",
           "BATON_TEST_SIGNAL_MID_STEP": "1:0:SIGKILL", "BATON_TEST_SIGNAL_MARK": str(tmp_path / "mark")}
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=0, script=SCRIPT, name="first", env=env)
    try:
        events = check_resolved_exact(job, reference, timeout=120)
        log = job.log(tail=None)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"], e["step"]) for e in events] == [("unplanned", 1, 0)], events
    assert "unregistered the buffers made after the record this rank goes back to: model/gain" in log, log[-3000:]


def test_a_joiner_whose_non_persistent_buffer_differs_stops_the_job_naming_it(tmp_path):
    job = _job(tmp_path, "skips", args=["--joiner-skips-buffer"])
    try:
        job.wait_step(5)
        job.client.migrate(1)
        code = job.wait(timeout=120)
        log = job.log(tail=None)
        assert code != 0, log
        assert "non-persistent buffers differ" in log and "model.scale" in log, log
    finally:
        job.kill()


def test_a_rank_whose_every_new_process_dies_at_once_ends_the_job_instead_of_respawning(tmp_path):
    """Each spare taking rank 1 over aborts in its first step: after the third loss with the
    job standing at one step, the job ends non-zero saying why, with no fourth spare."""
    job = _job(tmp_path, "aborts", args=["--joiner-aborts", "step"])
    try:
        job.wait_step(5)
        job.signal_rank(1, signal.SIGKILL)
        code = job.wait(timeout=150)
        log = job.log(tail=None)
        assert code == 1, log
        assert "rank 1 was lost 3 times in a row while the job stood at step" in log, log
        assert "signal 6" in log, log
        assert log.count("spare-starting") <= 4, log
    finally:
        job.kill()


def test_a_planned_move_whose_every_spare_dies_is_given_up_and_the_job_ends_as_without_it(tmp_path, reference):
    """Each spare taking rank 1 over aborts while it sets up: after the third, the move is
    given up, rank 1 stays where it is, and the run ends bitwise equal to the failure-free one."""
    # The ranks hold two steps before the end (30) until the move is given up: three spares
    # must start and die within the run, and at 0.6 s a step (a guess) CI's run ended first.
    job = _job(tmp_path, "gives-up", args=["--joiner-aborts", "setup"], leash=3, leash_cap=28)
    try:
        job.wait_step(2)
        job.client.migrate(1)
        job.wait_until(lambda st: any("given up" in (e.get("note") or "") for e in job.events()), timeout=150,
                       what="the move given up")
        assert job.wait(timeout=150) == 0, job.log()
        log = job.log(tail=None)
        assert "the move of rank 1 is given up: 3 spares in a row were lost" in log, log
        assert_ranks_equal(job, reference)
        planned = [e for e in job.events() if e["kind"] == "planned"]
        assert planned and all(e["status"] == "failed" for e in planned), planned
        assert "given up: 3 spares in a row" in planned[-1]["note"], planned
    finally:
        job.kill()


def test_buffers_a_forward_registered_reach_a_fresh_model_in_the_order_ddp_lists_them():
    """What a joiner gets: the buffers registered since the loop began, persistent or not, with
    their values and in registration order (DDP broadcasts `named_buffers()` as one list)."""
    from types import SimpleNamespace

    def tracked_with(net: torch.nn.Module) -> Tracked:
        t = Tracked()
        t.ddps = [SimpleNamespace(module=net)]  # what job.wrap records: the DDP around the model
        t.note_loop_start()
        return t

    src, dst = _Net(), _Net()
    source = tracked_with(src)
    src.body[0].register_buffer("mask", torch.tensor([1.0, 0.0, 1.0]), persistent=False)  # a first forward's
    src.register_buffer("count", torch.tensor(7))  # persistent: in state_dict from now on
    late = source.late_buffers()
    assert sorted(late["values"]) == ["wrapped0/body.0.mask", "wrapped0/count"]  # (an untracked model's name)
    assert late["persistent"] == ["wrapped0/count"]

    joiner = tracked_with(dst)
    assert joiner.adopt_late_buffers(late) == ["wrapped0/count", "wrapped0/body.0.mask"]  # module by module,
    # as named_buffers() lists them
    assert [n for n, _ in dst.named_buffers()] == [n for n, _ in src.named_buffers()]
    assert torch.equal(dst.body[0].mask, src.body[0].mask)
    dst.load_state_dict(src.state_dict())  # strict: the persistent one is a key here too
    assert joiner.adopt_late_buffers(late) == []  # held already: left as it is
    with pytest.raises(UsageError, match="neither wraps nor shards"):
        Tracked().adopt_late_buffers(late)

    # A sharded (FSDP2) model's are carried too, under the name it is tracked by.
    fsdp = Tracked()
    fsdp.objects["model"], fsdp.sharded = _Net(), {"model"}
    fsdp.note_loop_start()
    fsdp.objects["model"].register_buffer("seen", torch.zeros(2))
    late = fsdp.late_buffers()
    assert list(late["values"]) == ["model/seen"] and late["persistent"] == ["model/seen"], late
