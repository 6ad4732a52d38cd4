"""A count of parameters, buffers and submodules registered anywhere in this process.

Walking a large model to find its parameters or buffers costs ~0.4 ms, too much for every
step boundary; caching the walk misses what a script registers later (a rotary table made
on the first forward, a module added on the fly). torch's global registration hooks fire
on each such change, so a cache stamped with this count is walked again exactly when one
happened.
"""

from __future__ import annotations

from typing import Any

_count = 0
_hooked = False


def _seen(*_: Any) -> None:
    global _count
    _count += 1


def count() -> int:
    """Registrations so far (counted from the first call on: call it before caching a walk)."""
    global _hooked
    if not _hooked:
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_seen)
        module.register_module_buffer_registration_hook(_seen)
        module.register_module_module_registration_hook(_seen)
        _hooked = True
    return _count


def removed() -> None:
    """Something was unregistered (torch has no hook for that): cached walks are redone."""
    global _count
    count()
    _count += 1
