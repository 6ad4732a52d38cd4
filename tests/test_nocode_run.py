"""`baton run` on an unmodified torchrun script that logs at INFO: its own lines only, none of
baton's or of its HTTP client's (the four shapes' runs: test_nocode_moves)."""

from __future__ import annotations

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
