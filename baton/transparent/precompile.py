"""A spare instruments the script's code while it waits, not once it is given a rank.

Instrumenting a module (`rewrite`) parses and transforms its syntax tree: 10-50 ms for a
training script and its model file on our machines, which a successor would otherwise
spend inside a move's downtime before the first line of its setup runs. So every worker
compiles, before it registers, the script and the script's own modules that its import
statements reach (transitively, relative imports and imports by computed names aside).
The importer takes each one once, if its source is still the same bytes, and compiles
afresh otherwise: a file edited meanwhile, a module imported a second time, or one the
statements did not show. A module compiled ahead is declared to the runtime only when
it is imported, so one never imported costs nothing at the heads.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import logging
from dataclasses import dataclass
from pathlib import Path

from baton.transparent.rewrite import compile_instrumented, compile_tree, rewrite_ahead
from baton.transparent.sites import SITES
from baton.worker.script_files import ScriptModules

log = logging.getLogger("baton.worker")

MAX_FILES = 256  # a script directory that is a whole repository: the first ones its imports reach


@dataclass(frozen=True)
class _Ready:
    code: object
    declared_global: tuple[str, ...]


_READY: dict[tuple[str, str], _Ready] = {}


def _key(source: bytes, filename: str) -> tuple[str, str]:
    return filename, hashlib.blake2b(source, digest_size=16).hexdigest()


def take(source: bytes, filename: str) -> object:
    """The instrumented code of `source`: the one compiled ahead (once), else compiled now."""
    ready = _READY.pop(_key(source, filename), None)
    if ready is None:
        return compile_instrumented(source, filename)
    SITES.declare_globals(filename, ready.declared_global)
    return ready.code


def ahead(script: Path, modules: ScriptModules) -> int:
    """Compile the script and the own modules its imports reach; how many were compiled.
    Never raises: a file that does not compile here fails the same way when the script
    runs, with the script's own traceback."""
    root = script.resolve()
    queue, seen, done = [root], set(), 0
    while queue and len(seen) < MAX_FILES:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            source = path.read_bytes()
            tree, declared = rewrite_ahead(source, str(path))
            _READY[_key(source, str(path))] = _Ready(compile_tree(tree, str(path)), declared)
        except Exception as exc:  # noqa: BLE001 - its import reports it, as `python script.py` would
            log.debug("not compiled ahead: %s (%s)", path, exc)
            continue
        done += 1
        queue += [p for p in _own_imports(tree, [str(root.parent)], modules) if p not in seen]
    return done


def _own_imports(tree: ast.Module, search: list[str], modules: ScriptModules) -> list[Path]:
    """The script's own files that the absolute imports in `tree` name (packages' __init__
    included), found as the import system would from the script's directory."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
    found: dict[Path, None] = {}
    for name in names:
        for origin in _origins(name, search):
            if modules.own(origin):
                found[Path(origin).resolve()] = None
    return list(found)


def _origins(name: str, search: list[str]) -> list[str]:
    """The files importing `name` executes: each package on its way, then the module."""
    parts, path, out = name.split("."), search, []
    for i in range(len(parts)):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        except (ImportError, ValueError):
            return out
        if spec is None or spec.origin is None:
            return out
        out.append(spec.origin)
        path = spec.submodule_search_locations
        if path is None:
            return out
    return out
