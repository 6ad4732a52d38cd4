"""The no-code runtime's side of the instrumented loops: where the step loop is, and its heads.

At the first `optimizer.step()` the stack says which loop is the step loop (`nest`);
what cannot move is refused there, before the step changes anything (`analysis`). From
then on each head of that loop is handed to the runtime (a boundary, once the previous
iteration committed), and its exit starts the region after it.

This version finds the loop and runs the job through the orchestrator, but does not yet
hand a rank to a successor: a lost peer ends the job promptly, naming why, and planned
moves are refused (the rank reports itself unmovable), never a silent divergence.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from baton.control import messages as m
from baton.transparent import analysis, nest
from baton.transparent.importer import ScriptModules
from baton.transparent.loops import LOOPS, ActiveLoop
from baton.transparent.mode import NO_CODE_MOVES
from baton.transparent.script_runtime import ScriptRuntime
from baton.worker.runtime import exit_quietly
from baton.worker.tracked import UsageError


class StepLoopController:
    def __init__(self, rt: ScriptRuntime, modules: ScriptModules, script: str, args: list[str]):
        self.rt, self.modules, self.script, self.args = rt, modules, script, args
        self.step_site: int | None = None
        self.step_loop: ActiveLoop | None = None
        rt.ctl.heartbeat["unmovable"] = NO_CODE_MOVES
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
        if report.refusals:
            text = "\n".join(f"{r.where}: {r.what}: {r.why}. Fix: {r.fix}" for r in report.refusals)
            raise UsageError(f"baton cannot move this script's ranks bit for bit as it is "
                             f"(`baton explain {self.script}` says more):\n{text}")
        assert found.nest is not None
        self.step_loop = found.nest.step_loop
        self.step_site = self.step_loop.site.id
        self.rt.start_script_loop(self.step_loop.site.where)

    # ---------------------------------------------------------------- the loops (loops.Controller)
    def _is_step_loop(self, loop: ActiveLoop) -> bool:
        if loop.site.id != self.step_site:
            return False
        if loop is not self.step_loop:  # entered again (the next epoch): same site, a new entry
            self.step_loop = loop
        return True

    def before_item(self, loop: ActiveLoop) -> None:
        if self._is_step_loop(loop):
            self.rt.at_head()

    def left(self, loop: ActiveLoop) -> None:
        if loop.site.id == self.step_site:
            self.rt.at_exit()

    def restore(self, loop: ActiveLoop) -> dict[str, Any] | None:
        return None

    def absorb(self, loop: ActiveLoop, exc: BaseException) -> bool:
        """A lost peer cannot be absorbed by this version: end the job now, saying why."""
        rt = self.rt
        if isinstance(exc, (UsageError, KeyboardInterrupt, SystemExit, GeneratorExit)) or not rt.is_peer_failure(exc):
            return False
        detail = (f"rank {rt.rank}: a peer was lost ({type(exc).__name__}: {exc}). {NO_CODE_MOVES} "
                  "The job stops here: restart it from your own checkpoint.")
        print(f"[baton] {detail}", file=sys.__stderr__, flush=True)
        try:
            rt.ctl.report_now(m.UserError(traceback=detail[:60000], exit_code=1, phase="usage"))
        except Exception:  # noqa: BLE001 - the orchestrator may be ending the job already
            pass
        exit_quietly(1)
