"""The step loop, found from the stack at the first `optimizer.step()`.

The step loop is the innermost of the script's loops running around the optimizer's
step, whatever the functions on the way are called (`train()`, `self._run_epoch`,
`self.fwd_bwd_fn`): names would miss those. The loops around it, in the same frame or in
the frames that called it, are the nest a successor walks down to reach its rank's
place. A loop of an installed package between the script's loops and the step (the loop
of Lightning's or the HF Trainer's fit) is not the script's: baton cannot resume it.
"""

from __future__ import annotations

import ast
import functools
import linecache
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from baton.worker.script_files import ScriptModules
from baton.transparent.loops import LOOPS, ActiveLoop

_TORCH_DIR = Path(torch.__file__).resolve().parent
_BATON_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Place:
    """A point of the program: a file, a line and the function it is in."""

    file: str
    line: int
    function: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class FrameLoops:
    """One frame of the nest and the loops running in it, outermost first."""

    frame: FrameType
    place: Place  # where the frame is now (the call towards the step, or the step itself)
    loops: list[ActiveLoop]


@dataclass
class Nest:
    frames: list[FrameLoops]  # outermost first; the last one runs the step loop
    call: Place  # where the script called optimizer.step() (or the helper that did)

    @property
    def loops(self) -> list[ActiveLoop]:
        return [loop for f in self.frames for loop in f.loops]

    @property
    def step_loop(self) -> ActiveLoop:
        return self.frames[-1].loops[-1]


@dataclass(frozen=True)
class Found:
    """What the stack says: the nest, or why there is none."""

    nest: Nest | None
    library_loop: Place | None = None  # a loop of an installed package around the step
    call: Place | None = None


def _is_internal(filename: str) -> bool:
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return True
    return path.is_relative_to(_TORCH_DIR) or path.is_relative_to(_BATON_DIR) or filename.startswith("<")


def _place(frame: FrameType) -> Place:
    return Place(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname)


def find(frame: FrameType, modules: ScriptModules) -> Found:
    """The nest around `frame` (inside optimizer.step()), as seen from the stack."""
    stack: list[FrameType] = []
    f: FrameType | None = frame
    while f is not None:
        stack.append(f)
        f = f.f_back
    outside = [f for f in stack if not _is_internal(f.f_code.co_filename)]
    call = _place(outside[0]) if outside else _place(frame)
    running = LOOPS.enclosing(frame)
    step_frame = running[-1].frame if running else None
    # Frames between the step loop and optimizer.step() that are not the script's: is one
    # of them inside a loop of its own?
    for f in outside:
        if f is step_frame:
            break
        if not modules.own(f.f_code.co_filename):
            loop_line = loop_around(f.f_code.co_filename, f.f_lineno)
            if loop_line is not None:
                return Found(None, Place(f.f_code.co_filename, loop_line, f.f_code.co_qualname), call)
    if not running:
        return Found(None, None, call)
    frames: list[FrameLoops] = []
    for loop in running:
        if frames and frames[-1].frame is loop.frame:
            frames[-1].loops.append(loop)
        else:
            frames.append(FrameLoops(loop.frame, _place(loop.frame), [loop]))
    return Found(Nest(frames, call), None, call)


@functools.lru_cache(maxsize=256)
def _tree(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    try:
        return ast.parse(source) if source else None
    except SyntaxError:
        return None


def loop_around(filename: str, line: int) -> int | None:
    """The line of the innermost `for`/`while` of the function around `line` that contains
    it, read from the source (installed code is not instrumented)."""
    tree = _tree(filename)
    if tree is None:
        return None
    scope: ast.AST = tree
    best: int | None = None
    nodes = list(ast.iter_child_nodes(scope))
    while nodes:
        node = nodes.pop()
        start, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
        if start is None or end is None or not start <= line <= end:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            best = None  # loops outside the innermost function do not run in this frame
        elif isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            best = node.lineno
        nodes = list(ast.iter_child_nodes(node))
    return best
