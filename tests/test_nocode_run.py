"""`baton run` on an unmodified torchrun script that logs at INFO: its own lines only, none of
baton's or of its HTTP client's (the four shapes' runs: test_nocode_moves)."""

from __future__ import annotations

import pytest

from tests.jobs import Job


ROOT_INFO = """
import logging, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

logging.basicConfig(level=logging.INFO)  # as hydra sets it up
log = logging.getLogger("train")
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(30):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    log.info("step %d", step)
dist.destroy_process_group()
"""


def test_a_script_logging_at_info_gets_its_own_lines_only(tmp_path):
    script = tmp_path / "info.py"
    script.write_text(ROOT_INFO)
    job = Job(tmp_path, nproc=2, spares=0, script=script, out_arg=False)
    try:
        assert job.wait(timeout=120) == 0, job.log()
    finally:
        job.kill()
    log = job.log(None)
    assert log.count("INFO:train:step 29") == 2, log[-2000:]
    assert "HTTP Request" not in log and "INFO:baton" not in log and "INFO:httpx" not in log, log[-2000:]


def _stopped(tmp_path, name: str, source: str) -> str:
    """`source` as `name` under `baton run` (2 ranks): it must end non-zero; its whole log."""
    script = tmp_path / name
    script.write_text(source)
    job = Job(tmp_path, nproc=2, spares=0, script=script, out_arg=False)
    try:
        assert job.wait(timeout=120) != 0, job.log()
    finally:
        job.kill()
    return job.log(None)


STATEFUL_HOOK = """
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
{register}
print("registered")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("register, expect", [
    ("model.register_comm_hook(powerSGD.PowerSGDState(process_group=None), powerSGD.powerSGD_hook)",
     "a comm hook with state of its own (PowerSGD's error feedback"),
    ("model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)",
     "a built-in comm hook runs in C++ on DDP's own group"),
])
def test_a_comm_hook_baton_cannot_move_is_refused_before_training(tmp_path, register, expect):
    """PowerSGD keeps error feedback and factors across steps inside the hook's state, and a
    built-in hook reduces in C++ over DDP's own group: either would diverge silently after a
    move, so the script stops at the registration, saying why and what works instead."""
    log = _stopped(tmp_path, "hooked.py", STATEFUL_HOOK.format(register=register))
    assert expect in log and "registered" not in log, log[-3000:]


FSDP1 = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("gloo")
model = FSDP(torch.nn.Linear(4, 1))
print("wrapped", flush=True)
dist.destroy_process_group()
"""


def test_fsdp1_is_refused_where_the_script_wraps_its_model(tmp_path):
    """FSDP1's flat shards are each rank's own and baton keeps no copy: a lost rank could not
    be rebuilt, so the script stops at the wrap, saying why and what to use (FSDP2's
    fully_shard, or --no-migration). (On this CPU machine FSDP1 itself would refuse to run.)"""
    log = _stopped(tmp_path, "fsdp1.py", FSDP1)
    assert "FullyShardedDataParallel (FSDP1) is not supported with no code change" in log, log[-3000:]
    assert 'fsdp1.py", line 6' in log and "wrapped" not in log, log[-3000:]


TWO_PHASES = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):  # a warm-up phase: the step loop baton finds
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("warm-up done", flush=True)
for step in range(5):  # the main phase, another loop
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("main done", flush=True)
dist.destroy_process_group()
"""


def test_a_second_loop_that_steps_the_optimizer_stops_the_job_saying_so(tmp_path):
    """The step loop is the one around the first optimizer.step(); a later phase in another
    loop would have boundaries baton does not know, so its first optimizer step ends the job
    non-zero, naming the rule (never a move that cannot be placed)."""
    log = _stopped(tmp_path, "phases.py", TWO_PHASES)
    assert "may step its optimizers in one loop only" in log and "phases.py:8" in log, log[-3000:]
    assert "phases.py\", line 15" in log, log[-3000:]  # the script's own line, in its traceback
    out = (tmp_path / "job" / "stdout.log").read_text()
    assert "warm-up done" in out and "main done" not in out, out


TWO_MODELS_IN_TURN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
G, D = DDP(torch.nn.Linear(4, 8)), DDP(torch.nn.Linear(8, 1))
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for it in range(5):  # a GAN's iteration: the discriminator's step, then the generator's
    fake = G(torch.randn(16, 4))
    (D(torch.randn(16, 8)).mean() - D(fake.detach()).mean()).backward()
    opt_d.step()
    opt_d.zero_grad()
    D(fake).mean().backward()
    opt_g.step()
    opt_g.zero_grad()
    print("iteration done", flush=True)
"""


def test_two_models_trained_in_turn_stop_the_job_saying_so(tmp_path):
    """A second backward after the iteration's first optimizer step (a GAN's generator after its
    discriminator) cannot be captured as one step: the job stops in the first iteration,
    naming the script's line, why, and `--no-migration`, never a run that could not move."""
    log = _stopped(tmp_path, "gan.py", TWO_MODELS_IN_TURN)
    assert "gan.py:13: a backward of a DistributedDataParallel model ran after optimizer.step()" in log, log[-3000:]
    assert "two models trained in turn" in log and "--no-migration" in log, log[-3000:]
    assert "iteration done" not in (tmp_path / "job" / "stdout.log").read_text()


STRAY_PARAMETER = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
log_scale = torch.nn.Parameter(torch.zeros(()))  # a learned loss scale, outside the model
opt = torch.optim.AdamW([*model.parameters(), log_scale], lr=0.1)
for step in range(5):
    loss = model(torch.randn(2, 4)).pow(2).mean() * log_scale.exp() - log_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("stepped", flush=True)
dist.destroy_process_group()
"""


def test_an_optimizer_training_a_parameter_outside_the_model_is_refused_before_training(tmp_path):
    """A parameter DDP does not hold gets no averaged gradient: its value and its optimizer
    state are each rank's own, and a successor, which takes the optimizer's state from the
    other ranks, trained on with theirs (seen: exit 0, every rank's model different from
    torchrun's after a kill). The first optimizer step stops the job, saying why and how."""
    log = _stopped(tmp_path, "stray.py", STRAY_PARAMETER)
    assert "the optimizer trains a parameter of shape [] that no DistributedDataParallel" in log, log[-3000:]
    assert "stray.py:12" in log and "register it on the model before wrapping it" in log and "stepped" not in log


NEW_PHASE = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(4):
    if epoch == 2:  # the second phase: a cosine decay over its steps
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for i in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if epoch >= 2:
            sched.step()
    print("epoch done", epoch, flush=True)
dist.destroy_process_group()
"""


def test_a_scheduler_made_after_the_step_loop_began_stops_the_job_saying_so(tmp_path):
    """A successor restored into a later epoch never runs the iteration that made it (seen:
    the job failed on the successor's NameError after a kill; a new optimizer instead left
    every later step without a boundary, and the loss stopped the job with a wrong cause)."""
    log = _stopped(tmp_path, "phases.py", NEW_PHASE)
    assert "phases.py:10: a CosineAnnealingLR was created after the step loop began" in log, log[-3000:]
    assert "SequentialLR" in log and "--no-migration" in log and "epoch done 2" not in log
