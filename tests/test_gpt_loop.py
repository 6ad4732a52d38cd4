"""A nanoGPT-shaped loop (iteration-based, `torch.randint` batches drawn inside the step,
gradient accumulation with `no_sync()`, hand-set warm-up + cosine LR, bf16 autocast,
clipping, an evaluation every 15 steps with random batches and an `all_reduce`, rank 0's
best validation loss and checkpoint, a resume block): planned, taint, kill -9 and SIGSTOP,
inside a step and during evaluation, end with every rank's state bit-for-bit equal to the
failure-free run."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.jobs import Job

GPT = Path(__file__).resolve().parent.parent / "baton" / "examples" / "gpt.py"
NPROC = 3
EVAL_EVERY = 15
ARGS = ["--max-iters", "45", "--eval-interval", str(EVAL_EVERY), "--step-sleep", "0.04", "--eval-sleep", "1.0"]


def _job(tmp: Path, name: str, spares: int = 1, extra: list[str] | None = None,
         run_args: list[str] | None = None) -> Job:
    out_dir = tmp / name / "ckpt"
    out_dir.mkdir(parents=True, exist_ok=True)
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script=GPT, name=name, run_args=run_args,
               script_args=[*ARGS, "--out-dir", str(out_dir), *(extra or [])])


def _states(job: Job) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f"{job.out}.rank{r}") for r in range(NPROC)]


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in sorted(set(a) | set(b))
            if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("ref"), "ref", spares=0)
    assert job.wait(timeout=180) == 0, job.log()
    states = _states(job)
    # Parameters are shared; random streams are each rank's own (per-rank seed, own draws).
    assert not [k for k in _diff(states[0], states[2]) if k.startswith("model.")]
    assert not torch.equal(states[0]["rng"], states[1]["rng"])
    assert float(states[0]["best"]) < 1e9, "rank 0 never recorded a validation loss"
    return states, (job.dir / "ckpt" / "ckpt.pt").read_bytes()


def _check(job: Job, reference, kinds: list[str]) -> list[dict]:
    states, ckpt = reference
    assert job.wait(timeout=240) == 0, job.log()
    for rank, (got, want) in enumerate(zip(_states(job), states)):
        diff = _diff(got, want)
        assert not diff, f"rank {rank} differs from the failure-free run in {diff}:\n{job.log()}"
    events = job.events()
    assert [e["kind"] for e in events] == kinds, events
    assert all(e["status"] == "resolved" and e["steps_lost"] == 0 and e["resolved_without_rollback"]
               for e in events), events
    # Rank 0's checkpoint (written in the evaluation) is the failure-free run's, byte for byte
    # in what it holds.
    got = torch.load(job.dir / "ckpt" / "ckpt.pt")
    want = torch.load(__import__("io").BytesIO(ckpt))
    assert got["iter_num"] == want["iter_num"] and got["best_val_loss"] == want["best_val_loss"]
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    return events


def _in_eval(job: Job) -> None:
    """Wait until every rank has finished step 15 and is inside the 1 s evaluation."""
    job.wait_until(lambda st: min(r["step"] for r in st["ranks"]) >= EVAL_EVERY, what="evaluation")


def test_planned_move_inside_a_step(tmp_path, reference):
    job = _job(tmp_path, "planned")
    try:
        job.wait_step(4)
        job.client.migrate(2)
        _check(job, reference, ["planned"])
    finally:
        job.kill()


def test_taint_during_evaluation(tmp_path, reference):
    job = _job(tmp_path, "taint")
    try:
        _in_eval(job)
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 0)
        job.client.taint(slot, "ecc")
        events = _check(job, reference, ["pre-emptive"])
        assert events[0]["rank"] == 0 and events[0]["from_slot"] == slot
    finally:
        job.kill()


def test_kill_9_rank_0_inside_a_step(tmp_path, reference):
    job = _job(tmp_path, "kill0")
    try:
        job.wait_step(5)
        job.signal_rank(0, signal.SIGKILL)
        events = _check(job, reference, ["unplanned"])
        assert events[0]["rank"] == 0
    finally:
        job.kill()


def test_kill_9_during_evaluation(tmp_path, reference):
    job = _job(tmp_path, "kill1eval")
    try:
        _in_eval(job)
        job.signal_rank(1, signal.SIGKILL)
        events = _check(job, reference, ["unplanned"])
        assert events[0]["rank"] == 1
    finally:
        job.kill()


def test_sigstop_during_evaluation(tmp_path, reference):
    job = _job(tmp_path, "stop2eval", run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        _in_eval(job)
        job.signal_rank(2, signal.SIGSTOP)
        events = _check(job, reference, ["unplanned"])
        assert events[0]["rank"] == 2 and "hung" in events[0]["cause"]
    finally:
        job.kill()


def test_resumed_run_survives_a_kill(tmp_path):
    """A run resumed from rank 0's checkpoint (`job.steps(total, start=...)`); the joiner skips
    the resume block (job.joined) and still starts where its rank was, with the same LR."""
    first = _job(tmp_path, "first", spares=0, extra=["--max-iters", "30"])
    assert first.wait(timeout=180) == 0, first.log()
    ckpt = first.dir / "ckpt" / "ckpt.pt"
    assert torch.load(ckpt)["iter_num"] == 30
    runs = {}
    for name, spares in (("resumed-ref", 0), ("resumed-kill", 1)):
        (tmp_path / name / "ckpt").mkdir(parents=True)
        shutil.copy(ckpt, tmp_path / name / "ckpt" / "ckpt.pt")
        job = _job(tmp_path, name, spares=spares, extra=["--max-iters", "60", "--resume"])
        try:
            if spares:
                job.wait_step(36)
                job.signal_rank(1, signal.SIGKILL)
            assert job.wait(timeout=180) == 0, job.log()
            runs[name] = _states(job)
            if spares:
                assert [e["kind"] for e in job.events()] == ["unplanned"]
        finally:
            job.kill()
    for rank in range(NPROC):
        diff = _diff(runs["resumed-ref"][rank], runs["resumed-kill"][rank])
        assert not diff, f"rank {rank} differs after a kill in a resumed run: {diff}"
