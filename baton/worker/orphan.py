"""A worker never outlives the `baton run` that started it.

SIGINT and SIGTERM reach the launcher, which stops its workers itself; SIGKILL does not
let it. So each worker asks the kernel to SIGKILL it when its parent dies
(`PR_SET_PDEATHSIG`; that also ends a SIGSTOPped worker, which could not act on its
own), then checks the parent is still the launcher, in case it died before the request.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def ask_to_die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; whether it agreed. Also
    safe in a child between fork and exec (a preexec_fn)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def die_with_parent() -> None:
    expected = os.environ.get("BATON_PARENT_PID")
    if not expected or not ask_to_die_with_parent():
        return  # best effort: the control channel still notices the launcher is gone
    if os.getppid() != int(expected):
        os._exit(1)  # the launcher died before we could ask
