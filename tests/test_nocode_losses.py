"""Lost ranks of unmodified torchrun scripts under `baton run`, beyond the four shapes'
(test_nocode_moves): a step wrapped in the script's own `try/except Exception`, and a module
global a function changes, end bit for bit equal to torchrun after a kill -9 inside a step.
A rank lost in the evaluation after the step loop is replaced there, bit for bit. Where a
loss cannot be absorbed exactly (a spare whose setup built other data) the job stops non-zero
saying why, with the move closed as
failed; and whatever the moment a kill lands, the job never ends 0 with state that
differs: it is exact, or it stops non-zero saying why."""

from __future__ import annotations

import re
import signal
import textwrap
import time

import pytest
import torch

from tests.jobs import Job
from tests.nocode_runs import INJECT, NOCODE, compare, differences, exports, faulted, killed_in_step, torchrun


def test_gradient_buckets_are_recorded_in_the_order_issued_whatever_order_they_complete_in():
    """gloo runs two collectives at once (two threads by default): a step's second bucket can
    complete first. A successor's buckets are answered in the order DDP issues them, so the
    record keeps that order, and serves only what completed (a bucket still running is not
    an answer). Seen: a kill after a step's optimizer step stopped the job with 'its collective
    #1 here is bucket of [1050625], theirs was bucket of [1116160]'."""
    from baton.worker.collectives import Record, Recorded

    rec = Record()
    first, second = rec.reserve(), rec.reserve()
    rec.ops[second] = Recorded("bucket", [torch.ones(3)])
    assert rec.served_ops()["ops"] == []
    rec.ops[first] = Recorded("bucket", [torch.zeros(5)])
    served = rec.served_ops()
    assert served["ops"] == ["bucket", "bucket"] and [t[0].numel() for t in served["outputs"]] == [5, 3]


def _self_killed(tmp_path, torchrun_reference, source: str, run_args: list[str] | None = None):
    """`source`, which kills itself once with SIGKILL where $KILL_MARK is set and missing (never
    under torchrun), exporting each rank's state to $EXPORT: run under torchrun and under
    baton. The kill fired; baton's exit code, the job and both runs' folders."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, name="job", run_args=run_args,
              env={"EXPORT": str(run / "export"), "KILL_MARK": str(tmp_path / "killed")})
    try:
        code = job.wait(timeout=170)
    finally:
        job.kill()
    assert (tmp_path / "killed").exists(), job.log()
    return code, job, ref, run


def _absorbed(code: int, job: Job, ref, run) -> None:
    """The job ended 0, every rank equal to torchrun's, one unplanned move resolved."""
    assert code == 0, job.log()
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


SWALLOWING = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
errors = 0
for epoch in range(6):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        try:  # a script that logs its own errors and goes on
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        except Exception as exc:
            errors += 1
            print("step failed, going on:", type(exc).__name__)
        opt.step()
        opt.zero_grad()
torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(), "errors": errors},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


GLOBAL_COUNTER = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

samples_seen = 0  # changed by train_step, which declares it global: not a variable of any loop


def train_step(model, opt, x, y):
    global samples_seen
    samples_seen += len(x)  # before the backward: a re-run of the step must not count it twice
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = DistributedSampler(data)
    first_targets = []  # made before the loops, changed in place by them: carried
    for epoch in range(8):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=8, sampler=sampler):
            first_targets.append(float(y[0]))
            train_step(model, opt, x, y)
    torch.save({"model": model.module.state_dict(), "samples_seen": samples_seen,
                "first_targets": torch.tensor(first_targets)},
               os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


main()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


EMA_AND_SAMPLER = """
import copy, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1)))
ema = copy.deepcopy(model.module).requires_grad_(False)  # an EMA of the weights, no DDP of its own
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
shuffle = torch.Generator().manual_seed(1234 + dist.get_rank())  # each rank its own order
loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data, generator=shuffle))
slow = [p.detach().clone() for p in model.parameters()]  # another average, kept as a list of tensors
seen_loss = torch.zeros(())  # a running total changed in place
for epoch in range(4):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        seen_loss.add_(loss.detach())  # before the backward: a re-run must not add it twice
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.state_dict().values(), model.module.state_dict().values()):
                e.copy_(e * 0.9 + p * 0.1) if e.is_floating_point() else e.copy_(p)
            for e, p in zip(slow, model.parameters()):
                e.lerp_(p, 0.01)
torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "shuffle": shuffle.get_state(),
            "slow": slow, "seen_loss": seen_loss, "rng": torch.get_rng_state()},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("source, fault", [
    (SWALLOWING, "1:40:SIGKILL"),  # the script's own try/except Exception around the step
    (GLOBAL_COUNTER, "0:50:SIGKILL"),  # a module global a function changes, rank 0 killed
    # State no interception sees: an EMA module updated after each step, the generator a
    # sampler shuffles with, an average kept as a list of tensors and a total changed in
    # place. Seen: each restarted from the setup's values in the new rank 0 (and the total
    # counted the re-run step twice in the survivor), and the job ended 0.
    (EMA_AND_SAMPLER, "0:45:SIGKILL"),
])
def test_a_step_that_swallows_the_error_changes_a_global_or_keeps_state_aside_is_still_exact(
        tmp_path, torchrun_reference, source, fault):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, fault, env={"EXPORT": str(run / "export")})
    assert code == 0, job.log()
    compare(ref, run)  # "errors", "samples_seen", "first_targets" included: what the failed attempt changed was undone
    assert [e["kind"] for e in job.events()] == ["unplanned"]


@pytest.mark.parametrize("where, fault", [("IN_REGION", "1:8:SIGKILL"), ("IN_REGION", "0:8:SIGSTOP"),
                                          ("IN_SAVE", "0:8:SIGKILL")])
def test_a_rank_lost_in_the_evaluation_or_checkpoint_after_the_step_loop_is_replaced_bit_for_bit(
        tmp_path, torchrun_reference, where, fault):
    """In imagenet's shape: the rank dies (or hangs) in validate()'s all_reduce after its epoch's
    step loop, or rank 0 dies writing its checkpoint. A survivor waiting in the all_reduce
    recovers inside it and issues it again; one that went on to the next epoch recovers in
    its step. The spare runs the region from the step loop's exit, its collectives (DDP's
    buffer broadcast, the meters' all_reduces) answered from the survivor's record, and
    joins where the record runs out. Every rank and the checkpoints rank 0 writes end equal
    to torchrun's."""
    args = ["--epochs", "5"]
    ref = torchrun_reference(NOCODE / "imagenet_main.py", [*args, "--out-dir", "{d}/out", "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / "imagenet_main.py", fault, where=where,
                         script_args=[*args, "--out-dir", str(run / "out"), "--export", str(run / "export")])
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    for name in ("checkpoint.pth.tar", "model_best.pth.tar"):
        written = [torch.load(d / "out" / name, weights_only=False) for d in (ref, run)]
        assert differences(*written) == [], name
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


@pytest.mark.parametrize("fault", ["1:8", "0:12"])
def test_a_region_collective_that_completed_on_some_ranks_only_is_answered_from_their_record(
        tmp_path, torchrun_reference, fault):
    """In imagenet's shape: a collective of validate() after the step loop completes on one
    rank and fails on the other (a data path dropping its last bytes), and no rank is lost.
    The group re-forms with the ranks one collective apart in the region; the rank behind
    takes that collective's result from the record of the rank ahead (the same on every
    rank) instead of issuing it again alone, and the job ends bit for bit as torchrun's."""
    args = ["--epochs", "5"]
    ref = torchrun_reference(NOCODE / "imagenet_main.py", [*args, "--out-dir", "{d}/out", "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / "imagenet_main.py", fault, where="GLITCH_IN_REGION",
                        script_args=[*args, "--out-dir", str(run / "out"), "--export", str(run / "export")],
                        env={"BATON_LOG": "INFO"})
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    written = [torch.load(d / "out" / "checkpoint.pth.tar", weights_only=False) for d in (ref, run)]
    assert differences(*written) == []
    log = job.log(tail=None)
    assert "recovery op=1" in log and "those behind answer the rest from the record" in log, job.log()
    assert job.events() == []  # no rank lost, no spare used: every rank re-formed where it stood


_LOADER_SETUP = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(100 + rank)
data_x, data_y = torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g)
loader = DataLoader(TensorDataset(data_x, data_y), batch_size=16, shuffle=True, generator=g)
"""
_EVAL_THEN_SAVE = """# after the loop: a last evaluation with a collective, then rank 0's checkpoint
model.eval()
with torch.no_grad():
    val = torch.nn.functional.mse_loss(model(data_x[:64]), data_y[:64]).detach()
dist.all_reduce(val)
final = {"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(), "it": it,
         "best": best, "val": val{extra}}
if rank == 0:
    torch.save(final, os.path.join(os.environ["OUT"], "ckpt.pt"))
torch.save(final, os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""
_STEP = """loss = torch.nn.functional.mse_loss(model(x), y)
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
best = min(best, loss.item())
"""  # the loop-exit scripts' step
BREAKS_OUT = _LOADER_SETUP + """it, best = 0, float("inf")
{loop}
""" + textwrap.indent(_STEP, " " * 4) + """    it += 1
    if it >= 24:
        break
else:
    it = -1  # never: the loop ends by its break
""" + _EVAL_THEN_SAVE.replace("{extra}", "")
WHILE_TRUE = """while True:  # nanoGPT's shape: random batches, a counter, a break at the end
    ix = torch.randint(0, 512, (16,))
    x, y = data_x[ix], data_y[ix]"""
FOR_LOADER = """for x, y in loader:  # 32 batches; the loop breaks at 24"""


@pytest.mark.parametrize("loop, where, fault", [
    (WHILE_TRUE, "IN_REGION", "1:20:SIGKILL"),
    (WHILE_TRUE, "IN_SAVE", "0:20:SIGKILL"),
    (FOR_LOADER, "IN_REGION", "0:20:SIGSTOP"),
])
def test_a_rank_lost_after_a_step_loop_that_ended_by_a_break_is_replaced_bit_for_bit(tmp_path, torchrun_reference,
                                                                                   loop, where, fault):
    """The step loop ends by its `break` (nanoGPT's `while True`, a loader loop cut short);
    the rank is lost in the evaluation after it or while rank 0 writes its checkpoint. The
    spare walks to the loop, leaves it by a break at once (nothing drawn, its else clause
    not run), takes the rank over at the loop's exit and runs the region: every rank and
    the checkpoint end equal to torchrun's."""
    _lost_after_the_loop(tmp_path, torchrun_reference, BREAKS_OUT.replace("{loop}", loop), where, fault, steps=24)


def _lost_after_the_loop(tmp_path, torchrun_reference, source: str, where: str, fault: str, steps: int,
                         env: dict[str, str] | None = None) -> Job:
    """`source` (writing $OUT/ckpt.pt on rank 0 and each rank's state to $EXPORT) under
    torchrun and under baton with the fault (and `env`): the job ended 0 after one resolved
    loss, and every rank and the checkpoint (its `it`: `steps`) equal torchrun's."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export", "OUT": "{d}"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, fault, where=where,
                        env={"EXPORT": str(run / "export"), "OUT": str(run), **(env or {})})
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    written = [torch.load(d / "ckpt.pt", weights_only=False) for d in (ref, run)]
    assert differences(*written) == [] and written[1]["it"] == steps
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()
    return job


RETURNS_OUT = _LOADER_SETUP + """

def train(max_steps):
    it, best, history = 0, float("inf"), []
    for epoch in range(10):  # 32 batches an epoch; training returns at max_steps, in the second
        for x, y in loader:
""" + textwrap.indent(_STEP, " " * 12) + """            history.append(loss.detach())
            it += 1
            if it >= max_steps:
                return it, best, torch.stack(history).mean()
            if not torch.isfinite(loss):
                break  # a loop that can also break: which way it ended is what the spare must know
    return -1, best, torch.zeros(())


it, best, mean = train(40)
""" + _EVAL_THEN_SAVE.replace("{extra}", ', "mean": mean')


RETURNS_THE_MODEL = RETURNS_OUT.replace("torch.stack(history).mean()\n", "torch.stack(history).mean(), model\n") \
    .replace("torch.zeros(())\n", "torch.zeros(()), model\n").replace("it, best, mean = train(40)",
                                                                     "it, best, mean, model = train(40)")
RETURNS_AN_OBJECT = RETURNS_OUT.replace("torch.stack(history).mean()\n", "torch.stack(history).mean(), loader\n") \
    .replace("torch.zeros(())\n", "torch.zeros(()), loader\n").replace("it, best, mean = train(40)",
                                                                      "it, best, mean, _ = train(40)")


RETURNS_FROM_ELSE = _LOADER_SETUP + """

def train(max_epochs):
    it, best = 0, float("inf")
    for epoch in range(10):
        for x, y in loader:  # 32 batches an epoch
""" + textwrap.indent(_STEP, " " * 12) + """            it += 1
        else:  # the epoch's close: training ends after max_epochs, from here
            if epoch + 1 >= max_epochs:
                return it, best
    return -1, best


it, best = train(2)
""" + _EVAL_THEN_SAVE.replace("{extra}", "")


@pytest.mark.parametrize("source, where, fault, steps", [(RETURNS_OUT, "IN_REGION", "1:36:SIGKILL", 40),
                                                         (RETURNS_THE_MODEL, "IN_SAVE", "0:36:SIGKILL", 40),
                                                         (RETURNS_FROM_ELSE, "IN_REGION", "1:60:SIGKILL", 64)])
def test_a_rank_lost_after_a_step_loop_that_ended_by_a_return_is_replaced_bit_for_bit(tmp_path, torchrun_reference,
                                                                                    source, where, fault, steps):
    """The step loop, in a function, ends by a `return` of its counters and a tensor in the
    epoch loop's second pass (its body can also break); the rank is lost in the evaluation
    after it or while rank 0 writes its checkpoint. The spare walks to the loop, returns at
    once what its predecessor returned (nothing drawn), takes the rank over there and runs
    the rest: every rank and the checkpoint end equal to torchrun's (it stopped the job
    before: which of the two ways the loop ended was not known). Where it returns the model
    too, the successor returns its own; where the loop's else clause returns (the epoch's
    close), the successor returns at its loop's head, the clause not run again."""
    assert source.count(", model\n") == 2 or source is not RETURNS_THE_MODEL
    _lost_after_the_loop(tmp_path, torchrun_reference, source, where, fault, steps=steps)


def test_a_rank_lost_in_the_region_while_the_survivor_still_stands_at_the_loops_last_head_is_replaced(
        tmp_path, torchrun_reference):
    """Rank 1's loop runs out at the head of step 64 and it is killed in the evaluation after
    it, while rank 0 (a busy machine's slower rank) still stands at that head, its loop not yet
    left: rank 0 serves no record of the region, none of which it ran. The successor takes the
    rank over at the loop's exit with what rank 0 holds at that head (the same schedulers and
    optimizer settings the exit had), rank 0 then leaves its loop at its next draw, and both
    run the region together: every rank and the checkpoint equal torchrun's (it stopped the
    job before: "the survivors hold no record of the region it was lost in")."""
    job = _lost_after_the_loop(tmp_path, torchrun_reference, RETURNS_FROM_ELSE, "IN_REGION", "1:60:SIGKILL",
                               steps=64, env={"BATON_TEST_LAG_AT_HEAD": "0:64", "BATON_LOG": "INFO"})
    log = job.log(None)
    assert "the survivors stand at the head rank 1's loop ended at (step 64)" in log, log[-6000:]
    assert "this one ends its loop at its next draw" in log, log[-6000:]


def test_a_rank_lost_after_a_step_loop_that_returned_an_object_stops_the_job(tmp_path):
    """The same loop returning its DataLoader too, an object baton does not carry: the spare
    cannot return what its predecessor did, and the job stops, naming it."""
    assert RETURNS_AN_OBJECT.count(", loader\n") == 2
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(RETURNS_AN_OBJECT))
    (tmp_path / "export").mkdir()
    code, job = faulted(tmp_path, script, "1:36:SIGKILL", where="IN_REGION",
                        env={"EXPORT": str(tmp_path / "export"), "OUT": str(tmp_path)})
    log = job.log(None)
    assert code != 0 and (tmp_path / "fired").exists(), log[-4000:]
    assert "had ended by a return of a value that cannot be carried" in log, log[-4000:]
    assert [e["kind"] for e in job.events()][-1] == "divergence", job.events()


@pytest.mark.parametrize("name, args, fault", [
    ("imagenet_main.py", ["--epochs", "4"], "1:10:SIGKILL"),
    ("nanogpt_train.py", ["--max_iters=40", "--eval_interval=20"], "0:15:SIGKILL"),
    ("trainer_ddp.py", ["12", "5"], "1:9:SIGSTOP"),
    ("trainer_ddp.py", ["12", "5"], "1:15:SIGKILL"),  # an epoch's last step: the others go on into the region
])
def test_a_rank_lost_after_its_optimizer_step_is_replaced_bit_for_bit(tmp_path, torchrun_reference, name, args,
                                                                     fault):
    """The rank dies (or hangs) right after its optimizer step: after its last collective of the
    step, before the lines after it (counters, meters, a scheduler) and the next head. The
    survivors finish that step and fail in the next one; the spare runs the lost step again
    from the rank's last head, with the survivors' record of it (parameters at the head, the
    gradient buckets, DDP's buffer broadcast), its optimizer step replaced by the survivors'
    result, and joins at the next head: every rank ends equal to torchrun's. The spare fetches
    that record while its script sets up, beside the state (the lost rank's own record of the
    next head, which holds no place in the script, says it will need it)."""
    outs = {"imagenet_main.py": ["--out-dir", "{d}/out"], "nanogpt_train.py": ["--out_dir={d}/out"],
            "trainer_ddp.py": ["--snapshot-path", "{d}/snapshot.pt"]}[name]
    ref = torchrun_reference(NOCODE / name, [*args, *outs, "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / name, fault, where="AFTER_STEP", env={"BATON_LOG": "INFO"},
                         script_args=[*args, *[a.format(d=run) for a in outs], "--export", str(run / "export")])
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()
    assert "the step to run again was fetched beside the state" in job.log(tail=None), job.log()



@pytest.mark.parametrize("name, args", [
    ("nanogpt_train.py", ["--max_iters=40", "--eval_interval=20", "--out_dir={d}/out"]),
    ("imagenet_main.py", ["--epochs", "4", "--out-dir", "{d}/out"]),
])
def test_a_rank_that_abandoned_a_step_the_others_completed_runs_it_again_from_their_record(
        tmp_path, torchrun_reference, name, args):
    """Rank 0's group fails after its last collective of step 15 and before its optimizer
    step, once rank 1 has completed the step (a data path re-formed under it, or a peer lost
    at the very end of the all-reduce; seen in CI: the job stopped). Recovery gives rank 0
    rank 1's result, but what its loop carried after the step (the batch prefetched for the
    next one, counters, timers) was never shared: it runs step 15 again from its head with
    rank 1's record of it, and every rank ends equal to torchrun's. No rank was lost."""
    ref = torchrun_reference(NOCODE / name, [*args, "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    go = tmp_path / "go"
    job = Job(tmp_path, nproc=2, spares=0, script=NOCODE / name, out_arg=False, name="job",
              script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_FAIL_AFTER_ALLREDUCE": "0:15",
                   "BATON_TEST_FAIL_AFTER_ALLREDUCE_GO": str(go), "BATON_LOG": "INFO"})
    try:
        job.wait_until(lambda s: any(r["rank"] == 1 and r["step"] >= 16 for r in s["ranks"]), timeout=170,
                       what="rank 1 past step 15")
        go.touch()
        code = job.wait(timeout=170)
        log, events = job.log(None), job.events()
    finally:
        job.kill()
    assert code == 0, log[-4000:]
    assert "injected: rank 0 loses step 15" in log and "running it again from its head" in log, log[-4000:]
    compare(ref, run)
    assert events == [], events


METERS_BY_NAME = """
import collections, contextlib, os, signal, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Meter:
    def __init__(self):
        self.sum, self.n = 0.0, 0

    def update(self, v, k=1):
        self.sum += v * k
        self.n += k

    @property
    def avg(self):
        return self.sum / max(self.n, 1)


def train(model, opt, loader, accum, meters, history, rank, epoch):
    for i, (x, y) in enumerate(loader):
        sync = (i + 1) % accum == 0
        with contextlib.nullcontext() if sync else model.no_sync():  # DDP's own accumulation
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            if rank == 0 and epoch == 2 and i == 5 and os.environ.get("KILL_MARK") and \\
                    not os.path.exists(os.environ["KILL_MARK"]):
                open(os.environ["KILL_MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
        meters["loss"].update(loss.item(), len(x))
        meters["batches"].update(1.0)
        if sync:
            opt.step()
            opt.zero_grad()
            history.append(meters["loss"].avg)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    meters, history = collections.defaultdict(Meter), []  # meters made as they are first used
    for epoch in range(4):
        sampler.set_epoch(epoch)
        train(model, opt, loader, 4, meters, history, rank, epoch)
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                "history": torch.tensor(history), "meters": {k: (m.sum, m.n) for k, m in meters.items()}},
               os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do


if __name__ == "__main__":
    main()
"""


ACCUMULATING_FOR = """
import os, signal, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Jittered(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):  # no loader workers: this draws from the process's own stream
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = Jittered()
sampler = DistributedSampler(data)
accum = 4  # an optimizer step every 4 batches of the loader loop (HF examples' shape)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):
        loss = torch.nn.functional.mse_loss(model(x), y) / accum
        if dist.get_rank() == 1 and epoch == 1 and i == 6 and os.environ.get("KILL_MARK") and \\
                not os.path.exists(os.environ["KILL_MARK"]):  # killed in its step's third batch
            open(os.environ["KILL_MARK"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""

ACCUMULATING_WHILE = """
import os, signal, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X, Y = torch.randn(256, 8), torch.randn(256, 1)
accum, it, running = 4, 0, 0.0
while it < 120:
    ix = torch.randint(0, 256, (8,))
    loss = torch.nn.functional.mse_loss(model(X[ix]), Y[ix]) / accum
    running += loss.item()
    if dist.get_rank() == 0 and it == 22 and os.environ.get("KILL_MARK") and \\
            not os.path.exists(os.environ["KILL_MARK"]):
        open(os.environ["KILL_MARK"], "w").close()  # rank 0, killed in its step's third iteration
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    if (it + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
    it += 1
torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(), "running": torch.tensor(running)},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("source", [ACCUMULATING_FOR, ACCUMULATING_WHILE, METERS_BY_NAME],
                         ids=["for", "while", "no_sync-and-meters-by-name"])
def test_a_step_accumulating_over_several_iterations_runs_again_from_its_first(tmp_path, torchrun_reference, source):
    """The step loop iterates micro-batches and steps the optimizer every fourth: a step spans
    four iterations. A rank killed in the third runs the whole step again: the survivor from
    the step's first head, handed again the three items it had drawn, each with the streams
    as drawing it left them (the loader's dataset draws noise: the dropout after it must draw
    the same masks). Seen: the survivor ran the step from its current item only and the job
    stopped on mismatched collectives; and, with one item a step, the re-run's dropout drew
    other masks, exit 0. The third accumulates with DDP's no_sync() and keeps its meters in a
    `defaultdict(Meter)`, put back by name into the successor's own (seen: restored as plain
    dicts, the script failed on `meters["loss"].update(...)`)."""
    _absorbed(*_self_killed(tmp_path, torchrun_reference, source))


OWN_SAMPLER = """
import os, signal, numpy as np, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset


class ShardSampler(Sampler):  # the script's own: a new permutation from its own generator each pass
    def __init__(self, n, rank, world, seed):
        self.n, self.rank, self.world = n, rank, world
        self.rng = np.random.default_rng(seed)
        self.passes = 0

    def __iter__(self):
        self.passes += COUNTS
        return iter(self.rng.permutation(self.n)[self.rank::self.world].tolist())

    def __len__(self):
        return self.n // self.world


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
    loader = DataLoader(data, batch_size=8, sampler=ShardSampler(128, rank, 2, 5))
    for epoch in range(4):
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if rank == 1 and epoch == 2 and i == 3 and os.environ.get("KILL_MARK") and \\
                    not os.path.exists(os.environ["KILL_MARK"]):
                open(os.environ["KILL_MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            opt.zero_grad()
    torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(),
                "sampler": loader.sampler.rng.bit_generator.state["state"]["state"] % 2**62},
               os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("counts", [0, 1], ids=["own-generator", "pass-counter"])
def test_a_scripts_own_sampler_is_carried_or_the_job_stops_saying_why(tmp_path, torchrun_reference, counts):
    """A sampler of the script's own that shuffles with its own numpy generator, rank 1 killed in
    the third epoch: the generator is put back at the epoch's head before the successor's
    sampler draws its permutation (seen: it drew from the setup's state, exit 0). One that
    also counts its passes in an attribute cannot be brought there by a walk: the job stops
    non-zero, naming that cause."""
    code, job, ref, run = _self_killed(tmp_path, torchrun_reference, OWN_SAMPLER.replace("COUNTS", str(counts)))
    if counts:
        assert code != 0 and "a count of its passes" in job.log(), job.log()
        return
    assert code == 0, job.log()
    compare(ref, run)


_SHARDED_SETUP = """
import os, signal, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 2))
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
"""  # FSDP2 over a 1-d mesh of the two ranks

SHARDED_EMA = _SHARDED_SETUP + """ema = [p.detach().clone() for p in model.parameters()]  # DTensors: this rank's shards of an average
torch.manual_seed(1 + rank)
for it in range(60):
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
    if rank == 1 and it == 30 and os.environ.get("KILL_MARK") and not os.path.exists(os.environ["KILL_MARK"]):
        open(os.environ["KILL_MARK"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.lerp_(p, 0.1)
torch.save({"model": {k: v.to_local() for k, v in model.state_dict().items()}, "ema": [e.to_local() for e in ema],
            "rng": torch.get_rng_state()}, os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


def test_a_sharded_average_of_an_fsdp2_model_moves_by_its_shards(tmp_path, torchrun_reference):
    """An FSDP2 script keeps an EMA as a list of DTensors (each rank's shards), changed in
    place after each step; rank 1 is killed mid-step and rebuilt from its buddy's copy. The
    EMA's shards come with its record (seen: never copied, since an in-place op on a DTensor
    bumps its own version counter, not its shard's; and `e`, the comprehension's variable in
    the export, made the loop's `e` look live: a DTensor the codec could not carry)."""
    _absorbed(*_self_killed(tmp_path, torchrun_reference, SHARDED_EMA, run_args=["--redundancy", "1"]))


SHARDED_ACCUMULATING = _SHARDED_SETUP + """sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 2))
sampler = DistributedSampler(data, seed=3)
it, running, history = 0, 0.0, []
for epoch in range(3):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):  # 16 batches: 8 steps of 2
        loss = torch.nn.functional.mse_loss(model(x), y) / 2
        loss.backward()
        running += loss.item()
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            history.append(running)
            running, it = 0.0, it + 1
local = lambda v: v.to_local() if hasattr(v, "to_local") else v
torch.save({"model": {k: local(v) for k, v in model.state_dict().items()},
            "opt": [{k: local(v) for k, v in st.items()} for st in opt.state.values()],
            "sched": sched.state_dict(), "rng": torch.get_rng_state(), "it": it, "history": torch.tensor(history)},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("fault, lag", [("1:5:SIGKILL", None), ("0:5:SIGKILL", None), ("1:5:SIGKILL", "0:6")])
def test_a_sharded_rank_lost_after_its_last_collective_of_a_step_is_replaced_by_running_that_step_again(
        tmp_path, torchrun_reference, fault, lag):
    """FSDP2, two micro-batches a step from a DataLoader with a DistributedSampler, clipping,
    a scheduler, a running loss and a history the loop carries: a rank killed -9 right after
    its optimizer step of step 5 (after its last collective: its shards after that step
    existed only in it). The survivor goes back to its own copy of step 5's head, the step's
    two batches handed again with the variables that head had, and every rank runs step 5
    again with the spare, which took the lost rank's copy from its buddy: every rank ends
    equal to torchrun's (it stopped the job before). With `lag` the survivor learns of the
    loss standing at step 6's head, not in step 6's first collective."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SHARDED_ACCUMULATING))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    env = {"EXPORT": str(run / "export"), "BATON_LOG": "INFO", **({"BATON_TEST_LAG_AT_HEAD": lag} if lag else {})}
    code, job = faulted(tmp_path, script, fault, where="AFTER_STEP", env=env)
    log = job.log(None)
    assert code == 0 and (tmp_path / "fired").exists(), log[-6000:]
    compare(ref, run)
    where = "at a head" if lag else "in a step"
    assert f"{where}: back from the head of step 6 to the head of step 5" in log, log[-6000:]
    events = job.events()
    assert [(e["kind"], e["status"], e["steps_rerun"]) for e in events] == [("unplanned", "resolved", 1)], events


def test_a_rank_of_the_fsdp2_example_lost_after_its_last_collective_of_a_step_is_replaced(tmp_path, torchrun_reference):
    """The FSDP2 example's shape (a `range` loop drawing its batches with torch.randint,
    clip_grad_norm_, AdamW, rank 0's checkpoint after the loop): rank 0 killed -9 right
    after its optimizer step of step 8. The survivor and the spare run step 8 again, the
    same batch drawn from the streams the head had: every rank equal to torchrun's."""
    args = ["--iterations", "20", "--checkpoint-dir", "{d}/ck"]
    ref = torchrun_reference(NOCODE / "fsdp2_example.py", [*args, "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / "fsdp2_example.py", "0:8:SIGKILL", where="AFTER_STEP",
                        script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")],
                        env={"BATON_LOG": "INFO"})
    log = job.log(None)
    assert code == 0 and (tmp_path / "fired").exists(), log[-6000:]
    compare(ref, run)
    assert "back from the head of step 9 to the head of step 8" in log, log[-6000:]


def test_a_sharded_rank_lost_after_the_last_step_of_an_epoch_stops_the_job_saying_why(tmp_path):
    """The same script, its rank 1 killed after its optimizer step of step 7, the first
    epoch's last: the step to run again ran in the loop's earlier pass, which this version
    cannot go back into. The job stops non-zero, saying so (never a step run on other items)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SHARDED_ACCUMULATING))
    (tmp_path / "export").mkdir()
    code, job = faulted(tmp_path, script, "1:7:SIGKILL", where="AFTER_STEP", env={"EXPORT": str(tmp_path / "export")})
    log = job.log(None)
    assert code != 0 and (tmp_path / "fired").exists(), log[-6000:]
    assert "which ran in an earlier pass of" in log, log[-6000:]
    assert [e["kind"] for e in job.events()][-1] == "divergence", job.events()


LOGS_AFTER_STEP = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
mean_losses = []
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # after the optimizer step: the mean loss, for the log
        mean_losses.append(float(logged) / dist.get_world_size())
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
            "losses": torch.tensor(mean_losses)}, os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


EMA_TRAINER = """
import copy, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:  # the model's EMA and the loader live on `self`; a global module a function updates too
    def __init__(self):
        torch.manual_seed(0)
        self.model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
        self.ema = copy.deepcopy(self.model.module).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        self.loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))

    def _run_batch(self, x, y):
        with torch.no_grad():  # updated before the step too: the successor starts it from the head
            for e, p in zip(self.ema.parameters(), self.model.module.parameters()):
                e.lerp_(p, 0.05)
        track_output(self.model.module, x)
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.model.module.parameters()):
                e.lerp_(p, 0.1)

    def train(self, epochs):
        for epoch in range(epochs):
            self.loader.sampler.set_epoch(epoch)
            for x, y in self.loader:
                self._run_batch(x, y)


output_stats = torch.nn.BatchNorm1d(1, affine=False)  # a module-level global only a function uses


def track_output(model, x):
    with torch.no_grad():
        output_stats(model(x))


dist.init_process_group("gloo")
trainer = Trainer()
trainer.train(4)
torch.save({"model": trainer.model.module.state_dict(), "ema": trainer.ema.state_dict(),
            "output_stats": output_stats.state_dict(), "rng": torch.get_rng_state()},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


def test_an_ema_on_self_is_exact_through_a_rank_lost_after_its_optimizer_step(tmp_path, torchrun_reference):
    """A Trainer whose EMA (`self.ema`, a plain module) changes before and after the optimizer
    step, and a module-level BatchNorm that a function feeds the outputs to: the rank dies
    right after its optimizer step, and the successor runs that step again from both as
    they were at the step's head, not as the survivors hold them after."""
    killed_in_step(tmp_path, torchrun_reference, EMA_TRAINER, "1:21:SIGKILL")


@pytest.mark.parametrize("fault", ["1:25:SIGKILL", "0:33:SIGSTOP"])
def test_a_collective_after_the_optimizer_step_is_recorded_and_retried(tmp_path, torchrun_reference, fault):
    """A script that all-reduces its loss for the log after its optimizer step (and steps its
    scheduler): the rank dies (or hangs) right after its optimizer step, so the survivor fails
    in that all_reduce. It recovers there and issues it again; the spare runs the step again
    from the rank's head up to that all_reduce, joins there, and every rank ends equal to
    torchrun's, the logged losses included."""
    *_, job = killed_in_step(tmp_path, torchrun_reference, LOGS_AFTER_STEP, fault)
    events = job.events()
    assert [(e["kind"], e["status"]) for e in events] == [("unplanned", "resolved")], events
    # The ledger says the successor ran the step again, and for how long (not a hidden cost).
    assert re.fullmatch(r"ran step \d+ again, which its predecessor was lost after \(\d+\.\d{3}s\)",
                        events[0]["note"]), events[0]



@pytest.mark.parametrize("fault", ["1:25", "0:33"])
def test_a_collective_after_the_optimizer_step_that_completed_on_some_ranks_only_is_answered_from_their_record(
        tmp_path, torchrun_reference, fault):
    """The loss all-reduced for the log after the optimizer step completes on one rank and
    fails on the other (a data path dropping its last bytes), no rank lost: the rank ahead
    goes on into the next step and fails there; the group re-forms with one rank at the next
    step's head and the other short of that collective. The rank behind takes its result from
    the record of the rank ahead and goes on to the head, where they go on together, bit for bit."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LOGS_AFTER_STEP))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, fault, where="GLITCH_AFTER_STEP",
                        env={"EXPORT": str(run / "export"), "BATON_LOG": "INFO"})
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    assert "those behind answer the rest from the record of a rank at the head" in job.log(tail=None), job.log()
    compare(ref, run)
    assert job.events() == []  # no rank lost, no spare used

EPOCH_END = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
epochs_done, best = 0, float("inf")
for epoch in range(4):
    sampler.set_epoch(epoch)
    running = 0.0
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
    sched.step()  # the epoch's end: no collective here, so the survivors go on to the next epoch
    epochs_done, best = epoch + 1, min(best, running)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(os.environ["EXPORT"], "ckpt.pt"))
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "rng": torch.get_rng_state(), "epochs": epochs_done, "best": best},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("fault", ["1:15:SIGKILL", "0:31:SIGKILL"])
def test_a_rank_lost_after_an_epochs_last_step_is_replaced_bit_for_bit(tmp_path, torchrun_reference, fault):
    """The rank dies right after the optimizer step of its epoch's last step. The epoch's end
    runs no collective, so the survivors leave the step loop, step the scheduler, write the
    checkpoint and fail in the next epoch's first step: the spare runs the lost step again,
    leaves the loop as they did, runs the epoch's end with them and joins at the next epoch's
    first head. (With an evaluation that all-reduces, the survivors wait in it instead:
    test_a_rank_lost_after_its_optimizer_step_is_replaced_bit_for_bit, trainer_ddp.py.)"""
    ref, run, job = killed_in_step(tmp_path, torchrun_reference, EPOCH_END, fault)
    written = [torch.load(d / "export" / "ckpt.pt") for d in (ref, run)]
    assert differences(*written) == [] and written[1]["epoch"] == 3
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()



@pytest.mark.parametrize("name, args", [
    ("trainer_ddp.py", ["12", "5", "--snapshot-path", "{d}/snapshot.pt"]),
    ("imagenet_main.py", ["--epochs", "4", "--out-dir", "{d}/out"]),
])
def test_a_rank_lost_as_its_step_loop_ends_is_replaced_at_that_head(tmp_path, torchrun_reference, name, args):
    """The rank dies as its epoch's step loop ends (its iterator ran out), after its record
    of that last head reached its buddy and before it entered the evaluation, where the
    survivor waits in its first collective. Its successor takes over at that head, while the
    survivor stands in the region after it: the new generation's ranks stand at different
    places, but the successor's loop ends at its next draw as theirs did, so it goes on into
    the evaluation and runs it with them (it stopped the job before; seen in CI after a kill
    from outside). Every rank ends equal to torchrun's."""
    ref = torchrun_reference(NOCODE / name, [*args, "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / name, "1:8:SIGKILL", where="AT_EXIT", env={"BATON_LOG": "INFO"},
                        script_args=[*[a.format(d=run) for a in args], "--export", str(run / "export")])
    log = job.log(None)
    assert code == 0 and (tmp_path / "fired").exists(), log[-4000:]
    assert "at its step loop's exit" in log and "this one ends its loop at its next draw" in log, log[-4000:]
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


_SAMPLED_SETUP = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
sampler = DistributedSampler(data)
"""
LAST_INDEX_READ_AFTER = _SAMPLED_SETUP + """means, tags = [], []
for epoch in range(4):
    sampler.set_epoch(epoch)
    running = 0.0
    for i, (x, y) in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):
        tag = f"e{epoch}b{i}"
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
    mean = torch.tensor([running / (i + 1)]){after}  # the loop's own target, read after it
    dist.all_reduce(mean)  # the epoch's mean loss over the ranks: the survivor waits here
    means.append(float(mean))
    tags.append(tag)
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
            "means": torch.tensor(means), "tags": ",".join(tags)},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


def test_a_successor_at_the_head_where_its_loop_ends_gets_the_loop_index_the_code_after_reads(
        tmp_path, torchrun_reference):
    """As above, in a loop whose code after it reads the loop's own target (`running / (i + 1)`,
    the last index: only the predecessor's last item bound it). The head carries it, so the
    successor taking over there gets it back as its loop ends, runs the epoch's all-reduce
    with the survivor and every rank ends equal to torchrun's (it stopped the job before)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LAST_INDEX_READ_AFTER.replace("{after}", "")))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, "1:8:SIGKILL", where="AT_EXIT",
                        env={"EXPORT": str(run / "export"), "BATON_LOG": "INFO"})
    log = job.log(None)
    assert code == 0 and (tmp_path / "fired").exists(), log[-4000:]
    assert "this one ends its loop at its next draw" in log, log[-4000:]
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


def test_a_successor_at_the_head_where_its_loop_ends_stops_where_the_code_after_reads_the_last_batch(tmp_path):
    """The same, the code after the loop reading the last batch (`x`) too: a tensor the head
    does not carry (a copy of every batch at every head), so the successor stops the job,
    naming it, rather than go on with its own."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LAST_INDEX_READ_AFTER.replace("{after}", " + 0 * x.sum()")))
    (tmp_path / "export").mkdir()
    code, job = faulted(tmp_path, script, "1:8:SIGKILL", where="AT_EXIT", env={"EXPORT": str(tmp_path / "export")})
    log = job.log(None)
    assert code != 0 and (tmp_path / "fired").exists(), log[-4000:]
    assert "where the loop's items ran out, and its target x, read after the loop" in log, log[-4000:]
    assert [e["kind"] for e in job.events()][-1] == "divergence", job.events()


WITH_ELSE = _SAMPLED_SETUP + """means, epochs_closed, it = [], 0, 0
for epoch in range(4):
    sampler.set_epoch(epoch)
    running = 0.0
    {loop}
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
        it += 1
    else:  # the epoch's close, on what its loop carried
        epochs_closed += 1
        means.append(running * epochs_closed)
        running = -running
    mean = torch.tensor([running])
    dist.all_reduce(mean)  # the epoch's sum over the ranks: the survivor waits here
    means.append(float(mean))
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
            "means": torch.tensor(means), "closed": epochs_closed, "it": it},
           os.path.join(os.environ["EXPORT"], f"rank{rank}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""
FOR_ELSE = "for x, y in DataLoader(data, batch_size=8, sampler=sampler):  # 8 steps an epoch"
WHILE_ELSE = ("while it < 8 * (epoch + 1):  # nanoGPT's random batches, 8 an epoch\n"
              "        ix = torch.randint(0, 128, (8,))\n"
              "        x, y = data.tensors[0][ix], data.tensors[1][ix]")


@pytest.mark.parametrize("loop, where, fault", [(FOR_ELSE, "AT_EXIT", "1:8:SIGKILL"),
                                                (FOR_ELSE, "IN_REGION", "0:8:SIGKILL"),
                                                (WHILE_ELSE, "IN_REGION", "1:8:SIGKILL")])
def test_a_rank_lost_as_or_after_a_step_loop_with_an_else_clause_ends_is_replaced_bit_for_bit(
        tmp_path, torchrun_reference, loop, where, fault):
    """The step loop has an else clause that closes the epoch on what the loop carried. A
    rank lost as a `for` loop's items run out (its successor takes over at that head): the
    successor runs the clause itself, with the head's values. A rank lost in the region
    after it (the predecessor ran the clause before its record of the exit): the successor
    leaves its loop by a break, the clause's changes coming with that record (a `while`
    loop's too). Every rank ends equal to torchrun's. The first and the last stopped the job
    before; in the second the successor ran the clause again (its changes then overwritten
    by the record; a collective there would have had no group yet)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(WITH_ELSE.replace("{loop}", loop)))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, fault, where=where, env={"EXPORT": str(run / "export")})
    assert code == 0 and (tmp_path / "fired").exists(), job.log(None)[-4000:]
    compare(ref, run)
    assert exports(run / "export", 2)[0]["closed"] == 4
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


_SPLIT = """
import os, random, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
{seeding}
data = TensorDataset(torch.randn(400, 8), torch.randn(400, 1))
train = Subset(data, random.sample(range(400), 320))
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = DistributedSampler(train)
for epoch in range(400):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(train, batch_size=16, sampler=sampler):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""
UNSEEDED_SPLIT = _SPLIT.format(seeding="# the split below draws from Python's random: seeded anew in every process")


def test_a_successor_whose_setup_built_other_data_stops_the_job(tmp_path):
    """The exit-0 divergence of an unseeded split: the successor would train on another
    partition while every check of the moved state passed. It is found where the nest starts."""
    script = tmp_path / "split.py"
    script.write_text(textwrap.dedent(UNSEEDED_SPLIT))
    code, job = faulted(tmp_path, script, "1:30:SIGKILL")
    log = job.log(None)
    assert code != 0, log[-3000:]
    assert "not deterministic" in log and "what `train` will yield" in log, log[-3000:]
    events = job.events()
    assert [e["kind"] for e in events] == ["unplanned", "divergence"], events
    assert events[0]["status"] == "failed"


SEEDED_BY_PROCESS = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(os.getpid())  # this process's own seed: a successor's setup draws other numbers
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(0)
for step in range(400):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


def test_a_successor_whose_left_out_initialisation_drew_another_stream_stops_the_job(tmp_path):
    """The successor's setup seeds from its own pid, builds its model (whose initialisation it
    leaves out: the rank's state overwrites it) and draws nothing else before the loop: only
    the replay of the left-out draws (deferred_init) can tell its torch stream from its
    predecessor's, after the move has formed. The job stops there, before the new rank's
    first record names a stream it did not check."""
    script = tmp_path / "seeded.py"
    script.write_text(textwrap.dedent(SEEDED_BY_PROCESS))
    code, job = faulted(tmp_path, script, "1:30:SIGKILL")
    log, events = job.log(None), job.events()
    assert code != 0 and (tmp_path / "fired").exists(), log[-3000:]
    assert "the torch random stream" in log and "not deterministic" in log, log[-3000:]
    assert events[0]["kind"] == "unplanned" and events[0]["joiner_setup_left_out_mb"], events
    assert "divergence" in [e["kind"] for e in events], events


SPLIT_FROM_A_FILE = _SPLIT.format(seeding="""\
with open(sys.argv[1]) as f:  # a setup reading a file that changes while the job runs
    random.seed(int(f.read()))""")


def test_the_setup_check_holds_for_a_successors_successor(tmp_path):
    """Rank 1 moves (planned) to a process whose setup builds the same split; then the file
    the setup reads changes, and that process is killed -9: its successor's setup builds
    another split. The walked process's own record carries the setup's fingerprint as its
    predecessor's did, so the second successor is checked too: the job stops, rather than
    train rank 1 on another partition and end 0."""
    script, seed, go = tmp_path / "split.py", tmp_path / "seed.txt", tmp_path / "go"
    script.write_text(textwrap.dedent(SPLIT_FROM_A_FILE))
    seed.write_text("0")
    job = Job(tmp_path, nproc=2, spares=2, script=script, out_arg=False, name="job", script_args=[str(seed)],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MID_STEP": "1:go:SIGKILL",
                   "BATON_TEST_SIGNAL_GO": str(go), "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired")})
    try:
        job.wait_spare()
        job.wait_step(20, timeout=120)
        job.client.migrate(1)
        job.wait_until(lambda st: st["operation"] is None and any(e["status"] == "resolved" for e in job.events()),
                       timeout=120, what="the planned move")
        seed.write_text("1")
        go.touch()  # rank 1's next step, in the process that took it over
        code = job.wait(timeout=170)
        log, events = job.log(None), job.events()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists() and code != 0, log[-3000:]
    assert "not deterministic" in log and "what `train` will yield" in log, log[-3000:]
    assert [(e["kind"], e["status"]) for e in events][:2] == [("planned", "resolved"), ("unplanned", "failed")], events


def test_a_kill_from_outside_at_any_moment_is_exact_or_stops_the_job(tmp_path):
    """The kill lands where it lands (inside a step, after a rank's last collective, between
    epochs): the job ends 0 with every rank exact, or non-zero with a divergence saying why."""
    name, args = "trainer_ddp.py", ["60", "20", "--snapshot-path", "{d}/snapshot.pt"]
    ref = tmp_path / "torchrun"
    ref.mkdir()
    torchrun(NOCODE / name, [a.format(d=ref) for a in args] + ["--export", str(ref / "export")], 2, ref)
    run = tmp_path / "baton"
    job = Job(tmp_path, nproc=2, spares=1, script=NOCODE / name, out_arg=False, name="baton",
              script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")])
    try:
        st = job.wait_step(40, timeout=120)
        time.sleep(0.003 * (st["ranks"][0]["step"] % 7))  # somewhere in a step, whichever part
        job.signal_rank(1, signal.SIGKILL)
        code = job.wait(timeout=170)
    finally:
        job.kill()
    events = job.events()
    if code == 0:
        compare(ref, run)
        assert [(e["kind"], e["status"]) for e in events] == [("unplanned", "resolved")], events
    else:
        assert any(e["kind"] == "divergence" for e in events), (events, job.log())
        assert "restart it from your own checkpoint" in job.log(None)
        assert not [e for e in events if e["status"] == "in-progress"], events



@pytest.mark.parametrize("hook, where, fault", [("fp16", "MID_STEP", "1:9:SIGKILL"),
                                                ("fp16", "AFTER_STEP", "0:9:SIGKILL")])  # bf16: CUDA only
def test_a_scripts_own_comm_hook_keeps_working_through_a_lost_rank(tmp_path, torchrun_reference, hook, where,
                                                                   fault):
    """The DDP tutorial's Trainer with DDP's gradient-compression hook registered by the script
    (`register_comm_hook(None, default_hooks.fp16_compress_hook)`): the hook runs inside
    baton's, its all-reduces over the live group. A rank killed in a step, or right after its
    optimizer step (the spare runs that step again, the hook's collectives answered from the
    survivors' record), ends every rank bit for bit equal to torchrun's run of the same file."""
    args = ["12", "5", "--comm-hook", hook]
    outs = ["--snapshot-path", "{d}/snapshot.pt", "--export", "{d}/export"]
    ref = torchrun_reference(NOCODE / "trainer_ddp.py", [*args, *outs])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, NOCODE / "trainer_ddp.py", fault, where=where,
                         script_args=[*args, *[a.format(d=run) for a in outs]])
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


@pytest.mark.parametrize("source, fault", [(ACCUMULATING_FOR, "1:9:SIGKILL"), (METERS_BY_NAME, "0:12:SIGSTOP")],
                         ids=["for", "no_sync"])
def test_a_rank_lost_after_the_optimizer_step_of_an_accumulating_step_is_replaced_bit_for_bit(
        tmp_path, torchrun_reference, source, fault):
    """The successor runs the lost rank's last step again, every micro-batch of it: the replay
    ends at the head after its optimizer step, not at the first head (seen: 'running again
    step 9 ... gradient buckets 1 of 4, optimizer steps 0', the job stopped)."""
    killed_in_step(tmp_path, torchrun_reference, source, fault)


SCALED = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
# fp16 autocast with a dynamic loss scale (the AMP recipe): a scale too high makes the step's
# gradients overflow, and GradScaler skips that optimizer step and halves the scale
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, growth_interval=5)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
skipped = 0
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
        opt.zero_grad(set_to_none=True)
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
            "rng": torch.get_rng_state(), "skipped": torch.tensor(skipped)},
           os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("where, fault", [("AFTER_STEP", "1:6:SIGKILL"), ("MID_STEP", "1:2:SIGKILL")])
def test_steps_gradscaler_skipped_are_run_again_as_they_ran(tmp_path, torchrun_reference, where, fault):
    """A step whose optimizer step GradScaler skipped (its gradients overflowed) goes on into
    the next iteration, as an accumulating one does: a rank lost after the optimizer step that
    followed, or in an iteration of the skipped step, is replaced bit for bit (seen: the
    successor ended its replay at the skipped step's head, and the job stopped)."""
    *_, job = killed_in_step(tmp_path, torchrun_reference, SCALED, fault, where=where)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()


BUCKET_VIEWS = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
# gradients as views of DDP's buckets (one copy less; recipes that save memory turn it on),
# in several small buckets
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)),
            gradient_as_bucket_view=True, bucket_cap_mb=0.001)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
sampler = DistributedSampler(data)
norms = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "norms": torch.stack(norms),
            "rng": torch.get_rng_state()}, os.path.join(os.environ["EXPORT"], f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


@pytest.mark.parametrize("where, fault", [("AFTER_STEP", "1:9:SIGKILL"), ("MID_STEP", "0:12:SIGKILL")])
def test_gradients_as_views_of_ddps_buckets_are_averaged_and_recorded_bit_for_bit(
        tmp_path, torchrun_reference, where, fault):
    """DDP(gradient_as_bucket_view=True): the gradients are DDP's bucket itself, and baton
    averages each bucket into a tensor of the step's record, which DDP copies back into them.
    The gradient norms the script clips with, and every rank after a loss in the step's tail
    (its successor answered from that record) or mid-step, equal torchrun's."""
    *_, job = killed_in_step(tmp_path, torchrun_reference, BUCKET_VIEWS, fault, where=where)
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")], job.events()
