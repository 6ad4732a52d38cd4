"""baton: keep distributed PyTorch training running through failures by live-migrating ranks.

    import baton
    job = baton.init()
    model = job.wrap(MyModel())
    ...

`import baton` stays light (the CLI imports it); torch loads on first use of init().
"""

from __future__ import annotations

import os as _os
from typing import Any

__version__ = "0.1.0"
__all__ = ["init", "Job", "Step", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("init", "Job", "Step"):
        from baton.worker import job

        return getattr(job, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")


def _worker_process_started() -> None:
    """What a worker's process does before its script runs: at this import, or, in a worker
    the zygote forked (which imported baton before it was a worker), right after the fork."""
    if _os.environ.get("BATON_WORKER_ID") and _os.environ.get("BATON_MODE") == "model-aware":
        from baton.worker import rank_env

        rank_env.install()  # RANK, WORLD_SIZE ... read before baton.init() join the job first, as torchrun sets them


_worker_process_started()
