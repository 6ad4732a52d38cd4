"""`baton run` on an unmodified torchrun script: `baton status` says the job runs with no
code change and where its step loop is (before and after a move), and `baton status`
before the first step says the loop is not found yet."""

from __future__ import annotations

import subprocess
import sys

from tests.jobs import Job
from tests.nocode_runs import NOCODE


def _status_text(job: Job) -> str:
    return subprocess.run([sys.executable, "-m", "baton.cli", "status", "--run-dir", str(job.run_dir)],
                          capture_output=True, text=True, timeout=60).stdout


def test_status_says_no_code_and_where_the_step_loop_is(tmp_path):
    script = NOCODE / "trainer_ddp.py"
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False,
              script_args=["1000", "1000", "--snapshot-path", str(tmp_path / "snap.pt")])
    try:
        st = job.wait_step(3, timeout=120)
        loop_line = next(i for i, line in enumerate(script.read_text().splitlines(), 1)
                         if line.strip().startswith("for source, targets in"))
        assert st["mode"] == "no-code" and st["step_loop"] == f"{script}:{loop_line}"
        assert f"mode: no code change, step loop at {script}:{loop_line}" in _status_text(job)
        assert all("unmovable" not in r for r in st["ranks"])  # planned moves are taken
    finally:
        job.kill()


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
