"""Same numbers as torchrun: a failure-free `baton run` of a script ends with every rank's
parameters, BatchNorm buffers, optimizer state, LR and random stream bit-for-bit equal to
the same script under plain torchrun with DistributedDataParallel on gloo.

baton/examples/parity.py is one script with both versions (`--plain` is the torchrun one):
conv + BatchNorm (DDP broadcasts rank 0's buffers before each forward), dropout drawing from
torch's global RNG seeded per rank, a 3 MB MLP head (two gradient buckets after DDP's
rebuild), AdamW + StepLR, a shuffled DistributedSampler, 2 epochs of 10 steps."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.examples.parity import Net
from tests.jobs import Job

SCRIPT = Path(__file__).resolve().parent.parent / "baton" / "examples" / "parity.py"
NPROC = 3
TIMEOUT = 180
ENV = {"OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--nproc_per_node", str(NPROC), "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(SCRIPT), "--plain", "--out", str(out)]
    log = out.with_name("torchrun.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=out.parent, env={**os.environ, **ENV}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"torchrun did not finish in {TIMEOUT}s:\n{log.read_text()[-6000:]}")
    assert rc == 0, f"torchrun exited {rc}:\n{log.read_text()[-6000:]}"


def _load(out: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f"{out}.rank{r}") for r in range(NPROC)]


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose dtype, shape or bits differ (bitwise: -0.0 != 0.0, NaNs by payload)."""
    out = []
    for k in sorted(set(got) | set(want)):
        if k not in got or k not in want:
            out.append(f"{k}: only in {'baton' if k in got else 'torchrun'}")
            continue
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
            out.append(f"{k}: max |diff| {diff}")
    return out


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_baton_run_matches_torchrun_bit_for_bit(tmp_path):
    plain_out = tmp_path / "plain" / "final.pt"
    plain_out.parent.mkdir()
    _torchrun(plain_out)
    plain = _load(plain_out)

    job = Job(tmp_path, nproc=NPROC, spares=0, steps=0, script=SCRIPT, name="baton", env=ENV)
    try:
        assert job.wait(timeout=TIMEOUT) == 0, job.log()
    finally:
        job.kill()
    got = _load(job.out)

    # The comparison can fail: ranks really differ, and the state really moved.
    torch.manual_seed(0)
    init = {f"model.{k}": v for k, v in Net().state_dict().items()}
    for r, state in enumerate(plain):
        torch.manual_seed(100 + r)
        assert not torch.equal(state["rng"], torch.get_rng_state()), f"rank {r} drew no dropout masks"
        moved = [k for k in init if init[k].is_floating_point() and not torch.equal(init[k], state[k])]
        assert len(moved) == len([k for k in init if init[k].is_floating_point()]), moved
        assert int(state["model.bn.num_batches_tracked"]) == 20 and state["lr"].item() == pytest.approx(5e-4)
        assert all(int(state[k]) == 20 for k in state if k.endswith(".step"))
    assert not torch.equal(plain[0]["rng"], plain[1]["rng"])
    assert not torch.equal(plain[0]["model.bn.running_mean"], plain[1]["model.bn.running_mean"])

    report = {r: _differences(got[r], plain[r]) for r in range(NPROC)}
    assert not any(report.values()), "baton run differs from torchrun:\n" + "\n".join(
        f"rank {r}: {len(d)} of {len(plain[r])} keys differ: " + "; ".join(d[:12])
        for r, d in report.items() if d)
