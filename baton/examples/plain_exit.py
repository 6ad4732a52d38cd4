"""How the plain torchrun versions of the examples end: without interpreter teardown.

With torch 2.13, a gloo worker thread can still hold the last reference to a finished
collective's tensors when the script returns (it needs the GIL to drop it, and the main
thread held it). If the interpreter is finalizing by then, Python ends that thread in the
middle of a C++ destructor and the process aborts: SIGABRT, "terminate called without an
active exception", after a run that finished. `destroy_process_group()` does not prevent it:
it leaves gloo's threads running while any object (an FSDP module, a device mesh) still
refers to the group. We saw it in about one run in four of `resnet.py --plain --export` on
2 cores, and torchrun then reports the whole run failed.

baton's workers end the same way after `job.finish()`; this is the torchrun twin of that."""

from __future__ import annotations

import logging
from typing import NoReturn

import torch.distributed as dist

from baton.worker.exit import exit_quietly


def leave(code: int = 0) -> NoReturn:
    """Destroy the process groups, flush what the script printed and logged, and exit."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    exit_quietly(code)
