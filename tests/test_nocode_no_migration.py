"""`baton run --no-migration`: an unmodified torchrun script runs as torchrun runs it (every
rank's exported state bit for bit equal), and its first failure (a rank killed with
SIGKILL, or hung with SIGSTOP) ends the whole job promptly and non-zero, naming the rank,
instead of leaving the others in a collective until gloo's timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nocode_runs import ENV, NOCODE, differences, exports, torchrun

SCRIPT = NOCODE / "trainer_ddp.py"


def _baton(tmp_path: Path, *args: str) -> subprocess.Popen:
    out = open(tmp_path / "baton.log", "w")
    return subprocess.Popen([sys.executable, "-m", "baton.cli", "run", "--no-migration", "--nproc", "2",
                             str(SCRIPT), *args], cwd=tmp_path, env={**os.environ, **ENV}, stdout=out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "baton.log").read_text()


def _wait_for(tmp_path: Path, proc: subprocess.Popen, pattern: str) -> re.Match:
    """Block until the job's output matches `pattern` (progress, not time; the test timeout bounds it)."""
    while True:
        found = re.search(pattern, _log(tmp_path))
        if found:
            return found
        assert proc.poll() is None, _log(tmp_path)[-4000:]
        time.sleep(0.05)


def test_a_failure_free_run_is_bitwise_torchruns(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    torchrun(SCRIPT, ["--snapshot-path", str(ref / "snap.pt"), "--export", str(ref / "export")], 2, ref)
    proc = _baton(run, "--snapshot-path", str(run / "snap.pt"), "--export", str(run / "export"))
    assert proc.wait(timeout=170) == 0, _log(run)
    for rank, (a, b) in enumerate(zip(exports(ref / "export", 2), exports(run / "export", 2))):
        assert differences(a, b) == [], f"rank {rank}"
    assert (run / "snap.pt").read_bytes() != b""


@pytest.mark.parametrize("fault, victim, said", [
    (signal.SIGKILL, 1, "was killed by SIGKILL"),
    (signal.SIGSTOP, 0, "is stopped (SIGSTOP)"),
])
def test_the_first_failure_ends_the_job_promptly(tmp_path, fault, victim, said):
    proc = _baton(tmp_path, "1000", "1000", "--snapshot-path", str(tmp_path / "snap.pt"))
    try:
        pids = {int(r): int(p) for r, p in
                re.findall(r"rank (\d+) pid (\d+)", _wait_for(tmp_path, proc, r"started with --no-migration.*").group(0))}
        _wait_for(tmp_path, proc, r"\[RANK\d\] Epoch 2 ")  # training, with collectives under way
        os.kill(pids[victim], fault)
        code = proc.wait(timeout=120)  # gloo's own timeout would be 30 minutes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = _log(tmp_path)
    assert code != 0, log[-3000:]
    assert f"rank {victim} (pid {pids[victim]}) {said}" in log and "Restart it from your own checkpoint" in log
    assert "Epoch 999 " not in log
    for pid in pids.values():  # nothing left behind, the stopped rank included
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
