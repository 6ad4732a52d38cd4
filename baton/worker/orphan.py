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


def die_with_parent() -> None:
    expected = os.environ.get("BATON_PARENT_PID")
    if not expected or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # best effort: the control channel still notices the launcher is gone
    if os.getppid() != int(expected):
        os._exit(1)  # the launcher died before we could ask
