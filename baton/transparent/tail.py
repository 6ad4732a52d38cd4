"""The step a rank was lost after: what a successor needs to run it again.

A rank lost after its last collective of step N and before the next head (in its
optimizer step or the lines after it: counters, meters, a scheduler's step) never shared
where its loop then stood. The survivors complete step N and go on. The successor runs
step N again from the rank's head N (its own state there, from its buddies), with what
every rank records of each step: its parameters at the head (copied at the first optimizer
step, before it changes them), its schedulers and scalers there, and what each collective
of the step gave it (the gradient buckets, DDP's buffer broadcast, the script's own). Its
own optimizer step does not run: it takes the survivors' parameters and optimizer state
after step N instead, with the hyper-parameters as they were at the step, so that what
the lines after it compute (a scheduler's step, a scaler's update, a norm) comes out as
the lost rank's did. At head N+1 it joins, and the state check compares what it computed
with the survivors'.

The cost, on every rank: a copy of the parameters per step (bench/nocode.py measures it),
into the tensors of the record two steps back (`CopyPool`). The gradient buckets cost no
copy: each is averaged into a tensor of the record instead of in place. `baton run
--no-tail-copies` turns it off; a loss there then stops the job, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from baton.transfer.bundles import Pos
from baton.worker.collectives import Record
from baton.worker.tracked import Tracked


@dataclass
class StepRecord(Record):
    """What this rank records of the step beginning at head `pos`."""

    pos: Pos = (0, 0)
    small: dict[str, Any] | None = None  # optimizers' hyper-parameters, schedulers, scalers at the head
    forward_sync: list[bool] | None = None  # each DDP's "broadcast buffers before the next forward" there
    params: dict[str, list[torch.Tensor]] | None = None  # each model's parameters at the head
    grads: Record = field(default_factory=Record)  # the gradient buckets' results (completed on gloo's thread)
    lent: bool = False  # served to a successor: its tensors may still be read, never reused

    def served(self) -> dict[str, Any]:
        self.lent = True
        return {"pos": list(self.pos), "small": self.small, "forward_sync": self.forward_sync,
                "params": self.params, "grads": self.grads.served_ops(), "not_replayable": self.not_replayable,
                **self.served_ops()}

    @classmethod
    def from_served(cls, served: dict[str, Any]) -> "StepRecord":
        return cls(pos=tuple(served["pos"]), small=served["small"],  # type: ignore[arg-type]
                   forward_sync=list(served["forward_sync"]), params=served["params"],
                   grads=Record(replay=Record.replay_of(served["grads"])),
                   not_replayable=served["not_replayable"], replay=Record.replay_of(served))


def models(tracked: Tracked) -> dict[str, torch.nn.Module]:
    """The replicated models (a sharded model's parameters are each rank's own)."""
    return {name: obj for name, obj in tracked.objects.items()
            if isinstance(obj, torch.nn.Module) and name not in tracked.sharded}


class CopyPool:
    """The tensors of records no longer needed, reused for the next records' copies. A fresh
    tensor per copy costs ten times the copy itself, its pages faulted in as it is first
    written (2M parameters: 1.3 ms against 0.1 ms), and these copies are made every step."""

    KEEP = 4  # free tensors kept per shape: a layout that changed (DDP's rebuilt buckets) leaves a few behind

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as `t`, of unspecified content (on gloo's threads too: list.pop
        and append are atomic)."""
        free = self._free.get((t.shape, t.dtype, t.device))
        try:
            return free.pop()  # type: ignore[union-attr]
        except (AttributeError, IndexError):
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        out = self.empty_like(t)
        out.copy_(t.detach())
        return out

    def give_back(self, rec: "StepRecord | None") -> None:
        """`rec` is dropped: its tensors serve the next copies, unless it was served."""
        if rec is None or rec.lent:
            return
        copies = [t for ts in (rec.params or {}).values() for t in ts]
        copies += [t for r in (*rec.ops, *rec.grads.ops) for t in r.outputs]
        for t in copies:
            free = self._free.setdefault((t.shape, t.dtype, t.device), [])
            if len(free) < self.KEEP:
                free.append(t)


def param_copies(tracked: Tracked, pool: CopyPool) -> dict[str, list[torch.Tensor]]:
    return {name: [pool.copy(p) for p in model.parameters()] for name, model in models(tracked).items()}


def load_params(tracked: Tracked, params: dict[str, list[torch.Tensor]]) -> None:
    with torch.no_grad():
        for name, model in models(tracked).items():
            for p, saved in zip(model.parameters(), params[name], strict=True):
                p.copy_(saved)


def load_stepped(tracked: Tracked, opt: torch.optim.Optimizer, replicated: dict[str, Any],
                 groups: list[dict[str, Any]]) -> None:
    """Instead of `opt.step()`: its parameters and state as the survivors' step left them,
    its hyper-parameters as they were when it stepped (`groups`: the lines after the step,
    a scheduler's, read and change them)."""
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    with torch.no_grad():
        for name, model in models(tracked).items():
            after = _params_by_name(model, replicated[name])
            for pname, p in model.named_parameters():
                if id(p) in mine:
                    p.copy_(after[pname])
    name = next(n for n, o in tracked.objects.items() if o is opt)
    opt.load_state_dict(replicated[name])
    for group, values in zip(opt.param_groups, groups):
        group.update(values)


def _params_by_name(model: torch.nn.Module, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {pname: state_dict[pname] for pname, _ in model.named_parameters()}
