"""A fault campaign, not part of `make test` (pytest collects test_*.py only): random real
faults of a no-code job, each run compared bit for bit with the script's failure-free torchrun
run. Each run (seeded by its number) kills -9 (or SIGSTOPs) a random rank at a random step
and moment within it, `CAMPAIGN_KILLS` times, each once the fault before it was resolved;
one line per run goes to $CAMPAIGN_OUT (JSON lines), a run the job stopped is skipped
(its message is in that line), a divergence fails.

    CAMPAIGN_N=32 .venv/bin/python -m pytest -q -n 2 tests/campaign_nocode.py       # the FSDP2 example
    CAMPAIGN_SCRIPT=trainer_ddp.py CAMPAIGN_ARGS='["9", "4", "--snapshot-path", "{d}/snapshot.pt"]' \
        CAMPAIGN_STEPS=72 CAMPAIGN_KILLS=2 CAMPAIGN_SIGNAL=SIGSTOP .venv/bin/python -m pytest -q -n 2 tests/campaign_nocode.py
"""
from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from tests.jobs import Job
from tests.nocode_runs import NOCODE, compare

N = int(os.environ.get("CAMPAIGN_N", "8"))


@pytest.mark.parametrize("i", range(N))
def test_campaign(tmp_path, torchrun_reference, i):
    rnd = random.Random(1000 + i)
    name = os.environ.get("CAMPAIGN_SCRIPT", "fsdp2_example.py")
    steps = int(os.environ.get("CAMPAIGN_STEPS", "60"))
    args = ["--iterations", str(steps), "--checkpoint-dir", "{d}/ck"] if name == "fsdp2_example.py" else \
        json.loads(os.environ["CAMPAIGN_ARGS"])
    ref = torchrun_reference(NOCODE / name, [*args, "--export", "{d}/export"])
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    kills = int(os.environ.get("CAMPAIGN_KILLS", "1"))
    sig = getattr(signal, os.environ.get("CAMPAIGN_SIGNAL", "SIGKILL"))
    job = Job(tmp_path, nproc=2, spares=kills, script=NOCODE / name, out_arg=False, name="job",
              script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")],
              env={"BATON_LOG": "INFO"})
    try:
        at = rnd.randint(5, steps // (2 * kills))
        for k in range(kills):
            job.wait_step(at * (k + 1), timeout=120)
            if k:
                job.wait_until(lambda st: st["operation"] is None and st["state"] == "running" and
                               len([e for e in job.events() if e["status"] == "resolved"]) >= k, timeout=120)
            time.sleep(rnd.uniform(0, 0.05))
            victim = rnd.randint(0, 1)
            job.signal_rank(victim, sig)
        code = job.wait(timeout=170)
    finally:
        job.kill()
    log = job.log(None)
    with open(os.environ.get("CAMPAIGN_OUT", "/tmp/campaign.jsonl"), "a") as f:
        ev = job.events()
        f.write(json.dumps({"i": i, "script": name, "at": at, "victim": victim, "code": code,
                            "events": [(e["kind"], e["status"], e.get("steps_rerun"), e.get("note")) for e in ev],
                            "went_back": "back from the head" in log,  # a sharded survivor ran a step again
                            "stop": [l for l in log.splitlines() if "The job stops here" in l][:1]}) + "\n")
    if code != 0:
        pytest.skip("stopped: " + (log[-600:]))
    compare(ref, run)
