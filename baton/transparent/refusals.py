"""What this mode cannot carry or resume exactly, said before anything trains on.

A refusal names the file and line, the construct, why it cannot move bit for bit, and
the fix: usually the few model-aware lines, or a loader that can say where it is. Each
check looks at what the script really built (the loop's iterable, the values its
variables hold at the first step), so nothing is refused on a guess from names.
"""

from __future__ import annotations

import gc
import types
from dataclasses import dataclass
from typing import Any

from baton.transparent.carried import Kind, classify
from baton.transparent.loops import ActiveLoop
from baton.transparent.nest import Place

MODEL_AWARE_FIX = ("or use baton's model-aware API, a few lines: `job = baton.init()`, `model = job.wrap(model)`, "
                   "`job.track(data=loader)`, `for step in job.steps(n): with step: ...` (README: 'Five lines in "
                   "your script')")
NO_MIGRATION = ("To run it anyway without moves, `baton run --no-migration`: a failure then ends the job promptly "
                "and you restart from your own checkpoint.")


@dataclass(frozen=True)
class Refusal:
    where: str  # file:line
    what: str  # the construct refused
    why: str
    fix: str

    def text(self) -> str:
        return f"{self.where}: {self.what}: {self.why}. Fix: {self.fix}"


@dataclass(frozen=True)
class Iteration:
    """How a loop's position is kept: what it iterates over and how a successor gets there."""

    what: str
    how: str
    refusal: Refusal | None = None


def _inner_iterators(obj: Any) -> list[Any]:
    """The iterators an enumerate/zip/map/filter/itertools object wraps."""
    return [r for r in gc.get_referents(obj) if hasattr(r, "__next__") or _is_loader(r)]


def _is_loader(obj: Any) -> bool:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return isinstance(obj, (DataLoader, _BaseDataLoaderIter))


def _loader_iteration(obj: Any, where: str, repeated: bool) -> Iteration:
    from torch.utils.data import DataLoader, IterableDataset

    dataset = obj.dataset if isinstance(obj, DataLoader) else getattr(obj, "_dataset", None)
    sampler = getattr(obj, "sampler", None) if isinstance(obj, DataLoader) else getattr(obj, "_sampler", None)
    what = f"DataLoader over {type(dataset).__name__}"
    if sampler is not None and not isinstance(dataset, IterableDataset):
        what += f" ({type(sampler).__name__})"
    stateful = all(hasattr(x, m) for x in (dataset,) for m in ("state_dict", "load_state_dict")) or \
        all(hasattr(obj, m) for m in ("state_dict", "load_state_dict"))
    if isinstance(dataset, IterableDataset) and not stateful:
        return Iteration(what, "", Refusal(
            where, f"batches from {type(dataset).__name__}, an IterableDataset without state",
            "an IterableDataset's position lives in its own iterator, which baton can neither read nor rebuild "
            "without replaying the whole stream",
            "give the dataset state_dict()/load_state_dict() (or use a map-style Dataset with a sampler), "
            + MODEL_AWARE_FIX))
    persistent = getattr(obj, "persistent_workers", False) if isinstance(obj, DataLoader) else \
        getattr(obj, "_persistent_workers", False)
    if repeated and persistent and (getattr(obj, "num_workers", 0) or getattr(obj, "_num_workers", 0)):
        return Iteration(what, "", Refusal(
            where, "a DataLoader with persistent_workers=True, iterated again each time an outer loop comes round",
            "its worker processes keep their random streams from one pass to the next (a random crop drawn "
            "in a worker), and a successor, which starts its workers at its rank's epoch, cannot bring them "
            "where its predecessor's were without loading every earlier epoch again",
            "persistent_workers=False (the workers start each epoch from a seed the main process draws, which "
            "baton carries). " + NO_MIGRATION))
    if isinstance(dataset, IterableDataset):
        return Iteration(what, "its position through the dataset's state_dict()")
    return Iteration(what, "replayed to its position (the batches drawn so far are drawn again, "
                           "augmentations included)")


def iteration(loop: ActiveLoop, repeated: bool = False) -> Iteration:
    """What `loop` iterates over and how a successor reaches the same iteration; `repeated`:
    an outer loop of the nest runs it again and again."""
    where = loop.site.where
    if loop.site.kind == "while":
        return Iteration("a while loop", "its variables say where it is")
    return _iteration_of(loop.iterable, where, 0, repeated)


def _iteration_of(obj: Any, where: str, depth: int, repeated: bool = False) -> Iteration:
    if isinstance(obj, range):
        return Iteration(f"range({obj.start}, {obj.stop}" + (f", {obj.step})" if obj.step != 1 else ")"),
                         "by index")
    if isinstance(obj, (list, tuple, str, bytes, dict)):
        return Iteration(f"a {type(obj).__name__} of {len(obj)}", "by index")
    if _is_loader(obj):
        return _loader_iteration(obj, where, repeated)
    if isinstance(obj, (types.GeneratorType, types.AsyncGeneratorType)):
        return Iteration(f"generator {obj.__qualname__}", "", Refusal(
            where, f"batches from a Python generator ({obj.__qualname__})",
            "a generator's position lives in its suspended frame, which cannot be saved, sent or rebuilt",
            "iterate a DataLoader (a Dataset with a DistributedSampler), or draw the batches inside the loop, "
            + MODEL_AWARE_FIX))
    name = type(obj).__name__
    if name in ("range_iterator", "longrange_iterator", "list_iterator", "tuple_iterator", "count"):
        return Iteration(name, "by index")
    if depth < 3:
        inner = getattr(obj, "iterable", None)  # tqdm and similar progress wrappers
        parts = [inner] if inner is not None else _inner_iterators(obj) \
            if name in ("enumerate", "zip", "map", "filter", "islice", "chain") else []
        if parts:
            got = [_iteration_of(p, where, depth + 1, repeated) for p in parts]
            refused = next((g.refusal for g in got if g.refusal is not None), None)
            return Iteration(f"{name}({', '.join(g.what for g in got)})",
                             "; ".join(g.how for g in got if g.how), refused)
    return Iteration(name, "", Refusal(
        where, f"a loop over {name}", "baton cannot read or rebuild this iterator's position",
        "iterate a DataLoader, a range or a list, " + MODEL_AWARE_FIX))


LOADER_ITERATOR_FIX = ("iterate the DataLoader with a for loop (`for x, y in loader:`, a new one each epoch), "
                       "whose position baton replays, " + MODEL_AWARE_FIX)


def carried_value(site_where: str, name: str, value: Any) -> Refusal | None:
    """A refusal if what a loop variable holds cannot be handed to a successor."""
    got = classify(value)
    if got.kind is not Kind.REFUSED:
        return None
    fix = LOADER_ITERATOR_FIX if _is_loader(value) else \
        ("create it before the loop (the successor's setup makes its own), or keep only plain values "
         "and tensors in the loop's variables, " + MODEL_AWARE_FIX)
    return Refusal(site_where, f"the loop carries `{name}`, {got.detail}", got.why, fix)


def setup_value(site_where: str, name: str, value: Any, detail: str, why: str) -> Refusal:
    """A refusal for an object the setup made that the loop uses and that cannot be handed over."""
    fix = LOADER_ITERATOR_FIX if _is_loader(value) else \
        "keep loaders, counters and plain values on it, " + MODEL_AWARE_FIX
    return Refusal(site_where, f"the loop uses `{name}`, {detail}", why, fix)


def library_loop(place: Place) -> Refusal:
    return Refusal(place.where, f"the step loop is inside {place.function}, in an installed package",
                   "baton instruments only the script's own modules, and cannot resume a loop it does not see "
                   "(Lightning's, the HF Trainer's or Accelerate's, TorchTitan's)",
                   MODEL_AWARE_FIX.removeprefix("or ").capitalize() + ". " + NO_MIGRATION)


def no_loop(call: Place) -> Refusal:
    return Refusal(call.where, "optimizer.step() outside any loop of the script",
                   "baton resumes a rank at the start of an iteration of the loop around its optimizer's step, and "
                   "found none", "step the optimizer inside a for/while loop of the script, " + MODEL_AWARE_FIX)


def stray_parameter(call_where: str, shape: list[int]) -> Refusal:
    """An optimizer's trainable parameter that no DDP or fully_shard model holds."""
    return Refusal(call_where, f"the optimizer trains a parameter of shape {shape} that no DistributedDataParallel "
                   "or fully_shard model holds",
                   "DDP does not average its gradient, so its value and its optimizer state are each rank's own; a "
                   "successor takes a rank's optimizer state from the other ranks and its setup's value, and would "
                   "train on with others",
                   "register it on the model before wrapping it (`model.scale = nn.Parameter(...)`; DDP then averages "
                   "its gradient, as every rank holding the same value needs), " + MODEL_AWARE_FIX + ". " + NO_MIGRATION)
