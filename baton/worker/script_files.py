"""Which files are the script's own: the Python files under its directory, as `python
script.py` would import them from `sys.path[0]`, less installed packages (site-packages,
the standard library, torch, baton). No code change instruments only these; a successor's
fence (fence) guards only their writes."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from pathlib import Path

_PACKAGE_DIRS = ("site-packages", "dist-packages")


@functools.cache  # the same for the process's life; a joiner built it twice in its setup (1-3 ms each)
def _installed_roots() -> list[Path]:
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    roots.update(Path(p).resolve() for p in sysconfig.get_paths().values())
    roots.add(Path(__file__).resolve().parents[1])  # baton itself
    return sorted(roots)


class ScriptModules:
    """Which files are the script's own: under its directory and not an installed package."""

    def __init__(self, script_dir: Path):
        self.root = script_dir.resolve()
        self._installed = _installed_roots()

    def own(self, filename: str | None) -> bool:
        if not filename or not filename.endswith(".py"):
            return False
        path = Path(filename).resolve()
        if any(part in _PACKAGE_DIRS for part in path.parts):
            return False
        if any(path.is_relative_to(r) for r in self._installed if not self.root.is_relative_to(r)):
            return False
        return path.is_relative_to(self.root)


def script_dir_of(script: str) -> Path:
    return Path(os.path.abspath(script)).parent
