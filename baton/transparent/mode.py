"""Which mode a script runs in: model-aware if it uses baton, no code change if not.

Read from the source, before anything runs: the script and the modules of its own
directory it imports (a helper module may hold `baton.init()`). A script that imports
baton anywhere in its own code is taken to be written for the model-aware API.
"""

from __future__ import annotations

import ast
from pathlib import Path

MODEL_AWARE = "model-aware"
NO_CODE = "no-code"

# Where the no-code mode stands in this version: `baton explain`, `baton status` and the
# failures of a no-code job say it.
NO_CODE_MOVES = ("this version moves the ranks of a script with no code change in planned and pre-emptive moves, "
                 "and rebuilds a lost rank wherever it stood in a step and, for DDP, in the evaluation or checkpoint "
                 "after the step loop too; a sharded (FSDP2) rank lost after the last collective of a loop pass's last "
                 "step or after the step loop, or in a span that ran a collective whose result differs by rank (reduce, gather, "
                 "point-to-point, any on a group of some ranks), stops the job saying so (the model-aware API, README: 'Five lines in your "
                 "script', covers those with boundary functions)")
NO_CODE_STATUS = f"Note: {NO_CODE_MOVES}."


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def uses_baton(script: str | Path) -> bool:
    """Whether the script, or a module of its own directory it imports, imports baton.
    SyntaxError: the script itself does not parse (its own run shows where)."""
    script = Path(script).resolve()
    root = script.parent
    todo, seen = [script], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            if path == script:
                raise SyntaxError(f"{script} does not parse")
            continue  # the script's own run reports its modules' syntax errors
        for name in _imports(tree):
            if name == "baton" or name.startswith("baton."):
                return True
            parts = name.split(".")
            for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    todo.append(candidate)
    return False


def mode_of(script: str | Path) -> str:
    return MODEL_AWARE if uses_baton(script) else NO_CODE
