"""What a model holds outside its state_dict: each module's train/eval flag, and its
non-persistent buffers.

Neither is in a checkpoint, and a joiner builds its model afresh: every module in training
mode, non-persistent buffers as its own construction made them. Both can differ from its
predecessor's: a script that switches a module to eval inside its step loop (BatchNorm
statistics frozen from some step on), or a model built on the meta device whose rotary
tables the script did not recompute after `to_empty`. With either, a joiner trained on and
the run ended with exit code 0 and different weights. So the flags travel in the rank's
bundle and are applied where a bundle is; the buffers' digests travel there too, and a
joiner whose buffers differ fails its state check, naming them.
"""

from __future__ import annotations

import torch
import xxhash

from baton.transfer.protocol import byte_view
from baton.worker import registrations


class ModuleState:
    """Reads and sets the flags, and digests the buffers, of named models. Each model's module
    list is found again only after a registration (walking a large model's modules at every
    step's capture costs more than the capture's other parts; a buffer registered later, a
    rotary table made on the first forward, is found), and a buffer is hashed again only
    when it changed: its
    storage, shape or in-place version counter moved (a write through `.data` does not move
    the counter: such a buffer keeps the digest of its value before)."""

    def __init__(self) -> None:
        # id(model) -> (model, registration count when walked, what the walk found)
        self._modules: dict[int, tuple[torch.nn.Module, int, list[torch.nn.Module]]] = {}
        self._places: dict[int, tuple[torch.nn.Module, int, list[tuple[str, torch.nn.Module, str]]]] = {}
        self._digests: dict[str, tuple[tuple, str]] = {}

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        now = registrations.count()
        found = self._modules.get(id(model))
        if found is None or found[0] is not model or found[1] != now:
            found = self._modules[id(model)] = (model, now, list(model.modules()))
        return found[2]

    def modes(self, models: dict[str, torch.nn.Module]) -> dict[str, str]:
        """Each model's flags, one character per module in `modules()` order ('1': training)."""
        return {name: "".join("1" if m.training else "0" for m in self.modules(model))
                for name, model in models.items()}

    def set_modes(self, models: dict[str, torch.nn.Module], modes: dict[str, str]) -> None:
        """Set each module's flag as `modes` records it (not `.train()`, which would recurse)."""
        from baton.worker.tracked import UsageError
        for name, flags in modes.items():
            model = models.get(name)
            if model is None:
                raise UsageError(f"{name}: the rank this one replaces had a model of that name, this rank has none: "
                                 "every rank must track the same models")
            mods = list(model.modules())  # not the cache: a check on the rare path
            if len(mods) != len(flags):
                raise UsageError(f"{name}: {len(mods)} modules here, {len(flags)} in the rank this one replaces: "
                                 "the ranks build different models")
            for module, flag in zip(mods, flags):
                module.training = flag == "1"

    def volatile(self, models: dict[str, torch.nn.Module]) -> dict[str, str]:
        """A digest of each non-persistent buffer, by name."""
        out: dict[str, str] = {}
        for name, model in models.items():
            for key, module, attr in self._volatile_places(name, model):
                buf = module._buffers.get(attr)  # noqa: SLF001 - read each time: a script may reassign it
                if buf is not None:
                    out[key] = self._digest(key, buf)
        return out

    def _volatile_places(self, name: str, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        now = registrations.count()
        found = self._places.get(id(model))
        if found is None or found[0] is not model or found[1] != now:
            places = [(f"{name}.{mod_name}.{attr}" if mod_name else f"{name}.{attr}", module, attr)
                      for mod_name, module in model.named_modules()
                      for attr in sorted(module._non_persistent_buffers_set)]  # noqa: SLF001 - no public listing
            found = self._places[id(model)] = (model, now, places)
        return found[2]

    def _digest(self, key: str, buf: torch.Tensor) -> str:
        stamp = (buf.data_ptr(), buf._version, tuple(buf.shape), buf.stride(), buf.dtype, buf.device)
        cached = self._digests.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        t = buf.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
        h = xxhash.xxh3_64()
        if t.numel():
            h.update(byte_view(t.reshape(-1)))
        digest = f"{t.dtype}{tuple(t.shape)}:{h.hexdigest()}"
        self._digests[key] = (stamp, digest)
        return digest


def differing_buffers(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The non-persistent buffers both sides hold whose digests differ. One that only one
    side holds is not compared: a buffer a script makes on its first forward (a lazily
    built rotary table) exists on the predecessor and not yet on a joiner that has not run
    a step, and the joiner's forward makes it the same way."""
    return sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])


def differing_volatile(names: list[str]) -> str:
    """What to tell the user when a joiner's non-persistent buffers are not its predecessor's."""
    return (f"the joiner's non-persistent buffers differ from its predecessor's ({', '.join(names[:5])}): they are "
            "not in a state_dict, so a joiner must compute them exactly as its predecessor did; a model built "
            "on the meta device must recompute them after to_empty(), or register them as persistent buffers so that "
            "their values travel with the state")
