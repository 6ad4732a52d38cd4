"""A worker instruments the script and the own modules its imports reach before it waits
as a spare (baton/transparent/precompile.py), so a successor does not parse and rewrite
them inside a move's downtime; what it runs is exactly what an import would compile."""

from __future__ import annotations

import textwrap

from baton.transparent import precompile
from baton.transparent.sites import SITES
from baton.worker.script_files import ScriptModules


def _tree(tmp_path):
    files = {
        "train.py": """
            import os, torch
            import model
            from pkg import sub
            def main():
                from helpers import lr  # an import inside a function is found too
                for step in range(3):
                    pass
            """,
        "model.py": "import pkg.deep\ncounter = 0\ndef bump():\n    global counter\n    counter += 1\n",
        "pkg/__init__.py": "",
        "pkg/sub.py": "x = [i for i in range(3)]\n",
        "pkg/deep.py": "while False:\n    pass\n",
        "helpers.py": "lr = 0.1\n",
        "unused.py": "import this_is_never_imported\n",
        "broken.py": "def (:\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "train.py"


def test_the_script_and_the_own_modules_its_imports_reach_are_compiled_ahead_and_taken_once(tmp_path):
    script = _tree(tmp_path)
    precompile._READY.clear()
    try:
        assert precompile.ahead(script, ScriptModules(tmp_path)) == 6
        compiled = {name for name, _ in precompile._READY}
        assert compiled == {str(tmp_path / f) for f in ("train.py", "model.py", "pkg/__init__.py", "pkg/sub.py",
                                                        "pkg/deep.py", "helpers.py")}
        model = tmp_path / "model.py"
        # Declared to the runtime (read at every head) only once imported.
        assert str(model) not in SITES.globals
        ready = precompile._READY[precompile._key(model.read_bytes(), str(model))].code
        assert precompile.take(model.read_bytes(), str(model)) is ready
        assert SITES.globals[str(model)] == ("counter",)
        again = precompile.take(model.read_bytes(), str(model))  # a second import: compiled afresh
        assert again is not ready and again.co_filename == str(model)
        # A file edited after it was compiled ahead: its new source is what runs.
        sub = tmp_path / "pkg" / "sub.py"
        sub.write_text("x = 2\n")
        namespace: dict = {}
        exec(precompile.take(sub.read_bytes(), str(sub)), namespace)  # noqa: S102
        assert namespace["x"] == 2
    finally:
        precompile._READY.clear()


def test_a_file_that_does_not_compile_is_left_to_its_import(tmp_path):
    (tmp_path / "train.py").write_text("import broken\nimport ok\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "ok.py").write_text("y = 1\n")
    precompile._READY.clear()
    try:
        assert precompile.ahead(tmp_path / "train.py", ScriptModules(tmp_path)) == 2
        assert {name for name, _ in precompile._READY} == {str(tmp_path / "train.py"), str(tmp_path / "ok.py")}
        assert precompile.ahead(tmp_path / "missing.py", ScriptModules(tmp_path)) == 0
    finally:
        precompile._READY.clear()
