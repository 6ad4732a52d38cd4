"""`baton explain`'s report on a terminal."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from baton.transparent.analysis import Report
from baton.transparent.mode import NO_CODE_STATUS

_KIND_TEXT = {
    "value": "carried as it is",
    "tensor": "carried as it is",
    "numpy": "carried as it is",
    "object": "carried attribute by attribute",
    "state": "moves with its state_dict",
    "module": "in the rank's record at each head, once changed",
    "generator": "with the rank's random streams",
    "loader": "position replayed",
    "setup": "rebuilt by the successor's setup",
    "later": "checked when bound",
    "item": "drawn again",
    "item_kept": "drawn again; the last one's kept for the code after the loop",
    "item_read_after": "drawn again; not kept (a copy per item): a successor arriving as the loop ends stops",
    "dead": "not carried",
    "refused": "REFUSED",
}


def _here(where: str) -> str:
    """file:line, the file relative to the working directory when it lies under it."""
    path, _, line = where.rpartition(":")
    try:
        rel = Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return where
    return f"{rel}:{line}"


def _shorten(report: Report) -> Report:
    data = report.model_dump()
    for key, fields in (("loops", ("where",)), ("regions", ("loop",)), ("carried", ("loop",)),
                        ("refusals", ("where",))):
        for row in data[key]:
            for f in fields:
                row[f] = _here(row[f])
    data["call"] = _here(data["call"]) if data["call"] else ""
    if data["step_body"]:
        path, _, lines = data["step_body"].rpartition(":")
        data["step_body"] = _here(f"{path}:0").removesuffix(":0") + f":{lines}"
    return Report.model_validate(data)


def render(report: Report, console: Console) -> None:
    report = _shorten(report)
    args = " ".join([report.script, *report.args])
    console.print(f"[bold]baton explain[/] {args}  (ran as {report.world_size} rank(s), stopped before the "
                  "first optimizer.step())")
    console.print("Mode: [bold]no code change[/] (the script does not import baton)")
    step = report.step_loop
    if step is not None:
        console.print(f"\n[bold]Step loop[/]: {step.where} in {step.scope}: `{step.header}`")
        console.print(f"  boundary: the start of each iteration; the step is its body ({report.step_body}); "
                      f"optimizer.step() is called at {report.call}")
        loops = Table("loop", "in", "iterates over", "how a successor gets there", box=None, pad_edge=False)
        for loop in report.loops:
            mark = " (step)" if loop.step else ""
            loops.add_row(f"{loop.where}{mark}", loop.scope, loop.iterates, loop.position or "-")
        console.print("\n[bold]Loops[/], outermost first:")
        console.print(loops)
    if report.regions:
        console.print("\n[bold]Regions around the inner loops[/]:")
        for region in report.regions:
            if region.when == "before":
                what = "before the inner loop: a joiner runs it again as it catches up"
            else:
                what = ("after the inner loop (evaluation, checkpoint): a move waits for the next step; "
                        "a rank lost here ends the job in this version")
            console.print(f"  {region.loop} lines {region.lines}, {what}:")
            for text in region.statements:
                console.print(f"      {text}", markup=False, overflow="fold")
    if report.carried:
        carried = Table("loop", "name", "kind", "what happens", box=None, pad_edge=False)
        for c in report.carried:
            carried.add_row(c.loop, c.name, c.detail, _KIND_TEXT.get(c.kind, c.kind))
        console.print("\n[bold]What the loops carry[/] from one iteration to the next:")
        console.print(carried)
    if report.refusals:
        console.print(f"\n[bold red]Refused[/] ({len(report.refusals)}): this script cannot move bit for bit "
                      "as it is")
        for r in report.refusals:
            console.print(f"  [bold]{r.where}[/]: {r.what}")
            console.print(f"    why: {r.why}", markup=False)
            console.print(f"    fix: {r.fix}", markup=False)
    else:
        console.print("\n[bold green]Nothing refused[/].")
    console.print(NO_CODE_STATUS, markup=False)
