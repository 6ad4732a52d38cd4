"""The no-code runtime's side of the instrumented loops: where the step loop is, and its heads.

At the first `optimizer.step()` the stack says which loop is the step loop and which loops
enclose it (`nest`); what cannot move is refused there, before the step changes anything
(`analysis`). From then on each head of the step loop is handed to the runtime (a
boundary, once the previous iteration committed), its exit starts the region after it,
and each head of an outer loop of the nest notes the random streams there.

A spare that takes a rank over runs the script from its start and walks down to its
rank's place (`_CatchUp`): at the outermost loop of the nest (known from the job's loop
info) it fetches the state its predecessor published, then at each loop of the nest it
draws the items its predecessor had drawn (a loader's batches are drawn again), puts
the streams back as they were at that head, and hands the loop's variables back to the
rewritten head; at the step loop it takes the rank's state over and joins the group.

A lost peer inside a step is absorbed at the step loop's head: the runtime recovers (a spare
rebuilds the lost rank from its buddies' record of its last head) and the same iteration
runs again with the variables its head had: live with the others, or, where they completed
the step this rank abandoned, answered from their record of it. Where that cannot be exact
(a loss outside the steps, a step whose record was not kept), the job stops non-zero,
saying so.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from baton.control import messages as m
from baton.transfer import TransferError
from baton.transparent import analysis, deferred_init, extras, nest, values
from baton.worker.script_files import ScriptModules
from baton.transparent.loops import LOOPS, ActiveLoop
from baton.transparent.sites import SITES
from baton.transparent.script_runtime import ScriptRuntime
from baton.worker import rng, setup_check
from baton.worker.verify import Divergence
from baton.worker.tracked import UsageError

log = logging.getLogger("baton.worker")

# A planned move's joiner walks ahead to its rank's newest head only with this many steps
# of the step loop left after it (the ranks step on until the pause; see _CatchUp).
AHEAD_MARGIN = 16


class StepLoopController:
    def __init__(self, rt: ScriptRuntime, modules: ScriptModules, script: str, args: list[str]):
        self.rt, self.modules, self.script, self.args = rt, modules, script, args
        self.step_site: int | None = None
        self.step_loop: ActiveLoop | None = None
        self.nest_keys: list[str] = []
        self.catch_up: _CatchUp | None = None
        self.setup: dict[str, int] = {}  # the setup's fingerprint where the nest starts (setup_check)
        self._pending: dict[int, dict[str, Any]] = {}  # id(loop) -> what its next head hands back
        self._pending_exit: dict[int, dict[str, Any]] = {}  # site id -> what the code after the loop takes back
        # A successor whose step loop ran out at the head it arrived at: that loop, and the
        # values its head would have rebound, which the code after the loop rebinds (ran_out)
        self._ran_out_on_arrival: tuple[ActiveLoop, dict[str, Any]] | None = None
        self._extras_read: set[int] = set()  # id(frame) of the nest's frames read for untracked state
        # A joiner whose setup's dropped draws are still being replayed: the stream its
        # predecessor's fingerprint names (None: none there), checked before its first record
        self._late_stream: tuple[deferred_init.StreamReplay, dict[str, int]] | None = None
        rt.script_section = self.script_section
        rt.settle_setup = self.settle_setup
        if rt.joiner:
            assert rt.assignment is not None and rt.assignment.loop is not None, "a joiner is told the loop"
            self.nest_keys = list(rt.assignment.loop.nest)
            self.catch_up = _CatchUp(self)
        else:
            self._hook = register_optimizer_step_pre_hook(self._first_step)

    def attach(self) -> None:
        LOOPS.controller = self

    # ---------------------------------------------------------------- finding the step loop
    def _first_step(self, _opt: Any, *_: Any) -> None:
        if self.rt.loading:
            return
        self._hook.remove()
        found = nest.find(sys._getframe(1), self.modules)
        report = analysis.build(found, self.script, self.args, self.rt.world_size)
        if found.call is not None:
            report.refusals += analysis.stray_parameters(
                found.call.where, self.rt.tracked.optimizers() or [_opt],
                [*(ddp.module for ddp in self.rt.tracked.ddps), *self.rt.shard_roots])
        if report.refusals:
            text = "\n".join(f"{r.where}: {r.what}: {r.why}. Fix: {r.fix}" for r in report.refusals)
            raise UsageError(f"baton cannot move this script's ranks bit for bit as it is "
                             f"(`baton explain {self.script}` says more):\n{text}")
        assert found.nest is not None
        for frame_loops in found.nest.frames:  # before the loop's tracking is set up (start_script_loop)
            self._track_extras(frame_loops.frame)
        self.step_loop = found.nest.step_loop
        self.step_site = self.step_loop.site.id
        self.nest_keys = [loop.site.key for loop in found.nest.loops]
        outermost = found.nest.loops[0]
        self.setup = _setup_fingerprint(outermost, outermost.head_rng)
        self.rt.start_script_loop(self.step_loop.site.where, self.nest_keys)

    def _track_extras(self, frame: Any) -> None:
        """The state the setup made in `frame` that nothing tracked yet (an EMA, a sampler's
        generator), once per frame: every process names it the same way (extras.py)."""
        if id(frame) in self._extras_read:
            return
        self._extras_read.add(id(frame))
        added = extras.track(self.rt.tracked, frame, self.rt.shard_roots)
        if added:
            log.info("tracking the setup's state in %s: %s", frame.f_code.co_qualname, ", ".join(added))

    # ---------------------------------------------------------------- where the script stands
    def script_section(self, exiting: ActiveLoop | None = None) -> dict[str, Any]:
        """Each loop of the nest, outermost first: its place, its variables, the objects of
        plain values its frame holds, and the streams at its head (outer loops). With
        `exiting`, the step loop that just ended: last, with what it assigned as it left it."""
        path = []
        for loop in [*LOOPS.enclosing(sys._getframe()), *([exiting] if exiting is not None else [])]:
            if loop.site.key not in self.nest_keys:
                continue
            scope = _scope(loop.frame, loop.site.scope_names)
            if self._ran_out_on_arrival is not None and self._ran_out_on_arrival[0] is loop:
                scope.update(self._ran_out_on_arrival[1])  # what the code after the loop is about to rebind
            bound = loop.site.assigned if loop is exiting else \
                tuple(n for n in loop.site.live if n not in loop.site.targets)
            # objects the setup made that the loop uses (meters, `self`), read off the loop's body
            records = {}
            for n in loop.site.reads:
                if n in scope and n not in bound and (rec := _object_record(scope[n])) is not None:
                    records[n] = rec
            # lists and dicts made before the loop that it changes in place (`history.append(x)`)
            changed = values.containers(tuple(n for n in loop.site.mutated if n not in bound), scope)
            it = loop.iterable
            carried = values.carried_names(bound, scope)
            if loop is not exiting:  # its targets the code after it reads, where its items run out here
                carried.update(values.scalars(loop.site.targets_read_after, scope))
            entry = {"key": loop.site.key, "iteration": loop.iterations,
                     "range": [it.start, it.stop, it.step] if isinstance(it, range) else None,
                     "length": _length(it) if loop is self.step_loop else None,
                     "heads_per_step": loop.heads_last_step if loop is self.step_loop else None,
                     "values": carried, "records": records, "containers": changed,
                     "rng": loop.head_rng if loop is not self.step_loop and loop is not exiting else None}
            if loop is exiting:
                entry["exit"] = _exit_of(loop)
                if entry["exit"] == "return":
                    tracked = {id(obj): name for name, obj in self._returnable().items()}
                    returned = values.returned(loop.return_value, tracked)
                    if returned is None:
                        entry["exit"] = "return_uncarried"
                    else:
                        entry["returned"] = returned[0]
            path.append(entry)
        return {"path": path, "setup": self.settle_setup(), "globals": _declared_globals()}

    def settle_setup(self) -> dict[str, int]:
        """This process's setup fingerprint, its torch stream in it where a joiner's left-out
        initialisation was being replayed (deferred_init): compared with its predecessor's
        now, before a record of this process names it (the job stops where they differ)."""
        if self._late_stream is not None:
            replay, theirs = self._late_stream
            self._late_stream = None
            try:
                state = replay.result()
            except Exception as exc:  # noqa: BLE001 - no stream to check the setup by: no going on
                self.rt.stop(f"rank {self.rt.rank}: the replay of its setup's left-out draws failed ({exc!r}), so "
                             "its setup could not be checked against its predecessor's; the job stops here")
            mine = setup_check.fingerprint({"torch": rng.bytes_of(state)}, {})
            self.setup.update(mine)
            log.info("setup's torch stream replayed on a thread in %.3fs", replay.seconds)
            if theirs and setup_check.differences(mine, {k: theirs.get(k) for k in mine}):  # type: ignore[misc]
                self.rt.stop(setup_check.explain(self.rt.rank, sorted(mine)))
        return self.setup

    # ---------------------------------------------------------------- the loops (loops.Controller)
    def before_item(self, loop: ActiveLoop) -> None:
        if self.catch_up is not None:
            self.catch_up.head(loop)
            return
        if loop.site.id == self.step_site:
            self.step_loop = loop  # entered again (the next epoch): the same site, a new entry
            loop.heads_last_step = loop.step_heads  # read where a step begins (script_section)
            if self.rt.at_head():  # a step begins here
                if self.rt.went_back:  # at the head after the one it goes back to: that step's items again
                    self._go_back(loop, loop.drawn, loop.step_heads)
                else:
                    loop.heads_before, loop.drawn_before = loop.step_heads, loop.drawn
                    loop.step_heads, loop.drawn = 0, []
            loop.step_heads += 1
        elif (self.step_site is None and loop.iterations == 0) or loop.site.key in self.nest_keys:
            # the streams at each head of an outer loop of the nest, and, until the nest is
            # known, at each loop's first head (where the setup ended, for setup_check)
            loop.head_rng = rng.capture(self.rt.tracked.generators)

    def drawn(self, loop: ActiveLoop) -> None:
        """The step loop drew an item: it and the streams now, where a re-run of the step,
        handed the same item without drawing it, puts them back (`again`)."""
        if loop.site.id == self.step_site and self.catch_up is None:
            if self.rt.expecting_exit():  # the others' loop ended at this head
                self.rt.not_at_the_exit()
            loop.drawn.append((loop.item, rng.capture(self.rt.tracked.generators)))

    def again(self, loop: ActiveLoop, streams: Any) -> None:
        rng.restore(streams, self.rt.tracked.generators)

    def ran_out(self, loop: ActiveLoop) -> None:
        """A for loop's iterator ran out. Where a successor had just arrived at that head (its
        predecessor stood after the loop's last item), the values the head would have rebound
        go to the code right after the loop instead (`restore_exit`), and the objects are put
        back now, before the region's state is taken (`left`). A value only the predecessor's
        last item bound (the loop's own target read after the loop) goes with them where it is
        a number or a string (`i` of `for i, batch in ...`; the head carried it); one that is
        not (the last batch) cannot be handed back: the job stops rather than go on without.
        An else clause, which runs before that code, takes them at its top (rewrite.py)."""
        entry = self._pending.pop(id(loop), None)
        if entry is None:
            return
        site = loop.site
        unbound = [n for n in site.targets_read_after if n not in entry["values"]]
        if unbound:
            self.rt.stop(f"rank {self.rt.rank}: this process took its rank over at the head of {site.where} where "
                         f"the loop's items ran out, and its target {', '.join(unbound)}, read after the loop, would "
                         "run with what only its predecessor held. The job stops here: restart it from your own "
                         "checkpoint.")
        self._ran_out_on_arrival = (loop, self._hand_back(entry, loop.frame))
        self._pending_exit[site.id] = entry

    def left(self, loop: ActiveLoop) -> None:
        if self.catch_up is not None and self.catch_up.exiting is loop:
            self.catch_up.arrive_at_exit(loop)
        elif loop.site.id == self.step_site and self.catch_up is None:
            self.rt.at_exit(self.script_section(exiting=loop))

    def restore(self, loop: ActiveLoop) -> dict[str, Any] | None:
        if self.catch_up is not None or self._pending:
            entry = self._pending.pop(id(loop), None)
            self._restoring_done()
            return self._hand_back(entry, loop.frame) if entry is not None else None
        self._restoring_done()
        return None

    def return_value(self, loop: ActiveLoop) -> Any:
        """A successor leaving its step loop by a return, as its predecessor did: the objects
        put back as that loop left them, and the value it returned."""
        entry = self._pending_exit.pop(loop.site.id)
        self._hand_back(entry, loop.frame)
        self._restoring_done()
        return values.returned_again(entry["returned"], self._returnable())

    def _returnable(self) -> dict[str, Any]:
        """The objects whose state moves, which a step loop's return may hand on by name: a
        successor returns its own (the model as the script holds it: its DDP wrapper too)."""
        tracked = self.rt.tracked
        return {**tracked.objects, **{f"$ddp{i}": ddp for i, ddp in enumerate(tracked.ddps)}}

    def restore_exit(self, sid: int, frame: Any) -> dict[str, Any] | None:
        self._ran_out_on_arrival = None
        entry = self._pending_exit.pop(sid, None)
        self._restoring_done()
        return self._hand_back(entry, frame) if entry is not None else None

    def _restoring_done(self) -> None:
        if not self._pending and not self._pending_exit:
            LOOPS.restoring = False

    def _hand_back(self, entry: dict[str, Any], frame: Any) -> dict[str, Any]:
        """Put back what `entry` recorded of a loop: the objects in place, and the variables
        for the rewritten code to rebind."""
        scope = {**{n: v for n, v in frame.f_globals.items() if n in frame.f_code.co_names}, **frame.f_locals}
        for name, saved in entry["records"].items():
            if name in scope:
                values.restore_record(scope[name], saved, name)
        for name, saved in entry.get("containers", {}).items():
            if name in scope:
                values.restore_container(scope[name], saved, name)
        return {name: values.rebound(saved, scope.get(name), name) for name, saved in entry["values"].items()}

    def absorb(self, loop: ActiveLoop, exc: BaseException) -> bool:
        """A lost peer, out of the step loop's body: the runtime recovers, and the same
        iteration runs again with the variables its head had (handed back at the head)."""
        rt = self.rt
        if loop.site.key not in self.nest_keys:
            return False  # a loop inside the step (micro-batches): the step loop's head takes it
        try:
            if not rt.absorb(loop.site.id == self.step_site, exc):
                return False
        except Divergence as stop:
            rt.stop(str(stop))
        if rt.went_back:  # in the step after the one it goes back to: both steps' items again
            self._go_back(loop, loop.drawn_before + loop.drawn, loop.heads_before, loop.step_heads)
            loop.back_one = True  # (loops.absorb: put back already)
            return True
        self._hand_back_at_head(loop)
        return True

    def _go_back(self, loop: ActiveLoop, items: list[tuple[Any, Any]], heads_back: int, heads_now: int = 0) -> None:
        """The rank's recovery took it back to the head of the step before (`rt.went_back`):
        that step's items again (`heads_back` heads), and those the running step had drawn
        (`heads_now`), with the variables the step before's head had. The loop must then stand
        at that head's iteration, as recorded there: else the job stops (never a step run
        again on other items)."""
        rt = self.rt
        rt.went_back = False
        if heads_back == 0:
            rt.stop(f"rank {rt.rank}: the recovery took this rank back to the step before, which ran in an earlier "
                    f"pass of {loop.site.where} (a sharded rank was lost after the last collective of a pass's last "
                    "step): this version runs again only a step of the same pass. The job stops here: restart it "
                    "from your own checkpoint.")
        LOOPS.put_back(loop, items, heads_back + heads_now)
        loop.heads_before, loop.drawn_before = 0, []  # (run again: none before it to go back to)
        assert rt.head_state is not None
        recorded = rt.head_state["script"]["path"][-1]["iteration"]
        if loop.iterations != recorded:
            rt.stop(f"rank {rt.rank}: going back to the head of step {rt.pos[0]}, {loop.site.where} stands at its "
                    f"iteration {loop.iterations} where that head was at {recorded} (a baton bug: please report "
                    "it). The job stops here: restart it from your own checkpoint.")
        self._hand_back_at_head(loop)

    def _hand_back_at_head(self, loop: ActiveLoop) -> None:
        """The variables and globals of the running step's head (`rt.head_state`), handed
        back as the loop's body begins."""
        rt = self.rt
        assert rt.head_state is not None
        _restore_globals(rt.head_state["script"]["globals"])
        self._pending[id(loop)] = rt.head_state["script"]["path"][-1]
        LOOPS.restoring = True

_EXITS = {"return_uncarried": "by a return of a value that cannot be carried (an object of its own; numbers, "
                             "strings, tensors, containers of them, and the model, optimizer or scheduler can)",
          "exception": "by an exception"}


def _exit_of(loop: ActiveLoop) -> str:
    """How the step loop ended, for a successor to end its own the same way."""
    if loop.raised:
        return "exception"
    if loop.returned:  # from its body, or from its else clause once its items ran out
        return "return"
    return "ran_out" if loop.ran_out else "break"


_GLOBAL_MODULES: dict[str, Any] = {}  # file -> the module whose functions declare globals (found once)


def _declared_globals() -> dict[str, dict[str, Any]]:
    """The script's module globals some function declares `global` (wherever it is called
    from, it may change them), by file. Read at every head: the modules holding them are
    looked up in sys.modules only when a new such file was instrumented."""
    if _GLOBAL_MODULES.keys() != SITES.globals.keys():
        by_file = {getattr(mod, "__file__", None): mod for mod in list(sys.modules.values())}
        _GLOBAL_MODULES.clear()
        _GLOBAL_MODULES.update({f: by_file[f] for f in SITES.globals if f in by_file})
    return {file: values.carried_names(SITES.globals[file], vars(module)) for file, module in _GLOBAL_MODULES.items()}


def _restore_globals(saved: dict[str, dict[str, Any]]) -> None:
    if not saved:  # (reading every module's __file__ took 6-8 ms of a walk on 2 cores)
        return
    by_file = {getattr(mod, "__file__", None): mod for mod in list(sys.modules.values())}
    for file, names in saved.items():
        module = by_file.get(file)
        if module is None:
            raise Divergence(f"the script's module {file} is not imported here, but the rank this process "
                             "replaces had it: the script took another way")
        for name, value in names.items():
            setattr(module, name, values.rebound(value, getattr(module, name, None), name))


def _scope(frame: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """`names` as the loop's code sees them: bound locals (and cells), else the globals its code reads."""
    local, glob, read_global = frame.f_locals, frame.f_globals, frame.f_code.co_names
    scope = {}
    for n in names:
        if n in local:
            scope[n] = local[n]
        elif n in glob and n in read_global:
            scope[n] = glob[n]
    return scope


def _length(iterable: Any) -> int | None:
    """How many items a step loop's iterable has (a DataLoader's batches), where it says."""
    if type(iterable) is enumerate:  # `for i, batch in enumerate(loader)`: its loader's iterator says
        iterable = iterable.__reduce__()[1][0]
    if not hasattr(type(iterable), "__len__"):
        return None  # a generator, a zip
    try:
        return len(iterable)
    except TypeError:  # a DataLoader of an IterableDataset without a length
        return None


def _walked_past(early: list[dict[str, Any]], now: list[dict[str, Any]], rebound: set[str]) -> str | None:
    """Why a joiner walked ahead to `early` cannot walk on to `now` (None where it can): the
    loops around the step loop must stand where they stood, with the same variables (their
    heads ran with those), and the step loop must not have ended or gone back. Names the
    step loop assigns (`rebound`: a step counter of a `while done < steps` around it) change
    with every step and are the step loop's to carry: they are not compared."""
    if len(now) != len(early) or now[-1].get("exit"):
        return "its step loop ended"
    for a, b in zip(early[:-1], now[:-1]):
        if (a["key"], a["iteration"], a["range"]) != (b["key"], b["iteration"], b["range"]):
            return f"a loop around its step loop went on: {b['key']} at iteration {b['iteration']}"
        mine, theirs = a["values"], b["values"]
        changed = sorted(k for k in (mine.keys() | theirs.keys()) - rebound
                         if k not in mine or k not in theirs or not values.same(mine[k], theirs[k]))
        if changed:
            return f"the variables of {b['key']} changed: {', '.join(changed)}"
    if now[-1]["iteration"] < early[-1]["iteration"] or now[-1]["key"] != early[-1]["key"]:
        return "its step loop began again"
    return None


def _arriving(tracked: Any) -> list[Any]:
    """The tensors a joiner's arriving state is loaded into, whole: every tracked model's
    `state_dict()` (load_state_dict copies each), its sharded ones aside."""
    sharded = set(tracked.sharded_names())
    return [t for name, obj in tracked.objects.items() if isinstance(obj, torch.nn.Module) and name not in sharded
            for t in obj.state_dict().values() if isinstance(t, torch.Tensor)]


def _setup_fingerprint(loop: ActiveLoop, streams: dict[str, Any] | None) -> dict[str, int]:
    """Where the nest starts: the streams at its outermost loop's first head, and what the
    loaders, datasets and samplers its frame holds (directly, or as attributes of `self`)
    will yield, by name."""
    loaders: dict[str, Any] = {}
    for name, value in sorted(loop.frame.f_locals.items()):
        attrs = getattr(value, "__dict__", None)
        if setup_check.is_data(value):
            loaders.setdefault(name, value)
        elif isinstance(attrs, dict) and _is_record(value):
            for attr, candidate in sorted(attrs.items()):
                if setup_check.is_data(candidate):
                    loaders.setdefault(f"{name}.{attr}", candidate)
    return setup_check.fingerprint(streams or {}, loaders)


def _object_record(obj: Any) -> dict[str, Any] | None:
    """The carried attributes of an object (not a container) a loop reads: a meter, `self`;
    None for anything else (the model, the optimizer, modules, functions: its type says so
    first, and cheaply, as this is asked at every head of every name the loop reads)."""
    return values.carried_record(obj)


def _is_record(obj: Any) -> bool:
    from baton.transparent.carried import Kind, classify

    return classify(obj, from_setup=True).kind is Kind.RECORD


class _CatchUp:
    """A joiner walking down the nest to its rank's place."""

    def __init__(self, controller: StepLoopController):
        self.c = controller
        self.depth = 0
        self.fetched: tuple[m.Form, dict[str, Any], Any] | None = None
        self.t0 = 0.0
        self.exiting: ActiveLoop | None = None  # the step loop, ending at once: the rank was lost after it
        self.setup: dict[str, int] = {}  # this process's fingerprint where the nest starts (_setup_fingerprint)
        # A planned move's joiner walking ahead: its rank's own record at its newest head (from
        # its buddies, while the ranks train on), and the nest's loops walked to it
        self.ahead: dict[str, Any] | None = None
        self.walked: list[ActiveLoop] = []
        self.deferred = deferred_init.arm()  # the setup's random initialisation the state overwrites
        self.replay: deferred_init.StreamReplay | None = None

    def head(self, loop: ActiveLoop) -> None:
        c = self.c
        if self.depth >= len(c.nest_keys) or loop.site.key != c.nest_keys[self.depth]:
            return  # the setup's own loops, and the prefix's
        try:
            self._walk(loop)
        except Divergence as stop:
            c.rt.stop(str(stop))

    def _walk(self, loop: ActiveLoop) -> None:
        c = self.c
        if self.fetched is None and self.depth == 0:
            # What this setup built, taken before the pause (the ranks stop at its SetupDone):
            # a model's classification there took 15-40 ms, beside the state's arrival on 2 cores.
            replay = self.deferred.finish(_arriving(c.rt.tracked))
            c.rt.setup_left_out_bytes = self.deferred.left_out_bytes
            streams = rng.capture(c.rt.tracked.generators)
            if replay is not None:  # the stream its left-out draws would have left: checked late
                del streams["torch"]
            self.setup = _setup_fingerprint(loop, streams)
            self.replay = replay
            self.ahead = c.rt.latest_record()
            why = self._not_worth_walking_ahead(self.ahead) if self.ahead is not None else "no record to walk to"
            if why:
                log.info("rank %d: walking to its place in the pause (%s)", c.rt.rank, why)
                self.ahead = None
            if self.ahead is None:
                self._fetch()
        last = self.depth == len(c.nest_keys) - 1
        if self.ahead is not None and last:
            self._catch_up_from_ahead(loop)
        bundle = self.ahead if self.ahead is not None else self.fetched[1]["bundle"]  # type: ignore[index]
        path = bundle["script"]["path"]
        if len(path) != len(c.nest_keys) or path[self.depth]["key"] != loop.site.key:
            raise Divergence(f"rank {c.rt.rank}: its predecessor stood in loops {[e['key'] for e in path]}, not "
                             f"{c.nest_keys}: the script took another way (is its setup deterministic?)")
        entry = path[self.depth]
        if self.depth == 0:  # where the nest starts: did this setup build what the predecessor's did?
            theirs = bundle["script"].get("setup") or {}
            late = {"stream.torch"} if self.replay is not None else set()
            differing = [d for d in setup_check.differences(self.setup, theirs) if d not in late] if theirs else []
            if differing:
                raise Divergence(setup_check.explain(c.rt.rank, differing))
            c.setup = self.setup  # what this process's own record says from now on: its successor checks it too
            if self.replay is not None:
                c._late_stream = (self.replay, theirs)
            _restore_globals(bundle["script"].get("globals", {}))
        self.walked.append(loop)
        c._track_extras(loop.frame)  # before the streams at this head are put back: they include its generators
        if entry.get("exit"):
            self._end(loop, entry)
            return
        if loop.site.kind == "for":
            assert loop.counted is not None
            if entry["range"] is not None and isinstance(loop.iterable, range) and \
                    [loop.iterable.start, loop.iterable.stop, loop.iterable.step] != entry["range"]:
                loop.counted.replace(range(*entry["range"]))  # a resume block read a newer checkpoint
            # Outer loops: the predecessor had drawn the item it was in; the step loop: it stood
            # at a head, before drawing the next one. Either way this head draws that item.
            drawn_before = entry["iteration"] - (1 if self.depth < len(c.nest_keys) - 1 else 0)
            loop.counted.skip(drawn_before - loop.iterations)
        if entry["rng"] is not None:
            rng.restore(entry["rng"], c.rt.tracked.generators)
            # This process's own record of the head from now on (`script_section`): a rank
            # lost again before this loop's next head is rebuilt from it, and without it
            # its successor's draws there (a DataLoader's worker seeds) came from its setup.
            loop.head_rng = rng.capture(c.rt.tracked.generators)
        c._pending[id(loop)] = entry
        LOOPS.restoring = True
        self.depth += 1
        if self.depth == len(c.nest_keys):
            self._arrive(loop)

    def _fetch(self) -> None:
        """Report the setup done (a planned move's ranks pause only now) and wait for the Form
        naming the rank's place, with the state taken over there."""
        self.c.rt.setup_done()
        self.t0 = time.perf_counter()
        try:
            self.fetched = self.c.rt.fetch_for_join()
        except (TransferError, OSError) as exc:
            self.c.rt.leave_to_another_spare(exc)

    def _not_worth_walking_ahead(self, ahead: dict[str, Any]) -> str:
        """Walk ahead only to a head inside the step loop with steps to spare before its end:
        the ranks go on meanwhile, and a place past the loop's end (another epoch) cannot be
        walked to from there (where the ranks went that far anyway, this process leaves the
        rank to another spare, which walks in the pause). Steps, not items: a step
        accumulating 16 micro-batches spends a 16-item epoch in one. A loop whose length is
        unknown, or whose step size is not known yet (the first step of an epoch), is walked
        in the pause. Why not (empty: walk ahead)."""
        path = ahead["script"]["path"]
        if len(path) != len(self.c.nest_keys) or any(e.get("exit") for e in path):
            return "its rank stood outside its step loop"
        left = os.environ.get("BATON_TEST_AHEAD_MARGIN")
        margin = int(left) if left is not None else AHEAD_MARGIN
        step = path[-1]
        if step["range"] is not None:  # a range is walked in no time (and its length may be replaced)
            return "its step loop walks a range"
        length, per_step = step.get("length"), step.get("heads_per_step")
        if length is None or not per_step:
            return "its step loop's length is unknown" if length is None else \
                f"its step size is not known yet (iteration {step['iteration']}: its first step this loop)"
        if (length - step["iteration"]) // per_step < margin:
            return f"fewer than {margin} steps to its step loop's end"
        return ""

    def _catch_up_from_ahead(self, loop: ActiveLoop) -> None:
        """At the step loop's head, walked ahead to where the rank stood a moment ago (`ahead`,
        drawn to there): report the setup done, take the place the pause names, and walk on
        to it from here, with what the rank's record there says of the loops walked past."""
        assert self.ahead is not None and loop.counted is not None
        c, early = self.c, self.ahead["script"]
        loop.counted.skip(early["path"][-1]["iteration"] - loop.iterations)
        c.rt.walked_ahead = early["path"][-1]["iteration"]
        self._fetch()
        assert self.fetched is not None
        now = self.fetched[1]["bundle"]["script"]
        differs = _walked_past(early["path"], now["path"], set(loop.site.assigned))
        mark = os.environ.get("BATON_TEST_AHEAD_UNREACHABLE")  # tests, once: as if the ranks had gone past
        if mark and not differs and not os.path.exists(mark):  # the loop's end
            open(mark, "w").close()
            differs = "BATON_TEST_AHEAD_UNREACHABLE"
        if differs:
            c.rt.leave_to_another_spare(RuntimeError(
                f"it walked ahead to iteration {early['path'][-1]['iteration']} of its step loop, and cannot walk "
                f"on to the rank's place from there: {differs}"))
        for outer, entry in zip(self.walked, now["path"][:-1]):
            c._hand_back(entry, outer.frame)  # objects and containers as they are now (a meter, `self`)
        _restore_globals(now.get("globals", {}))
        self.ahead = None

    def _end(self, loop: ActiveLoop, entry: dict[str, Any]) -> None:
        """The predecessor was lost after its step loop had ended: end this one at once, as
        that one ended (nothing drawn), then take the rank over right after it (`arrive_at_exit`).
        A for loop whose iterator ran out ends as it did; one left by a break, or a loop with an
        else clause (which the predecessor ran before its record of the exit: what it changed
        is in that record, handed back right after the loop), breaks at this head; one left by
        a return returns from this head what its predecessor returned."""
        how = entry["exit"]
        exact = self.depth == len(self.c.nest_keys) - 1 and how in ("break", "return", "ran_out")
        if not exact:
            raise Divergence(f"rank {self.c.rt.rank} was lost after its step loop ({loop.site.where}) had ended "
                             f"{_EXITS.get(how, how)}: a successor cannot leave the loop the same way. The job "
                             "stops here: restart it from your own checkpoint.")
        if loop.site.kind == "for" and how == "ran_out" and not loop.site.has_else:
            loop.exhausted = True
        elif how == "return":
            loop.returning = True  # its function returns the predecessor's value (`return_value`)
        else:
            loop.breaking = True  # a for loop's head draws nothing then
        self.exiting = loop
        self.c._pending_exit[loop.site.id] = entry
        LOOPS.restoring = True

    def arrive_at_exit(self, loop: ActiveLoop) -> None:
        c = self.c
        assert self.fetched is not None
        cmd, state, stats = self.fetched
        state, stats = self._rest_of_state(state, stats)
        c.step_loop, c.step_site = loop, loop.site.id
        c.catch_up = None
        try:
            c.rt.join_in_region(cmd, state, stats, self.t0)
        except Divergence as stop:
            c.rt.stop(str(stop))

    def _arrive(self, loop: ActiveLoop) -> None:
        c = self.c
        loop.step_heads, loop.drawn = 1, []  # its step begins at this head
        assert self.fetched is not None
        cmd, state, stats = self.fetched
        state, stats = self._rest_of_state(state, stats)
        c.step_loop, c.step_site = loop, loop.site.id
        c.catch_up = None
        c.rt.join_at_head(cmd, state, stats, self.t0)

    def _rest_of_state(self, state: dict[str, Any], stats: Any) -> tuple[dict[str, Any], Any]:
        """What arrived while the script walked here; its sources lost meanwhile (a planned
        move's leaver, say) leave the rank to another spare: this process has walked to a
        place the next plan may not name."""
        try:
            return self.c.rt.fetched_state(state, stats)
        except (TransferError, OSError) as exc:
            self.c.rt.leave_to_another_spare(exc)
