"""What baton will do with a script, read off its stack at the first `optimizer.step()`.

The report names the step loop and the loops around it, what each iterates over and how a
successor gets back to the same iteration, the regions of the outer loops' bodies before
and after the inner ones (a joiner re-runs what comes before; a failure in what comes
after, the evaluation and the checkpoint, re-runs that region), what each loop carries,
and what is refused. It is a typed message: `baton explain` computes it in the script's
own process and prints it from the launcher's.
"""

from __future__ import annotations

import gc
import warnings
from typing import Literal

import torch
from pydantic import BaseModel

from baton.transparent import ddp_rules, extras, refusals
from baton.transparent.carried import Kind, classify
from baton.transparent.values import scalars
from baton.transparent.loops import ActiveLoop
from baton.transparent.nest import FrameLoops, Found, Nest, Place
from baton.transparent.sites import Statement

_NOT_CARRIED = ("__builtins__", "__baton_loops__")


class LoopReport(BaseModel):
    where: str
    scope: str
    header: str
    iterates: str
    position: str
    step: bool = False


class RegionReport(BaseModel):
    loop: str  # the loop whose body it is in
    when: Literal["before", "after"]  # the inner loop
    lines: str
    statements: list[str]


class CarriedReport(BaseModel):
    loop: str
    name: str
    kind: str
    detail: str


class RefusalReport(BaseModel):
    where: str
    what: str  # the construct refused
    why: str
    fix: str


class Report(BaseModel):
    script: str
    args: list[str]
    world_size: int
    call: str = ""  # where optimizer.step() is called
    step_body: str = ""  # the step loop's body, file:first-last
    loops: list[LoopReport] = []
    regions: list[RegionReport] = []
    carried: list[CarriedReport] = []
    refusals: list[RefusalReport] = []
    ended: str = ""  # why there is no nest: the script ended or failed before its first step

    @property
    def step_loop(self) -> LoopReport | None:
        return next((loop for loop in self.loops if loop.step), None)


def _refusal(r: refusals.Refusal) -> RefusalReport:
    return RefusalReport(where=r.where, what=r.what, why=r.why, fix=r.fix)


def ddp_refusals(script: str) -> list[RefusalReport]:
    """What `baton run` refuses in the DistributedDataParallels the script built (here it ran
    under plain torch, where nothing refused them as it went)."""
    from torch.nn.parallel import DistributedDataParallel

    out = []
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            calls = obj.__dict__.get("_baton_calls", {})
            out += [RefusalReport(where=calls.get(call, f"{script}:0"), what=f"DistributedDataParallel.{call}",
                                  why=why, fix=refusals.NO_MIGRATION) for call, why in ddp_rules.refusals_of(obj)]
    return out


def stray_parameters(call_where: str, optimizers: list[torch.optim.Optimizer],
                     models: list[torch.nn.Module]) -> list[RefusalReport]:
    """The optimizers' trainable parameters that none of `models` (the DDPs, the modules given
    fully_shard) holds: rank-local state a successor would not get (refusals.stray_parameter)."""
    held = {id(p) for model in models for p in model.parameters()}
    stray = [p for opt in optimizers for g in opt.param_groups for p in g["params"]
             if p.requires_grad and id(p) not in held]
    return [_refusal(refusals.stray_parameter(call_where, list(p.shape))) for p in dict.fromkeys(stray)]


def models_in_memory() -> list[torch.nn.Module]:
    """The DDPs and the modules given fully_shard that the process holds (`baton explain`, which
    ran the script under plain torch, tracking nothing)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    # isinstance reads each object's __class__: on torch's deprecated aliases that warns (a
    # FutureWarning about `torch.distributed.reduce_op` printed by `baton explain`)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return [obj for obj in gc.get_objects() if isinstance(obj, (DistributedDataParallel, FSDPModule))]


def build(found: Found, script: str, args: list[str], world_size: int, explaining: bool = False) -> Report:
    """The report; `explaining` (baton explain) adds the setup's untracked state that moves with
    the rank (extras.py), which a run finds itself as it tracks it."""
    report = Report(script=script, args=list(args), world_size=world_size,
                    call=found.call.where if found.call else "")
    if found.nest is None:
        refusal = refusals.library_loop(found.library_loop) if found.library_loop is not None else \
            refusals.no_loop(found.call or Place(script, 0, "<module>"))
        report.refusals.append(_refusal(refusal))
        return report
    nest = found.nest
    step = nest.step_loop
    body = step.site.body
    if body:
        report.step_body = f"{step.site.file}:{body[0].line}-{body[-1].end_line}"
    for depth, loop in enumerate(nest.loops):
        it = refusals.iteration(loop, repeated=depth > 0)
        report.loops.append(LoopReport(where=loop.site.where, scope=loop.site.scope, header=loop.site.header,
                                       iterates=it.what, position=it.how, step=loop is step))
        if it.refusal is not None:
            report.refusals.append(_refusal(it.refusal))
    report.regions = _regions(nest)
    for frame_loops in nest.frames:
        carried, refused = _carried(frame_loops)
        report.carried += carried
        report.refusals += [_refusal(r) for r in refused]
        if explaining:
            report.carried += _setup_state(frame_loops)
    return report


def _setup_state(frame_loops: FrameLoops) -> list[CarriedReport]:
    """The modules and generators of the frame's setup that move with the rank (extras.py)."""
    where = frame_loops.loops[0].site.where
    return [CarriedReport(loop=where, name=name.removeprefix(extras.PREFIX), detail=type(obj).__name__,
                          kind="module" if isinstance(obj, torch.nn.Module) else "generator")
            for name, obj in extras.untracked_in(frame_loops.frame)]


def _point(nest: Nest, loop: ActiveLoop) -> int:
    """The line inside `loop`'s body where the way down to the step goes on."""
    loops = nest.loops
    inner = loops[loops.index(loop) + 1]
    return inner.site.line if inner.frame is loop.frame else loop.frame.f_lineno


def _regions(nest: Nest) -> list[RegionReport]:
    out = []
    for loop in nest.loops[:-1]:
        point = _point(nest, loop)
        before = [s for s in loop.site.body if s.end_line < point]
        after = [s for s in loop.site.body if s.line > point]
        for when, stmts in (("before", before), ("after", after)):
            if stmts:
                out.append(RegionReport(loop=loop.site.where, when=when,  # type: ignore[arg-type]
                                        lines=f"{stmts[0].line}-{stmts[-1].end_line}",
                                        statements=[_summary(s) for s in stmts]))
    return out


def _summary(statement: Statement) -> str:
    """A statement's first line, and for a compound one (`if rank == 0:`) what it calls."""
    if statement.text.endswith(":") and statement.calls:
        return f"{statement.text}  -> {', '.join(statement.calls[:6])}"
    return statement.text


def _carried(frame_loops: FrameLoops) -> tuple[list[CarriedReport], list[refusals.Refusal]]:
    """What the frame's loops carry: the names they bind or mutate (checked strictly), and
    objects of plain attributes the setup made that they use (meters, `self`)."""
    frame = frame_loops.frame
    local_values = frame.f_locals
    values = {**{n: v for n, v in frame.f_globals.items() if n in frame.f_code.co_names}, **local_values}
    outer = frame_loops.loops[0]
    where = outer.site.where
    bound: dict[str, None] = {}
    for loop in frame_loops.loops:
        bound.update(dict.fromkeys(loop.site.assigned + loop.site.mutated))
    used: dict[str, None] = {}
    for loop in frame_loops.loops:
        used.update(dict.fromkeys(loop.site.reads))
    setup_names = [n for n in used if n not in bound and n not in _NOT_CARRIED]
    out: list[CarriedReport] = []
    refused: list[refusals.Refusal] = []
    items = {n for loop in frame_loops.loops for n in loop.site.targets}
    live = {n for loop in frame_loops.loops for n in loop.site.live}
    for name in bound:
        if name in items:
            if name not in live:
                out.append(CarriedReport(loop=where, name=name, kind="item", detail="loop item"))
            else:  # read after the loop: the last item's, which a successor arriving where the loop ends needs
                scalar = bool(scalars((name,), values))
                out.append(CarriedReport(loop=where, name=name, kind="item_kept" if scalar else "item_read_after",
                                         detail="loop item, read after the loop"))
            continue
        if name not in live and name not in {n for loop in frame_loops.loops for n in loop.site.mutated}:
            out.append(CarriedReport(loop=where, name=name, kind="dead", detail="overwritten before it is read"))
            continue
        if name not in values:
            out.append(CarriedReport(loop=where, name=name, kind="later",
                                     detail="not bound yet"))
            continue
        got = classify(values[name])
        out.append(CarriedReport(loop=where, name=name, kind=got.kind.value, detail=got.detail))
        r = refusals.carried_value(where, name, values[name])
        if r is not None:
            refused.append(r)
    for name in setup_names:
        if name not in values:
            continue
        got = classify(values[name], from_setup=True)
        if got.kind is Kind.RECORD:
            out.append(CarriedReport(loop=where, name=name, kind=got.kind.value, detail=got.detail))
        elif got.kind is Kind.REFUSED:
            out.append(CarriedReport(loop=where, name=name, kind=got.kind.value, detail=got.detail))
            refused.append(refusals.setup_value(where, name, values[name], got.detail, got.why))
    return out, refused
