"""The model-aware runtime, driven by the script's own loop instead of `job.steps()`.

The protocols are the same (the live group, DDP's comm hook, the bundle captured at the
syncing backward and pushed to the buddies, the hot-path boundary check, finishing): what
differs is who says where the boundaries are. Here the controller does, from the
instrumented loops: the step loop is known only at the first `optimizer.step()`, which
runs inside the first step; each later head of the step loop whose previous iteration
committed (an optimizer step ran) is a boundary; what runs after the step loop (the
evaluation, the checkpoint) is a region, where collectives are the script's business.

Before the step loop is found, DDP reduces gradients and the script's collectives run
like torchrun's: nothing is captured, and nothing can move yet.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from baton.control import messages as m
from baton.transfer import codec
from baton.worker import shards
from baton.worker.job import Step
from baton.worker.runtime import Runtime, _text
from baton.worker.tracked import UsageError

REGION = "region"  # scope between the step loop's exit and its next head


class ScriptRuntime(Runtime):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.current: Step | None = None
        self.shard_roots: list[Any] = []  # modules the script gave fully_shard(), in order (intercept)
        self.steps_seen = 0  # step loop iterations begun (a step may span several: accumulation)

    # ---------------------------------------------------------------- the loop, as the script runs it
    def start_script_loop(self, step_loop: str) -> None:
        """At the first optimizer.step(), inside the first step: from here on, the step loop's
        heads are boundaries. Mirrors enter_loop() for a loop that is already running."""
        self.loop_started = True
        self._track_sharded_models()
        self.tracked.add_discovered()
        if not self.tracked.optimizers():
            raise UsageError("no optimizer found (a script with no code change must create its optimizer "
                             "after its process group)")
        for opt in self.tracked.optimizers():
            opt.register_step_post_hook(self._on_optimizer_step)
        sharded = self.tracked.sharded_names()
        self.tracked.sharded = set(sharded)
        self.tracked.note_loop_start()
        self.replicas = shards.replica_peers(self.tracked)
        codec.encode(self.tracked.replicated())  # refuse untransferable state now, not mid-failure
        self.loop = m.LoopInfo(style="script", total_steps=0, step_loop=step_loop, sharded=sharded)
        start_bundle, start_rng = self._capture_at(self.pos)
        self.at_pos, self.at_pos_rng = start_bundle, start_rng
        self.ctl.report_now(m.Ready(loop=self.loop, bundle=_text(start_bundle)))
        self.warned_no_capture = True  # the first step's backward ran before the loop was known
        self.small = self.tracked.snapshot_small()
        self.scope, self.committed, self.seq, self.capture = "step", False, 0, None
        self.tracked.scope = "step"
        self._step_t0 = time.perf_counter()
        self._busy_s = None
        self.current = Step(self, 0, None, 0)

    def _track_sharded_models(self) -> None:
        """The roots among the modules fully_shard() was applied to: the script's sharded models,
        named in the order they were sharded, as every rank and a joiner shard them."""
        inside = {id(sub) for m in self.shard_roots for sub in m.modules() if sub is not m}
        roots = [m for m in dict.fromkeys(self.shard_roots) if id(m) not in inside]
        for i, model in enumerate(roots):
            self.tracked.add("model" if i == 0 and "model" not in self.tracked.objects else f"sharded{i}", model)

    def at_head(self) -> None:
        """A head of the step loop, before its next item is drawn."""
        self.steps_seen += 1
        if self.scope == "step":
            if not self.committed:
                return  # no optimizer step yet (gradient accumulation): the same step goes on
            self._complete_step()
        while not self._boundary():
            pass
        self.current = self._begin_step(Step)

    def at_exit(self) -> None:
        """The step loop ended (its iterator ran out, or a break): the region after it begins."""
        if self.scope == "step" and self.committed:
            self._complete_step()
        if self.scope != "step":
            self.scope = self.tracked.scope = REGION

    def _complete_step(self) -> None:
        step = self.current
        assert step is not None
        step.completed = True
        self._end_step(step)
        self.current = None

    def finish_script(self) -> None:
        """The script is done training (it destroyed its process group, or is exiting)."""
        if self.finished:
            return
        if self.scope == "step" and self.committed:
            self._complete_step()
        self.loop_done = True
        self.scope = self.tracked.scope = None
        self.finish()

    # ---------------------------------------------------------------- the runtime's checks, for a script's loop
    def on_sync_backward(self, first: bool, last: bool) -> None:
        if self.loop_started and self.scope == "step":
            super().on_sync_backward(first, last)

    def watch_backward_start(self, out: Any) -> None:
        if self.loop_started:
            super().watch_backward_start(out)

    def check_forward_placement(self) -> None:
        """A forward may run anywhere: the script's evaluation is a region, not a boundary function."""

    def _guard(self, op: str) -> dist.ProcessGroup | None:
        if not self.loop_started or self.scope != "step":
            if not self.loop_started and self.joiner:
                return super()._guard(op)
            return None  # the script's own collectives outside steps (a region, its setup)
        return super()._guard(op)

    def _check_no_stray_draws(self, where: str) -> None:
        """The script may draw between steps (a loader's iterator, its evaluation): not a rule here."""

    def _on_optimizer_step(self, *_: Any) -> None:
        if not self.loop_started or self.loading:
            return
        if self.scope == "step":
            self.committed = True
            self.params_step = self.pos[0] + 1
            return
        raise UsageError("optimizer.step() ran outside the step loop baton found (at the first optimizer step): "
                         "a script with no code change may step its optimizers in one loop only")
