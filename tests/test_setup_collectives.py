"""Collectives a script runs before its step loop (a seed broadcast from rank 0, an
all_gather_object, a barrier; a scatter of shards, a reduce to rank 0): the ranks that start
the job record what each gave them, rank 0's record goes to every spare with its assignment
(a rank's own to its successors where a result was the rank's own), and a spare's own setup
collectives are answered from it (its peers ran them long ago), in both modes."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.jobs import AWARE_TRAINING, Job
from tests.nocode_runs import NOCODE, exports, killed_in_step

INJECT = NOCODE.parent / "inject"

SETUP_COLLECTIVES = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
# rank 0 picks the seed and tells the others
seed = torch.randint(0, 1 << 30, (1,), generator=torch.Generator().manual_seed(7)) if rank == 0 \\
    else torch.zeros(1, dtype=torch.int64)
dist.broadcast(seed, 0)
torch.manual_seed(int(seed))
hosts = [None] * dist.get_world_size()
dist.all_gather_object(hosts, f"host-{rank}")
dist.barrier()
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
for epoch in range(6):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(), "seed": seed, "hosts": hosts},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("fault", ["0:30:SIGKILL", "1:30:SIGKILL"])
def test_a_successors_setup_collectives_are_answered_with_what_its_rank_saw(tmp_path, torchrun_reference,
                                                                            fault):
    """A seed broadcast from rank 0, an all_gather_object and a barrier before the loop: the
    successor's are answered from rank 0's record of them (handed over with its assignment),
    so a new rank 0 does not pick a seed of its own and a new rank 1 does not wait for peers
    that ran them long ago; both end bit for bit equal to torchrun."""
    _, _, job = killed_in_step(tmp_path, torchrun_reference, SETUP_COLLECTIVES, fault, where="MID_STEP")
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")]


SETUP_BY_RANK = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
made = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(256, 8, generator=made), torch.randn(256, 1, generator=made))
# rank 0 deals the shards out: each rank's own indices and its dropout seed
order = torch.randperm(len(data), generator=torch.Generator().manual_seed(11)).view(world, -1)
mine = torch.empty(order.shape[1], dtype=torch.int64)
dist.scatter(mine, list(order.unbind(0)) if rank == 0 else None, src=0)
config = [None]
dist.scatter_object_list(config, [{"seed": 100 + 7 * r, "lr": 0.05, "rank": r} for r in range(world)]
                         if rank == 0 else None, src=0)
# every rank tells rank 0 what it holds; rank 0 keeps the sums (the others' tensors change too)
sizes = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
dist.gather(torch.tensor([float(len(mine))]), sizes, dst=0)
total = torch.tensor([float(mine.sum())])
dist.reduce(total, dst=0)
# each rank swaps noise seeds with the others and keeps its slice of a reduced statistic
swapped = torch.empty(world, dtype=torch.int64)
dist.all_to_all_single(swapped, torch.arange(world, dtype=torch.int64) * 1000 + rank)
stat = torch.empty(2)
dist.reduce_scatter_tensor(stat, torch.arange(2.0 * world) * (rank + 1))
parts = torch.empty(2)
dist.reduce_scatter(parts, [torch.full((2,), float(rank + 3 * r)) for r in range(world)])
halves = [torch.empty(1) for _ in range(world)]
dist.all_to_all(halves, [torch.tensor([float(10 * rank + r)]) for r in range(world)])
# point to point: rank 0 hands rank 1 a token; a ring exchange, posted both ways before waiting
token = torch.tensor([float(100 + rank)])
if rank == 0:
    dist.send(token * 2, dst=1)
else:
    dist.recv(token, src=0)
ring = torch.empty(1)
for req in [dist.isend(torch.tensor([float(rank)]), (rank + 1) % world), dist.irecv(ring, (rank - 1) % world)]:
    req.wait()
batched = torch.empty(1)
for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([7.0 * rank]), (rank + 1) % world),
                                   dist.P2POp(dist.irecv, batched, (rank - 1) % world)]):
    req.wait()
torch.manual_seed(config[0]["seed"] + int(swapped.sum()))
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=config[0]["lr"])
for epoch in range(6):
    for x, y in DataLoader(Subset(data, mine.tolist()), batch_size=8, shuffle=True):
        torch.nn.functional.mse_loss(model(x) + stat.mean(), y).backward()
        opt.step()
        opt.zero_grad()
torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(), "mine": mine, "config": config,
            "sizes": sizes, "total": total, "swapped": swapped, "stat": stat, "parts": parts, "halves": halves,
            "token": token, "ring": ring, "batched": batched},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("fault", ["0:30:SIGKILL", "1:30:SIGKILL"])
def test_a_successors_setup_collectives_whose_result_is_its_ranks_own_are_answered_from_that_ranks_record(
        tmp_path, torchrun_reference, fault):
    """A setup that deals each rank its own: a scatter of data shards, a scatter_object_list
    of configs, a gather and a reduce to rank 0 (whose other ranks' tensors change too),
    all-to-alls and reduce-scatters (of tensors and of lists: gloo's work for a list's
    reduce-scatter has no future, which baton's group used to require), a send and receive,
    a ring of isend/irecv and a batch_isend_irecv (a successor's sends skipped, its receives
    answered). Each rank that
    starts the job keeps its own record; a successor of rank 0 and one of rank 1 are answered
    from their rank's, and the job ends bit for bit equal to torchrun, the collectives'
    results included."""
    ref, _, job = killed_in_step(tmp_path, torchrun_reference, SETUP_BY_RANK, fault, where="MID_STEP")
    theirs = exports(ref / "export", 2)
    assert not torch.equal(theirs[0]["mine"], theirs[1]["mine"])  # the ranks did get their own
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")]


MODEL_AWARE = """
import os, sys, torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import baton

job = baton.init()
seed = torch.tensor([1234 + job.rank])  # each rank's own: rank 0's wins
dist.broadcast(seed, 0)  # not skipped with `if not job.joined:`: a spare's is answered from rank 0's record
dist.barrier()
torch.manual_seed(int(seed))
""" + AWARE_TRAINING + """with open(os.path.join(sys.argv[1], f"seed-{os.getpid()}"), "w") as f:
    f.write(f"{job.rank} {int(seed)} {int(job.joined)}")
"""


def test_a_model_aware_spares_setup_collectives_are_answered_too(tmp_path):
    script = tmp_path / "aware.py"
    script.write_text(textwrap.dedent(MODEL_AWARE))
    out = tmp_path / "seeds"
    out.mkdir()
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, script_args=[str(out)],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MID_STEP": "1:20:SIGKILL",
                   "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired")})
    try:
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    seen = sorted(p.read_text() for p in out.iterdir())
    assert seen == ["0 1234 0", "1 1234 1"], seen  # the spare took rank 1 over and got rank 0's seed
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")]
