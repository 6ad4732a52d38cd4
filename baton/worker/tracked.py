"""Everything that migrates, by name: models, optimizers, schedulers, scalers, generators,
and the script's own rank-local values.

Three kinds of state, because after an unplanned loss they come from different places:

- *replicated*: equal on every data-parallel replica (parameters, optimizer, schedulers,
  scalers). Fetched from healthy survivors; compared across ranks by `verify`.
- *rank-local per step*: random streams and the BatchNorm-style buffers of wrapped
  models (each rank updates them with its own batch). Captured inside every step and
  held by a buddy rank (`bundle`).
- *rank-local values* (`job.local(...)`): small values a rank keeps for itself, changed
  only in boundary functions; the orchestrator holds each rank's latest.

Small mutable state (schedulers, scalers, optimizer hyperparameters, local values) is
also snapshotted at every unit start, so a re-run starts from exactly where the first
attempt did even if code after a failed `with step:` touched it.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Iterator

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from baton.worker import discover, registrations, rng
from baton.worker.adopt import adopt_parameters
from baton.worker.compile_watch import CompileWatch
from baton.worker.module_state import ModuleState


class UsageError(RuntimeError):
    """The script uses baton in a way that cannot migrate correctly; the message says how to fix it."""


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


class LocalValues:
    """A rank's own small values (`job.local(best_loss=1e9)`), e.g. rank 0's best validation
    loss. They migrate from this rank's latest boundary, never from another rank, so they
    may only change inside boundary functions, where baton can make the change durable."""

    def __init__(self, owner: "Tracked", values: dict[str, Any]):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_values", {})
        for k, v in values.items():
            self._values[k] = _check_json(k, v)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"job.local has no value {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"job.local has no value {name!r}: declare it in job.local({name}=...)")
        self._owner.check_local_write(name)
        self._values[name] = _check_json(name, value)

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.__setattr__(name, value)

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def load(self, values: dict[str, Any]) -> None:
        self._values.update(values)

    def __repr__(self) -> str:
        return f"LocalValues({self._values})"


def _check_json(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"job.local value {name!r}: only numbers, strings, lists and dicts "
                            "(or one-element tensors) are kept; track bigger state with job.track")
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"job.local value {name!r} must be JSON-like: {exc}") from None
    return copy.deepcopy(value)


class Tracked:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}  # name -> object with state_dict/load_state_dict
        self.generators: dict[str, Any] = {}  # name -> torch/numpy/python generator
        self.ddps: list[Any] = []  # the DistributedDataParallel modules job.wrap built
        # rank-local state no model holds (no code change: an EMA module, tensors; baton.transparent.extras)
        self.extras: dict[str, Any] = {}
        self._extra_versions: dict[str, tuple[int, ...]] = {}  # their tensors' versions when first read
        self.extras_changed: set[str] = set()  # those changed since: captured from then on
        self.local: LocalValues | None = None
        self.scope: str | None = None  # "step" | "boundary" | None, set by the loop
        self.discovered: list[str] = []
        self.sharded: set[str] = set()  # objects holding DTensor shards (see sharded_names)
        self.shard_capture: dict[str, Any] = {}  # name -> its learned state dict (shard_capture.py)
        # id(module) -> (registration count when walked, its persistent buffers' places)
        self._buffer_places: dict[int, tuple[int, list[tuple[str, torch.nn.Module, str]]]] = {}
        self._module_state = ModuleState()
        self._loop_buffers: dict[str, set[str]] = {}  # each model's buffer names as its step loop began
        # (registration count when walked, where each buffer registered since the loop began lives)
        self._late_places: tuple[int, list[tuple[str, torch.nn.Module, str, bool]]] = (-1, [])
        self.compile_watch = CompileWatch()

    # ---------------------------------------------------------------- registration
    @property
    def wrapped(self) -> list[torch.nn.Module]:
        """The modules job.wrap was given (inside their DDP)."""
        return [d.module for d in self.ddps]

    def add_wrapped(self, ddp: Any, model: torch.nn.Module) -> None:
        """A model the job wrapped in DDP, named "model", then "model1", ... in wrapping order."""
        self.ddps.append(ddp)
        name = "model" if not any(n.startswith("model") for n in self.objects) else f"model{len(self.wrapped) - 1}"
        self.add(name, model)

    def add(self, name: str, obj: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(obj, DistributedDataParallel):
            obj = obj.module
        if name in self.objects or name in self.generators:
            if self.objects.get(name) is obj or self.generators.get(name) is obj:
                return
            raise ValueError(f"job.track: the name {name!r} is already used")
        if rng.is_generator(obj):
            self.generators[name] = obj
            return
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"job.track({name}=...): {type(obj).__name__} has no "
                            "state_dict()/load_state_dict(), so it cannot migrate")
        self.objects[name] = obj

    def add_discovered(self, scan_for_untracked: bool = True) -> None:
        """Track every optimizer/scheduler/scaler the script created after baton.init().

        `scan_for_untracked` looks through every live object (gc) for those created before
        it: 0.2 s and more in a real process, pointless where discovery was installed before
        the script's first line ran (no code change), and on a joiner's critical path there."""
        known = {id(o) for o in self.objects.values()}
        counts: dict[str, int] = {}
        for kind, obj in discover.created():
            n = counts.get(kind, 0)
            counts[kind] = n + 1
            if id(obj) in known:
                continue
            name = kind if n == 0 else f"{kind}{n}"
            while name in self.objects:
                name += "_"
            self.objects[name] = obj
            self.discovered.append(name)
        missing = discover.untracked_before_init(list(self.objects.values()) + _BATON_OWNED) \
            if scan_for_untracked else []
        if missing:
            raise UsageError(
                "these were created before baton.init() and are not tracked, so they would not "
                f"migrate: {', '.join(missing)}. Create them after baton.init(), or pass them to "
                "job.track(name=obj).")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]

    def check_local_write(self, name: str) -> None:
        if self.scope == "step":
            raise UsageError(f"job.local.{name} changed inside a step: rank-local values may only "
                             "change in boundary functions (job.every / job.at_epoch_end), where "
                             "baton makes the change durable before any rank moves on")

    def sharded_names(self) -> list[str]:
        """Tracked objects whose state holds DTensor shards (an FSDP2 model and its optimizer):
        rank-local, so neither fetched from another replica nor compared across ranks."""
        from baton.worker.dtensors import is_dtensor

        out = []
        for name, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                tensors: Iterator[Any] = iter(obj.parameters())
            elif isinstance(obj, torch.optim.Optimizer):
                tensors = (p for group in obj.param_groups for p in group["params"])
            else:
                continue
            if any(is_dtensor(t) for t in tensors):
                out.append(name)
        return sorted(out)

    # ---------------------------------------------------------------- replicated state
    def replicated(self) -> dict[str, Any]:
        """State every replica holds equally: the sharded objects (`sharded`, set when the loop
        starts) are each rank's own and are left out."""
        return {name: obj.state_dict() for name, obj in self.objects.items() if name not in self.sharded}

    def load_replicated(self, state: dict[str, Any], adopt: bool = False) -> None:
        """Load the replicated state; with `adopt`, models' parameters take the arrived
        tensors' memory instead of a copy (`adopt.adopt_parameters`: the caller never uses
        `state` again)."""
        mine = set(self.objects) - self.sharded
        if set(state) != mine:
            raise UsageError(f"tracked state differs between ranks: arrived {sorted(state)}, this rank "
                             f"tracks {sorted(mine)} (besides its shards); every rank must track the same objects")
        for name, sd in state.items():
            obj = self.objects[name]
            if adopt and isinstance(obj, torch.nn.Module):
                adopt_parameters(obj, sd)
            obj.load_state_dict(sd)

    # ---------------------------------------------------------------- rank-local per step
    def local_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers of wrapped and of sharded models: each rank updates them with its
        own batch (DDP broadcasts them before a forward, FSDP2 never syncs them), so a step
        abandoned after its forward must give them back; and the tensors of the extras the
        script has changed since they were first read. Where they live is found again only
        after a registration; each call reads the owner's current tensor, so a buffer the
        script reassigns is still the one captured."""
        out: dict[str, torch.Tensor] = {}
        now = registrations.count()
        for key, module in self._buffered_models():
            found = self._buffer_places.get(id(module))
            if found is None or found[0] != now:  # new: or a buffer registered since (a first forward's)
                found = self._buffer_places[id(module)] = (now, _buffer_places(module, key))
            for name, owner, attr in found[1]:
                buf = owner._buffers.get(attr)
                if buf is not None:
                    out[name] = buf
        for name, obj in self.extras.items():
            tensors = _own_tensors(obj)
            if name not in self.extras_changed:  # a frozen module (a teacher, a VAE) is never copied
                # (a DTensor's own counter: an in-place op bumps it, not its local shard's)
                versions = tuple(t._version for t in tensors.values())
                if self._extra_versions.setdefault(name, versions) == versions:
                    continue
                self.extras_changed.add(name)
            for key, t in tensors.items():  # whole: each rank may change them anywhere in a step
                out[f"{name}.{key}" if key else name] = _local(t)
        return out

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Every extra module's parameters and buffers, changed or not (what a record restores)."""
        return {f"{name}.{key}" if key else name: _local(t) for name, obj in self.extras.items()
                for key, t in _own_tensors(obj).items()}

    def note_extras_restored(self, buffers: dict[str, Any]) -> None:
        """The extras a record held were put back: they are captured from now on (a copy into
        a DTensor's shard leaves the DTensor's own version counter as it was)."""
        self.extras_changed.update(name for name in self.extras if _holds(buffers, name))

    def extras_missing(self, buffers: dict[str, Any]) -> list[str]:
        """Extra modules changed since first read that a record of buffers lacks: it was taken
        before their first change, which cannot be undone."""
        return [name for name in sorted(self.extras_changed) if not _holds(buffers, name)]

    def _buffered_models(self) -> list[tuple[str, torch.nn.Module]]:
        """The models whose buffers are rank state, by the name every rank gives them: those
        job.wrap wrapped (DDP) and the sharded ones (FSDP2)."""
        out = [(self._name_of(module, i), module) for i, module in enumerate(self.wrapped)]
        seen = {id(module) for _, module in out}
        out += [(name, self.objects[name]) for name in sorted(self.sharded)
                if isinstance(self.objects[name], torch.nn.Module) and id(self.objects[name]) not in seen]
        return out

    # ---------------------------------------------------------------- buffers made in the loop
    def note_loop_start(self) -> None:
        """Remember each model's buffers as its step loop begins (call it once `sharded` is
        set): a joiner builds the model afresh, so it holds exactly these, and not those its
        predecessor's forward made."""
        self._loop_buffers = {key: {name for name, _ in m.named_buffers()} for key, m in self._buffered_models()}
        self._late_places = (-1, [])
        self.compile_watch.start(registrations.count())

    def note_step_end(self) -> None:
        """A step (or boundary function) ended: note the buffers it registered inside compiled
        code by breaking the graph (compile_watch)."""
        self.compile_watch.step_ended(
            registrations.count(), lambda: [(key, owner) for key, owner, _, _ in self._late_buffer_places()],
            lambda: [model for _, model in self._buffered_models()])

    def late_buffers(self, copy: bool = True) -> dict[str, Any]:
        """The models' buffers registered since their step loop began (a mask, a rotary table
        or running statistics a forward builds on first use), with their values. A joiner
        needs them before it loads or steps: DDP broadcasts every buffer before each forward,
        so a joiner without them sends fewer bytes than its peers and dies in its first step
        (gloo: "Received data size doesn't match expected size"); a sharded model's state dict
        names its persistent ones, which a fresh model refuses ("Unexpected key(s)"); and a
        value nothing broadcasts (FSDP2's buffers are each rank's own) exists only here.
        Persistent ones are named too: load_state_dict needs them. `copy=False`: the live
        tensors, for a caller that copies them anyway (a shard snapshot)."""
        values: dict[str, torch.Tensor] = {}
        persistent: list[str] = []
        for key, owner, attr, is_persistent in self._late_buffer_places():
            buf = owner._buffers.get(attr)  # noqa: SLF001 - the current tensor, should the script reassign it
            if buf is None:
                continue
            values[key] = buf.detach().clone() if copy else buf.detach()
            if is_persistent:
                persistent.append(key)
        return {"values": values, "persistent": persistent, "broke_compile": dict(self.compile_watch.broke)}

    def late_buffer_keys(self) -> list[str]:
        """The keys of the buffers registered since the loop began (what a record notes)."""
        return [key for key, _, _, _ in self._late_buffer_places()]

    def drop_late_buffers(self, keep: list[str]) -> list[str]:
        """Unregister the buffers registered since the loop began that `keep` (a record's
        `late_buffer_keys`) lacks; their keys. An abandoned step's first forward made them after
        the record this rank goes back to: a rerun that found them would update the abandoned
        attempt's values where the first run made them afresh (running statistics), and
        diverge."""
        kept = set(keep)
        dropped = []
        for key, owner, attr, _ in self._late_buffer_places():
            if key not in kept:
                del owner._buffers[attr]  # noqa: SLF001 - as delattr does, without a module's own __delattr__
                owner._non_persistent_buffers_set.discard(attr)  # noqa: SLF001
                dropped.append(key)
        if dropped:
            registrations.removed()
        return dropped

    def _late_buffer_places(self) -> list[tuple[str, torch.nn.Module, str, bool]]:
        """(key, owner, attribute, persistent) of each buffer registered since the loop began,
        in `named_buffers()` order (the list, and its order, DDP broadcasts). Walked again only
        after a registration: a shard snapshot asks at every boundary."""
        now = registrations.count()
        if self._late_places[0] != now:
            places = []
            for key, module in self._buffered_models():
                initial = self._loop_buffers.get(key)
                if initial is None:
                    continue
                for name, _ in module.named_buffers():
                    if name in initial:
                        continue
                    owner_name, _, attr = name.rpartition(".")
                    owner = module.get_submodule(owner_name)
                    places.append((f"{key}/{name}", owner, attr,
                                   attr not in owner._non_persistent_buffers_set))  # noqa: SLF001
            self._late_places = (now, places)
        return self._late_places[1]

    def adopt_late_buffers(self, late: dict[str, Any]) -> list[str]:
        """Register the buffers a source's forward made that this rank's model lacks (a
        joiner's, before its first forward), in the source's order; their keys."""
        added = []
        persistent = set(late.get("persistent", []))
        models = dict(self._buffered_models())
        for key, value in late.get("values", {}).items():
            model, name = key.split("/", 1)
            if model not in models:
                raise UsageError(f"the source holds buffers of a model this rank neither wraps nor shards "
                                 f"({key}; here: {sorted(models) or 'none'}): every rank must build, wrap and "
                                 "track the same models")
            owner_name, _, attr = name.rpartition(".")
            owner = models[model].get_submodule(owner_name)
            if attr in owner._buffers and owner._buffers[attr] is not None:  # noqa: SLF001
                continue  # made here too (its value is compared: module_state)
            owner.register_buffer(attr, value.clone(), persistent=key in persistent)
            added.append(key)
        self.compile_watch.adopted(added)
        return added

    def models(self) -> dict[str, torch.nn.Module]:
        return {name: obj for name, obj in self.objects.items() if isinstance(obj, torch.nn.Module)}

    def modes(self) -> dict[str, str]:
        """Every tracked model's train/eval flags (module by module), and the DDP wrappers'."""
        out = self._module_state.modes(self.models())
        if self.ddps:
            out["$ddp"] = "".join("1" if d.training else "0" for d in self.ddps)
        return out

    def set_modes(self, modes: dict[str, str]) -> None:
        flags = modes.get("$ddp", "")
        if len(flags) != len(self.ddps):
            raise UsageError(f"{len(self.ddps)} models wrapped here, {len(flags)} in the rank this one replaces: "
                             "every rank must call job.wrap alike")
        for d, flag in zip(self.ddps, flags):
            d.training = flag == "1"
        self._module_state.set_modes(self.models(), {k: v for k, v in modes.items() if k != "$ddp"})

    def volatile_buffers(self) -> dict[str, str]:
        """Digests of the tracked models' non-persistent buffers (see module_state)."""
        return self._module_state.volatile(self.models())

    def _name_of(self, module: torch.nn.Module, index: int) -> str:
        for name, obj in self.objects.items():
            if obj is module:
                return name
        return f"wrapped{index}"

    # ---------------------------------------------------------------- small-state snapshots
    def snapshot_small(self) -> list[tuple[Any, Any]]:
        """Cheap copies of the state a re-run must start from (not parameters or optimizer moments)."""
        # DDP's own "broadcast buffers before the next forward" flag: an evaluation forward
        # clears it, so a re-run must start with the value the first attempt started with.
        snap: list[tuple[Any, Any]] = [(d, d.require_forward_param_sync) for d in self.ddps]
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                snap.append((obj, [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]))
            elif _is_scheduler(obj):
                snap.append((obj, copy.deepcopy(obj.state_dict())))
            elif isinstance(obj, torch.amp.GradScaler):
                snap.append((obj, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                   for k, v in obj.__dict__.items() if k != "_per_optimizer_states"}))
        if self.local is not None:
            snap.append((self.local, self.local.as_dict()))
        # Train/eval modes: a boundary function interrupted between model.eval() and
        # model.train() must not leave the step that re-runs before it in eval mode.
        snap.append((_MODES, self.modes()))
        return snap

    def restore_small(self, snap: list[tuple[Any, Any]]) -> None:
        from torch.nn.parallel import DistributedDataParallel

        for obj, saved in snap:
            if isinstance(obj, DistributedDataParallel):
                obj.require_forward_param_sync = saved
            elif isinstance(obj, torch.optim.Optimizer):
                for group, values in zip(obj.param_groups, saved):
                    group.update(values)
            elif _is_scheduler(obj):
                obj.load_state_dict(copy.deepcopy(saved))
            elif isinstance(obj, torch.amp.GradScaler):
                for k, v in saved.items():
                    setattr(obj, k, v.clone() if isinstance(v, torch.Tensor) else v)
                reset_scaler_stage(obj)
            elif isinstance(obj, LocalValues):
                obj.load(copy.deepcopy(saved))
            elif obj is _MODES:
                self.set_modes(saved)

    def scalers(self) -> Iterator[torch.amp.GradScaler]:
        return (o for o in self.objects.values() if isinstance(o, torch.amp.GradScaler))


class _Modes:
    """Marks the tracked models' train/eval modes (`Tracked.modes`) in a small-state snapshot."""


_MODES = _Modes()


def reset_scaler_stage(scaler: torch.amp.GradScaler) -> None:
    """Forget a half-done unscale_/step of an abandoned attempt (what update() would do)."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state
    from collections import defaultdict

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# Module names that wrappers add and state-dict keys leave out, as the DCP helpers do
# (checkpoint_wrapper's, torch.compile's).
_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def _holds(buffers: dict[str, Any], name: str) -> bool:
    """Whether a record of buffers holds the extra `name` (a tensor, or its items)."""
    return any(k == name or k.startswith(name + ".") for k in buffers)


def _own_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """An extra's tensors by key: a module's parameters and buffers, a tensor ("") or the
    items of a list, tuple or dict of tensors."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict(keep_vars=True)
    if isinstance(obj, torch.Tensor):
        return {"": obj}
    return {str(k): t for k, t in (obj.items() if isinstance(obj, dict) else enumerate(obj))}


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (an EMA of an FSDP2 model's
    parameters), a plain tensor itself."""
    return getattr(t, "_local_tensor", t)


def _buffer_places(module: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, owning module, attribute) of each persistent buffer of `module`, named by its
    state-dict key (HSDP matches them against the keys of shards from another replica group)."""
    out = []
    for mod_name, mod in module.named_modules():
        path = ".".join(part for part in mod_name.split(".") if part and part not in _WRAPPER_NAMES)
        for attr in mod._buffers:
            if attr not in mod._non_persistent_buffers_set:
                out.append((f"{prefix}.{path}.{attr}" if path else f"{prefix}.{attr}", mod, attr))
    return out


# Objects baton makes for itself (the warm-up's optimizer) are never the script's.
_BATON_OWNED: list[Any] = []
