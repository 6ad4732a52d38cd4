"""How a worker process leaves."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

def exit_quietly(code: int) -> NoReturn:
    """Flush what was printed and leave now, without interpreter teardown: gloo's threads
    could still be dropping a collective's tensors then and abort the process
    (baton/examples/plain_exit.py says how)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

