"""DTensor checks that never import torch.distributed.tensor.

Importing that module costs about 1.5 CPU-seconds on our 2-core dev machine (its operator
registrations), more than all of baton's own modules. A worker forked from a job's zygote
has it already (the zygote preloads torch._dynamo, which imports it), but a worker started
as a process of its own, or a tool reading a state, need not pay for it: no DTensor can
exist before the module is imported (by FSDP2, a device mesh, dynamo, the script itself),
so a check asks for the class only once it is there.
"""

from __future__ import annotations

import sys
from typing import Any


def dtensor_class() -> type | None:
    """DTensor, if anything in this process has imported it; else None (none exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(x: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(x, cls)
