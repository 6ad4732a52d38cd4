"""What of a script's `DistributedDataParallel` this mode cannot move, in one place: the
intercepted constructor and `register_comm_hook` refuse it as the script runs (intercept),
and `baton explain` reports it from the DDPs the script built (analysis)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

SUB_GROUP = ("DistributedDataParallel(process_group=...) over a sub-group is not supported with no code change "
             "yet: use the default (world) group")
DEVICE_MESH = "DistributedDataParallel(device_mesh=...) is not supported with no code change yet"
BUILTIN_HOOK = ("a built-in comm hook runs in C++ on DDP's own group, not baton's live group, so it is not "
                "supported with no code change; register the Python hook instead (register_comm_hook(None, "
                "default_hooks.fp16_compress_hook) for FP16_COMPRESS)")


def hook_refusal(state: Any, hook: Any) -> str | None:
    """Why a comm hook cannot run inside baton's, or None: only a hook without state of its
    own (compression hooks, allreduce_hook); PowerSGD's error feedback and factors, or a
    process group other than the world, would not move with the rank."""
    if state is None or state is dist.group.WORLD:
        return None
    return (f"register_comm_hook({type(state).__name__}, {getattr(hook, '__name__', hook)}): a comm hook with state "
            "of its own (PowerSGD's error feedback and low-rank factors, or a process group other than the world) "
            "is not supported with no code change: that state would not move with the rank. Stateless hooks are "
            "(register_comm_hook(None, default_hooks.fp16_compress_hook))")


def refusals_of(ddp: Any) -> list[tuple[str, str]]:
    """What `baton run` would refuse in a DDP a script built under plain torch (`baton explain`):
    (the call that did it: "__init__", "register_comm_hook" or "_register_builtin_comm_hook", why)."""
    out = []
    group = getattr(ddp, "process_group", None)
    if group is not None and group is not dist.group.WORLD:
        out.append(("__init__", SUB_GROUP))
    for hook, state in getattr(ddp, "_comm_hooks", []):
        why = hook_refusal(state, hook)
        if why is not None:
            out.append(("register_comm_hook", why))
    logger = getattr(ddp, "logger", None)
    name = logger._get_ddp_logging_data().strs_map.get("comm_hook", "") if logger is not None else ""
    if name.startswith("BuiltinCommHookType"):
        out.append(("_register_builtin_comm_hook", f"{name}: {BUILTIN_HOOK}"))
    return out


CALLS = ("__init__", "register_comm_hook", "_register_builtin_comm_hook")


def remember_calls() -> None:
    """Note on each DDP where the script made the calls `refusals_of` names (file:line), for
    `baton explain` to point at them."""
    import sys

    from torch.nn.parallel import DistributedDataParallel

    for name in CALLS:
        def wrapped(self: Any, *args: Any, _original: Any = getattr(DistributedDataParallel, name), _name: str = name,
                    **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            out = _original(self, *args, **kwargs)
            self.__dict__.setdefault("_baton_calls", {})[_name] = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            return out
        setattr(DistributedDataParallel, name, wrapped)
