"""The region after the step loop (an evaluation, a checkpoint): its collectives recorded,
answered and retried, so that a rank lost there is replaced bit for bit.

Between the step loop's exit and its next head the script's collectives are its own: the
evaluation all-reduces its meters, DDP broadcasts buffers before the first evaluation
forward. Every rank records what each of them gave it. When a rank is lost there:

- a survivor waiting in one of them recovers where it stands (the new generation forms
  around it) and issues the same collective again, with the inputs it had; where that
  collective had completed on another rank (it had all it needed before the failure), the
  rank behind answers it from that rank's record instead (`catch_up`);
- the successor runs the region from the step loop's exit, with the state the rank had
  there (its own from its buddies, the rest from the survivors, its schedulers as they
  were at the exit), each collective answered from a survivor's record, until the record
  runs out where the survivors stand: there it joins the new generation, and from there
  on the collectives run live with everyone.

A region that runs a collective whose result differs by rank (reduce, gather, scatter,
point-to-point, FSDP2's flat-shard collectives) still runs, live, but a loss after it
cannot be replayed: the job stops there, saying so. The recording itself is `collectives`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from baton.transfer.bundles import Pos
from baton.worker.collectives import Record, Recorded
from baton.worker.tracked import Tracked, _is_scheduler


@dataclass
class Region(Record):
    """One region: from the step loop's exit at `pos` to its next head."""

    pos: Pos = (0, 0)
    small: dict[str, Any] | None = None  # the optimizers' hyper-parameters, schedulers and scalers at the exit
    forward_sync: list[bool] | None = None  # each DDP's "broadcast buffers before the next forward" at the exit
    active: bool = True  # until the next head of the step loop

    @classmethod
    def at_exit(cls, pos: Pos, tracked: Tracked) -> "Region":
        return cls(pos=pos, small=small_state(tracked),
                   forward_sync=[bool(d.require_forward_param_sync) for d in tracked.ddps])

    def place(self) -> tuple[int, int]:
        """Where a rank stands, for the check that a new generation's ranks agree on it."""
        return (1, len(self.ops)) if self.active else (0, 0)

    def served(self) -> dict[str, Any]:
        """What a successor needs to run this region again (plain values and tensors)."""
        return {"pos": list(self.pos), "small": self.small, "forward_sync": self.forward_sync,
                "not_replayable": self.not_replayable, **self.served_ops()}

    @classmethod
    def from_served(cls, served: dict[str, Any]) -> "Region":
        return cls(pos=tuple(served["pos"]), small=served["small"],  # type: ignore[arg-type]
                   forward_sync=list(served["forward_sync"]), not_replayable=served["not_replayable"],
                   replay=Record.replay_of(served))


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


def catch_up(record: Record, counts: list[int], rank: int, broadcast: Callable[[torch.Tensor, int], None]) -> None:
    """Ranks of a new generation in the same region, some short of collectives that completed
    on others (a data path failed inside one: it completed on a rank that had all it needed).
    Only collectives whose outputs are the same on every rank are recorded, so a rank behind
    answers those it lacks from the record of the first rank furthest ahead, broadcast here
    over the new generation (every rank takes part): a description as JSON, then the tensors.
    The caller has checked that no rank ran a collective that is not recorded."""
    ahead, low, high = counts.index(max(counts)), min(counts), max(counts)
    if rank == ahead:
        text = json.dumps([[r.op, [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in r.outputs]]
                           for r in record.ops[low:high]]).encode()
        raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        size = torch.tensor([raw.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, ahead)
    if rank != ahead:
        raw = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(raw, ahead)
    got: list[Recorded] = []
    for i, (op, shapes) in enumerate(json.loads(bytes(raw.numpy()))):
        outputs = (record.ops[low + i].outputs if rank == ahead else
                   [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes])
        for t in outputs:
            broadcast(t, ahead)
        got.append(Recorded(op, outputs))
    mine = counts[rank]
    if mine < high:
        record.replay = list(record.ops) + got[mine - low:]
