"""DataLoader worker processes with random augmentation (`num_workers=2`, a random flip and
noise per sample drawn in the workers): a rank replaced in the middle of an epoch gets the
same augmented batches its predecessor would have, so the final state is bit-for-bit the
failure-free run's."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.jobs import Job, check_resolved_exact

EPOCHS = Path(__file__).resolve().parent.parent / "baton" / "examples" / "epochs.py"
NPROC = 3
ARGS = ["--epochs", "3", "--workers", "2", "--augment", "--step-sleep", "0.05", "--val-sleep", "0.2"]


def _job(tmp: Path, name: str, spares: int = 1) -> Job:
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script_args=ARGS, name=name, script=EPOCHS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("ref"), "ref", spares=0)
    assert job.wait(timeout=170) == 0, job.log()
    return job.all_rank_params(NPROC)


def _check(job: Job, reference) -> list[dict]:
    return check_resolved_exact(job, reference, timeout=170)


def test_augmentation_in_workers_is_exact_after_a_kill_mid_epoch(tmp_path, reference):
    job = _job(tmp_path, "kill")
    try:
        job.wait_step(16 + 6)  # inside the second epoch: its workers have transformed batches already
        job.signal_rank(1, signal.SIGKILL)
        assert [e["kind"] for e in _check(job, reference)] == ["unplanned"]
    finally:
        job.kill()


def test_augmentation_in_workers_is_exact_after_a_planned_move(tmp_path, reference):
    job = _job(tmp_path, "planned")
    try:
        job.wait_step(5)
        job.client.migrate(0)
        assert [e["kind"] for e in _check(job, reference)] == ["planned"]
    finally:
        job.kill()


def test_persistent_workers_are_refused_with_a_clear_error(tmp_path):
    script = tmp_path / "persistent.py"
    script.write_text(
        "import torch, baton\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "job = baton.init()\n"
        "model = job.wrap(torch.nn.Linear(2, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2, num_workers=1, persistent_workers=True)\n"
        "job.track(data=loader)\n")
    job = Job(tmp_path, nproc=2, spares=0, steps=0, script=script, name="persistent")
    try:
        assert job.wait(timeout=120) != 0
        assert "persistent_workers=False" in job.log()
    finally:
        job.kill()
