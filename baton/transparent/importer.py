"""Run the script as `__main__`, its own modules instrumented as they are imported.

The script's own modules are the Python files under its directory, as `python script.py`
would import them from `sys.path[0]`; installed packages (site-packages, the standard
library, torch, baton) run as they are. A loop in one of those is not the script's: if
the step loop lives there (Lightning, the HF Trainer), `nest` sees no instrumented loop
around `optimizer.step()` and says so. Instrumented code is compiled afresh in each
process (ahead of the import where `ahead` could) and never written to `__pycache__`,
so a later plain `python` run is unaffected.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any, Sequence

from baton.transparent import ahead
from baton.transparent.loops import LOOPS
from baton.transparent.rewrite import HOOKS
from baton.worker.script_files import ScriptModules


class _InstrumentedLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        return ahead.take(self.get_data(path), path)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__[HOOKS] = LOOPS
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: ScriptModules):
        self.modules = modules

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader) \
                or not self.modules.own(spec.origin):
            return None
        spec.loader = _InstrumentedLoader(fullname, spec.origin)
        return spec


def run_script(script: str, args: Sequence[str]) -> None:
    """Execute `script` with `args` as `python script args` would, instrumented. Returns when
    the script returns; its exceptions (SystemExit included) propagate."""
    path = Path(script).resolve()
    modules = ScriptModules(path.parent)
    sys.argv = [script, *args]
    sys.path.insert(0, str(path.parent))
    sys.meta_path.insert(0, _Finder(modules))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=str(path), __builtins__=__builtins__, __spec__=None, __loader__=None,
                         __package__=None, __cached__=None)
    main.__dict__[HOOKS] = LOOPS
    sys.modules["__main__"] = main
    code = ahead.take(path.read_bytes(), str(path))
    exec(code, main.__dict__)  # noqa: S102 - the user's own script, as `python script.py` runs it


def print_script_error(exc: BaseException) -> None:
    """The script's traceback as `python script.py` prints it: without baton's frames above it."""
    import traceback

    tb = exc.__traceback__
    here = Path(__file__).resolve().parents[1]
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(here):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
