"""Hot spares (`baton run --hot-spares`): the spare mirrors the replicated state from one rank's
gradients at every step, and a lost rank's replacement takes only its own state and the
small state. Scripts in the shape of real ones (BatchNorm, dropout, SGD + StepLR, GradScaler
with bf16 autocast, validation with an all_reduce, rank 0's checkpoint; the nanoGPT-shaped
loop with AdamW, accumulation and clipping), bitwise against the failure-free run, exit 0.

A kill of the feeding rank or of the hot spare itself falls back to the ordinary paths:
another spare, or the whole state from a survivor; never a hang, never exit 0 with other
state."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.jobs import Job, check_resolved_exact
from tests.once import once

EPOCHS = Path(__file__).resolve().parent.parent / "baton" / "examples" / "epochs.py"
NPROC = 3
ARGS = ["--epochs", "3", "--augment", "--step-sleep", "0.04", "--val-sleep", "0.4"]


INJECT = str(Path(__file__).resolve().parent / "inject")  # see its baton_test_faults.py
FAST = ["--op-timeout", "2", "--heartbeat-timeout", "2"]


def _job(tmp: Path, name: str, spares: int = 1, hot: bool = True, run_args: list[str] | None = None,
         env: dict[str, str] | None = None, leash: int = 4) -> Job:
    """A job whose ranks run at most `leash` steps ahead of what the test last saw (Job): a
    new spare's start and its mirror's first steps fit before the end on any machine."""
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script_args=ARGS, name=name, script=EPOCHS,
               run_args=(["--hot-spares"] if hot else []) + (run_args or []), env=env, leash=leash)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "hot-spares", _reference)


def _reference(tmp):
    job = _job(tmp, "ref", spares=0, hot=False, leash=0)
    assert job.wait(timeout=180) == 0, job.log()
    return job.all_rank_params(NPROC)


def _mirroring(s: dict) -> bool:
    """A spare holds the feed's base: the ranks' next steps are what it follows (before, a
    leashed job's ranks wait for it: a spare starting costs the run no steps)."""
    return any(sp.get("hot", {}).get("state") in ("following", "current") for sp in s["spares"])


def _hot(job: Job, timeout: float = 120.0, but: int | None = None) -> dict:
    """Wait until a spare (other than pid `but`) keeps pace with the feeding rank; the job's status then."""
    return job.wait_until(lambda s: any(sp.get("hot", {}).get("state") == "current" and sp.get("pid") != but
                                        for sp in s["spares"]),
                          timeout=timeout, what="a hot spare keeping pace", pull=_mirroring)


def _lose(tmp_path, reference, name: str, rank: int, sig: int, run_args: list[str] | None = None) -> list[dict]:
    """Run the hot job, send `rank` `sig` once a spare keeps pace; the ledger of a run that ended
    exit 0 with every rank exact."""
    job = _job(tmp_path, name, run_args=run_args)
    try:
        job.wait_step(4)
        _hot(job)
        job.signal_rank(rank, sig)
        return check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()


def test_a_rank_lost_mid_step_is_rebuilt_from_the_hot_spares_mirror(tmp_path, reference):
    """kill -9 of a rank that does not feed: its replacement takes the replicated state from its
    mirror (only its own and the small state move), bitwise."""
    events = _lose(tmp_path, reference, "hot", 2, signal.SIGKILL)
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 2)], events
    hot = events[0]["hot_spare"]
    assert hot and hot["used"], events[0]
    assert events[0]["state_bytes"] < 20_000, events[0]  # the rank's own and the small state, not the model


def test_the_feeding_rank_lost_falls_back_or_uses_what_it_served(tmp_path, reference):
    """kill -9 of the rank that feeds the spare (rank 0, the lowest): the mirror holds every step it served;
    if it lacks the last, the replacement fetches the whole state from a survivor. Bitwise."""
    events = _lose(tmp_path, reference, "feeder", 0, signal.SIGKILL)
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 0)], events
    hot = events[0]["hot_spare"]
    assert hot is not None and (hot["used"] or hot["detail"]), events[0]


def test_a_hot_spare_killed_while_it_follows_is_replaced_and_the_next_loss_is_still_exact(tmp_path, reference):
    """kill -9 of the hot spare itself: a new spare starts and mirrors the state from the
    current feed; then a rank lost is rebuilt, bitwise."""
    job = _job(tmp_path, "spare-lost")
    try:
        job.wait_step(3)
        st = _hot(job)
        os.kill(st["spares"][0]["pid"], signal.SIGKILL)
        _hot(job, but=st["spares"][0]["pid"])  # a new one
        job.signal_rank(1, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 1)], events
    assert events[0]["hot_spare"]["used"], events[0]


def test_the_feeding_rank_hung_is_replaced_and_nothing_waits_on_it(tmp_path, reference):
    """SIGSTOP of the feeding rank: the spare's link to it stalls; the recovery takes the mirror
    if it reached the boundary, else the whole state from a survivor after a short wait. Bitwise."""
    events = _lose(tmp_path, reference, "feeder-hung", 0, signal.SIGSTOP, run_args=FAST)
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 0)] and "hung" in events[0]["cause"], events
    assert events[0]["hot_spare"] is not None, events[0]


def test_a_hot_spare_lost_while_it_takes_a_rank_over_leaves_it_to_the_next_one(tmp_path, reference):
    """Two hot spares; rank 2 is killed and the spare taking it over is killed too, as it is about
    to take its mirror's state: the other hot spare takes the rank over from its own mirror
    (the feed stopped where the recovery began; its records stay served). Bitwise."""
    hold, mark = tmp_path / "hold", tmp_path / "mark"
    hold.touch()
    job = _job(tmp_path, "joiner-lost", spares=2,
               env={"PYTHONPATH": INJECT, "BATON_TEST_HOLD_HOT_TAKE": str(hold), "BATON_TEST_HOT_TAKE_MARK": str(mark)})
    try:
        job.wait_step(3)
        job.wait_until(lambda s: sum(sp.get("hot", {}).get("state") == "current" for sp in s["spares"]) == 2,
                       timeout=120, what="two hot spares keeping pace")
        job.signal_rank(2, signal.SIGKILL)
        job.wait_until(lambda s: mark.exists() and mark.read_text().strip(), timeout=60,
                       what="the first hot spare about to take its mirror's state")
        os.kill(int(mark.read_text()), signal.SIGKILL)
        hold.unlink()
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("unplanned", 2)], events
    assert events[0]["hot_spare"]["used"], events[0]


# ---------------------------------------------------------------- the mirror's arithmetic, in process
class _Tied(torch.nn.Module):
    """An embedding and a head sharing one weight (nanoGPT's), a LayerNorm, a bias-free layer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.mid = torch.nn.Linear(6, 6, bias=False)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.ln(self.wte(idx))))


OPTIMIZERS = {
    "adamw-groups": lambda m: torch.optim.AdamW([{"params": [m.wte.weight, m.mid.weight], "weight_decay": 0.1},
                                                 {"params": list(m.ln.parameters()), "weight_decay": 0.0}],
                                                lr=3e-3, betas=(0.9, 0.95)),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("make", list(OPTIMIZERS), ids=list(OPTIMIZERS))
def test_the_mirror_follows_the_feeders_optimizer_bit_for_bit(make):
    """The spare's mirror, built from the feeder's base and stepped with its gradients, holds
    the feeder's parameters and optimizer state bit for bit, with a scheduler changing the rate
    every step and tied weights kept one tensor."""
    from baton.control import messages as m
    from baton.transfer import codec
    from baton.worker.hot import Mirror, mirror_plan
    from baton.worker.precopy import _settings, small_state
    from baton.worker.tracked import Tracked

    def wire(x):  # what crosses the socket: encoded, decoded into fresh tensors
        meta, tensors = codec.encode(x)
        return codec.decode(meta, [t.clone() for t in tensors])

    torch.manual_seed(0)
    model = _Tied()
    opt = OPTIMIZERS[make](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    tracked = Tracked()
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched)):
        tracked.add(name, obj)
    mirror = Mirror(m.Follow(op=1, source=("127.0.0.1", 1), feeder=0), "token", 1.0, lambda _: None)
    mirror._build(wire({"replicated": tracked.replicated(), "small": small_state(tracked), "pos": [0, 0],
                        "plan": mirror_plan(tracked)}))
    for step in range(6):
        loss = model(torch.randint(0, 11, (4, 5))).logsumexp(-1).mean()
        loss.backward()
        grads = [p.grad for g in opt.param_groups for p in g["params"]]
        mirror._apply(wire({"kind": "optimizer_step", "step": step, "opt": 0, "settings": _settings(opt),
                            "grads": [g.detach() for g in grads]}))
        opt.step()
        opt.zero_grad()
        sched.step()
        mirror._apply(wire({"kind": "step_end", "step": step, "small": small_state(tracked)}))
    assert not mirror.failed and mirror.pos == (6, 0)
    got = mirror.take((6, 0))
    assert isinstance(got, dict), got
    assert got["model"]["head.weight"] is got["model"]["wte.weight"]
    for key, value in model.state_dict().items():
        assert torch.equal(got["model"][key], value), key
    want = opt.state_dict()
    assert got["optimizer"]["param_groups"] == want["param_groups"]
    for index, entry in want["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][index][k]), torch.as_tensor(v)), (index, k)


def test_an_optimizer_outside_torch_optim_is_refused_with_its_name():
    from baton.worker.hot import mirror_plan
    from baton.worker.tracked import Tracked

    class Lion(torch.optim.SGD):  # a script's own optimizer class
        pass

    model = torch.nn.Linear(3, 1)
    tracked = Tracked()
    tracked.add("model", model)
    tracked.add("optimizer", Lion(model.parameters(), lr=0.1))
    plan = mirror_plan(tracked)
    assert "Lion" in plan["refused"] and "torch.optim" in plan["refused"], plan


def test_planned_moves_of_the_feeder_and_of_another_rank_then_a_loss_on_a_new_feed(tmp_path, reference):
    """--hot-spares through planned moves: rank 0 (the feeder) moves, then rank 1, each to the hot
    spare, which takes the replicated state from its mirror and only the leaver's own and the
    small state in the pause; after each the feed starts afresh from the new generation, a new
    spare mirrors it, and rank 2 lost is rebuilt from that mirror. With --pre-copy too, a move
    to a hot spare skips the pre-copy: the mirror is that copy already. Bitwise."""
    job = _job(tmp_path, "planned", spares=1, run_args=["--pre-copy"])  # a hot joiner needs no pre-copy
    try:
        job.wait_step(3)
        for rank in (0, 1):
            _hot(job)
            n = len(job.events())
            job.client.migrate(rank)
            job.wait_until(lambda s: len(job.events()) > n and job.events()[-1]["status"] == "resolved",
                           timeout=120, what=f"rank {rank}'s move resolved")
        _hot(job)
        job.signal_rank(2, signal.SIGKILL)
        events = check_resolved_exact(job, reference, timeout=240)
    finally:
        job.kill()
    assert [(e["kind"], e["rank"]) for e in events] == [("planned", 0), ("planned", 1), ("unplanned", 2)], events
    # A planned move's target may follow a boundary function (the pause lands after it), which
    # the mirror does not run: that move fetches the whole state and the ledger says why.
    assert all(e["hot_spare"]["used"] and e["state_bytes"] < 20_000 or e["kind"] == "planned" and
               "follows a boundary function" in e["hot_spare"]["detail"] for e in events), \
        [(e["kind"], e["rank"], e["state_bytes"], e["hot_spare"]) for e in events]
    assert events[-1]["hot_spare"]["used"] and events[-1]["state_bytes"] < 20_000, events[-1]
    assert all(e["pre_copy"] is None for e in events[:2]), events
