"""The loop instrumentation of the no-code mode: a rewritten module behaves exactly as written
(break, continue, else, return, exceptions, generators, closures, global/nonlocal, private
names), the runtime sees which loops run where, and a controller can put a loop back at
the start of an iteration or hand its variables back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from baton.transparent import rewrite
from baton.transparent.loops import LOOPS, ActiveLoop
from baton.transparent.rewrite import HOOKS, compile_instrumented

SEMANTICS = '''
import itertools
log = []
counter = 0

def for_else(xs):
    for x in xs:
        if x == 3:
            break
        if x % 2:
            continue
        log.append(("for", x))
    else:
        log.append("for-else")
    return x

def while_else(n):
    i = 0
    while (j := i) < n:
        i += 1
        if i == 2:
            continue
        if i == 7:
            break
        log.append(("while", i, j))
    else:
        log.append("while-else")
    return i

def returns_inside(xs):
    for x in xs:
        for y in range(3):
            if x * y == 4:
                return (x, y)
    return None

def raises_through(xs):
    try:
        for x in xs:
            if x == 2:
                raise KeyError(x)
    except KeyError as e:
        log.append(("caught", e.args))
    try:
        for x in xs:
            try:
                1 / (x - 1)
            except ZeroDivisionError:
                log.append("inner-caught")
    finally:
        log.append("finally")

def gen(n):
    for i in range(n):
        yield i * i

def closures():
    fns = []
    for i in range(3):
        fns.append(lambda k=i: k + 100)
        def f(i=i):
            return i * 10
        fns.append(f)
    return [g() for g in fns]

def uses_global():
    global counter
    for _ in range(4):
        counter += 1

def uses_nonlocal():
    total = 0
    def add(xs):
        nonlocal total
        for x in xs:
            total += x
    add([1, 2, 3])
    return total

class Private:
    def __init__(self):
        self.__hidden = 0
    def run(self):
        __local = 5
        for i in range(3):
            self.__hidden += i + __local
        return self.__hidden

for_else([0, 1, 2, 3, 4]); for_else([0, 2])
while_else(5); while_else(10)
log.append(returns_inside([1, 2, 3]))
raises_through([0, 1, 2, 3])
log.append(list(gen(4)))
log.append(sum(x for x in gen(3)))
log.append(closures())
uses_global(); log.append(counter)
log.append(uses_nonlocal())
log.append(Private().run())
log.append([(a, b) for a, b in itertools.product(range(2), repeat=2)])
k = 0
while k < 3:
    k += 1
else:
    log.append(("module-while-else", k))
'''


def _run(source: str, instrumented: bool) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "m", HOOKS: LOOPS}
    code = compile_instrumented(source, "<m>") if instrumented else compile(source, "<m>", "exec")
    exec(code, namespace)  # noqa: S102
    return namespace


def test_a_rewritten_module_behaves_as_written():
    plain, rewritten = _run(SEMANTICS, False), _run(SEMANTICS, True)
    assert rewritten["log"] == plain["log"]
    assert rewritten["counter"] == plain["counter"] == 4
    assert "__baton_v__" not in rewritten and not LOOPS.running  # nothing left entered


def test_the_site_knows_what_a_loop_binds_mutates_and_iterates():
    tree = rewrite.rewrite(textwrap.dedent('''
        def train(self, loader, meter):
            best = 0
            for i, (x, y) in enumerate(loader):
                loss = step(x, y)
                meter.update(loss)
                self.epochs_run = i
                stats[i] = loss
                history.append(loss)
                del pending[i]
                best = max(best, loss)
                fn = lambda: best
                import math
    '''), "<t>")
    assert tree is not None
    from baton.transparent.sites import SITES

    site = SITES[len(SITES) - 1]
    assert site.scope == "train" and site.kind == "for" and site.header == "for (i, (x, y)) in enumerate(loader)"
    assert site.targets == ("i", "x", "y")
    assert site.assigned == ("i", "x", "y", "loss", "best", "fn", "math")
    assert site.mutated == ("meter", "self", "stats", "history", "pending")  # changed in place: carried
    assert [s.calls for s in site.body][:2] == [("step",), ("meter.update",)]


class _Controller:
    """Re-runs a chosen iteration once, as a recovery would, and hands variables back."""

    def __init__(self, values: dict[str, Any] | None = None):
        self.values = values
        self.absorbed: list[tuple[int, str]] = []
        self.heads = 0

    def before_item(self, loop: ActiveLoop) -> None:
        self.heads += 1
        loop.step_heads, loop.drawn = 1, []  # each head begins a step, as the runtime's do without accumulation

    def drawn(self, loop: ActiveLoop) -> None:
        loop.drawn.append((loop.item, None))

    def again(self, loop: ActiveLoop, streams: Any) -> None:
        pass

    def ran_out(self, loop: ActiveLoop) -> None:
        pass

    def left(self, loop: ActiveLoop) -> None:
        pass

    def restore(self, loop: ActiveLoop) -> dict[str, Any] | None:
        LOOPS.restoring = False  # once: as the runtime does when it has handed a head its values
        return self.values

    def absorb(self, loop: ActiveLoop, exc: BaseException) -> bool:
        if not isinstance(exc, ConnectionError):
            return False
        self.absorbed.append((loop.iterations, str(exc)))
        LOOPS.restoring = self.values is not None
        return True


@pytest.fixture
def controller():
    def attach(c: _Controller) -> _Controller:
        LOOPS.controller = c
        return c

    yield attach
    LOOPS.controller = None
    LOOPS.restoring = False


RERUN = '''
seen, done = [], []
total = 0
for i in range(5):
    seen.append((i, total))
    total += 100  # undone: the re-run starts from the variables as they were
    try:
        if i == 2 and len(seen) == 3:
            raise ConnectionError("peer lost")
    except ValueError:
        pass
    total -= 100
    total += i
    done.append(i)
'''


def test_an_absorbed_failure_runs_the_same_iteration_again_on_the_same_item(controller):
    c = controller(_Controller(values={"total": 1}))
    ns = _run(RERUN, True)
    assert c.absorbed == [(3, "peer lost")]
    # the iteration of i=2 ran twice, with total handed back as it was at its start
    assert ns["seen"] == [(0, 0), (1, 0), (2, 1), (2, 1), (3, 3), (4, 6)]
    assert ns["done"] == [0, 1, 2, 3, 4]
    assert c.heads == 6  # the re-run draws nothing new: one head per item, and the last


def test_a_script_error_is_not_absorbed(controller):
    controller(_Controller())
    with pytest.raises(ZeroDivisionError):
        _run("for i in range(3):\n    1 / (i - 1)\n", True)
    assert not LOOPS.running


def test_a_while_loop_reads_restored_variables_before_its_test(controller):
    controller(_Controller(values={"it": 7}))
    LOOPS.restoring = True  # as the runtime sets it when a successor arrives
    ns = _run("it = 0\nsteps = []\nwhile it < 9:\n    steps.append(it)\n    it += 1\n", True)
    assert ns["steps"] == [7, 8]


def test_the_runtime_sees_which_loops_enclose_a_point():
    seen = []

    def probe():
        frame = sys._getframe(1)
        seen.append([(loop.site.header, loop.iterations) for loop in LOOPS.enclosing(frame)])

    source = ("def gen():\n    for g in range(2):\n        yield g\n"
              "def inner(xs):\n    for x in xs:\n        probe()\n"
              "for a in gen():\n    inner([1])\n")
    ns = {"__name__": "m", HOOKS: LOOPS, "probe": probe}
    exec(compile_instrumented(source, "<m>"), ns)  # noqa: S102
    # the generator's loop is suspended, not around the probe
    assert seen == [[("for a in gen()", 1), ("for x in xs", 1)], [("for a in gen()", 2), ("for x in xs", 1)]]


def test_a_scripts_modules_are_instrumented_but_never_cached(tmp_path: Path):
    (tmp_path / "helper.py").write_text("def count(xs):\n    n = 0\n    for _ in xs:\n        n += 1\n    return n\n")
    (tmp_path / "main.py").write_text("import json, helper\nprint(helper.count([1, 2]), "
                                      "'__baton_loops__' in vars(helper), '__baton_loops__' in vars(json))\n")
    out = subprocess.run([sys.executable, "-c", "from baton.transparent.importer import run_script; "
                          f"run_script({str(tmp_path / 'main.py')!r}, [])"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True", "False"]  # the script's own module only
    assert not (tmp_path / "__pycache__").exists()


LIVE = '''
import time
def estimate():
    logits = 1          # a local of its own: does not make the loop's `logits` live
    return logits
best = 1e9
t0 = time.time()
it = 0
while True:
    lr = it * 0.1                       # assigned before it is read
    if it % 10 == 0:
        losses = estimate()
        best = min(best, losses)        # read before assigned in the iteration
        ckpt = {"it": it}               # built and used in one branch
        save(ckpt)
    for micro in range(2):
        logits, loss = step(lr)         # read only after this
        total = logits + loss
    t1 = time.time()
    dt, t0 = t1 - t0, t1                # t0 read first
    it += 1
    if it > 5:
        break
report(loss, it)                        # read after the loop: `loss` may be the last micro-batch's
'''


def test_only_what_is_read_after_a_head_is_carried():
    tree = rewrite.rewrite(LIVE, "<live>")
    assert tree is not None
    from baton.transparent.sites import SITES

    loop = next(SITES[i] for i in range(len(SITES)) if SITES[i].file == "<live>" and SITES[i].kind == "while")
    assert set(loop.live) == {"best", "loss", "t0", "it"}
    assert {"lr", "losses", "ckpt", "logits", "total", "micro", "t1", "dt"} <= set(loop.assigned) - set(loop.live)
    # A loop inside another: what the outer loop's next iteration reads before assigning it
    # is live too, not every name its body mentions (the micro-step's logits are not).
    inner = next(SITES[i] for i in range(len(SITES)) if SITES[i].file == "<live>" and SITES[i].kind == "for")
    assert set(inner.live) == {"loss"} and {"logits", "total", "micro"} <= set(inner.assigned)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _SpinningController(_Controller):
    """Each head costs the runtime 10 ms (what baton does there: capturing, pushing)."""

    def before_item(self, loop: ActiveLoop) -> None:
        _spin(0.01)
        super().before_item(loop)


COSTS = '''
class Batches:  # the script's loader: 20 ms a batch, its own cost
    def __init__(self):
        self.i = -1

    def __iter__(self):
        return self

    def __next__(self):
        spin(0.02)
        self.i += 1
        if self.i == 5:
            raise StopIteration
        return self.i

total = 0
for b in Batches():
    total += b
'''


def test_the_loop_hooks_count_as_batons_own_cpu_and_the_scripts_loader_does_not(controller):
    """The no-code mode's heads are baton's entry points: what the runtime does there is
    counted as baton's own CPU (the job's summary, `bench/nocode.py`), what the script's own
    iterator does to produce an item is not."""
    from baton import selfcost

    controller(_SpinningController())
    namespace: dict[str, Any] = {"__name__": "m", HOOKS: LOOPS, "spin": _spin}
    before = selfcost.snapshot().entry_s
    exec(compile_instrumented(COSTS, "<m>"), namespace)  # noqa: S102
    counted = selfcost.snapshot().entry_s - before
    assert namespace["total"] == 10
    assert 0.06 <= counted < 0.09, counted  # 6 heads (the last one runs out) of 10 ms, no batch's 20 ms
