"""Rewrite a module's loops so the running loops can be seen, as pytest rewrites asserts.

Each `for` statement becomes

    __baton_loops__.enter(ID)
    try:
        for x in __baton_loops__.iterate(ID, <iter>):
            if __baton_loops__.restoring:                    # rebind the loop's variables
                __baton_v__ = __baton_loops__.restore(ID)    # (a successor at its rank's place,
                ...                                          #  a survivor re-running an iteration)
            try:
                <body, rewritten>
            except BaseException as __baton_e__:
                if not __baton_loops__.absorb(ID, __baton_e__):
                    raise
                continue                                     # the same iteration again
        else:
            <else>
    finally:
        __baton_loops__.leave(ID)
    if __baton_loops__.restoring:                        # rebind what the loop assigned, as
        __baton_v__ = __baton_loops__.restore_exit(ID)   # it was left (a successor taking over
        ...                                              # in the region after the step loop)

and a `while` the same, its test moved after the head so restored variables are read.
The runtime (`loops`) thus knows, at any moment, which loops each frame is in, how many
iterations each has begun and what it iterates over, and can put a loop back at the start
of an iteration. Without a runtime that asks for it nothing changes: the body,
`break`/`continue`/`else`, return, exceptions, line numbers and tracebacks are the
script's own. `ID` names a
`LoopSite` holding what the source says about the loop (the names it binds, its
statements), which the runtime cannot see.
"""

from __future__ import annotations

import ast
from typing import Iterable

from baton.transparent import liveness
from baton.transparent.sites import DRAW, SITES, LoopSite, Statement

HOOKS = "__baton_loops__"  # the name rewritten code calls; the loader puts the runtime there
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def rewrite(source: str | bytes, filename: str) -> ast.Module:
    """The module's syntax tree with every loop instrumented (SyntaxError as compile gives it)."""
    tree, declared = rewrite_ahead(source, filename)
    SITES.declare_globals(filename, declared)
    return tree


def rewrite_ahead(source: str | bytes, filename: str) -> tuple[ast.Module, tuple[str, ...]]:
    """As `rewrite`, and the module globals its functions declare `global`, not yet declared
    to the runtime (which reads them at every head): a module instrumented ahead of its
    import (`ahead`) is declared when it is imported."""
    tree = ast.parse(source, filename=filename)
    declared = liveness.declared_global(tree)
    tree = _Instrument(filename, tree).visit(tree)
    return ast.fix_missing_locations(tree), declared


def compile_instrumented(source: str | bytes, filename: str) -> object:
    return compile_tree(rewrite(source, filename), filename)


def compile_tree(tree: ast.Module, filename: str) -> object:
    return compile(tree, filename, "exec", dont_inherit=True)


def _own_nodes(nodes: Iterable[ast.AST]) -> Iterable[ast.AST]:
    """Every node under `nodes` that belongs to their scope (not inside a nested function,
    class, lambda or comprehension, whose names are their own); nested scopes themselves
    are yielded, not entered."""
    stack = list(nodes)[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES + _COMPREHENSIONS):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


# Methods that change a list, dict, set or deque in place: the container a loop calls them on
# is carried like a variable the loop assigns.
_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
                       "add", "discard", "sort", "reverse", "appendleft", "extendleft", "popleft", "rotate"})


def names_of(nodes: Iterable[ast.AST]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The names `nodes` bind in their own scope, those whose attributes or items they
    assign or delete or that they change through a container's method (`self.best = ...`,
    `stats[k] += ...`, `history.append(x)`), and those they read, each in order of first
    appearance."""
    bound: dict[str, None] = {}
    mutated: dict[str, None] = {}
    read: dict[str, None] = {}
    for node in _own_nodes(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read[node.id] = None
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound[node.id] = None
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root_name(node)
            if root is not None:
                mutated[root] = None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            root = _root_name(node.func.value)  # history.append(loss), stats.update(...), self.seen.add(i)
            if root is not None:
                mutated[root] = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name.split(".")[0]] = None
    return tuple(bound), tuple(mutated), tuple(read)


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _statement(node: ast.stmt) -> Statement:
    calls = []
    for sub in _own_nodes([node]):
        if isinstance(sub, ast.Call):
            name = _short(ast.unparse(sub.func), 40)
            if name not in calls:
                calls.append(name)
    return Statement(line=node.lineno, end_line=node.end_lineno or node.lineno,
                     text=_short(ast.unparse(node).splitlines()[0]),
                     calls=tuple(calls))


def _hook_call(method: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name(id=HOOKS, ctx=ast.Load()), attr=method, ctx=ast.Load()),
                    args=list(args), keywords=[])


def _stmts(code: str, at: ast.AST) -> list[ast.stmt]:
    """Statements parsed from `code`, placed at `at`'s line (tracebacks point at the loop)."""
    out = ast.parse(code).body
    for stmt in out:
        for node in ast.walk(stmt):
            if hasattr(node, "lineno"):
                ast.copy_location(node, at)
    return out


def _restore(site: LoopSite, at: ast.AST) -> list[ast.stmt]:
    """At a head: rebind the loop's variables to what the runtime hands back (a successor
    reaching its rank's place, or a survivor re-running an iteration), or leave the loop as
    its predecessor had, by a break (a successor taking over after it); usually skipped at
    the cost of one attribute read."""
    names = [n for n in site.assigned if n not in site.targets]
    assign = "".join(f"\n        if {n!r} in __baton_v__: {n} = __baton_v__[{n!r}]" for n in names)
    ret = f"\n    if {HOOKS}.returning({site.id}):\n        return {HOOKS}.return_value({site.id})" if site.returns else ""
    return _stmts(f"if {HOOKS}.restoring:\n    __baton_v__ = {HOOKS}.restore({site.id})\n"
                  f"    if __baton_v__ is not None:\n        pass{assign}\n    del __baton_v__\n"
                  f"    if {HOOKS}.breaking({site.id}):\n        break{ret}", at)


def _note_returns(body: list[ast.stmt]) -> None:
    """Each `return` of the loop's own function in its body (or its else clause) reports its
    value on the way out (`return x` becomes `return __baton_loops__.returned(x)`), so the
    loop's exit says it was a return and with what: a successor taking the rank over after
    it returns the same."""
    for node in _own_nodes(body):
        if isinstance(node, ast.Return) and not _is_hook(node.value, "returned"):
            value = node.value if node.value is not None else ast.copy_location(ast.Constant(None), node)
            node.value = ast.copy_location(_hook_call("returned", value), node)


def _is_hook(node: ast.AST | None, method: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method and \
        isinstance(node.func.value, ast.Name) and node.func.value.id == HOOKS


def _restore_after(site: LoopSite, at: ast.AST) -> list[ast.stmt]:
    """Right after the loop: rebind what it assigned, as the loop had left it (a successor
    taking a rank over in the region after its step loop); skipped like `_restore`."""
    assign = "".join(f"\n        if {n!r} in __baton_v__: {n} = __baton_v__[{n!r}]" for n in site.assigned)
    return _stmts(f"if {HOOKS}.restoring:\n    __baton_v__ = {HOOKS}.restore_exit({site.id})\n"
                  f"    if __baton_v__ is not None:\n        pass{assign}\n    del __baton_v__", at)


def _absorbing(body: list[ast.stmt], site: LoopSite, at: ast.AST) -> ast.Try:
    """The body, with a lost peer absorbed: the runtime recovers and the loop goes on with
    the same iteration (`continue`: its iterator hands the same item again)."""
    handler = _stmts(f"try:\n    pass\nexcept BaseException as __baton_e__:\n"
                     f"    if not {HOOKS}.absorb({site.id}, __baton_e__):\n        raise\n    continue", at)[0]
    assert isinstance(handler, ast.Try)
    handler.body = body
    return handler


def _jumps_out(stmts: list[ast.stmt]) -> bool:
    """Whether `stmts` hold a break/continue of the loop they are in (not of a nested loop)."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Break, ast.Continue)):
            return True
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor) + _SCOPES):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return False


def _placeholder(target: ast.AST) -> object:
    """What `target` unpacks without an item drawn: None per name, tuples as it nests."""
    if isinstance(target, ast.Name):
        return None
    if isinstance(target, (ast.Tuple, ast.List)):
        parts = tuple(_placeholder(t) for t in target.elts)
        return DRAW if DRAW in parts else parts
    return DRAW


def _returns(stmts: list[ast.stmt]) -> bool:
    """Whether `stmts` hold a `return` of their own function (not of a nested one)."""
    return any(isinstance(node, ast.Return) for node in _own_nodes(stmts))


class _Instrument(ast.NodeTransformer):
    def __init__(self, filename: str, module: ast.Module):
        self.filename = filename
        self.scopes: list[str] = []
        self.scope_nodes: list[ast.AST] = [module]  # the module, then each function the visit is in

    # Scope names, for the report ("Trainer._run_epoch").
    def _scoped(self, node: ast.AST) -> ast.AST:
        self.scopes.append(node.name)  # type: ignore[attr-defined]
        function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if function:
            self.scope_nodes.append(node)
        try:
            return self.generic_visit(node)
        finally:
            self.scopes.pop()
            if function:
                self.scope_nodes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_For(self, node: ast.For) -> list[ast.stmt]:
        site = self._site(node, "for", f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}",
                          [node.target, *node.body, *node.orelse], resumable=True)
        self.generic_visit(node)
        _note_returns(node.body + node.orelse)
        node.iter = ast.copy_location(_hook_call("iterate", ast.Constant(site.id), node.iter), node.iter)
        node.body = [*_restore(site, node), _absorbing(node.body, site, node)]
        if node.orelse:  # a successor arriving at the head where the items run out: its else clause reads them
            node.orelse = [*_restore_after(site, node), *node.orelse]
        return self._wrapped(node, site)

    def visit_While(self, node: ast.While) -> list[ast.stmt]:
        # `while test: body else: orelse` becomes `while True: head; restore; if not test: orelse;
        # break; body`, so a successor's restored variables are in place before the test reads
        # them. An else clause with a break/continue of its own keeps the plain form (not resumable).
        resumable = not _jumps_out(node.orelse)
        site = self._site(node, "while", f"while {ast.unparse(node.test)}", [*node.body, *node.orelse],
                          resumable=resumable)
        self.generic_visit(node)
        _note_returns(node.body + node.orelse)
        if not resumable:
            head = ast.copy_location(_hook_call("head", ast.Constant(site.id)), node.test)
            node.test = ast.copy_location(ast.BoolOp(op=ast.And(), values=[head, node.test]), node.test)
            return self._wrapped(node, site)
        head = ast.copy_location(ast.Expr(_hook_call("head", ast.Constant(site.id))), node)
        ended = ast.copy_location(ast.Expr(_hook_call("ran_out", ast.Constant(site.id))), node)
        done = ast.copy_location(ast.If(test=ast.UnaryOp(op=ast.Not(), operand=node.test),
                                        body=[ended, *node.orelse, ast.copy_location(ast.Break(), node)], orelse=[]),
                                 node)
        loop = ast.copy_location(ast.While(test=ast.Constant(True), orelse=[], body=[
            head, *_restore(site, node), done, _absorbing(node.body, site, node)]), node)
        return self._wrapped(loop, site)

    def _site(self, node: ast.For | ast.While, kind: str, header: str, parts: list[ast.AST],
              resumable: bool) -> LoopSite:
        assigned, mutated, reads = names_of(parts)
        targets = names_of([node.target])[0] if isinstance(node, ast.For) else ()
        live = liveness.live_at_head(node, self.scope_nodes[-1])
        reads = tuple(dict.fromkeys([*reads, *sorted(liveness.loads(parts) - set(reads))]))
        scope = ".".join(self.scopes) or "<module>"
        return SITES.add(lambda sid: LoopSite(
            id=sid, file=self.filename, line=node.lineno, col=node.col_offset, kind=kind, scope=scope,
            header=_short(header), targets=targets, assigned=assigned, mutated=mutated, reads=reads,
            live=tuple(n for n in assigned if n in live), returns=_returns(node.body) or _returns(node.orelse),
            has_else=bool(node.orelse),
            placeholder=_placeholder(node.target) if isinstance(node, ast.For) else None,
            resumable=resumable, body=tuple(_statement(s) for s in node.body)))

    @staticmethod
    def _wrapped(node: ast.For | ast.While, site: LoopSite) -> list[ast.stmt]:
        enter = ast.copy_location(ast.Expr(_hook_call("enter", ast.Constant(site.id))), node)
        leave = ast.copy_location(ast.Expr(_hook_call("leave", ast.Constant(site.id))), node)
        guarded = ast.copy_location(ast.Try(body=[node], handlers=[], orelse=[], finalbody=[leave]), node)
        return [enter, guarded, *_restore_after(site, node)]
