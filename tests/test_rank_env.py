"""A model-aware script that reads torchrun's variables before `baton.init()` (the FSDP2
example does: `rank = int(os.environ["RANK"])` first) finds them as torchrun sets them: the
initial ranks at once, a spare once it is given a rank (the read waits there, as
baton.init() does), and a second baton.init() returns the same job."""

from __future__ import annotations

import json
import textwrap

from tests.jobs import AWARE_TRAINING, Job
from tests.nocode_runs import NOCODE

INJECT = NOCODE.parent / "inject"

READS_FIRST = """
import json, os, sys
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import baton

seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
with open(os.path.join(sys.argv[1], f"env-{os.getpid()}.json"), "w") as f:
    json.dump(seen, f)
job = baton.init()
assert baton.init() is job and int(seen["RANK"]) == job.rank and int(seen["WORLD_SIZE"]) == job.world_size
torch.manual_seed(0)
""" + AWARE_TRAINING


def test_torchrun_variables_read_before_init_hold_the_rank_a_spare_included(tmp_path):
    script = tmp_path / "reads_first.py"
    script.write_text(textwrap.dedent(READS_FIRST))
    out = tmp_path / "seen"
    out.mkdir()
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, script_args=[str(out)],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MID_STEP": "1:20:SIGKILL",
                   "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired")})
    try:
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    seen = sorted((json.loads(p.read_text()) for p in out.glob("env-*.json")), key=lambda s: s["RANK"])
    assert [s["RANK"] for s in seen] == ["0", "1", "1"], seen  # the spare read rank 1 once it took it over
    assert all(s["WORLD_SIZE"] == "2" and s["LOCAL_WORLD_SIZE"] == "2" and s["LOCAL_RANK"] == s["RANK"] and
               s["TORCHELASTIC_RUN_ID"] for s in seen), seen
    assert [(e["kind"], e["status"]) for e in job.events()] == [("unplanned", "resolved")]
