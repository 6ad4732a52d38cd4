"""Patch a module when the script imports it, not before.

Importing FSDP2 (`torch.distributed.fsdp`, which brings `torch.distributed.tensor`) costs
about 1.5 CPU-seconds. A worker forked from the job's zygote has it already (torch._dynamo,
preloaded there, imports it), and the patch is applied at once; a worker started as a
process of its own pays for it only if its script uses FSDP2 (or DDP, whose constructor
imports dynamo): its `fully_shard` must still be baton's before the script reads it, so
the patch runs right after the module's own code, on the first import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Sequence


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[types.ModuleType], None]):
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the module's own finder answers from here on
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_then_patch(module: types.ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def after_import(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """`patch(module)` once `name` is imported: now, if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport(name, patch))
