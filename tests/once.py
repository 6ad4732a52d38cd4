"""A fixture's result computed once per test session, however many pytest-xdist workers ask.

Reference runs (a failure-free job to compare with) are session- or module-scoped, which
pytest-xdist scopes per worker: each worker ran its own copy of every reference its tests
used, a job of several ranks each time. Here the first worker to ask computes it and saves
it (torch.save: tensors, plain values, paths) in the session's shared directory; the others
wait on a file lock and load it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
from filelock import FileLock


def once(tmp_path_factory: Any, key: Any, compute: Callable[[Path], Any]) -> Any:
    """`compute(folder)`, run in a folder of its own by the first worker that asks for `key`."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's directory, shared by its workers
    name = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
    where = root / f"once-{name}"
    with FileLock(str(where) + ".lock"):
        result = where / "result.pt"
        if result.exists():
            return torch.load(result, weights_only=False)
        where.mkdir(exist_ok=True)
        value = compute(where)
        torch.save(value, where / "result.tmp")
        os.replace(where / "result.tmp", result)
        return value
