"""Did a successor's setup build what its predecessor's did?

A spare that takes a rank over runs the script's setup again, and is then given the rank's
state: parameters, optimizer, streams, position. What the setup made and nothing carries
(the partition of a dataset, a sampler's seed) must come out the same, or the successor
trains on other data while every check of the moved state passes: a run that ends with
exit 0 and other numbers. An unseeded `random_split` does exactly that.

So each rank records a fingerprint where its step loop starts, and it travels with the
rank's own state: digests of its torch random streams there, and of what its loader will yield
(the dataset's length and the index chain of its `Subset`s, the sampler's kind and
settings, the batch size). A successor computes its own at the same point and stops the
job, naming what differs, where the two disagree.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from baton.worker import verify


# Python's `random` and numpy's global generator are seeded from the operating system's
# entropy in every new process: they differ between a rank and its successor whether or not
# the setup used them (what it built with them is caught as data).
_COMPARED_STREAMS = ("torch", "cuda", "tracked")


def fingerprint(streams: dict[str, Any], data: dict[str, Any]) -> dict[str, int]:
    """Digests of the streams that start the same in every process (torch's, CUDA's, the
    script's own generators) and of each DataLoader, Dataset or Sampler in `data`, by name."""
    out = {f"stream.{name}": verify.combined(verify.entries(state)) for name, state in streams.items()
           if name in _COMPARED_STREAMS}
    for name, obj in data.items():
        out[f"data.{name}"] = data_digest(obj)
    return out


def is_data(obj: Any) -> bool:
    """A DataLoader, a Dataset or a Sampler: what data_digest reads."""
    from torch.utils.data import DataLoader, Dataset, Sampler

    return isinstance(obj, (DataLoader, Dataset, Sampler))


def data_digest(loader: Any) -> int:
    """What a DataLoader (or a Dataset, or a Sampler) will yield, up to the data's values: the
    dataset's length and `Subset` index chain, the sampler's kind and settings, the batch size."""
    from torch.utils.data import DataLoader, Dataset, Sampler, Subset

    h = xxhash.xxh3_64()
    if isinstance(loader, DataLoader):
        dataset, sampler, batch = loader.dataset, loader.sampler, loader.batch_size
    elif isinstance(loader, Dataset):
        dataset, sampler, batch = loader, None, None
    elif isinstance(loader, Sampler):
        dataset, sampler, batch = getattr(loader, "dataset", None), loader, None
    else:  # an iterator of one
        dataset, sampler, batch = getattr(loader, "_dataset", None), getattr(loader, "_sampler", None), None
    while isinstance(dataset, Subset):
        indices = [int(i) for i in dataset.indices]
        h.update(len(indices).to_bytes(8, "little"))
        h.update(b"".join(i.to_bytes(8, "little", signed=True) for i in indices))
        dataset = dataset.dataset
    settings = {k: v for k, v in vars(sampler).items() if isinstance(v, (int, float, str, bool)) and k != "epoch"} \
        if sampler is not None and hasattr(sampler, "__dict__") else {}  # its epoch is a position, not its data
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = -1
    h.update(json.dumps([type(dataset).__qualname__, length, type(sampler).__qualname__, settings, batch],
                        sort_keys=True, default=repr).encode())
    return h.intdigest()


def differences(mine: dict[str, int], theirs: dict[str, int]) -> list[str]:
    return verify.differing(mine, theirs)


def explain(rank: int, differing: list[str]) -> str:
    what = []
    for name in differing:
        if name.startswith("stream."):
            what.append(f"the {name.removeprefix('stream.')} random stream")
        else:
            what.append(f"what `{name.removeprefix('data.')}` will yield")
    return (f"rank {rank}'s successor does not start where the rank did: {', '.join(what)} "
            "differ(s) where the step loop starts. The script's setup is not deterministic (an unseeded "
            "random_split or initialisation, say): every process that runs it must build the same data and "
            "draw the same random numbers before its loop. Seed the setup (torch.manual_seed, a generator "
            "for random_split). Or a Sampler or Dataset of the script changes its own plain attributes as it is "
            "iterated (a count of its passes), which a successor walking to its rank's epoch does not repeat: "
            "derive them from the epoch instead (as DistributedSampler.set_epoch does). The job stops here "
            "rather than train the new rank on other data.")
