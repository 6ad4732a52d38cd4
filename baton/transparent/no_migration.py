"""`baton run --no-migration`: a torchrun script run as torchrun would, with no moves.

For scripts this version cannot move (see `baton explain`): every rank starts with
torchrun's environment, and the first failure ends the job promptly, with what failed
and what to do, instead of leaving the others waiting in a collective until its timeout
or restarting anything: the user restarts from their own checkpoint. A failure is a rank
that exits non-zero or is killed, or one that is stopped (SIGSTOP: it can make no
progress and its peers would wait for it). A rank that exits 0 while others still run is
the script's own business, as under torchrun.

The failure named is the first one, by when each rank ended: a killed rank's peers fail
their next collective and exit non-zero a moment later, and naming one of them would send
the user after the wrong rank.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from baton.worker import orphan
from baton.worker.torchrun_env import free_port, torchrun_env

POLL_S = 0.1
GRACE_S = 5.0
# A rank killed by a signal that ended within this long of the first to end is the cause:
# its peers' collectives fail when its sockets close, and a waiter thread may be woken late.
CAUSE_WINDOW_S = 0.5


@dataclass(frozen=True)
class Failure:
    rank: int
    pid: int
    what: str  # "exited with code 3", "was killed by SIGKILL", "is stopped (SIGSTOP)"
    code: int  # the job's exit code
    killed: bool = False  # by a signal: a cause, where its peers' failed collectives follow it


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _failure(rank: int, proc: subprocess.Popen) -> Failure | None:
    code = proc.poll()
    if code is None:
        return Failure(rank, proc.pid, "is stopped (SIGSTOP): it makes no progress and its peers wait for it",
                       1) if _stopped(proc.pid) else None
    if code == 0:
        return None
    if code < 0:
        return Failure(rank, proc.pid, f"was killed by {signal.Signals(-code).name}", 1, killed=True)
    return Failure(rank, proc.pid, f"exited with code {code}", code)


class _EndTimes:
    """When each rank's process ended, taken by a thread waiting on it (polling would see
    several ends at once and lose their order)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self._at: dict[int, float] = {}
        for p in procs:
            threading.Thread(target=self._wait, args=(p,), daemon=True, name=f"baton-wait-{p.pid}").start()

    def _wait(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._at.setdefault(proc.pid, time.monotonic())

    def at(self, pid: int) -> float:
        """When `pid` ended; infinity while its waiter has not said (a stopped rank, or one
        seen ended by a poll a moment before its waiter ran): it sorts after those that did."""
        return self._at.get(pid, math.inf)


def _cause(failures: list[Failure], ends: _EndTimes) -> Failure:
    """The failure that started it: the first to end, or a signal's death close behind it."""
    ordered = sorted(failures, key=lambda f: ends.at(f.pid))
    first = ordered[0]
    killed = [f for f in ordered if f.killed and ends.at(f.pid) <= ends.at(first.pid) + CAUSE_WINDOW_S]
    return killed[0] if killed else first


def run(script: str, args: list[str], nproc: int, env: dict[str, str] | None = None) -> int:
    """Run `nproc` ranks of `script`; the job's exit code (0 when every rank exits 0)."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nproc):
            child_env = {**os.environ, **(env or {}), **torchrun_env(rank, nproc, "127.0.0.1", port, "baton")}
            child_env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(subprocess.Popen([sys.executable, script, *args], env=child_env,
                                          start_new_session=True, preexec_fn=orphan.ask_to_die_with_parent))
        pids = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(procs))
        print(f"[baton] {nproc} rank(s) of {script} started with --no-migration ({pids}): nothing moves; the "
              "first failure ends the job", file=sys.stderr, flush=True)
        ends = _EndTimes(procs)
        while True:
            if interrupted:
                print(f"[baton] received signal {interrupted[0]}: stopping the job", file=sys.stderr, flush=True)
                _stop(procs, signal.Signals(interrupted[0]))
                return 128 + interrupted[0]
            failures = [f for rank, p in enumerate(procs) if (f := _failure(rank, p)) is not None]
            if failures:
                first = _cause(failures, ends)
                after = "".join(f"; then rank {f.rank} {f.what}" for f in failures if f is not first)
                print(f"[baton] rank {first.rank} (pid {first.pid}) {first.what}{after}. With --no-migration "
                      "nothing moves: the job stops now. Restart it from your own checkpoint (or run it without "
                      "--no-migration once `baton explain` refuses nothing).", file=sys.stderr, flush=True)
                _stop(procs, signal.SIGTERM)
                return first.code
            if all(p.poll() == 0 for p in procs):
                return 0
            time.sleep(POLL_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _stop(procs, signal.SIGKILL)


def _stop(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    """Signal every rank's process group; SIGKILL what is left after the grace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, sig)
            if sig != signal.SIGKILL:
                os.killpg(p.pid, signal.SIGCONT)  # a stopped rank cannot act on SIGTERM otherwise
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
