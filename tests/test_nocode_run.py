"""`baton run` on unmodified torchrun scripts (tests/nocode/, the shapes of nanoGPT, the DDP
tutorial's Trainer, imagenet and the FSDP2 example): every rank ends bit for bit equal to
the same file under torchrun, the files it writes too; `baton status` says the job runs
with no code change and where its step loop is; and since this version does not move such
ranks yet, a planned move is refused with the reason and a lost rank ends the job at once,
non-zero, saying why: never exit 0 with different state."""

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
    # script, its arguments ({d}: the run's folder), the files it writes that must match torchrun's
    "nanogpt": ("nanogpt_train.py", ["--out_dir={d}/out"], ["out/ckpt.pt"]),
    "trainer": ("trainer_ddp.py", ["--snapshot-path", "{d}/snapshot.pt"], ["snapshot.pt"]),
    "imagenet": ("imagenet_main.py", ["--out-dir", "{d}/out"], ["out/checkpoint.pth.tar", "out/model_best.pth.tar"]),
    "fsdp2": ("fsdp2_example.py", ["--checkpoint-dir", "{d}/ck"], []),  # DCP folders are named by the time
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_an_unmodified_script_ends_bitwise_equal_to_torchrun(tmp_path, shape):
    name, args, files = SHAPES[shape]
    ref = tmp_path / "torchrun"
    ref.mkdir()
    torchrun(NOCODE / name, [a.format(d=ref) for a in args] + ["--export", str(ref / "export")], 2, ref)
    job = Job(tmp_path, nproc=2, spares=1, script=NOCODE / name, out_arg=False, name="baton",
              script_args=[a.format(d=tmp_path / "baton") for a in args] + ["--export", str(tmp_path / "baton" / "export")])
    try:
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    for rank, (a, b) in enumerate(zip(exports(ref / "export", 2), exports(job.dir / "export", 2))):
        assert differences(a, b) == [], f"rank {rank}"
    for f in files:  # read back: a file may hold the folder it was written to (nanoGPT's config)
        written = [_relative(torch.load(d / f, weights_only=False), d) for d in (ref, job.dir)]
        assert differences(*written) == [], f


def _relative(obj: Any, folder: Path) -> Any:
    if isinstance(obj, str):
        return obj.replace(str(folder), "<run>")
    if isinstance(obj, dict):
        return {k: _relative(v, folder) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_relative(v, folder) for v in obj)
    return obj


def test_status_says_no_code_and_a_move_or_a_loss_never_passes_silently(tmp_path):
    script = NOCODE / "trainer_ddp.py"
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False,
              script_args=["1000", "1000", "--snapshot-path", str(tmp_path / "snap.pt")])
    try:
        st = job.wait_step(3, timeout=120)
        loop_line = next(i for i, line in enumerate(script.read_text().splitlines(), 1)
                         if line.strip().startswith("for source, targets in"))
        assert st["mode"] == "no-code" and st["step_loop"] == f"{script}:{loop_line}"
        text = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--run-dir", str(job.run_dir)],
                              capture_output=True, text=True, timeout=60).stdout
        assert f"mode: no code change, step loop at {script}:{loop_line}" in text
        moved = subprocess.run([sys.executable, "-m", "baton.cli", "migrate", "--rank", "1", "--run-dir",
                                str(job.run_dir)], capture_output=True, text=True, timeout=60)
        assert moved.returncode != 0 and "does not yet move its ranks" in moved.stderr
        job.signal_rank(0, 9)
        code = job.wait(timeout=120)
    finally:
        job.kill()
    log = job.log(None)
    assert code != 0, log[-3000:]
    assert "a peer was lost" in log and "restart it from your own checkpoint" in log
