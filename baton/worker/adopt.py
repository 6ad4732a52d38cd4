"""A joiner's parameters take the memory their arrived values were received into.

Loading a fetched state dict copies each arrived parameter into the module's own: at 1 GB of
DDP state with Adam (a third of it parameters) that copy is ~0.15 s of a move's pause, for
memory the joiner then drops. An optimizer's load already keeps the tensors it is given;
here each parameter is pointed at its arrived tensor instead (`param.data = arrived`: the
same Parameter object, so the optimizer, DDP's reducer and any hook still hold it), and the
module's own load_state_dict, run after as before, finds each already in place (copy_
returns at once for the same memory) and still runs its hooks and checks.

Only where nothing can tell the difference: a plain dense Parameter and a plain tensor of the
same dtype, device, shape and strides, each owning its memory alone (a parameter viewed
into a flat buffer stays there; an arrived tensor viewed into a larger block would make a
`torch.save` of the parameter write the whole block), nothing requiring grad, and each
arrived tensor taken once (tied weights are one Parameter under two keys). The caller must
not use the arrived tensors again: they are the parameters now.
"""

from __future__ import annotations

from typing import Any

import torch


def _owns_its_memory(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def adopt_parameters(module: torch.nn.Module, arrived: dict[str, Any]) -> int:
    """Point `module`'s parameters at their arrived values where they are alike (above).
    Returns the bytes adopted."""
    adopted, taken = 0, set()
    with torch.no_grad():
        for key, p in module.state_dict(keep_vars=True).items():
            t = arrived.get(key)
            if type(p) is not torch.nn.Parameter or type(t) is not torch.Tensor or id(p) in taken:
                continue
            if (t.dtype, t.device, t.shape, t.stride()) != (p.dtype, p.device, p.shape, p.stride()) or \
                    t.requires_grad or not t.numel() or not t.is_contiguous() or \
                    not _owns_its_memory(t) or not _owns_its_memory(p) or t.data_ptr() in taken:
                continue
            p.data = t
            taken.update((id(p), t.data_ptr()))
            adopted += t.numel() * t.element_size()
    return adopted
