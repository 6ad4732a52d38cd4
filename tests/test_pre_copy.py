"""Pre-copied planned moves (baton/worker/precopy.py): the joiner copies the replicated state
while training goes on and follows the leaver's optimizer steps; the pause moves only the
rank's own state. What it cannot follow, and every death during it, falls back to the paths
without it: bitwise, never a hang, never exit 0 with other state.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.jobs import Job, bitwise_equal

NPROC, STEPS = 3, 150
ARGS = ["--width", "128", "--step-sleep", "0.02"]
INJECT = str(Path(__file__).resolve().parent / "inject")


def _equal_to(job: Job, reference: list) -> None:
    for rank, (got, want) in enumerate(zip(job.all_rank_params(NPROC), reference)):
        assert bitwise_equal(got, want), f"rank {rank} differs from the run without a move:\n{job.log()}"


def _pre_copied_move(tmp_path, train_reference, args: list[str], name: str) -> dict:
    """A --pre-copy job with `args` whose rank 1 moves once a spare is ready: its one ledger
    event, the job having ended exit 0 bitwise equal to the run without the move."""
    reference = train_reference(NPROC, STEPS, args)
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=args, name=name, run_args=["--pre-copy"])
    try:
        job.wait_step(5)
        job.wait_spare()
        job.client.migrate(1)
        assert job.wait(timeout=180) == 0, job.log()
        _equal_to(job, reference)
        (ev,) = job.events()
    finally:
        job.kill()
    return ev


def test_a_joiner_that_cannot_follow_takes_the_whole_state_bitwise(tmp_path, train_reference):
    """The script clips its weights after each optimizer step (as WGAN's critic does): the
    leaver's version counters see the parameters change outside the optimizer, the joiner
    says it cannot follow, and the move takes the whole state in its pause, bitwise."""
    ev = _pre_copied_move(tmp_path, train_reference, [*ARGS, "--clamp", "0.05"], "clamp")
    assert ev["kind"] == "planned" and ev["status"] == "resolved" and ev["steps_lost"] == 0, ev
    assert ev["pre_copy"]["ok"] is False and "other than the optimizer" in ev["pre_copy"]["detail"], ev
    assert "follow" not in ev["phases"] and ev["state_bytes"] > ev["pre_copy"]["base_bytes"] / 2, ev


def _no_spare_starting(st: dict) -> bool:
    return not any(s["state"] == "starting" for s in st["spares"])


@pytest.mark.parametrize("victim", ["joiner", "leaver", "survivor", "leaver-hung"])
def test_a_kill_during_a_pre_copy_falls_back_bitwise(tmp_path, train_reference, victim):
    """kill -9 while the joiner holds the leaver's copy and has not followed a step yet:
    - the joiner: the move is called off before any rank paused and runs again with the
      other spare (which follows and moves only the rank's own state);
    - the leaver: its rank is rebuilt from the survivors, the joiner taking it over;
    - a survivor: its rank is rebuilt, the move waits for the job to re-form and runs again;
    - the leaver hung (SIGSTOP): found by its missing heartbeats, then as killed.
    Each ends bitwise equal to the run without failures, exit 0."""
    reference = train_reference(NPROC, STEPS, ARGS)
    hold, mark = tmp_path / "hold", tmp_path / "following"
    hold.touch()
    env = {"PYTHONPATH": INJECT, "BATON_TEST_HOLD_FOLLOWING": str(hold), "BATON_TEST_FOLLOWING_MARK": str(mark)}
    expected = 3 if victim == "survivor" else 2
    # leashed: the ranks wait while a spare starts (a survivor's loss restarts the joiner as a
    # spare, and the move runs again only once one is ready: CI's job had ended by then)
    job = Job(tmp_path, nproc=NPROC, spares=2, steps=STEPS, script_args=ARGS, name=victim, env=env,
              run_args=["--pre-copy"], leash=4, leash_cap=STEPS - 2)
    try:
        job.wait_step(5)
        job.wait_until(lambda st: sum(s["state"] == "spare" for s in st["spares"]) == 2, timeout=120,
                       what="two spares ready", pull=_no_spare_starting)
        job.client.migrate(1)
        job.wait_until(lambda st: mark.exists() and mark.read_text(), timeout=120,
                       what="the joiner holding the leaver's copy")
        if victim == "joiner":
            os.kill(int(mark.read_text()), signal.SIGKILL)
        elif victim == "leaver-hung":
            job.signal_rank(1, signal.SIGSTOP)
        else:
            job.signal_rank(1 if victim == "leaver" else 2, signal.SIGKILL)
        hold.unlink()
        job.wait_until(lambda st: sum(e["status"] in ("resolved", "failed") for e in job.events()) >= expected,
                       timeout=240, what=f"{expected} moves ended", pull=_no_spare_starting)
        assert job.wait(timeout=240) == 0, job.log()
        _equal_to(job, reference)
        events = job.events()
    finally:
        job.kill()
    shape = [(e["kind"], e["status"]) for e in events]
    if victim == "joiner":
        assert shape == [("planned", "failed"), ("planned", "resolved")], events
        assert events[1]["pre_copy"]["ok"] and "follow" in events[1]["phases"], \
            f"pre_copy {events[1]['pre_copy']}, phases {events[1]['phases']}"
    elif victim.startswith("leaver"):
        assert shape == [("planned", "failed"), ("unplanned", "resolved")], events
        assert "superseded by the loss of its leaver" in events[0]["note"], events[0]
    else:
        assert shape == [("planned", "failed"), ("unplanned", "resolved"), ("planned", "resolved")], events
        assert events[1]["rank"] == 2 and events[2]["rank"] == 1, events
    assert all(e["steps_lost"] == 0 for e in events if e["status"] == "resolved"), events


def test_a_joiner_still_far_behind_when_the_ranks_pause_takes_the_whole_state(tmp_path, train_reference):
    """The joiner holds the leaver's copy but follows no step until after the pre-copy's
    deadline (--formation-timeout) has passed and the ranks have paused: replaying the steps
    it lacks inside the pause would cost about what they cost the ranks, so it takes the
    whole state instead. Bitwise, exit 0."""
    reference = train_reference(NPROC, STEPS, ARGS)
    hold, mark, end = tmp_path / "hold", tmp_path / "following", tmp_path / "end"
    hold.touch()
    end.touch()  # the ranks wait two steps before the end until the move is over, however fast they are
    env = {"PYTHONPATH": INJECT, "BATON_TEST_HOLD_FOLLOWING": str(hold), "BATON_TEST_FOLLOWING_MARK": str(mark),
           "BATON_TEST_HOLD_AT_STEP": str(STEPS - 2), "BATON_TEST_HOLD_FILE": str(end)}
    job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, name="behind", env=env,
              run_args=["--pre-copy", "--formation-timeout", "4"])
    try:
        job.wait_step(5)
        job.wait_spare()
        job.client.migrate(1)
        job.wait_until(lambda st: mark.exists(), timeout=120, what="the joiner holding the leaver's copy")
        job.wait_until(lambda st: all(r["state"] == "paused" for r in st["ranks"]), timeout=120,
                       what="the ranks paused for a joiner that never caught up")
        hold.unlink()
        job.wait_until(lambda st: any(e["status"] == "resolved" for e in job.events()), timeout=120,
                       what="the move resolved")
        end.unlink()
        assert job.wait(timeout=180) == 0, job.log()
        _equal_to(job, reference)
        (ev,) = job.events()
        log = job.log(tail=None)
    finally:
        job.kill()
    assert "did not catch up with their leavers" in log and "steps behind the pause's boundary" in log, log[-3000:]
    assert ev["kind"] == "planned" and ev["status"] == "resolved" and "follow" not in ev["phases"], ev


def test_a_joiner_whose_replay_is_as_slow_as_the_steps_gives_up():
    """A replay that takes most of a step (a spare sharing the ranks' CPU cores) would still be
    running when the ranks pause: after three steps the joiner says so and why."""
    from baton.worker.precopy import _cannot_keep_up

    assert _cannot_keep_up([(0.9, 1.0), (0.95, 1.0)]) == ""  # too early to judge
    assert _cannot_keep_up([(0.1, 1.0), (0.2, 1.0), (0.15, 0.9)]) == ""
    why = _cannot_keep_up([(0.1, 1.0), (0.9, 1.0), (0.95, 1.0), (1.2, 1.1)])
    assert "cannot keep up" in why and "0.950s" in why and "1.000s" in why, why


def test_a_pre_copy_whose_gradients_fill_mapped_buffers_is_bitwise(tmp_path, train_reference):
    """Layers wide enough (640x640 fp32: 1.6 MB) that each step's gradients go into the feed's
    buffers mapped ahead and reused (RecordBuffers.POOLED), not fresh clones: the joiner follows
    them and the move ends bitwise equal to the run without it."""
    ev = _pre_copied_move(tmp_path, train_reference, ["--width", "640", "--step-sleep", "0.02"], "wide")  # ARGS, wider
    assert ev["kind"] == "planned" and ev["status"] == "resolved" and ev["steps_lost"] == 0, ev
    assert ev["pre_copy"]["ok"] is True and ev["pre_copy"]["steps"] >= 1, ev


class _Tracked:
    """What a Feed reads of baton's tracked objects: a model and its optimizer."""

    def __init__(self, model, opt):
        self.objects, self.sharded = {"model": model, "opt": opt}, set()

    def optimizers(self):
        return [self.objects["opt"]]


def _fed_model():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # 2 MB weights
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_feeds_records_reuse_mapped_buffers_and_each_holds_its_own_steps_gradients():
    """The leaver copies each step's gradients into buffers mapped ahead (on a thread, once the
    base is served) and reused once a record is dropped; every record a joiner fetches, over a
    real socket, holds the gradients of its own step, never a later step's."""
    import time

    import torch

    from baton.transfer import codec
    from baton.transfer.client import SnapshotLink
    from baton.transfer.server import TransferServer, snapshot_key
    from baton.worker import precopy
    from baton.worker.precopy import Feed, record_key

    model, opt = _fed_model()
    server = TransferServer("tok")
    feed = Feed(server, 0, _Tracked(model, opt), op=7)
    link = SnapshotLink(server.address, "tok", 10.0)
    try:
        feed.serve_base({"x": 1}, (0, 0))
        buffers = feed.buffers
        deadline = time.monotonic() + 60  # the thread maps them beside this test
        while sum(len(v) for v in buffers._free.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        mapped = {t.data_ptr() for v in buffers._free.values() for t in v}
        assert mapped, "no buffer mapped ahead"
        steps = precopy.KEEP_RECORDS  # enough for records to be dropped and their buffers reused
        used = set()
        for step in range(steps):
            for i, p in enumerate(model.parameters()):  # in place, as zero_grad(set_to_none=False) and backward
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.fill_(float(step * 10 + i))
            feed.before_optimizer_step(0, opt, step, False)
            opt.step()
            feed.after_optimizer_step()
            feed.end_step(step)
            flat, _ = link.fetch(snapshot_key(feed.ids[1], record_key(7, 2 * step)))
            record = codec.decode(flat.meta, list(flat.tensors))
            assert record["kind"] == "optimizer_step" and record["step"] == step
            for i, g in enumerate(record["grads"]):
                assert torch.equal(g, torch.full_like(g, float(step * 10 + i))), (step, i)
            used |= {t.data_ptr() for t in server.get_snapshot(feed.ids[1], record_key(7, 2 * step)).tensors}
        assert mapped & used, "the buffers mapped ahead were never used"
        kept = [k for k in server.snapshot_steps(feed.ids[1])]
        assert 2 <= len(kept) < 2 * steps, kept  # old records dropped
        # a record still held by the server was not overwritten by a later step's gradients
        oldest = min(kept)
        flat, _ = link.fetch(snapshot_key(feed.ids[1], oldest))
        record = codec.decode(flat.meta, list(flat.tensors))
        if record["kind"] == "optimizer_step":
            g = record["grads"][0]
            assert torch.equal(g, torch.full_like(g, float(record["step"] * 10))), record["step"]
    finally:
        link.close()
        feed.close()
        server.close()


def test_a_followers_records_arrive_in_buffers_mapped_ahead_and_reused():
    """The joiner receives each record's large gradients into buffers it mapped ahead and takes
    back once the step was applied (a fresh 333 MB a step cost it its page faults, the last
    step's inside the pause); a buffer still held is never handed out again, and each record
    holds its own step's gradients."""
    import time

    import torch

    from baton.transfer import codec
    from baton.transfer.client import SnapshotLink
    from baton.transfer.server import TransferServer, snapshot_key
    from baton.worker.precopy import Feed, RecordBuffers, record_key

    model, opt = _fed_model()
    server = TransferServer("tok")
    feed = Feed(server, 0, _Tracked(model, opt), op=5)
    link = SnapshotLink(server.address, "tok", 10.0)
    received = RecordBuffers()
    try:
        feed.serve_base({"x": 1}, (0, 0))
        received.prepare([[(p.shape, p.dtype) for p in model.parameters()]], count=2)
        deadline = time.monotonic() + 60  # the thread maps them beside this test
        while sum(len(v) for v in received._free.values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        mapped = {t.data_ptr() for v in received._free.values() for t in v}
        assert len(mapped) == 4, "two sets of the two large gradients, mapped ahead"
        held: list = []
        for step in range(6):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, float(step * 10 + i))
            feed.before_optimizer_step(0, opt, step, False)
            opt.step()
            feed.after_optimizer_step()
            feed.end_step(step)
            flat, _ = link.fetch(snapshot_key(feed.ids[1], record_key(5, 2 * step)), pool=received)
            grads = codec.decode(flat.meta, list(flat.tensors))["grads"]
            large = [g for g in grads if g.numel() * g.element_size() >= RecordBuffers.POOLED]
            assert len(large) == 2 and {g.data_ptr() for g in large} <= mapped, "received into the mapped buffers"
            assert not {g.data_ptr() for g in large} & {g.data_ptr() for g in held}, "a held buffer handed out again"
            for i, g in enumerate(grads):
                assert torch.equal(g, torch.full_like(g, float(step * 10 + i))), (step, i)
            received.give_back(held)  # the step before was applied meanwhile: its buffers come back
            held = large
    finally:
        link.close()
        feed.close()
        received.close()
        server.close()


def test_an_applied_records_gradients_go_back_once_and_never_one_an_optimizer_kept():
    """After a replayed step, its gradients serve the next receive: each tensor once, and not
    one the optimizer holds in its state (a custom optimizer keeping the last gradient by
    reference would see it overwritten by a later step's)."""
    import torch

    from baton.worker.precopy import replay_optimizer_step, replayed_grads

    class KeepsLastGrad(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN201
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["last_grad"] = p.grad  # by reference
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    shared = torch.ones(4)
    plain = torch.optim.SGD([a, b], lr=0.1)
    record = {"grads": [shared, shared], "settings": [{}]}
    replay_optimizer_step(plain, record)
    assert replayed_grads(plain, record) == [shared]  # listed twice, given back once
    keeper = KeepsLastGrad([a], lr=0.1)
    record = {"grads": [torch.ones(4)], "settings": [{}]}
    replay_optimizer_step(keeper, record)
    assert replayed_grads(keeper, record) == []


def test_a_follower_waits_for_a_base_that_takes_longer_than_its_timeout_and_a_form_ends_the_wait():
    """The leaver's base comes once it reaches a boundary and copies its state: on a busy
    machine, later than a connection's timeout; the follower waits for it (a hot spare that
    gave up there stayed an ordinary spare until the next operation). A Form that comes first
    ends the wait at once: the move then takes the whole state."""
    import threading
    import time

    from baton.transfer.server import TransferServer
    from baton.worker.precopy import Feed, Follower

    model, opt = _fed_model()
    server = TransferServer("tok")
    feed = Feed(server, 0, _Tracked(model, opt), op=3)
    try:
        follower = Follower(server.address, "tok", 0, timeout=0.5, op=3)
        threading.Timer(2.0, feed.serve_base, args=({"replicated": {"w": model[0].weight.detach()}, "pos": [4, 0]}, (4, 0))).start()
        base = follower.fetch_base()
        assert follower.pos == (4, 0) and follower.base_s >= 1.5, follower
        assert base["replicated"]["w"].equal(model[0].weight), "the base is the leaver's state"
        follower.close()

        late = Follower(server.address, "tok", 0, timeout=0.5, op=4)  # a feed that never comes
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(_raised(late.fetch_base)))
        t0 = time.monotonic()
        waiting.start()
        time.sleep(1.5)  # past its timeout: still waiting
        assert waiting.is_alive() and not got
        late.wake()  # its Form came
        waiting.join(10)
        assert not waiting.is_alive() and got and got[0] is not None, got
        assert time.monotonic() - t0 < 8
        late.close()
    finally:
        feed.close()
        server.close()


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what ended the wait
        return exc
    return None
