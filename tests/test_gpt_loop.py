"""A nanoGPT-shaped loop (iteration-based, `torch.randint` batches drawn inside the step,
gradient accumulation with `no_sync()`, hand-set warm-up + cosine LR, bf16 autocast,
clipping, an evaluation every 15 steps with random batches and an `all_reduce`, rank 0's
best validation loss and checkpoint, a resume block): planned, taint, kill -9 and SIGSTOP,
inside a step and during evaluation, end with every rank's state bit-for-bit equal to the
failure-free run."""

from __future__ import annotations

import shutil
import signal

import pytest
import torch

from tests.gpt_job import NPROC, check_equal, gpt_job, in_eval, states
from tests.jobs import state_diff
from tests.once import once


def _check(job, reference, kinds: list[str]) -> list[dict]:
    events = check_equal(job, reference)
    assert [e["kind"] for e in events] == kinds, events
    assert all(e["status"] == "resolved" and e["steps_lost"] == 0 and e["resolved_without_rollback"]
               for e in events), events
    return events


def test_taint_during_evaluation(tmp_path, gpt_reference):
    """The ranks are held in the evaluation after step 15 (it waits on a file) until the move
    has picked its boundary: the one right after the evaluation, whenever in the beat period
    they entered it, not one extrapolated at their step rate."""
    hold = tmp_path / "hold-eval"
    hold.touch()
    job = gpt_job(tmp_path, "taint", extra=["--eval-hold", str(hold)])
    try:
        in_eval(job)
        at = job.status()["ranks"][0]["step"]
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 0)
        job.client.taint(slot, "ecc")
        st = job.wait_until(lambda st: (st.get("operation") or {}).get("target_step") is not None,
                            what="the move's target", timeout=120)
        hold.unlink()
        assert st["operation"]["target_step"] == at + 1, st["operation"]
        events = _check(job, gpt_reference, ["pre-emptive"])
        assert events[0]["rank"] == 0 and events[0]["from_slot"] == slot
    finally:
        job.kill()


def test_a_pre_copied_taint_during_evaluation(tmp_path, gpt_reference):
    """`--pre-copy`: the joiner follows rank 0's AdamW steps (gradients clipped, accumulated
    under no_sync, the warm-up/cosine rate the script sets in the optimizer's settings) while
    the evaluation and the steps go on; the pause moves rank 0's own state only. Bitwise."""
    job = gpt_job(tmp_path, "pre-copied", run_args=["--pre-copy"])
    try:
        in_eval(job)
        slot = next(r["slot"] for r in job.status()["ranks"] if r["rank"] == 0)
        job.client.taint(slot, "ecc")
        events = _check(job, gpt_reference, ["pre-emptive"])
        pc = events[0]["pre_copy"]
        assert pc["ok"] and pc["steps"] >= 1 and "follow" in events[0]["phases"], events[0]
    finally:
        job.kill()


def test_kill_9_rank_0_inside_a_step(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "kill0")
    try:
        job.wait_step(5)
        job.signal_rank(0, signal.SIGKILL)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 0
    finally:
        job.kill()


def test_kill_9_during_evaluation(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "kill1eval")
    try:
        in_eval(job)
        job.signal_rank(1, signal.SIGKILL)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 1
    finally:
        job.kill()


def test_a_hot_spare_takes_over_a_rank_lost_during_evaluation(tmp_path, gpt_reference):
    """`--hot-spares`: the spare mirrors rank 0's AdamW steps (two parameter groups, the tied
    embedding and head as one tensor, clipped gradients accumulated under no_sync, the rate the
    script sets by hand); rank 1 killed in the evaluation is rebuilt from the mirror and its
    buddy's copy of its own state. Bitwise."""
    job = gpt_job(tmp_path, "hot", run_args=["--hot-spares"])
    try:
        job.wait_until(lambda s: any(sp.get("hot", {}).get("state") == "current" for sp in s["spares"]),
                       timeout=120, what="a hot spare keeping pace")
        in_eval(job)
        job.signal_rank(1, signal.SIGKILL)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 1 and events[0]["hot_spare"]["used"], events[0]
    finally:
        job.kill()


def test_sigstop_during_evaluation(tmp_path, gpt_reference):
    job = gpt_job(tmp_path, "stop2eval", run_args=["--op-timeout", "2", "--heartbeat-timeout", "2"])
    try:
        in_eval(job)
        job.signal_rank(2, signal.SIGSTOP)
        events = _check(job, gpt_reference, ["unplanned"])
        assert events[0]["rank"] == 2 and "hung" in events[0]["cause"]
    finally:
        job.kill()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Rank 0's checkpoint after 30 iterations, and the failure-free run resumed from it."""
    return once(tmp_path_factory, "gpt-resumed", _resumed_reference)


def _resumed_reference(tmp):
    first = gpt_job(tmp, "first", spares=0, extra=["--max-iters", "30"])
    assert first.wait(timeout=180) == 0, first.log()
    ckpt = first.dir / "ckpt" / "ckpt.pt"
    assert torch.load(ckpt)["iter_num"] == 30
    ref = _resumed_job(tmp, "resumed-ref", ckpt, spares=0)
    try:
        assert ref.wait(timeout=180) == 0, ref.log()
        return ckpt, states(ref)
    finally:
        ref.kill()


def _resumed_job(tmp, name: str, ckpt, spares: int = 1, run_args: list[str] | None = None):
    (tmp / name / "ckpt").mkdir(parents=True)
    shutil.copy(ckpt, tmp / name / "ckpt" / "ckpt.pt")
    return gpt_job(tmp, name, spares=spares, extra=["--max-iters", "60", "--resume"], run_args=run_args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill", "planned"])  # a hung rank: every other gpt test with sigstop
def test_a_resumed_run_survives_every_kind_of_move(tmp_path, resumed, fault):
    """A run resumed from rank 0's checkpoint (`job.steps(total, start=...)`): a joiner skips
    the resume block (job.joined) and still starts where its rank was, with the same LR,
    whether it replaces a killed rank or takes a rank in a planned move (a planned move
    inside a step of this script: the resumed planned case; the stop-detection is the same
    for resumed and fresh runs)."""
    ckpt, reference = resumed
    job = _resumed_job(tmp_path, fault, ckpt)
    try:
        job.wait_step(36)
        if fault == "kill":
            job.signal_rank(1, signal.SIGKILL)
        else:
            job.client.migrate(0)
        assert job.wait(timeout=180) == 0, job.log()
        events = job.events()
        assert [e["kind"] for e in events] == ["planned" if fault == "planned" else "unplanned"], events
        assert all(e["status"] == "resolved" and e["steps_lost"] == 0 for e in events), events
        got = states(job)
    finally:
        job.kill()
    for rank in range(NPROC):
        d = state_diff(reference[rank], got[rank])
        assert not d, f"rank {rank} differs after a {fault} in a resumed run: {d}"
