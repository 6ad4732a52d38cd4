"""What a torchrun script calls, answered by baton's runtime.

The script calls `init_process_group`, wraps its model in `DistributedDataParallel`,
destroys its process group at the end and may leave with `os._exit`; it never names baton.
By the time it runs, this process already holds a rank in baton's live group (installed as
torch.distributed's default group), so:

- `init_process_group(...)` returns at once: the group is there (same rank, same world);
- `DistributedDataParallel(model, ...)` builds baton's live DDP (the same numbers as
  torchrun's, rank 0's parameters broadcast at construction as DDP does) and tracks the model;
- `init_device_mesh(...)` gives a mesh over the live group (its sub-groups live too), and
  `fully_shard(module)` notes the module: the roots among those are the sharded models;
  FSDP1's `FullyShardedDataParallel(...)` is refused, saying why and what to use;
- `destroy_process_group()` and `os._exit()` first end the job's training (`finish`: a rank
  lost at the very end is still replaced), then let the script go on or leave;
- `dist.get_backend()` says "gloo" (the live group's transport) where torch would name baton's
  plugin, and `dist.monitored_barrier()`, which torch allows on gloo only, is a barrier of the
  live group (a rank that does not arrive is baton's to find and replace).

`dist.new_group` needs no patch: torch hands it to the default group (LiveGroup.new_group).

Patches are made on torch's public import paths (`torch.distributed`,
`torch.nn.parallel`), which the script reads when it imports them; torch's internals keep
their own names.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from baton.transparent import ddp_rules, on_import
from baton.worker import ddp as ddp_mod
from baton.worker.group import solo_group
from baton.worker.tracked import UsageError


def install(rt: Any, job: Any, on_finish: Callable[[], None]) -> None:
    """Answer the script's torch.distributed calls with `rt` (a ScriptRuntime) and `job`
    (its baton.Job, for meshes)."""
    import torch.distributed.device_mesh as device_mesh

    world = dist.group.WORLD
    original_shard: list[Callable[..., Any]] = []  # FSDP2's own, once the script imports it

    def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                         mesh_dim_names: tuple[str, ...] | None = None, **_: Any) -> Any:
        return job.mesh(mesh_dim_names, tuple(mesh_shape), device_type=device_type)

    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_shard[0](module, *args, **kwargs)
        for m in module if isinstance(module, (list, tuple)) else [module]:
            rt.shard_roots.append(m)
        return out

    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, *args: Any, **kwargs: Any) -> None:
        if world_size not in (-1, rt.world_size) or rank not in (-1, rt.rank):
            raise UsageError(f"init_process_group(world_size={world_size}, rank={rank}) does not match the job "
                             f"baton started (rank {rt.rank} of {rt.world_size}): read RANK and WORLD_SIZE from "
                             "the environment, as under torchrun")

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is world:
            on_finish()

    _real_exit = os._exit
    owner = os.getpid()

    def leave(code: int) -> None:
        # Only the rank's own process: a DataLoader worker forked from it ends with os._exit too.
        if code == 0 and os.getpid() == owner:
            on_finish()
        _real_exit(code)

    real_get_backend = dist.get_backend

    def get_backend(group: Any = None) -> Any:
        name = real_get_backend(group)
        return dist.Backend.GLOO if name == "baton" else name

    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        dist.barrier(group=group)

    device_mesh.init_device_mesh = init_device_mesh  # type: ignore[assignment]
    dist.init_device_mesh = init_device_mesh  # type: ignore[attr-defined]
    def patch_fsdp(module: Any) -> None:
        if not original_shard:
            original_shard.append(module.fully_shard)
        module.fully_shard = fully_shard
        fsdp1 = getattr(module, "FullyShardedDataParallel", None)
        if fsdp1 is not None:  # on the class: every path the script imports it by
            fsdp1.__init__ = _refuse_fsdp1

    # FSDP2's public paths, patched as the script imports them (on_import: a DDP script never pays for them)
    on_import.after_import("torch.distributed.fsdp", patch_fsdp)
    on_import.after_import("torch.distributed._composable.fsdp", patch_fsdp)
    dist.init_process_group = init_process_group  # type: ignore[assignment]
    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    dist.get_backend = get_backend  # type: ignore[assignment]
    dist.monitored_barrier = monitored_barrier  # type: ignore[assignment]
    os._exit = leave  # type: ignore[assignment]
    ScriptDDP._baton_rt_for_script = rt
    torch.nn.parallel.DistributedDataParallel = ScriptDDP  # type: ignore[misc]


FSDP1 = ("FullyShardedDataParallel (FSDP1) is not supported with no code change: its flat shards are each rank's "
         "own and baton keeps no copy of them, so a lost rank could not be rebuilt. Shard with FSDP2 instead "
         "(`from torch.distributed.fsdp import fully_shard`: each block, then the root), which baton moves and "
         "rebuilds bit for bit, or run it as it is with `baton run --no-migration` (a failure then ends the job "
         "promptly, and you restart from your own checkpoint)")


def _refuse_fsdp1(self: Any, *args: Any, **kwargs: Any) -> None:
    raise UsageError(FSDP1)


_DDP_PARAMS = inspect.signature(DistributedDataParallel.__init__)


class ScriptDDP(ddp_mod.LiveDDP):
    """`DistributedDataParallel(model, ...)` as a torchrun script writes it, over the live group."""

    _baton_rt_for_script: Any = None

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any):
        rt = ScriptDDP._baton_rt_for_script
        bound = _DDP_PARAMS.bind(self, module, *args, **kwargs).arguments
        bound.pop("self")
        bound.pop("module")
        group = bound.pop("process_group", None)
        if group is not None and group is not dist.group.WORLD:
            raise UsageError(ddp_rules.SUB_GROUP)
        if bound.pop("device_mesh", None) is not None:
            raise UsageError(ddp_rules.DEVICE_MESH)
        bound.pop("init_sync", None)
        if not rt.joiner:
            ddp_mod.broadcast_from_rank0(rt, module)  # what DDP's constructor does: rank 0's values everywhere
        super().__init__(module, process_group=solo_group(), init_sync=False, **bound)
        self._baton_rt = rt
        self._baton_hook = ddp_mod.ScriptHook(rt)
        DistributedDataParallel.register_comm_hook(self, self._baton_hook, ddp_mod.script_or_allreduce_hook)
        rt.tracked.add_wrapped(self, module)

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """The script's own hook runs inside baton's. Only a hook without state of its own
        (compression: fp16/bf16_compress_hook, allreduce_hook): PowerSGD's error feedback, or
        a sub-group, would not move with the rank."""
        if self._baton_hook.hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        why = ddp_rules.hook_refusal(state, hook)
        if why is not None:
            raise UsageError(f"DistributedDataParallel.{why}")
        self._check_comm_hook(hook)
        self._baton_hook.hook, self._baton_hook.state = hook, state

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        raise UsageError(f"DistributedDataParallel._register_builtin_comm_hook({comm_hook_type}): "
                         f"{ddp_rules.BUILTIN_HOOK}")
