"""setup_check: the fingerprint of what a setup built where the step loop starts (unit)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from baton.worker import rng, setup_check


def _loader(indices: list[int], rank: int = 0, seed: int = 0) -> DataLoader:
    data = Subset(TensorDataset(torch.arange(10.0)), indices)
    return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=rank, seed=seed))


def test_the_same_setup_gives_the_same_fingerprint_and_its_epoch_does_not_count():
    a, b = _loader([0, 2, 4, 6]), _loader([0, 2, 4, 6])
    b.sampler.set_epoch(3)  # a position, not other data
    assert setup_check.fingerprint(rng.capture(), {'loader': a}) == setup_check.fingerprint(rng.capture(), {'loader': b})


def test_another_split_seed_rank_or_stream_is_named():
    base = setup_check.fingerprint({}, {'loader': _loader([0, 2, 4, 6])})
    for other in (_loader([0, 2, 4, 8]), _loader([0, 2, 4, 6], rank=1), _loader([0, 2, 4, 6], seed=1)):
        assert setup_check.differences(setup_check.fingerprint({}, {'loader': other}), base) == ["data.loader"]
    before = rng.capture()
    import random

    random.random()  # Python's stream starts from OS entropy in each process: not compared
    torch.rand(1)
    named = setup_check.differences(setup_check.fingerprint(rng.capture(), {}), setup_check.fingerprint(before, {}))
    assert named == ["stream.torch"]
    assert "the torch random stream" in setup_check.explain(1, named)
