"""A rank's FSDP2 shards (parameters and optimizer state) as plain tensors, and back.

A sharded model's or optimizer's state exists on its own rank only, so it travels from
that rank (a planned move's leaver, or a buddy's copy) to the rank taking its place. It
is captured and loaded with torch.distributed.checkpoint's state-dict helpers (the
sharded form: every DTensor holds this rank's shard); on the wire each DTensor is its
local tensor under a `$dtensor` key, and the receiver rebuilds it on its own copy of the
same mesh and placements, so nothing about the mesh crosses the socket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from baton.transfer.codec import tensors_in
from baton.worker import shard_capture, verify
from baton.worker.dtensors import is_dtensor
from baton.worker.tracked import Tracked, UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

LOCAL = "$dtensor"


def owner_model(tracked: Tracked, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """The tracked sharded model whose parameters this optimizer updates (the DCP helpers
    key optimizer state by the model's parameter names)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name in sorted(tracked.sharded):
        obj = tracked.objects[name]
        if isinstance(obj, torch.nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
            return obj
    raise UsageError("a sharded optimizer's parameters do not all belong to one tracked FSDP2 model: "
                     "track the root module fully_shard was applied to (job.track(model=model))")


def capture(tracked: Tracked, encoded: bool = False) -> dict[str, Any]:
    """This rank's shards of every sharded object, DTensors replaced by their local tensors
    (the helpers' answer, learned after the first boundary: see shard_capture.py); with
    `encoded`, each object's already encoded (codec.Encoded), as a snapshot takes them."""
    out: dict[str, Any] = {}
    for name in sorted(tracked.sharded):
        obj = tracked.objects[name]
        if not isinstance(obj, torch.nn.Module) and not obj.state:
            out[name] = _to_local(obj.state_dict())  # never stepped: nothing to shard (the helper would step it)
            continue
        capturer = _capturer_of(tracked, name, obj)
        out[name] = capturer.encoded() if encoded else capturer()
    return out


def _capturer_of(tracked: Tracked, name: str, obj: Any) -> shard_capture.ShardCapture:
    """The object's capture, made at its first use (what it learns lives as long as it does)."""
    capturer = tracked.shard_capture.get(name)
    if capturer is None:
        capturer = tracked.shard_capture[name] = _capturer(tracked, name, obj)
    return capturer


def _capturer(tracked: Tracked, name: str, obj: Any) -> shard_capture.ShardCapture:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(obj, torch.nn.Module):
        return shard_capture.for_model(name, obj, lambda: _to_local(get_model_state_dict(obj)), _to_local)
    model = owner_model(tracked, obj)
    return shard_capture.for_optimizer(name, obj, lambda: _to_local(get_optimizer_state_dict(model, obj)),
                                       _to_local)


def load(tracked: Tracked, state: dict[str, Any], owned: bool = True) -> list[str]:
    """Load `capture`'s output from another rank into this rank's sharded objects: copied into
    the live shards where their structure is the one that arrived (one pass over the bytes),
    else through the DCP helpers. `owned`: the arrived tensors are this rank's to keep (a
    fetch); otherwise (its own snapshot, which must stay as it is) they are never aliased.
    Returns the objects loaded without the helpers (copied in place, or adopted by a fresh
    optimizer)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    if set(state) != set(tracked.sharded):
        raise UsageError(f"sharded state differs between ranks: arrived {sorted(state)}, this rank shards "
                         f"{sorted(tracked.sharded)}; every rank must shard the same objects")
    models = [n for n in sorted(state) if isinstance(tracked.objects[n], torch.nn.Module)]
    in_place = []
    for name in models + [n for n in sorted(state) if n not in models]:  # optimizers after models
        obj, incoming = tracked.objects[name], state[name]
        if owned and not isinstance(obj, torch.nn.Module) and not obj.state and isinstance(incoming, dict) \
                and incoming.get("state") and _adopt(tracked, obj, incoming):
            in_place.append(name)
            continue
        if _load_in_place(tracked, name, obj, incoming):
            in_place.append(name)
            continue
        if not owned:
            incoming = cloned(incoming)
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, _rebuild(incoming, get_model_state_dict(obj), name))
        elif not incoming.get("state"):
            obj.load_state_dict(incoming)
        else:
            model = owner_model(tracked, obj)
            here = get_optimizer_state_dict(model, obj)
            set_optimizer_state_dict(model, obj, _rebuild(incoming, here, name))
    return in_place


def prepare(tracked: Tracked) -> None:
    """Make a joiner ready to take shards in place before it is needed: the capture of its
    models learned (a fresh optimizer takes the arrived state as its own: see _adopt), and
    their shards' pages mapped. A model built on the meta device and materialised with
    `to_empty` holds memory never written: the copy into it faulted every page in, which
    took 0.04-0.2 s instead of 0.02 s for a 57 MB shard (bench machine), in a planned
    move's pause. The values are zeros until the predecessor's arrive."""
    for name in sorted(tracked.sharded):
        obj = tracked.objects[name]
        if not isinstance(obj, torch.nn.Module) and not obj.state:
            continue
        live = _capturer_of(tracked, name, obj).live()
        if isinstance(obj, torch.nn.Module) and live is not None:
            with torch.no_grad():
                for t in tensors_in(live):
                    t.zero_()


def _adopt(tracked: Tracked, optimizer: torch.optim.Optimizer, incoming: Any) -> bool:
    """A fresh optimizer (a joiner's: no state yet) takes the arrived state as its own, each
    shard made a DTensor laid out as its parameter, through its own load_state_dict: what
    the DCP helper does after it has created the state with a step at lr 0 (0.3-0.7 s for
    171 MB on the bench machine, in the downtime). False where the arrival does not name
    this optimizer's parameters in its order (the helper then loads it)."""
    groups, state = incoming.get("param_groups"), incoming.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(optimizer.param_groups):
        return False
    fqn_of = {id(p): n for n, p in owner_model(tracked, optimizer).named_parameters()}
    index: dict[str, tuple[int, torch.Tensor]] = {}
    native_groups = []
    for arrived, group in zip(groups, optimizer.param_groups):
        if not isinstance(arrived, dict) or arrived.get("params") != [fqn_of.get(id(p)) for p in group["params"]]:
            return False
        ids = []
        for fqn, param in zip(arrived["params"], group["params"]):
            index[fqn] = (len(index), param)
            ids.append(index[fqn][0])
        native_groups.append({**{k: v for k, v in arrived.items() if k != "params"}, "params": ids})
    native_state = {}
    for fqn, entry in state.items():
        if fqn not in index or not isinstance(entry, dict):
            return False
        i, param = index[fqn]
        native_state[i] = {}
        for key, value in entry.items():
            if isinstance(value, dict) and set(value) == {LOCAL}:
                value = _shard_like(value[LOCAL], param)
                if value is None:
                    return False
            elif isinstance(value, (dict, list)):
                return False
            native_state[i][key] = value
    optimizer.load_state_dict({"state": native_state, "param_groups": native_groups})
    return True


def _init_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Create a fresh optimizer's state the way the DCP helper does; False where it cannot."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    init = getattr(dcp_state_dict, "_init_optim_state", None)
    if init is None:
        return False
    init(optimizer)
    return bool(optimizer.state)


def _load_in_place(tracked: Tracked, name: str, obj: Any, incoming: Any) -> bool:
    """Copy `incoming` into the live shards of `obj` if they have its very structure (keys,
    shapes, dtypes; an optimizer's param_groups values are set as its load_state_dict would).
    What the helpers would do then comes to the same bytes in the same storage; anything
    else (other keys, a fresh optimizer the helper could not initialise) returns False."""
    if not isinstance(incoming, dict):
        return False
    if not isinstance(obj, torch.nn.Module):
        if not incoming.get("state"):
            return False  # nothing to shard yet: the plain load_state_dict is cheap
        if not obj.state and not _init_optimizer(obj):  # the state tensors to copy into
            return False
    ours = _capturer_of(tracked, name, obj).live()
    if ours is None:
        return False
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    settings: list[tuple[int, str, Any]] = []
    if not _pair(ours, incoming, pairs, settings, ()):
        return False
    if settings and isinstance(obj, torch.nn.Module):
        return False
    with torch.no_grad():
        for live, new in pairs:
            live.copy_(new)
    for index, key, value in settings:
        obj.param_groups[index][key] = value
    return True


def _pair(ours: Any, incoming: Any, pairs: list, settings: list, path: tuple) -> bool:
    """Walk the live answer and the arrived one together: tensor pairs to copy, and the
    param_groups values (LR, betas, ...) that differ; False at any other difference."""
    if isinstance(ours, torch.Tensor):
        if not isinstance(incoming, torch.Tensor) or incoming.shape != ours.shape or incoming.dtype != ours.dtype:
            return False
        pairs.append((ours, incoming))
        return True
    if isinstance(ours, dict):
        return isinstance(incoming, dict) and list(incoming) == list(ours) and all(
            _pair(ours[k], incoming[k], pairs, settings, (*path, k)) for k in ours)
    if isinstance(ours, (list, tuple)):
        return isinstance(incoming, (list, tuple)) and len(incoming) == len(ours) and all(
            _pair(a, b, pairs, settings, (*path, i)) for i, (a, b) in enumerate(zip(ours, incoming)))
    if isinstance(incoming, (dict, list, torch.Tensor)):
        return False
    if type(ours) is type(incoming) and ours == incoming:
        return True
    if len(path) == 3 and path[0] == "param_groups" and path[2] != "params":
        settings.append((path[1], path[2], incoming))
        return True
    return False


def cloned(obj: Any) -> Any:
    """`obj` (as codec.decode makes it) with every tensor in it copied."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        out = type(obj)((k, cloned(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = cloned(obj._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(cloned(v) for v in obj)
    return obj


def reset_after_failure(tracked: Tracked) -> None:
    """Discard a step a failure interrupted, on every sharded model: FSDP2 would otherwise
    keep blocks it had gathered (and skip gathering them again: a collective the other
    ranks run and this one does not), prefetches and partial gradients."""
    from torch.distributed.fsdp import FSDPModule

    for name in sorted(tracked.sharded):
        model = tracked.objects[name]
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            if isinstance(module, FSDPModule):
                _drop_pending_gathers(module)
        if isinstance(model, FSDPModule) and getattr(model._get_fsdp_state(), "_is_root", None):
            model.reset_iter_state()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                _drop_unsharded_grads(module)
        for param in model.parameters():
            param.grad = None
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    if not group.is_sharded or group._all_gather_result is not None:
                        raise RuntimeError(f"FSDP2 block {group._module_fqn or name!r} is still gathered after "
                                           "a failed step was discarded: re-running the step would skip its "
                                           "all-gather on this rank only (a baton bug; please report it)")


def _drop_unsharded_grads(module: Any) -> None:
    """Gradients a block's backward left on its gathered parameters before its
    reduce-scatter ran: the re-run's backward would add to them (reset_iter_state
    leaves them, as it leaves the sharded gradients)."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None


def _drop_pending_gathers(module: Any) -> None:
    """Wait out (and forget) all-gathers of the broken generation, which fail when waited
    on: reset_iter_state() would wait on them and raise half way through its reset."""
    state = module._get_fsdp_state()
    for group in state._fsdp_param_groups:
        result = group._all_gather_result
        if result is not None and result.all_gather_work is not None:
            try:
                result.all_gather_work.wait()
            except Exception:  # noqa: BLE001 - the generation is already known to be broken
                pass
            group._all_gather_result = None
    if getattr(state._comm_ctx, "all_gather_state", None) is not None:  # absent before a first forward
        state._comm_ctx.all_gather_state = None


def replica_peers(tracked: Tracked) -> list[int]:
    """The other ranks holding this rank's very shards (HSDP's other replica groups): the
    ranks at this rank's place on every dimension its sharded state is split over."""
    for name in sorted(tracked.sharded):
        obj = tracked.objects[name]
        if isinstance(obj, torch.nn.Module):
            dt = next((p for p in obj.parameters() if is_dtensor(p)), None)
            if dt is not None:
                mesh, placements = dt.device_mesh, dt.placements
                layout = mesh.mesh
                coords = mesh.get_coordinate()
                if coords is None:
                    return []
                index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(placements, coords))
                me = int(layout[tuple(coords)])
                return sorted(int(r) for r in layout[index].flatten().tolist() if int(r) != me)
    return []


def without_rank_local(tracked: Tracked, state: dict[str, Any]) -> dict[str, Any]:
    """`capture`'s output less the sharded models' buffers (each rank's own, see
    `Tracked.local_buffers`): what HSDP replica groups share."""
    return {name: {k: v for k, v in value.items() if not isinstance(v, torch.Tensor)}
            if isinstance(tracked.objects[name], torch.nn.Module) and isinstance(value, dict) else value
            for name, value in state.items()}


def with_rank_local(state: dict[str, Any], buffers: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    """Shards from another HSDP replica group with `rank`'s own buffers (its bundle's, named
    as `Tracked.local_buffers` names them) in place of that group's: FSDP2 shards parameters
    only and never syncs buffers, so BatchNorm statistics differ between replica groups."""
    for name, value in state.items():
        if not isinstance(value, dict):
            continue
        for key, theirs in value.items():
            if isinstance(theirs, torch.Tensor):
                mine = buffers.get(f"{name}.{key}")
                if mine is None:
                    raise UsageError(f"{name}.{key}: rank {rank}'s own state holds no such buffer, which the "
                                     "replica its shards came from has: the ranks build different models")
                value[key] = mine
    return state


def digests(state: dict[str, Any]) -> dict[str, int]:
    """Per-entry digests of captured shards, to check a load reproduced them exactly."""
    return verify.entries(state, "sharded")


def _to_local(obj: Any) -> Any:
    if is_dtensor(obj):
        return {LOCAL: obj._local_tensor.detach()}  # noqa: SLF001 - to_local() without the autograd call
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _shard_like(local: torch.Tensor, here: Any) -> DTensor | None:
    """An arrived local shard as a DTensor laid out as `here` (this rank's own), or None where
    `here` is no DTensor or holds a shard of another shape or dtype."""
    if not is_dtensor(here):
        return None
    mine = here._local_tensor  # noqa: SLF001 - to_local() without the autograd call
    if local.shape != mine.shape or local.dtype != mine.dtype:
        return None
    return type(here).from_local(local.to(mine.device), here.device_mesh, here.placements,
                              run_check=False, shape=here.shape, stride=here.stride())


def _rebuild(incoming: Any, here: Any, path: str) -> Any:
    """`incoming` with each `$dtensor` local tensor made a DTensor laid out as `here`'s."""
    if isinstance(incoming, dict) and set(incoming) == {LOCAL}:
        local = incoming[LOCAL]
        if not is_dtensor(here):
            raise UsageError(f"{path}: a shard arrived where this rank holds no DTensor")
        shard = _shard_like(local, here)
        if shard is None:
            mine = here.to_local()
            raise UsageError(f"{path}: the shard that arrived is {tuple(local.shape)} {local.dtype}, this rank's "
                             f"is {tuple(mine.shape)} {mine.dtype}: the ranks build different models or meshes")
        return shard
    if isinstance(incoming, dict):
        if not isinstance(here, dict):
            raise UsageError(f"{path}: structure differs from this rank's state")
        return {k: _rebuild(v, here.get(k), f"{path}.{k}") for k, v in incoming.items()}
    if isinstance(incoming, (list, tuple)) and isinstance(here, (list, tuple)) and len(here) == len(incoming):
        return type(incoming)(_rebuild(v, h, f"{path}[{i}]") for i, (v, h) in enumerate(zip(incoming, here)))
    return incoming
