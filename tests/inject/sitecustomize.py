"""Loads the test faults (baton_test_faults.py beside this file) into every Python process of a job
that runs worker code: the zygote, ranks, spares, a script's own subprocesses.

Not into the launcher (`baton.cli`) or the rendezvous store's process: nothing the faults
patch runs there, and importing torch and baton's worker for them cost each test job about
3 CPU-s of its launcher's time, counted as the control plane's."""

import sys


def _a_control_process() -> bool:
    argv = sys.orig_argv
    if "-m" in argv[1:-1]:
        return argv[argv.index("-m") + 1] in ("baton.cli", "baton.store.rendezvous_process")
    return len(argv) > 1 and argv[1].endswith("/bin/baton")  # the console script


if not _a_control_process():
    import baton_test_faults  # noqa: F401
