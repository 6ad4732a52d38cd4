"""FSDP2 on baton's live group (issue 10's base): a per-block `fully_shard` model with AdamW
and clip_grad_norm_ trains over LiveGroup exactly as over torch's own gloo group, bit for
bit on every rank's shards, across a generation swap that leaves the first generation's
sockets shut (so FSDP's all-gathers and reduce-scatters follow the live group)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import Job, state_diff
from tests.served import free_port

HELPER = Path(__file__).resolve().parent / "fsdp_on_live_group.py"
REPO = HELPER.parent.parent


def _run(tmp: Path, mode: str, world: int) -> list[dict[str, torch.Tensor]]:
    port = free_port()
    if mode == "live":  # baton's launcher hosts the store; here the test does
        from baton.store.rendezvous_process import RendezvousProcess

        store = RendezvousProcess("127.0.0.1").start()
        port = store.port
    outs = [tmp / f"{mode}.rank{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HELPER), mode, str(r), str(world), str(port), str(outs[r])],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        if mode == "live":
            store.stop()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-6000:]
    return [torch.load(o) for o in outs]


def test_fsdp2_on_the_live_group_matches_torchs_own_group_bitwise_across_a_generation(tmp_path):
    plain = _run(tmp_path, "plain", 2)
    live = _run(tmp_path, "live", 2)
    assert len(plain[0]) > 10 and any(k.startswith("opt.") for k in plain[0])
    assert state_diff(plain[0], plain[1]), "the two ranks hold the same shard: nothing was sharded"
    for rank in range(2):
        assert not state_diff(plain[rank], live[rank]), f"rank {rank}: {state_diff(plain[rank], live[rank])}"


LLAMA = REPO / "baton" / "examples" / "llama.py"
LLAMA_ARGS = ["--steps", "12", "--eval-every", "5"]


def test_the_llama_example_under_baton_run_matches_torchrun_bitwise(tmp_path):
    """baton/examples/llama.py (per-block fully_shard, AdamW, LambdaLR, clipping, an
    evaluation with an all_reduce) with no failure: every rank's shards, optimizer state, LR
    and random stream equal the same script's under torchrun."""
    torchrun = Path(sys.executable).with_name("torchrun")
    plain = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                            "--master_port", str(free_port()), str(LLAMA), "--plain", *LLAMA_ARGS,
                            "--out", str(tmp_path / "plain.pt")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    job = Job(tmp_path, nproc=2, spares=0, steps=0, script=LLAMA, name="baton", script_args=[*LLAMA_ARGS],
              run_args=["--verify-every", "4"])  # the replicated-state check leaves each rank's shards out
    try:
        assert job.wait(timeout=180) == 0, job.log()
    finally:
        job.kill()
    got = job.all_rank_params(2)
    assert state_diff(got[0], got[1]) and any(k.startswith("opt.") for k in got[0]), "nothing was sharded"
    for rank in range(2):
        want = torch.load(tmp_path / f"plain.pt.rank{rank}")
        assert not state_diff(got[rank], want), f"rank {rank}: {state_diff(got[rank], want)}"


def test_a_lost_fsdp_rank_stops_the_job_loudly_and_moves_are_refused(tmp_path):
    """Until sharded ranks can move: a planned move of an FSDP2 rank is refused with the
    reason, a taint marks the slot but moves nothing, and a killed rank ends the job at once
    with a non-zero exit, the reason, and a failed event in the ledger; never a job that
    goes on (or ends with 0) without that rank's shard."""
    job = Job(tmp_path, nproc=2, spares=1, steps=0, script=LLAMA, name="lost",
              script_args=["--steps", "2000", "--eval-every", "50"])
    try:
        job.wait_step(5)
        with pytest.raises(Exception, match="hold FSDP2/DTensor shards") as refused:
            job.client.migrate(1)
        assert "409" in str(refused.value) or "cannot migrate rank 1" in str(refused.value)
        taint = job.client.taint("local/1", "ecc")
        assert taint["moving_ranks"] == [] and "its rank stays" in taint["note"], taint
        job.signal_rank(1, signal.SIGKILL)
        code = job.wait(timeout=60)
        assert code != 0, job.log()
        assert "cannot move or rebuild a sharded rank yet" in job.log(), job.log()
        events = job.events()
        assert [(e["kind"], e["status"], e["rank"]) for e in events] == [("unplanned", "failed", 1)], events
        assert events[0]["resolved_without_rollback"] is False
    finally:
        job.kill()
