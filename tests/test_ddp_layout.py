"""A joiner's DDP reduces with the survivors' bucket layout; the rebuilt reducer is checked
against it as its first syncing backward hands the buckets over (baton.worker.ddp), not by
reading them in the move's pause. A bucket that does not hold what the survivors' did stops
the step before it is reduced, saying why."""

from __future__ import annotations

import pytest
import torch

from baton.worker import ddp


class Bucket:
    """What the reducer hands a comm hook, as far as the check reads it."""

    def __init__(self, index: int, params: list[torch.Tensor]):
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def _owed(params: list[torch.Tensor], layout: list[list[int]]) -> None:
    check = ddp._LayoutCheck({id(p): i for i, p in enumerate(params)}, layout, set(range(len(layout))))
    for p in params:
        ddp._layout_checks[id(p)] = check


def test_buckets_as_the_survivors_had_them_pass_and_the_check_is_then_forgotten():
    params = [torch.zeros(2) for _ in range(4)]
    _owed(params, [[3, 2], [1, 0]])
    ddp.check_bucket(Bucket(0, [params[3], params[2]]))
    assert ddp._layout_checks  # bucket 1 still owed
    ddp.check_bucket(Bucket(1, [params[1], params[0]]))
    assert not ddp._layout_checks  # nothing left to look up, step after step


def test_a_bucket_unlike_the_survivors_stops_the_step_before_it_is_reduced():
    params = [torch.zeros(2) for _ in range(3)]
    _owed(params, [[2, 1], [0]])
    try:
        with pytest.raises(ddp.LayoutMismatch, match=r"bucket 0 holds parameters \[1, 2\], theirs \[2, 1\]"):
            ddp.check_bucket(Bucket(0, [params[1], params[2]]))
    finally:
        ddp._layout_checks.clear()


def test_buckets_of_a_ddp_that_owes_no_check_are_not_looked_at():
    ddp.check_bucket(Bucket(0, [torch.zeros(1)]))
    ddp.check_bucket(Bucket(0, []))
