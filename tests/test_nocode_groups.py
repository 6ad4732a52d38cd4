"""A torchrun script's own process groups (`dist.new_group`, `dist.new_subgroups`) under
`baton run`, unchanged: they are live sub-groups of the job's group, formed again with it in
every generation. Their collectives in the setup are answered from the successor's own
rank's record (only the members got that result); in a step or a region they run live, and
a rank lost where a successor would need their results (after its optimizer step) stops the
job saying so, never exit 0 with other state."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.jobs import Job
from tests.nocode_runs import INJECT, differences, exports
from tests.test_nocode_moves import _cli

NPROC = 3
GROUPS = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "gloo", dist.get_backend()
host = dist.new_group([0, 1])  # say ranks 0 and 1 share a host, 1 and 2 a switch
switch = dist.new_group([1, 2])
far = dist.new_group([0, 2])
singles, _ = dist.new_subgroups(group_size=1)
dist.monitored_barrier()
seed = torch.tensor([17 * (rank + 1)])
if rank in (0, 1):
    dist.broadcast(seed, src=0, group=host)
if rank in (1, 2):
    dist.all_reduce(seed, group=switch)
if rank in (0, 2):
    dist.all_reduce(seed, group=far)
dist.all_reduce(torch.zeros(1), group=singles)
torch.manual_seed(int(seed))
made = torch.Generator().manual_seed(5)
data = TensorDataset(torch.randn(192, 8, generator=made), torch.randn(192, 1, generator=made))
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = DistributedSampler(data, seed=3)
host_loss = torch.zeros(1)
for epoch in range(6):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank in (0, 1):  # the host's mean loss, for its log
            shared = loss.detach().clone()
            dist.all_reduce(shared, group=host)
            host_loss += shared
        loss.backward()
        opt.step()
        opt.zero_grad()
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
            "seed": seed, "host_loss": host_loss}, os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)
"""


def _job(tmp_path, env: dict[str, str], **leash: int) -> tuple[Job, Path]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(GROUPS))
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    job = Job(tmp_path, nproc=NPROC, spares=1, script=script, out_arg=False, name="job",
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired"),
                   "EXPORT": str(run / "export"), **env}, **leash)
    return job, script


def _bitwise(torchrun_reference, script, run) -> None:
    ref = torchrun_reference(script, [], nproc=NPROC, env={"EXPORT": "{d}/export"})
    theirs = exports(ref / "export", NPROC)
    assert [int(t["seed"]) for t in theirs] == [85, 68, 85]  # each got its own groups' results
    for rank, (a, b) in enumerate(zip(theirs, exports(run / "export", NPROC))):
        assert differences(a, b) == [], f"rank {rank}"


@pytest.mark.parametrize("fault", ["1:20:SIGKILL", "2:20:SIGSTOP"])
def test_a_rank_of_a_scripts_own_groups_lost_mid_step_is_replaced_bit_for_bit(tmp_path, torchrun_reference, fault):
    """Rank 1, a member of both groups, killed -9 in a step after its host's all-reduce, or
    rank 2 hung: its successor's setup makes the same groups (answered from its own rank's
    record: the seed only its groups gave it), forms them with the survivors, runs the step
    again with them, and every rank ends bit for bit equal to torchrun's."""
    job, script = _job(tmp_path, {"BATON_TEST_SIGNAL_MID_STEP": fault})
    try:
        assert job.wait(timeout=170) == 0, job.log()
        events = job.events()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    assert [(e["kind"], e["status"], e["steps_lost"]) for e in events] == [("unplanned", "resolved", 0)], events
    _bitwise(torchrun_reference, script, tmp_path / "job")


def test_a_planned_move_of_a_groups_member_then_a_loss_in_the_joiners_first_step_are_bit_for_bit(
        tmp_path, torchrun_reference):
    """Rank 1 moves to a spare (its groups made again in the joiner's setup and formed at the
    boundary); the ranks hold there (leashed) until rank 0, the host group's source, is
    killed -9 in the next step, the joiner's first, after the joiner added the host's loss to
    the total it carries: the joiner runs that step again from the state it joined with.
    (That state was the very tensor the script then added to in place, so the step ran again
    from the sum: the job ended 0 with rank 1's total one loss too high.)"""
    go = tmp_path / "go"
    job, script = _job(tmp_path, {"BATON_TEST_SIGNAL_MID_STEP": "0:go:SIGKILL", "BATON_TEST_SIGNAL_GO": str(go)},
                       leash=2, leash_cap=30)  # the moves land before step 30 of 48 however slow the machine
    try:
        job.wait_step(6, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        job.wait_until(lambda st: st["operation"] is None and any(e["status"] == "resolved" for e in job.events()),
                       timeout=120, what="the planned move", pull=False)  # held at the move's boundary
        go.touch()
        assert job.wait(timeout=170) == 0, job.log()
        events = job.events()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == [
        ("planned", 1, "resolved", 0), ("unplanned", 0, "resolved", 0)], events
    assert events[1]["step"] == events[0]["step"] and events[1]["steps_rerun"] == 1, events
    _bitwise(torchrun_reference, script, tmp_path / "job")


def test_a_rank_lost_after_its_optimizer_step_where_its_step_ran_a_groups_collective_stops_the_job(tmp_path):
    """The successor of a rank lost after its last collective of a step runs that step again
    from the survivors' record of it; the host's all-reduce gave ranks 0 and 1 a result
    rank 2's record does not hold, so the step cannot be run again exactly: the job stops
    non-zero, saying so."""
    job, _ = _job(tmp_path, {"BATON_TEST_SIGNAL_AFTER_STEP": "1:20:SIGKILL"})
    try:
        code = job.wait(timeout=170)
        log = job.log(tail=None)
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), log[-3000:]
    assert code != 0, log[-3000:]
    assert "allreduce on a group of some ranks (dist.new_group)" in log, log[-3000:]
