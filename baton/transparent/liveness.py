"""Which of a loop's variables hold something at its head that the program still reads.

A loop's variables are handed to a successor, and copied at every head of the step loop
(the record its buddies keep). A value the next iteration overwrites before reading it (a
model's logits, the checkpoint dict a branch builds and saves) need not be: in nanoGPT's
loop the logits alone are the size of a batch times the vocabulary. A name is live at the
head if some path through the body reads it before it is surely assigned, or anything
outside the loop in its scope reads it (after the loop, a function of the module reading
a global). The analysis errs on the side of live: branches and loops that may not run
assign nothing for sure, nested functions and comprehensions count as reads where they
stand, `try` keeps nothing.
"""

from __future__ import annotations

import ast
from typing import Iterable


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def loads(nodes: Iterable[ast.AST]) -> set[str]:
    """Every name read under `nodes`, nested scopes included (an augmented assignment and a
    `del` read their target too), but a comprehension's own variables (`[e.item() for e in
    ema]` reads `ema`, not the `e` of the scope around it)."""
    out: set[str] = set()
    for top in nodes:
        out |= _loads(top)
    return out


def _loads(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, (ast.Load, ast.Del)) else set()
    out = {node.target.id} if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) else set()
    for child in ast.iter_child_nodes(node):
        out |= _loads(child)
    if isinstance(node, _COMPREHENSIONS):  # its first iterable is read in the scope around it
        out = (out - set().union(*(_stores(g.target) for g in node.generators))) | _loads(node.generators[0].iter)
    return out


def _stores(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _block(stmts: list[ast.stmt], assigned: set[str]) -> tuple[set[str], set[str]]:
    """(names read before surely assigned, names surely assigned after the block)."""
    live: set[str] = set()
    assigned = set(assigned)
    for stmt in stmts:
        got, assigned = _stmt(stmt, assigned)
        live |= got
    return live, assigned


def _stmt(stmt: ast.stmt, assigned: set[str]) -> tuple[set[str], set[str]]:
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        value = [stmt.value] if stmt.value is not None else []
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        # subscripts and attributes of targets read their base (d[k] = v reads d)
        reads = loads(value) | loads(t for t in targets if not isinstance(t, ast.Name))
        return reads - assigned, assigned | set().union(*(_stores(t) for t in targets))
    if isinstance(stmt, ast.AugAssign):
        return loads([stmt]) - assigned, assigned | _stores(stmt.target)
    if isinstance(stmt, ast.If):
        live = loads([stmt.test]) - assigned
        body_live, body_assigned = _block(stmt.body, assigned)
        else_live, else_assigned = _block(stmt.orelse, assigned)
        return live | body_live | else_live, body_assigned & else_assigned
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        live = loads([stmt.iter]) - assigned
        body_live, _ = _block(stmt.body, assigned | _stores(stmt.target))
        else_live, _ = _block(stmt.orelse, assigned)
        return live | body_live | else_live, assigned  # it may not run at all
    if isinstance(stmt, ast.While):
        live = loads([stmt.test]) - assigned
        body_live, _ = _block(stmt.body, assigned)
        else_live, _ = _block(stmt.orelse, assigned)
        return live | body_live | else_live, assigned
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        live = loads([i.context_expr for i in stmt.items]) - assigned
        inner = assigned | set().union(*(_stores(i.optional_vars) for i in stmt.items if i.optional_vars))
        body_live, body_assigned = _block(stmt.body, inner)
        return live | body_live, body_assigned
    if isinstance(stmt, ast.Try):
        live, _ = _block(stmt.body, assigned)
        for handler in stmt.handlers:
            live |= _block(handler.body, assigned)[0]
        live |= _block(stmt.orelse, assigned)[0] | _block(stmt.finalbody, assigned)[0]
        return live, assigned
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return loads([stmt]) - assigned, assigned | {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return set(), assigned | {a.asname or a.name.split(".")[0] for a in stmt.names}
    return loads([stmt]) - assigned, assigned  # expressions, return, raise, assert, match, ...


def live_at_head(loop: ast.For | ast.While, scope: ast.AST) -> set[str]:
    """The names live at the head of `loop`, which stands in `scope` (a module or function)."""
    live, _ = _block(loop.body, _stores(loop.target) if isinstance(loop, ast.For) else set())
    if isinstance(loop, ast.While):
        live |= loads([loop.test])
    live |= _block(loop.orelse, set())[0]
    return live | _outside(scope, loop)


def _outside(scope: ast.AST, loop: ast.AST) -> set[str]:
    """Names that code outside `loop` may read after one of its heads: the statements after
    it in each block that holds it, what the next iteration of a loop around it reads before
    assigning it (it runs the code before `loop` again), and every function, lambda and class
    body of the scope (they may be called from anywhere, the loop included)."""
    out: set[str] = set()
    path = _path(scope, loop)
    for parent, child in zip(path, path[1:]):
        if isinstance(parent, (ast.For, ast.While, ast.AsyncFor)) and parent is not loop:
            out |= _next_iteration(parent)
        for block in _blocks(parent):
            if child in block:
                out |= loads(block[block.index(child) + 1:])
    for node in ast.walk(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not scope:
            out |= _free_reads(node)  # a method too: a class body's own reads are negligible
    return out


def _next_iteration(loop: ast.For | ast.While | ast.AsyncFor) -> set[str]:
    """What an iteration of `loop` reads before it surely assigns it."""
    live, _ = _block(loop.body, set() if isinstance(loop, ast.While) else _stores(loop.target))
    return live | (loads([loop.test]) if isinstance(loop, ast.While) else set())


def _free_reads(fn: ast.AST) -> set[str]:
    """What a function (lambda, class) reads of the scope it is defined in: its loads less
    its own locals (parameters, names it assigns without a `global`/`nonlocal`)."""
    if isinstance(fn, ast.ClassDef):  # its methods' free reads, and what its body reads itself
        return set().union(set(), *(_free_reads(s) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                                    else loads([s]) for s in fn.body))
    args = fn.args  # type: ignore[attr-defined]
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    declared = {n for node in ast.walk(fn) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    body = fn.body if isinstance(fn.body, list) else [fn.body]  # type: ignore[attr-defined]
    assigned = {n.id for node in body for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return loads(body) - params - (assigned - declared)


def _path(scope: ast.AST, target: ast.AST) -> list[ast.AST]:
    """The nodes from `scope` down to `target`."""
    stack: list[tuple[ast.AST, list[ast.AST]]] = [(scope, [scope])]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        stack.extend((child, path + [child]) for child in ast.iter_child_nodes(node))
    return [scope]


def _blocks(node: ast.AST) -> list[list[ast.AST]]:
    return [getattr(node, f) for f in ("body", "orelse", "finalbody", "handlers")
            if isinstance(getattr(node, f, None), list)]


def declared_global(tree: ast.Module) -> tuple[str, ...]:
    """Names some function of the module declares `global`: it may change them wherever it is
    called from, so they are the module's carried state too."""
    out: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.update(dict.fromkeys(node.names))
    return tuple(out)
