"""DataLoader worker processes with random augmentation (`num_workers=2`, a random flip and
noise per sample drawn in the workers): a rank replaced in the middle of an epoch gets the
same augmented batches its predecessor would have, so the final state is bit-for-bit the
failure-free run's."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.jobs import Job, check_resolved_exact
from tests.once import once

EPOCHS = Path(__file__).resolve().parent.parent / "baton" / "examples" / "epochs.py"
NPROC = 3
ARGS = ["--epochs", "3", "--workers", "2", "--augment", "--step-sleep", "0.05", "--val-sleep", "0.2"]


def _job(tmp: Path, name: str, spares: int = 1) -> Job:
    return Job(tmp, nproc=NPROC, spares=spares, steps=0, script_args=ARGS, name=name, script=EPOCHS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "loader-workers", _reference)


def _reference(tmp: Path) -> list:
    job = _job(tmp, "ref", spares=0)
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


def test_a_gloo_descriptor_number_reused_by_a_loader_socket_is_not_shut_down():
    """gloo closes the pair of a dead peer and the loader's fd handoff may take its number at
    once: breaking the generation's transport must leave that new socket alone (it did not,
    and the rank's next batch failed with EOFError)."""
    import os
    import socket

    from baton.worker.group import _socket_fds, shut_down_sockets

    gloo_end, peer_end = socket.socketpair()
    number = gloo_end.fileno()
    formed = {number: _socket_fds()[number]}
    gloo_end.close()
    peer_end.close()
    loader_end, worker_end = socket.socketpair()
    if loader_end.fileno() != number:
        os.dup2(loader_end.fileno(), number)
    made = loader_end.detach()  # the number now names the loader's socket
    if made != number:
        os.close(made)
    try:
        assert _socket_fds()[number] != formed[number]
        shut_down_sockets(formed)
        worker_end.sendall(b"batch")
        assert os.read(number, 5) == b"batch"
    finally:
        os.close(number)
        worker_end.close()

    alive, other = socket.socketpair()
    shut_down_sockets({alive.fileno(): _socket_fds()[alive.fileno()]})
    assert other.recv(1) == b""  # still the formed socket: shut down, the peer sees the end
    alive.close()
    other.close()


def test_an_error_in_a_process_the_script_forked_does_not_speak_for_the_rank(tmp_path):
    """multiprocessing's resource_sharer thread calls sys.excepthook itself, in a DataLoader
    worker: the hook the worker inherited must not report a script error for the rank."""
    import os
    import sys

    from baton.worker import job as job_mod

    reports = tmp_path / "reports"

    class Channel:
        def report_now(self, msg):  # noqa: ANN001
            with open(reports, "a") as f:
                f.write(f"{os.getpid()} {type(msg).__name__}\n")

    saved = sys.excepthook
    job_mod._install_excepthook(Channel())
    try:
        pid = os.fork()
        if pid == 0:
            try:
                raise BrokenPipeError(32, "Broken pipe")
            except BrokenPipeError:
                sys.stderr = open(os.devnull, "w")
                sys.excepthook(*sys.exc_info())
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert not reports.exists()
        try:
            raise ValueError("the script's own bug")
        except ValueError:
            sys.stderr, real = open(os.devnull, "w"), sys.stderr
            try:
                sys.excepthook(*sys.exc_info())
            finally:
                sys.stderr = real
        assert reports.read_text() == f"{os.getpid()} UserError\n"
    finally:
        sys.excepthook = saved
        job_mod._EXIT_CODE[0] = 0
