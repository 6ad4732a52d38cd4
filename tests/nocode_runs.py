"""Running test scripts (those of tests/nocode/, and sources the tests write) under torchrun and
under `baton run`, with faults injected, and comparing what each rank exported (`--export DIR`:
DIR/rank{N}.pt) bit for bit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests.jobs import Job

NOCODE = Path(__file__).resolve().parent / "nocode"
INJECT = NOCODE.parent / "inject"  # fault injection (baton_test_faults.py, loaded by its sitecustomize.py)
ENV = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, args: list[str], nproc: int, cwd: Path, stall_s: float = 60,
             env: dict[str, str] | None = None) -> str:
    """Run the script under torchrun; its output (asserts exit 0).

    Bounded by progress, not by a guess of its length: it may run as long as it prints
    something every `stall_s` seconds. A run that stalls is killed, whole tree, and run once
    more: the scripts' DataLoaders fork workers every epoch, and CPython 3.11 can deadlock a
    forked child after fork (`PyOS_AfterFork_Child` waiting on the runtime's thread-state
    lock another thread held), plain torchrun with no baton in sight. Twice is a failure."""
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun_bin)] if torchrun_bin.exists() else [sys.executable, "-m", "torch.distributed.run"]
    for attempt in (1, 2):
        cmd = [*launcher, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), str(script), *args]
        out, code = _run_watched(cmd, cwd, {**os.environ, **ENV, **(env or {})}, stall_s)
        if code is not None:
            assert code == 0, out[-6000:]
            return out
        print(f"torchrun {script.name} printed nothing for {stall_s:g}s (attempt {attempt}): killed", file=sys.stderr)
    raise AssertionError(f"torchrun {script.name} stalled twice:\n{out[-4000:]}")


def _run_watched(cmd: list[str], cwd: Path, env: dict[str, str], stall_s: float) -> tuple[str, int | None]:
    """Run `cmd`; its output and exit code, or None for the code when it printed nothing for
    `stall_s` seconds (then it and every process under it are killed)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    heard = [time.monotonic()]

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            heard[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        if time.monotonic() - heard[0] > stall_s:
            for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun's ranks run in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            reader.join(timeout=10)
            return "".join(lines), None
        time.sleep(0.2)
    reader.join(timeout=30)
    return "".join(lines), proc.returncode


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _descendants(k)]


def exports(folder: Path, nproc: int) -> list[dict[str, Any]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two exported states differ, bit for bit (tensors by bytes, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.shape != b.shape:
            return [path]
        same = torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return []
    try:
        equal = bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        import numpy as np

        equal = np.array_equal(a, b)
    return [] if equal else [path]


def faulted(tmp_path, script, fault: str, *, where: str = "MID_STEP", name: str = "job",
             script_args: list[str] | None = None, env: dict[str, str] | None = None) -> tuple[int, Job]:
    """Run `script` under baton with a real signal injected (tests/inject: BATON_TEST_SIGNAL_<where>,
    "rank:step:signal", once per job), or another fault (`where` "GLITCH_...": BATON_TEST_<where>);
    its exit code and the job."""
    key = f"BATON_TEST_{where}" if where.startswith("GLITCH_") else f"BATON_TEST_SIGNAL_{where}"
    job = Job(tmp_path, nproc=2, spares=1, script=script, out_arg=False, name=name, script_args=script_args,
              env={"PYTHONPATH": str(INJECT), key: fault,
                   "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired"), **(env or {})})
    try:
        return job.wait(timeout=170), job
    finally:
        job.kill()


def compare(ref, run) -> None:
    for rank, (a, b) in enumerate(zip(exports(ref / "export", 2), exports(run / "export", 2))):
        assert differences(a, b) == [], f"rank {rank}"


def killed_in_step(tmp_path, torchrun_reference, source: str, fault: str, where: str = "AFTER_STEP"):
    """`source` (exporting each rank's state to $EXPORT) under torchrun and under baton with the
    fault (AFTER_STEP unless `where` says): it fired, the job ended 0 and every rank equals
    torchrun's. The two runs' folders and the job."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    ref = torchrun_reference(script, [], env={"EXPORT": "{d}/export"})
    run = tmp_path / "job"
    (run / "export").mkdir(parents=True)
    code, job = faulted(tmp_path, script, fault, where=where, env={"EXPORT": str(run / "export")})
    assert code == 0 and (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    return ref, run, job
