"""Checkpoints written whole: a successor's resume block never reads one half written.

Under torchrun a script's resume block (`if os.path.exists(ckpt): torch.load(ckpt)`) reads
its checkpoint before any rank trains. Under baton a successor runs that block while the
others train, and rank 0 may be writing that very file: torch.save writes in place, so the
reader finds a truncated archive ("PytorchStreamReader failed reading zip archive") and the
successor dies in the script's own code. So, in both modes, every rank's torch.save to a
path (from `baton.init()`, or the no-code worker's start, on) writes a temporary file beside
it and renames it over the path (POSIX rename is atomic): a reader sees the old file or the
new one, and the bytes are the script's own. A destination that is not a regular file
(/dev/null, a FIFO), or in a folder the process may not create files in, is written as the
script asked; a process killed while saving leaves its temporary file (`.<name>.baton-<pid>`),
never a truncated checkpoint.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

# the real ones: the fence (fence.py) patches them for a successor's setup
_replace, _unlink = os.replace, os.unlink


def install() -> None:
    save = torch.save

    def whole_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)  # a buffer or an open file: the script's own handle
        path = os.fsdecode(os.fspath(f))
        head, name = os.path.split(path)
        if (os.path.exists(path) and not os.path.isfile(path)) or not os.access(head or ".", os.W_OK):
            return save(obj, f, *args, **kwargs)  # not a file, or no room for one beside it: as asked
        tmp = os.path.join(head, f".{name}.baton-{os.getpid()}")
        try:
            save(obj, tmp, *args, **kwargs)
            if os.path.exists(path):
                shutil.copymode(path, tmp)  # the permissions the script's file had
            _replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                _unlink(tmp)
            raise

    whole_save.__wrapped__ = save  # type: ignore[attr-defined]
    whole_save.__doc__ = save.__doc__
    torch.save = whole_save
