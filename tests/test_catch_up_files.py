"""A successor runs its script's setup again, long after its predecessor did: what that
setup writes must not undo what the job wrote since (baton/worker/fence.py). The script
here does what setups do: opens its log with mode "w" and keeps writing to it, writes its
config, saves the initial model where the loop saves its latest checkpoint, records its
progress through a temporary file and os.replace, and clears its samples folder. Rank 0,
the one writing, is killed after the last checkpoint: every file ends as torchrun's, and
the one only its setup wrote (its pid) is written again by the successor."""

from __future__ import annotations

import json
import os
import textwrap
import time

import torch

from baton.worker.fence import Fence
from tests.jobs import Job
from tests.nocode_runs import NOCODE, differences

INJECT = NOCODE.parent / "inject"

WRITER = """
import json, os, shutil, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

OUT = os.environ["OUT"]


def write_progress(done):  # write then rename, as careful scripts do
    tmp = os.path.join(OUT, "progress.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"steps_done": done}, f)
    os.replace(tmp, os.path.join(OUT, "progress.json"))


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(320, 8), torch.randn(320, 1))
sampler = DistributedSampler(data)
with open(os.path.join(OUT, f"pid.rank{rank}"), "w") as f:  # training never touches it: a successor rewrites it
    f.write(str(os.getpid()))
log = None
if rank == 0:
    log = open(os.path.join(OUT, "log.txt"), "w")
    log.write("step loss\\n")
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump({"lr": 0.05, "world": dist.get_world_size()}, f)
    torch.save(model.module.state_dict(), os.path.join(OUT, "latest.pt"))  # the initial model, as a start
    write_progress(0)
    samples = os.path.join(OUT, "samples")
    if os.path.isdir(samples):
        shutil.rmtree(samples)
    os.makedirs(samples)
done = 0
for epoch in range(4):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        done += 1
        if rank == 0:
            log.write(f"{done} {loss.item():.6f}\\n")
            log.flush()
            if done % 30 == 0:
                torch.save(model.module.state_dict(), os.path.join(OUT, "latest.pt"))
                write_progress(done)
                with open(os.path.join(samples, f"at{done}.txt"), "w") as f:
                    f.write(f"{loss.item():.6f}\\n")
if rank == 0:
    log.close()
dist.destroy_process_group()
os._exit(0)  # past gloo's exit-time abort with torch 2.13 (baton/examples/plain_exit.py), as tests/nocode do
"""


AWARE_WRITER = """
import json, os, shutil, torch, baton
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

OUT = os.environ["OUT"]


def write_progress(done):
    tmp = os.path.join(OUT, "progress.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"steps_done": done}, f)
    os.replace(tmp, os.path.join(OUT, "progress.json"))


job = baton.init()
torch.manual_seed(0)
model = job.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(320, 8), torch.randn(320, 1))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, job.world_size, job.rank))
job.track(model=model, optimizer=opt, data=loader)
log = None
if job.rank == 0:
    log = open(os.path.join(OUT, "log.txt"), "w")
    log.write("step loss\\n")
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump({"lr": 0.05, "world": job.world_size}, f)
    torch.save(model.module.state_dict(), os.path.join(OUT, "latest.pt"))
    write_progress(0)
    samples = os.path.join(OUT, "samples")
    if os.path.isdir(samples):
        shutil.rmtree(samples)
    os.makedirs(samples)


@job.every(30)
def checkpoint(at):
    if job.rank == 0:
        torch.save(model.module.state_dict(), os.path.join(OUT, "latest.pt"))
        write_progress(at.step)
        with open(os.path.join(samples, f"at{at.step}.txt"), "w") as f:
            f.write("sample\\n")


for step in job.steps(80):
    with step:
        x, y = step.batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    if job.rank == 0:
        log.write(f"{step.index + 1} {loss.item():.6f}\\n")
        log.flush()
job.finish()
if job.rank == 0:
    log.close()
"""


def _files(out) -> dict:
    return {"log": (out / "log.txt").read_text(), "config": json.loads((out / "config.json").read_text()),
            "progress": json.loads((out / "progress.json").read_text()),
            "latest": torch.load(out / "latest.pt", weights_only=True),
            "samples": {p.name: p.read_text() for p in sorted((out / "samples").iterdir())},
            "others": sorted(p.name for p in out.iterdir())}


def _run(tmp_path, source: str, name: str) -> tuple[int, Job, object]:
    """`source` under baton, rank 0 killed mid-step at 70 of 80 steps (the last checkpoint
    was at 60); its exit code, the job, and its output folder."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / f"{name}-out"
    out.mkdir()
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False,
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MID_STEP": "0:70:SIGKILL",
                   "BATON_TEST_SIGNAL_MARK": str(tmp_path / f"{name}-fired"), "OUT": str(out)}, name=name)
    try:
        code = job.wait(timeout=170)
    finally:
        job.kill()
    assert code == 0, job.log()
    assert (tmp_path / f"{name}-fired").exists()
    assert [(e["kind"], e["status"], e["rank"]) for e in job.events()] == [("unplanned", "resolved", 0)]
    return code, job, out


def test_a_successors_setup_leaves_the_jobs_files_as_the_job_wrote_them(tmp_path, torchrun_reference):
    ref = torchrun_reference(_write(tmp_path, WRITER), [], env={"OUT": "{d}/export"})
    _, _, out = _run(tmp_path, WRITER, "nocode")
    mine, theirs = _files(out), _files(ref / "export")
    assert mine["log"].count("step loss") == 1 and mine["log"] == theirs["log"]
    assert differences(mine, theirs) == []
    # what the predecessor's setup alone wrote is written again: its pid file names the successor
    assert (out / "pid.rank0").stat().st_mtime > (out / "samples" / "at60.txt").stat().st_mtime


def test_a_fence_writes_again_only_what_an_earlier_setup_left_as_it_was(tmp_path):
    """Both files changed after the step loop began; an earlier successor's setup wrote both,
    and training changed one since: this setup writes the other again and leaves that one,
    and says which it wrote."""
    setup_only, trained = tmp_path / "pid", tmp_path / "log"
    for path in (setup_only, trained):
        path.write_text("an earlier setup's")
    earlier = {str(setup_only): setup_only.stat().st_mtime, str(trained): trained.stat().st_mtime}
    trained.write_text("training's")
    os.utime(trained, (earlier[str(trained)] + 1, earlier[str(trained)] + 1))
    fenced = Fence(own=lambda name: name == __file__, since=time.time() - 60, setup_files=earlier)
    fenced.install()
    try:
        with open(setup_only, "w") as f:
            f.write("this setup's")
        with open(trained, "w") as f:
            f.write("this setup's")
    finally:
        written = fenced.lift()
    assert setup_only.read_text() == "this setup's" and trained.read_text() == "training's"
    assert list(written) == [str(setup_only)]


def test_the_third_process_of_a_rank_rewrites_what_only_setups_wrote(tmp_path, torchrun_reference):
    """Rank 0 moves (planned), and its successor is killed 5 steps after it joined: the third
    process of rank 0 rewrites its pid file, which only the second's setup had written, but
    after the step loop began (the second said so as it took its place: SetupWritten); what
    training wrote still ends as torchrun's."""
    ref = torchrun_reference(_write(tmp_path, WRITER), [], env={"OUT": "{d}/export"})
    script = tmp_path / "twice.py"
    script.write_text(textwrap.dedent(WRITER))
    out = tmp_path / "twice-out"
    out.mkdir()
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, name="twice", leash=4, leash_cap=70,
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MID_STEP": "0:joined+5:SIGKILL",
                   "BATON_TEST_SIGNAL_MARK": str(tmp_path / "twice-fired"), "OUT": str(out)})
    try:
        job.wait_step(10)
        job.wait_spare()
        job.client.migrate(0)
        job.wait_until(lambda st: sum(e["status"] == "resolved" for e in job.events()) == 2, timeout=240,
                       what="the move and the recovery resolved")
        third = next(r["pid"] for r in job.status()["ranks"] if r["rank"] == 0)
        job.let_go()
        assert job.wait(timeout=170) == 0, job.log()
        events = job.events()
    finally:
        job.kill()
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == [("planned", "resolved", 0),
                                                                     ("unplanned", "resolved", 0)], events
    assert (out / "pid.rank0").read_text() == str(third), "the pid file names a process that rank 0 no longer is"
    assert differences(_files(out), _files(ref / "export")) == []


def test_the_same_in_a_model_aware_script(tmp_path):
    """Its setup runs after baton.init(), where a spare waits: fenced the same way. (What a
    spare runs before baton.init() runs as it starts, assigned or not: the README says so.)"""
    _, _, out = _run(tmp_path, AWARE_WRITER, "aware")
    files = _files(out)
    assert [line.split()[0] for line in files["log"].splitlines()] == ["step", *map(str, range(1, 81))], files["log"]
    assert files["progress"] == {"steps_done": 60} and sorted(files["samples"]) == ["at30.txt", "at60.txt"]
    assert files["config"] == {"lr": 0.05, "world": 2}
    initial = _initial()
    assert not any(torch.equal(files["latest"][k], v) for k, v in initial.items()), "the initial model"


def _write(tmp_path, source: str):
    script = tmp_path / "reference.py"
    script.write_text(textwrap.dedent(source))
    return script


def _initial() -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    return net.state_dict()
