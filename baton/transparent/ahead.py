"""What a spare does with the script while it waits, not once it is given a rank.

- **Compile.** Instrumenting a module (`rewrite`) parses and transforms its syntax tree:
  10-50 ms for a training script and its model file on our machines, which a successor
  would otherwise spend inside a move's downtime before the first line of its setup runs.
  Every worker compiles, before it registers, the script and the script's own modules that
  its import statements reach (transitively; relative imports and imports by computed
  names aside). The importer takes each one once, if its source is still the same bytes,
  and compiles afresh otherwise: a file edited meanwhile, a module imported a second time,
  one the statements did not show. A module compiled ahead is declared to the runtime only
  when it is imported, so one never imported costs nothing at the heads.
- **Import.** The installed packages the script imports before anything else runs (its
  opening import statements: torchvision, numpy, transformers ...) are imported too, as
  the model-aware spare has them, waiting in `baton.init()` below the script's imports.
  Only that opening block: a statement before an import (`os.environ[...] = ...`, say)
  may be what the import reads, so the imports after it are left to the script. The
  script's own modules are never run ahead, and the random streams are put back.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import sys
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


def prepare(script: Path, modules: ScriptModules) -> tuple[int, int]:
    """Compile the script and the own modules its imports reach, and import the installed
    packages of its opening imports: how many of each. Never raises: what fails here fails
    the same way when the script runs, with the script's own traceback."""
    compiled = _compile(script, modules)
    try:
        opening = _opening_imports(ast.parse(script.read_bytes(), filename=str(script)))
    except (OSError, SyntaxError, ValueError):
        return compiled, 0
    return compiled, _import_installed(opening, [str(script.resolve().parent)], modules)


def _compile(script: Path, modules: ScriptModules) -> int:
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


def _opening_imports(tree: ast.Module) -> list[str]:
    """The modules the script's first statements import, before any other statement runs
    (its docstring aside)."""
    names: list[str] = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        names += [n for n in _imported(node) if n != "__future__" and not n.startswith("__future__.")]
    return names


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement may load (none for another node or a relative import):
    for `from a import b`, a and a.b (b may be a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")]
    return []


def _import_installed(names: list[str], search: list[str], modules: ScriptModules) -> int:
    """Import, in the script's order, those of `names` that are installed packages (not the
    script's own files, not yet imported): the first failure ends it (the script's import
    will report it)."""
    from baton.worker import discover, rng

    done = 0
    saved = rng.capture()
    try:
        with discover.paused():
            for name in names:
                if name in sys.modules:
                    continue
                origins = _origins(name, search)
                if any(modules.own(o) for o in origins):
                    continue
                if "." in name and not _is_module(name):
                    continue  # `from a import b` where b is a name in a, not a submodule
                importlib.import_module(name)
                done += 1
    except Exception as exc:  # noqa: BLE001 - the script's own import reports it
        log.debug("not imported ahead: %s", exc)
    finally:
        rng.restore(saved)
    return done


def _is_module(name: str) -> bool:
    parent = name.rpartition(".")[0]
    try:
        importlib.import_module(parent)
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _own_imports(tree: ast.Module, search: list[str], modules: ScriptModules) -> list[Path]:
    """The script's own files that the absolute imports in `tree` name (packages' __init__
    included), found as the import system would from the script's directory."""
    found: dict[Path, None] = {}
    for name in (n for node in ast.walk(tree) for n in _imported(node)):
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
