"""DistributedDataParallel over the live group, bit-for-bit equal to torchrun + DDP.

DDP runs over a world-of-one group, so its own bookkeeping never involves peers and
a joiner can build one at any time. A comm hook sends each gradient bucket to the
live group, averaging exactly as DDP's reducer does (multiply by 1/world in float32,
not divide: the two differ in the last bit for a third of values). The bucket layout
is DDP's own: one bucket for the first iteration, then rebuilt in gradient-ready
order. gloo's ring sums each element in an order set by its offset in the bucket, so
a joiner must use the survivors' exact layout: survivors export it (a list of
parameter-index lists, plain ints) with their state, and the joiner rebuilds its
reducer to match before its first step.

A step's bundle is captured when the syncing backward starts (a hook on the output's
autograd node; the first gradient bucket if that never fires), so it travels to the
buddy during the whole backward; the comm hook waits for the ward's bundle before the
last bucket (see bundle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from baton import selfcost
from baton.worker.group import solo_group

if TYPE_CHECKING:
    from baton.worker.runtime import Runtime


class LiveDDP(DistributedDataParallel):
    """DDP whose buffer broadcasts go to the live group and whose reducer order can be set."""

    _baton_rt: "Runtime"
    _baton_order: list[int] | None = None

    def _build_params_for_reducer(self):  # noqa: ANN202 - torch's private hook point
        params, sparse = super()._build_params_for_reducer()
        order = getattr(self, "_baton_order", None)
        if order is None:
            return params, sparse
        return [params[i] for i in order], [sparse[i] for i in order]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        out = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._baton_rt.watch_backward_start(out)
        return out

    def _distributed_broadcast_coalesced(self, tensors, buffer_size, authoritative_rank=0):  # noqa: ANN001
        # DDP syncs buffers from rank 0 before a forward exactly when it would under torchrun.
        rt = self._baton_rt
        rt.check_forward_placement()
        rt.sync_buffers(tensors, buffer_size, authoritative_rank)


def build(rt: "Runtime", model: torch.nn.Module, **ddp_kwargs: Any) -> LiveDDP:
    if isinstance(model, DistributedDataParallel):
        raise TypeError("job.wrap() takes the bare module; it builds DistributedDataParallel itself")
    for key in ("process_group", "init_sync"):
        if key in ddp_kwargs:
            raise TypeError(f"job.wrap() sets {key} itself")
    if not rt.joiner:
        broadcast_from_rank0(rt, model)
    ddp = LiveDDP(model, process_group=solo_group(), init_sync=False, **ddp_kwargs)
    ddp._baton_rt = rt
    ddp.register_comm_hook(rt, allreduce_hook)
    return ddp


def broadcast_from_rank0(rt: "Runtime", model: torch.nn.Module) -> None:
    """Initial ranks start from rank 0's parameters and buffers, as DDP's constructor does."""
    tensors = [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]
    if tensors:
        with rt.group.internal():
            dist._broadcast_coalesced(rt.group, tensors, 250 * 1024 * 1024, 0)


@selfcost.counted
def allreduce_hook(rt, bucket):  # DDP inspects real annotations; see below
    if _layout_checks:
        check_bucket(bucket)
    rt.on_sync_backward(first=bucket.index() == 0, last=bucket.is_last())
    return rt.average_bucket(bucket.buffer())


allreduce_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


@dataclass
class ScriptHook:
    """The comm hook a script registered itself (`default_hooks.fp16_compress_hook`, say), run
    inside baton's: baton still sees the syncing backward's first and last buckets, and the
    hook's own collectives go to the live group, where a step's are captured and recorded
    like any of the script's. None: baton's own averaging (`allreduce_hook`)."""

    rt: "Runtime"
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]] | None = None
    state: Any = None


def script_or_allreduce_hook(hs, bucket):  # DDP inspects real annotations; see below
    if hs.hook is None:
        return allreduce_hook(hs.rt, bucket)
    rt = hs.rt
    if _layout_checks:
        check_bucket(bucket)
    rt.on_sync_backward(first=bucket.index() == 0, last=bucket.is_last())
    if not rt.loop_started:  # the first step, before its loop is known: DDP's reduction, not a setup collective
        with rt.group.internal():
            return hs.hook(hs.state, bucket)
    return hs.hook(hs.state, bucket)


script_or_allreduce_hook.__annotations__ = allreduce_hook.__annotations__


def export_layout(ddp: LiveDDP) -> list[list[int]] | None:
    """The rebuilt bucket layout over DDP's natural parameter indices, or None before the rebuild.

    Read once per reducer: the reducer shows its buckets only as zero-filled copies
    (`_get_zeros_like_grad_buckets`, the whole model's size in fresh memory: 0.1-1 s at 1 GB,
    in a move's pause), and a reducer's layout changes only at its one rebuild."""
    if ddp.reducer._rebuild_buckets():  # what DDP would do at its next forward: do it now
        ddp._has_rebuilt_buckets = True
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return None
    if _layout_cached(ddp):
        return ddp._baton_layout[1]
    index = _natural_index(ddp)
    layout = [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]
    ddp._baton_layout = (ddp.reducer, layout)
    return layout


def ddp_layout_known(ddp: LiveDDP) -> None:
    """Read the rebuilt layout once, at the end of the step it was rebuilt in, so that a
    move's pause finds it known (2M parameters: 18 ms of zero-filled buckets there, where a
    leaver exports its state; once per reducer, at the cost of a step's end)."""
    if getattr(ddp, "_has_rebuilt_buckets", False) and not _layout_cached(ddp):
        export_layout(ddp)


def _layout_cached(ddp: LiveDDP) -> bool:
    """Whether `_baton_layout` holds this reducer's layout (a rebuilt reducer has its own)."""
    cached = getattr(ddp, "_baton_layout", None)
    return cached is not None and cached[0] is ddp.reducer


def _natural_index(ddp: LiveDDP) -> dict[int, int]:
    natural = DistributedDataParallel._build_params_for_reducer(ddp)[0]
    return {id(p): i for i, p in enumerate(natural)}


def adopt_layout(ddp: LiveDDP, layout: list[list[int]] | None) -> None:
    """A joiner's DDP reduces with the survivors' layout from its first step on. The rebuilt
    reducer's buckets are checked against it as its first syncing backward hands them over
    (`check_bucket`), before each is reduced: reading them now would fill the model's size
    of fresh memory with zeros inside the move's pause."""
    if layout is None or export_layout(ddp) == layout:
        return
    ddp._baton_order = [i for bucket in layout for i in bucket]
    params, sparse = ddp._build_params_for_reducer()
    mapping = ddp._build_debug_param_to_name_mapping(params)
    ddp._ddp_init_helper(params, sparse, mapping, ddp.static_graph)
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()
    ddp._has_rebuilt_buckets = True
    ddp._baton_layout = (ddp.reducer, [list(b) for b in layout])
    check = _LayoutCheck(_natural_index(ddp), ddp._baton_layout[1], set(range(len(layout))))
    for p in params:
        _layout_checks[id(p)] = check


class LayoutMismatch(RuntimeError):
    """A joiner's rebuilt reducer did not reproduce the survivors' bucket layout: its
    gradients would be summed in another order than theirs."""


@dataclass
class _LayoutCheck:
    index: dict[int, int]  # id(param) -> DDP's natural index
    layout: list[list[int]]
    unseen: set[int]  # buckets not handed over yet


# id(param) -> the check its DDP owes until its first syncing backward (usually empty: one
# dict lookup per bucket is all it costs)
_layout_checks: dict[int, _LayoutCheck] = {}


def check_bucket(bucket: dist.GradBucket) -> None:
    """The bucket holds the parameters the survivors' layout says, before it is reduced."""
    params = bucket.parameters()
    check = _layout_checks.get(id(params[0])) if params else None
    if check is None:
        return
    got = [check.index.get(id(p), -1) for p in params]
    want = check.layout[bucket.index()] if bucket.index() < len(check.layout) else None
    if got != want:
        raise LayoutMismatch(f"could not reproduce the survivors' gradient bucket layout: bucket "
                             f"{bucket.index()} holds parameters {got[:20]}, theirs {(want or [])[:20]}; "
                             f"its gradients would be summed in another order (state would diverge)")
    check.unseen.discard(bucket.index())
    if not check.unseen:
        for key in [k for k, c in _layout_checks.items() if c is check]:
            del _layout_checks[key]


def export_state(ddp: LiveDDP) -> dict[str, Any]:
    """What a joiner's DDP must match besides parameters: the bucket layout, and whether the
    next forward broadcasts buffers (an evaluation forward turns that off until training)."""
    return {"layout": export_layout(ddp), "forward_sync": bool(ddp.require_forward_param_sync)}


def adopt_state(ddp: LiveDDP, state: dict[str, Any]) -> None:
    adopt_layout(ddp, state["layout"])
    ddp.require_forward_param_sync = bool(state["forward_sync"])


def reset_after_failure(ddp: LiveDDP) -> None:
    """Discard a partial backward: clear grads and the reducer's in-flight state."""
    ddp.reducer._reset_state()
    for p in ddp.parameters():
        p.grad = None
