"""The region after the step loop (an evaluation, a checkpoint): its collectives recorded,
answered and retried, so that a rank lost there is replaced bit for bit.

Between the step loop's exit and its next head the script's collectives are its own: the
evaluation all-reduces its meters, DDP broadcasts buffers before the first evaluation
forward. Every rank records what each of them gave it. When a rank is lost there:

- a survivor waiting in one of them recovers where it stands (the new generation forms
  around it) and issues the same collective again, with the inputs it had;
- the successor runs the region from the step loop's exit, with the state the rank had
  there (its own from its buddies, the rest from the survivors, its schedulers as they
  were at the exit), each collective answered from a survivor's record, until the record
  runs out where the survivors stand: there it joins the new generation, and from there
  on the collectives run live with everyone.

Only collectives whose result is the same on every rank are answered from another rank's
record (all-reduce, broadcast, all-gather, barrier). A region that runs another kind
(reduce, gather, scatter, point-to-point, FSDP2's flat-shard collectives) still runs, live,
but a loss after it cannot be replayed: the job stops there, saying so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from baton.transfer.bundles import Pos
from baton.worker.group import _Done
from baton.worker.tracked import Tracked, _is_scheduler

if TYPE_CHECKING:
    from baton.transparent.script_runtime import ScriptRuntime

# LiveGroup's names for the collectives whose outputs are equal on every rank
SAME_EVERYWHERE = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_base",
                             "barrier"})


@dataclass
class Recorded:
    op: str
    outputs: list[torch.Tensor]


@dataclass
class Region:
    """One region: from the step loop's exit at `pos` to its next head."""

    pos: Pos
    small: dict[str, Any]  # the optimizers' hyper-parameters, schedulers and scalers at the exit
    forward_sync: list[bool]  # each DDP's "broadcast buffers before the next forward" at the exit
    ops: list[Recorded] = field(default_factory=list)  # what each collective gave, in order
    not_replayable: str = ""  # the first collective run here whose result differs by rank
    active: bool = True  # until the next head of the step loop
    replay: list[Recorded] = field(default_factory=list)  # a successor's answers, in order
    join: Callable[[], None] | None = None  # a successor's join, run where its answers run out

    @classmethod
    def at_exit(cls, pos: Pos, tracked: Tracked) -> "Region":
        return cls(pos, small_state(tracked), [bool(d.require_forward_param_sync) for d in tracked.ddps])

    def place(self) -> tuple[int, int]:
        """Where a rank stands, for the check that a new generation's ranks agree on it."""
        return (1, len(self.ops)) if self.active else (0, 0)

    def served(self) -> dict[str, Any]:
        """What a successor needs to run this region again (plain values and tensors)."""
        return {"pos": list(self.pos), "small": self.small, "forward_sync": self.forward_sync,
                "ops": [r.op for r in self.ops], "outputs": [r.outputs for r in self.ops],
                "not_replayable": self.not_replayable}

    @classmethod
    def from_served(cls, served: dict[str, Any]) -> "Region":
        region = cls(tuple(served["pos"]), served["small"], list(served["forward_sync"]),  # type: ignore[arg-type]
                     not_replayable=served["not_replayable"])
        region.replay = [Recorded(op, list(outs)) for op, outs in zip(served["ops"], served["outputs"])]
        return region


def small_state(tracked: Tracked) -> dict[str, Any]:
    """What the region may change besides the script's variables, as plain values: the
    optimizers' hyper-parameters (a scheduler sets the learning rate), schedulers, scalers."""
    out: dict[str, Any] = {}
    for name, obj in tracked.objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            out[name] = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]}
        elif _is_scheduler(obj) or isinstance(obj, torch.amp.GradScaler):
            out[name] = {"state": copy.deepcopy(obj.state_dict())}
    return out


def load_small_state(tracked: Tracked, small: dict[str, Any]) -> None:
    for name, saved in small.items():
        obj = tracked.objects.get(name)
        if obj is None:
            continue
        if "groups" in saved:
            for group, values in zip(obj.param_groups, saved["groups"]):
                group.update(values)
        else:
            obj.load_state_dict(saved["state"])


class RegionGroup(dist.ProcessGroup):
    """What the live group runs a region's collectives on (its guard hands this one out):
    each runs to completion here, recorded; a lost peer is recovered from in place and the
    collective issued again; a successor's are answered from the record it was given."""

    def __init__(self, rt: "ScriptRuntime"):
        super().__init__(rt.group.rank(), rt.group.size())
        self.rt = rt

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "baton-region"

    def rank(self) -> int:
        return self.rt.group.rank()

    def size(self) -> int:
        return self.rt.group.size()

    def allreduce(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._run("allreduce", tensors, tensors, lambda g: g.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", tensors, tensors, lambda g: g.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, lambda g: g.broadcast(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        outputs = [t for per_input in output_tensors for t in per_input]
        return self._run("allgather", outputs, input_tensors,
                         lambda g: g.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output, input, opts=None):  # type: ignore[override]  # noqa: ANN001,A002
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._run("allgather_base", [output], [input], lambda g: g._allgather_base(output, input, opts))

    def barrier(self, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._run("barrier", [], [], lambda g: g.barrier(opts))

    def _run(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
             issue: Callable[[dist.ProcessGroup], dist.Work]) -> dist.Work:
        rt = self.rt
        region = rt.region
        assert region is not None
        if len(region.ops) < len(region.replay):
            return self._answer(region, op, outputs)
        if region.join is not None:  # a successor: its record ends here, where the survivors stand
            join, region.join = region.join, None
            join()
        saved = [t.detach().clone() for t in inputs]  # gloo reduces in place: a failed attempt leaves partial sums
        while True:
            try:
                issue(rt.group._backend()).wait()
                break
            except (RuntimeError, dist.DistError) as exc:
                rt.group.note_failure(exc)
                if not rt.is_peer_failure(exc):
                    raise
                rt.recover_in_region(exc)
                with torch.no_grad():
                    for t, s in zip(inputs, saved):
                        t.copy_(s)
        region.ops.append(Recorded(op, [t.detach().clone() for t in outputs]))
        return _Done(outputs)

    def _answer(self, region: Region, op: str, outputs: list[torch.Tensor]) -> dist.Work:
        n = len(region.ops)
        recorded = region.replay[n]
        shapes = [(tuple(t.shape), t.dtype) for t in outputs]
        if recorded.op != op or shapes != [(tuple(t.shape), t.dtype) for t in recorded.outputs]:
            self.rt.stop(f"rank {self.rt.rank}: the region after the step loop took another way in this process "
                         f"than in the survivors: its collective #{n + 1} is {op} of {shapes}, theirs was "
                         f"{recorded.op} of {[(tuple(t.shape), t.dtype) for t in recorded.outputs]} (is the "
                         "evaluation deterministic?). The job stops here: restart it from your own checkpoint.")
        with torch.no_grad():
            for t, r in zip(outputs, recorded.outputs):
                t.copy_(r)
        region.ops.append(recorded)
        return _Done(outputs)
