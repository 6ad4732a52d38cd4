"""Test helper: the nanoGPT-shaped example (baton/examples/gpt.py) as a job, and the checks
that compare every rank's full final state with the failure-free run."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tests.jobs import Job, assert_ranks_equal, state_diff

GPT = Path(__file__).resolve().parent.parent / "baton" / "examples" / "gpt.py"
NPROC = 3
EVAL_EVERY = 15
ARGS = ["--max-iters", "45", "--eval-interval", str(EVAL_EVERY), "--step-sleep", "0.04", "--eval-sleep", "1.0"]


def gpt_job(tmp: Path, name: str, spares: int = 1, extra: list[str] | None = None,
            run_args: list[str] | None = None, run_dir: Path | None = None,
            env: dict[str, str] | None = None) -> Job:
    out_dir = tmp / name / "ckpt"
    out_dir.mkdir(parents=True, exist_ok=True)
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script=GPT, name=name, run_args=run_args, run_dir=run_dir, env=env,
               script_args=[*ARGS, "--out-dir", str(out_dir), *(extra or [])])


def states(job: Job) -> list[dict[str, torch.Tensor]]:
    return job.all_rank_params(NPROC)


def reference_run(tmp: Path) -> tuple[list[dict[str, torch.Tensor]], bytes]:
    job = gpt_job(tmp, "ref", spares=0)
    assert job.wait(timeout=180) == 0, job.log()
    got = states(job)
    # Parameters are shared; random streams are each rank's own (per-rank seed, own draws).
    assert not [k for k in state_diff(got[0], got[2]) if k.startswith("model.")]
    assert not torch.equal(got[0]["rng"], got[1]["rng"])
    assert float(got[0]["best"]) < 1e9, "rank 0 never recorded a validation loss"
    return got, (job.dir / "ckpt" / "ckpt.pt").read_bytes()


def check_equal(job: Job, reference, timeout: float = 240) -> list[dict]:
    """The job ends with exit 0, every rank's state and rank 0's checkpoint equal to the
    failure-free run's; returns the ledger."""
    want_states, ckpt = reference
    assert job.wait(timeout=timeout) == 0, job.log()
    assert_ranks_equal(job, want_states)
    got = torch.load(job.dir / "ckpt" / "ckpt.pt")
    want = torch.load(io.BytesIO(ckpt))
    assert got["iter_num"] == want["iter_num"] and got["best_val_loss"] == want["best_val_loss"]
    assert not state_diff(got["model"], want["model"])
    return job.events()


def in_eval(job: Job) -> None:
    """Wait until every rank has finished step 15 or a later multiple of it and is inside the
    evaluation there (each rank says so as it enters it: status's `outside_steps`)."""
    def evaluating(st) -> bool:
        steps = {r["step"] for r in st["ranks"]}
        return (all(r.get("outside_steps") for r in st["ranks"]) and len(steps) == 1
                and min(steps) >= EVAL_EVERY and min(steps) % EVAL_EVERY == 0)
    job.wait_until(evaluating, what="every rank in an evaluation")
