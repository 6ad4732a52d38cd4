"""FSDP2 and HSDP in the shape of an image-classification script (baton/examples/resnet.py):
BatchNorm (each rank's running statistics its own, in HSDP too), dropout, SGD with a
one-cycle LR, bf16 autocast with a ShardedGradScaler, clipping after unscaling, a shuffled
DistributedSampler with random flips, validation at each epoch's end with a sharded DCP
checkpoint and rank 0's best model gathered as a full state dict, and a resume block.

Each job resumes from the epoch-1 checkpoint of a failure-free torchrun run and must end
with every rank's state (shards, BatchNorm statistics, optimizer, LR, loss scale, random
stream) and rank 0's exported best model bitwise equal to the same resume under torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.jobs import Job, assert_ranks_equal, state_diff
from tests.served import free_port

REPO = Path(__file__).resolve().parent.parent
RESNET = REPO / "baton" / "examples" / "resnet.py"
COMMON = ["--epochs", "4", "--train-samples", "512"]
STEPS_PER_EPOCH = 16  # 512 samples / 4 ranks / batch 8; a resumed job starts at step 32 (epoch 2)
# The jobs are leashed and hold two steps before the end until the test has injected its
# faults: on a fast machine the last epoch's 16 steps pass quicker than three moves.
LEASH = {"leash": 4, "leash_cap": 4 * STEPS_PER_EPOCH - 2, "leash_from": 2 * STEPS_PER_EPOCH}


def _torchrun(where: Path, args: list[str]) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), str(RESNET), "--plain", *COMMON, *args],
                          cwd=where, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _reference(tmp_path_factory, replicas: int) -> Path:
    """The epoch-1 checkpoint of a failure-free pure-FSDP torchrun run (DCP reshards it for
    HSDP), and the same script resumed from it under torchrun with `replicas` replica groups:
    the state every baton job here must end with. Computed once per test session
    (pytest-xdist workers wait for the first)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    first = root / "reference-resnet-first"
    with FileLock(str(first) + ".lock"):
        if not (first / "done").exists():
            first.mkdir(exist_ok=True)
            _torchrun(first, ["--checkpoint", str(first / "checkpoint")])
            (first / "done").write_text("ok")
    where = root / f"reference-resnet-{replicas}"
    with FileLock(str(where) + ".lock"):
        if not (where / "done").exists():
            where.mkdir(exist_ok=True)
            _torchrun(where, ["--replicas", str(replicas), "--resume", str(first / "checkpoint" / "epoch1"),
                              "--checkpoint", str(where / "resumed"), "--export", str(where / "best.pt"),
                              "--out", str(where / "plain.pt")])
            (where / "done").write_text("ok")
    return where


def _resumed_from(reference: Path) -> str:
    """The checkpoint `reference` resumed from (that of `_reference`'s first run, epoch 1)."""
    return str(reference.parent / "reference-resnet-first" / "checkpoint" / "epoch1")


def _resolved(job: Job, rank: int) -> bool:
    return any(e["rank"] == rank and e["status"] == "resolved" for e in job.events())


def _check(job: Job, reference: Path) -> None:
    assert job.wait(timeout=240) == 0, job.log()
    assert_ranks_equal(job, [torch.load(reference / f"plain.pt.rank{r}") for r in range(4)])
    best, want = torch.load(job.dir / "best.pt"), torch.load(reference / "best.pt")
    assert len(want) > 10 and not state_diff(best, want), state_diff(best, want)
    assert "resumed from" in (job.dir / "stdout.log").read_text()


def test_hsdp_with_batchnorm_moves_and_rebuilds_each_ranks_own_statistics(tmp_path, tmp_path_factory):
    """2x2 HSDP (`job.mesh(("replicate", "shard"), (2, 2))`: shards all-gathered and
    reduce-scattered within a replica group, gradients all-reduced across groups, every
    mesh dimension a live sub-group): a planned move of rank 0, a taint of rank 3's slot,
    then rank 1 killed -9. Rank 1's shards come from rank 3 (the other replica group holds
    the same shards) but its BatchNorm statistics, which rank 3 does not share, from its
    buddy's copy of its own state."""
    reference = _reference(tmp_path_factory, 2)
    plain = [torch.load(reference / f"plain.pt.rank{r}") for r in range(4)]
    assert any(k.endswith("running_mean") for k in state_diff(plain[1], plain[3])), \
        "replica groups' BatchNorm statistics should differ (each rank normalises its own batches)"
    job = Job(tmp_path, nproc=4, spares=3, steps=0, script=RESNET, name="hsdp",
              script_args=[*COMMON, "--replicas", "2", "--resume", _resumed_from(reference),
                           "--checkpoint", str(tmp_path / "ckpt"), "--export", "best.pt"],
              run_args=["--redundancy", "1", "--verify-every", "10"], env={"BATON_LOG": "INFO"}, **LEASH)
    try:
        job.wait_step(2 * STEPS_PER_EPOCH + 4, timeout=120)
        job.client.migrate(0)
        job.wait_until(lambda s: _resolved(job, 0), timeout=90, what="rank 0's planned move", pull=False)
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 3)
        assert job.client.taint(slot, "ecc")["moving_ranks"] == [3]
        job.wait_until(lambda s: _resolved(job, 3), timeout=90, what="rank 3's pre-emptive move", pull=False)
        # A joiner holds no snapshot from before it joined: the first loss after a move is
        # rebuildable once the buddies hold the boundary the joiner started at.
        job.wait_step(job.status()["ranks"][0]["step"] + 2, timeout=60)
        job.signal_rank(1, signal.SIGKILL)
        job.wait_until(lambda s: _resolved(job, 1), timeout=90, what="rank 1 rebuilt")
        _check(job, reference)
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == \
        [("planned", "resolved", 0), ("pre-emptive", "resolved", 3), ("unplanned", "resolved", 1)], events
    assert "rebuilding rank=1" in log and "shards_from=[3]" in log, log[-3000:]


def test_fsdp_loses_rank_0_in_validation_and_another_rank_in_training(tmp_path, tmp_path_factory):
    """Pure FSDP over 4 ranks with --redundancy 1: rank 0 killed -9 while the epoch's
    validation (a boundary function: an all_reduce, every rank writing its checkpoint
    shards, a full-state gather) is under way, then rank 2 killed in the next epoch's
    training. Both are rebuilt from their buddies' copies."""
    reference = _reference(tmp_path_factory, 1)
    job = Job(tmp_path, nproc=4, spares=2, steps=0, script=RESNET, name="fsdp",
              script_args=[*COMMON, "--resume", _resumed_from(reference), "--checkpoint",
                           str(tmp_path / "ckpt"), "--export", "best.pt", "--val-sleep", "1.5"],
              run_args=["--redundancy", "1"], env={"BATON_LOG": "INFO"}, **LEASH)
    try:
        job.wait_step(3 * STEPS_PER_EPOCH, timeout=120)  # epoch 2 done: its validation follows
        job.signal_rank(0, signal.SIGKILL)
        job.wait_until(lambda s: _resolved(job, 0), timeout=90, what="rank 0 rebuilt")
        job.wait_step(job.status()["ranks"][0]["step"] + 4, timeout=60)
        job.signal_rank(2, signal.SIGKILL)
        job.wait_until(lambda s: _resolved(job, 2), timeout=90, what="rank 2 rebuilt")
        _check(job, reference)
        events = job.events()
    finally:
        job.kill()
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == \
        [("unplanned", "resolved", 0), ("unplanned", "resolved", 2)], events
