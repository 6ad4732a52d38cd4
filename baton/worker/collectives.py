"""The script's collectives, recorded and answered, so that a successor can run again code
that the rank it replaces had run with the others: the script's setup before its step loop
(the record goes to a spare with its assignment), the region after the step loop
(baton.transparent.region), or the step a rank was lost after (baton.transparent.tail).

Each rank records what every collective of such a span gave it. A successor replaying the
span gets a survivor's record: its collectives are answered from it, in order, until the
record runs out, where the survivors stand; there it joins them and the rest runs live.
Only collectives whose result is the same on every rank can be answered from another rank's
record (all-reduce, broadcast, all-gather, barrier over the whole job: `same_everywhere`).
Those whose result is the rank's own (scatter, gather, reduce, reduce-scatter, all-to-all:
`BY_RANK`, and any collective of a group of some ranks only, `dist.new_group`) are answered
only from the record of the rank being replaced: in the setup, where each rank's record is
kept by the orchestrator for its successors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from baton.worker.group import _Done

if TYPE_CHECKING:
    from baton.worker.group import LiveGroup
    from baton.worker.runtime import Runtime

# LiveGroup's names for the collectives whose outputs are equal on every rank
SAME_EVERYWHERE = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_base",
                             "barrier", "all_gather_single", "allgather_into_tensor_coalesced"})
# ... and those whose outputs are each rank's own (a reduce's non-destination ranks keep what
# gloo left in their tensor: recorded too, so a successor ends with the same bytes)
BY_RANK = frozenset({"scatter", "gather", "reduce", "reduce_scatter", "reduce_scatter_single",
                     "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "send", "recv"})


def same_everywhere(op: str, group: "LiveGroup") -> bool:
    """Whether every rank of the job gets this collective's result: one of SAME_EVERYWHERE on
    a group of every rank (on a group of some, only its members do)."""
    return op in SAME_EVERYWHERE and group.whole


@dataclass
class Recorded:
    op: str
    outputs: list[torch.Tensor]


PENDING = Recorded("pending", [])  # a slot taken in issue order, filled when its collective completes


@dataclass
class Record:
    """The collectives of one span, in order; for a successor, the answers it was given."""

    ops: list[Recorded] = field(default_factory=list)
    replay: list[Recorded] = field(default_factory=list)
    join: Callable[[], None] | None = None  # a successor's join, run where its answers run out
    not_replayable: str = ""  # the first collective run here whose result differs by rank (or why none is kept)
    by_rank: str = ""  # a setup's first collective answered with this rank's own result (kept per rank)

    def answering(self) -> bool:
        return len(self.ops) < len(self.replay)

    def reserve(self) -> int:
        """A slot, in issue order, for a collective that completes later: DDP's gradient
        buckets complete on gloo's threads (two by default), not always in the order issued."""
        self.ops.append(PENDING)
        return len(self.ops) - 1

    def served_ops(self) -> dict[str, Any]:
        """What completed, in issue order (up to the first collective still running)."""
        done = self.ops[: next((i for i, r in enumerate(self.ops) if r is PENDING), len(self.ops))]
        return {"ops": [r.op for r in done], "outputs": [r.outputs for r in done]}

    @staticmethod
    def replay_of(served: dict[str, Any]) -> list[Recorded]:
        return [Recorded(op, list(outs)) for op, outs in zip(served["ops"], served["outputs"])]

    def answer(self, rt: "Runtime", op: str, outputs: list[torch.Tensor]) -> None:
        """Fill `outputs` with the next recorded answer (it must be the same collective)."""
        n = len(self.ops)
        recorded = self.replay[n]
        shapes = [(tuple(t.shape), t.dtype) for t in outputs]
        if recorded.op != op or shapes != [(tuple(t.shape), t.dtype) for t in recorded.outputs]:
            rt.stop(f"rank {rt.rank}: the script took another way in this process than in the survivors: its "
                    f"collective #{n + 1} here is {op} of {shapes}, theirs was {recorded.op} of "
                    f"{[(tuple(t.shape), t.dtype) for t in recorded.outputs]} (is the code deterministic?). "
                    "The job stops here: restart it from your own checkpoint.")
        with torch.no_grad():
            for t, r in zip(outputs, recorded.outputs):
                t.copy_(r)
        self.ops.append(recorded)


class RecordingGroup(dist.ProcessGroup):
    """What the live group runs the script's recorded collectives on (its guard hands this one
    out): each runs to completion here and is recorded, or is answered from a successor's
    record. A lost peer: where the state cannot go back to a head (a region, the lines after
    a step's optimizer step), the survivor recovers in place and issues the collective again
    (`retry`); before a step's optimizer step, the failure goes on to the loop's head."""

    def __init__(self, rt: "Runtime", live: "LiveGroup"):
        super().__init__(live.rank(), live.size())
        self.rt, self.live = rt, live  # the live group (the world, or a sub-group) it runs them on

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "baton-recording"

    def rank(self) -> int:
        return self.live.rank()

    def size(self) -> int:
        return self.live.size()

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

    # BY_RANK: recorded in a setup only (the guard hands this group out for them nowhere else)
    def scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._run("scatter", output_tensors, [], lambda g: g.scatter(output_tensors, input_tensors, opts))

    def gather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.GatherOptions()
        outputs = [t for per_input in output_tensors for t in per_input]  # none but on the destination
        return self._run("gather", outputs, [], lambda g: g.gather(output_tensors, input_tensors, opts))

    def reduce(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._run("reduce", tensors, tensors, lambda g: g.reduce(tensors, opts))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run("reduce_scatter", output_tensors, [],
                         lambda g: g.reduce_scatter(output_tensors, input_tensors, opts))

    def _reduce_scatter_base(self, output, input, opts=None):  # type: ignore[override]  # noqa: ANN001,A002
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run("reduce_scatter_base", [output], [],
                         lambda g: g._reduce_scatter_base(output, input, opts))

    def alltoall(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run("alltoall", output_tensors, [], lambda g: g.alltoall(output_tensors, input_tensors, opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # type: ignore[override]
                      opts=None):  # noqa: ANN001,A002
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run("alltoall_base", [output], [],
                         lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts))

    # Point-to-point, in a setup: a send records nothing (a successor skips it: its peer
    # received long ago), a receive what arrived. Neither is waited for here: a script's
    # isend and irecv may pair up only once both are posted (an exchange between two ranks).
    def send(self, tensors, dst, tag=0):  # type: ignore[override]  # noqa: ANN001
        record, _ = self.rt.collective_record()
        answered = self._answered(record, "send", [])
        if answered is not None:
            return answered
        record.ops.append(Recorded("send", []))
        return self.live._backend().send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):  # type: ignore[override]  # noqa: ANN001
        record, _ = self.rt.collective_record()
        answered = self._answered(record, "recv", tensors)
        if answered is not None:
            return answered
        slot = record.reserve()
        return _RecordedWhenDone(self.live._backend().recv(tensors, src, tag), record, slot, "recv", tensors)

    def _answered(self, record: Record, op: str, outputs: list[torch.Tensor]) -> dist.Work | None:
        """A successor's next answer from `record`, done at once; None where it runs live (where
        its answers ran out, it first joins the survivors, who stand there)."""
        if record.answering():
            record.answer(self.rt, op, outputs)
            return _Done(outputs)
        if record.join is not None:
            join, record.join = record.join, None
            join()
        return None

    def _run(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
             issue: Callable[[dist.ProcessGroup], dist.Work]) -> dist.Work:
        rt = self.rt
        record, retry = rt.collective_record()
        answered = self._answered(record, op, outputs)
        if answered is not None:
            return answered
        saved = [t.detach().clone() for t in inputs] if retry else []  # gloo reduces in place
        while True:
            try:
                issue(self.live._backend()).wait()
                break
            except (RuntimeError, dist.DistError) as exc:
                rt.group.note_failure(exc)
                if not retry or not rt.is_peer_failure(exc):
                    raise
                rt.recover_in_place(exc)
                with torch.no_grad():
                    for t, s in zip(inputs, saved):
                        t.copy_(s)
                if record.answering():  # it had completed on a rank ahead: answered from its record
                    record.answer(rt, op, outputs)
                    return _Done(outputs)
        record.ops.append(Recorded(op, [t.detach().clone() for t in outputs]))
        return _Done(outputs)


class _RecordedWhenDone(dist.Work):
    """A collective's work whose outputs go into its slot of the record once it is waited on."""

    def __init__(self, inner: dist.Work, record: Record, slot: int, op: str, outputs: list[torch.Tensor]):
        super().__init__()
        self._inner, self._record, self._slot, self._op, self._outputs = inner, record, slot, op, outputs

    def wait(self, timeout=None) -> bool:  # type: ignore[override]  # noqa: ANN001
        done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        if self._record.ops[self._slot] is PENDING:
            self._record.ops[self._slot] = Recorded(self._op, [t.detach().clone() for t in self._outputs])
        return done

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):  # noqa: ANN201
        return self._inner.exception()
