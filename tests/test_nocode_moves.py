"""Moves of unmodified torchrun scripts under `baton run` (tests/nocode/: the shapes of
nanoGPT's train.py, the DDP tutorial's Trainer, imagenet's main.py and the FSDP2 example):
a planned move of one rank, then a taint of rank 0's slot (a pre-emptive move), each taken
wherever the script stands (mid-epoch, at an epoch's end, after an evaluation), end with
every rank bit for bit equal to the same file under torchrun, and a ledger of two moves
resolved with no step lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import Job
from tests.nocode_runs import NOCODE, differences, exports, torchrun

SHAPES = {
    # long enough that both moves land mid-run; {d}: the run's folder; the files the script
    # writes, which must match torchrun's (read back: nanoGPT's holds the folder it was written to)
    "nanogpt": ("nanogpt_train.py", ["--out_dir={d}/out", "--max_iters=160", "--eval_interval=40"], ["out/ckpt.pt"]),
    "trainer": ("trainer_ddp.py", ["200", "7", "--snapshot-path", "{d}/snapshot.pt"], ["snapshot.pt"]),
    "imagenet": ("imagenet_main.py", ["--epochs", "16", "--out-dir", "{d}/out"],
                 ["out/checkpoint.pth.tar", "out/model_best.pth.tar"]),
    "fsdp2": ("fsdp2_example.py", ["--iterations", "160", "--checkpoint-dir", "{d}/ck"], []),  # DCP folders: by time
}


def _cli(job: Job, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args, "--run-dir", str(job.run_dir)],
                          capture_output=True, text=True, timeout=60, cwd=job.dir)


def _resolved(job: Job, count: int) -> None:
    job.wait_until(lambda st: st["operation"] is None and len([e for e in job.events() if e["status"] == "resolved"])
                   >= count, timeout=120, what=f"{count} resolved move(s)")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_planned_move_and_a_taint_end_bitwise_equal_to_torchrun(tmp_path, shape):
    name, args, files = SHAPES[shape]
    ref = tmp_path / "torchrun"
    ref.mkdir()
    torchrun(NOCODE / name, [a.format(d=ref) for a in args] + ["--export", str(ref / "export")], 2, ref)
    run = tmp_path / "baton"
    job = Job(tmp_path, nproc=2, spares=2, script=NOCODE / name, out_arg=False, name="baton",  # the taint needs a warm spare too
              script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")])
    try:
        st = job.wait_step(12, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        _resolved(job, 1)
        st = job.wait_step(st["ranks"][0]["step"] + 25, timeout=120)
        slot = next(r["slot"] for r in st["ranks"] if r["rank"] == 0)
        tainted = _cli(job, "taint", slot, "--reason", "ecc")
        assert tainted.returncode == 0, tainted.stderr
        _resolved(job, 2)
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    for rank, (a, b) in enumerate(zip(exports(ref / "export", 2), exports(run / "export", 2))):
        assert differences(a, b) == [], f"rank {rank}"
    for f in files:
        written = [_relative(torch.load(d / f, weights_only=False), d) for d in (ref, run)]
        assert differences(*written) == [], f
    events = job.events()
    assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == [
        ("planned", 1, "resolved", 0), ("pre-emptive", 0, "resolved", 0)], events


def _relative(obj: Any, folder: Path) -> Any:
    if isinstance(obj, str):
        return obj.replace(str(folder), "<run>")
    if isinstance(obj, dict):
        return {k: _relative(v, folder) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_relative(v, folder) for v in obj)
    return obj
