"""A worker instruments the script and the own modules its imports reach before it waits
as a spare, and imports the installed packages of the script's opening imports
(baton/transparent/ahead.py), so a successor does not spend a move's downtime on them;
what it runs is exactly what an import would compile, and nothing of the script runs."""

from __future__ import annotations

import random
import sys
import textwrap

import torch

from baton.transparent import ahead
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
    ahead._READY.clear()
    try:
        assert ahead.prepare(script, ScriptModules(tmp_path))[0] == 6
        compiled = {name for name, _ in ahead._READY}
        assert compiled == {str(tmp_path / f) for f in ("train.py", "model.py", "pkg/__init__.py", "pkg/sub.py",
                                                        "pkg/deep.py", "helpers.py")}
        model = tmp_path / "model.py"
        # Declared to the runtime (read at every head) only once imported.
        assert str(model) not in SITES.globals
        ready = ahead._READY[ahead._key(model.read_bytes(), str(model))].code
        assert ahead.take(model.read_bytes(), str(model)) is ready
        assert SITES.globals[str(model)] == ("counter",)
        again = ahead.take(model.read_bytes(), str(model))  # a second import: compiled afresh
        assert again is not ready and again.co_filename == str(model)
        # A file edited after it was compiled ahead: its new source is what runs.
        sub = tmp_path / "pkg" / "sub.py"
        sub.write_text("x = 2\n")
        namespace: dict = {}
        exec(ahead.take(sub.read_bytes(), str(sub)), namespace)  # noqa: S102
        assert namespace["x"] == 2
    finally:
        ahead._READY.clear()


def test_a_file_that_does_not_compile_is_left_to_its_import(tmp_path):
    (tmp_path / "train.py").write_text("import broken\nimport ok\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "ok.py").write_text("y = 1\n")
    ahead._READY.clear()
    try:
        assert ahead.prepare(tmp_path / "train.py", ScriptModules(tmp_path)) == (2, 0)
        assert {name for name, _ in ahead._READY} == {str(tmp_path / "train.py"), str(tmp_path / "ok.py")}
        assert ahead.prepare(tmp_path / "missing.py", ScriptModules(tmp_path)) == (0, 0)
    finally:
        ahead._READY.clear()


def test_the_installed_packages_of_the_opening_imports_are_imported_and_nothing_else(tmp_path, monkeypatch):
    """Only the opening block (an import after another statement may read what it set), only
    installed packages (the script's own modules never run ahead), the random streams as
    they were (an import that draws)."""
    site, work = tmp_path / "site", tmp_path / "work"
    (site / "bt_extpkg").mkdir(parents=True)
    (site / "bt_extpkg" / "__init__.py").write_text("import random, torch\nrandom.random(); torch.rand(3)\n")
    (site / "bt_extpkg" / "layers.py").write_text("")
    (site / "bt_extlate.py").write_text("")
    work.mkdir()
    (work / "model.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (work / "train.py").write_text(textwrap.dedent('''
        """A training script."""
        from __future__ import annotations
        import json, bt_extpkg
        from bt_extpkg import layers, not_a_module
        import model
        import os
        os.environ["BT_FLAG"] = "1"  # what the next import might read
        import bt_extlate
        '''))
    monkeypatch.syspath_prepend(str(site))
    for name in ("bt_extpkg", "bt_extpkg.layers", "bt_extlate", "model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    streams = (torch.get_rng_state(), random.getstate())
    ahead._READY.clear()
    try:
        compiled, imported = ahead.prepare(work / "train.py", ScriptModules(work))
    finally:
        ahead._READY.clear()
    assert (compiled, imported) == (2, 2)  # train.py and model.py; bt_extpkg and bt_extpkg.layers
    assert "bt_extpkg" in sys.modules and "bt_extpkg.layers" in sys.modules
    assert "bt_extlate" not in sys.modules and "model" not in sys.modules and not (tmp_path / "ran").exists()
    assert torch.equal(streams[0], torch.get_rng_state()) and streams[1] == random.getstate()
