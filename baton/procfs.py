"""What /proc says of another process: the launcher's view of the helpers it started."""

from __future__ import annotations

import os


def cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) a live process has used; 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def running(pid: int) -> bool:
    """Whether `pid` still runs. A zombie (dead, not yet reaped: an orphan waits for init,
    which in a container may reap late or never) has ended; `os.kill(pid, 0)` says it lives."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
