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
