"""torchrun's variables for a model-aware script that reads them before `baton.init()`.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and the rest before the script starts. Under
`baton run` a worker learns its rank when it registers (a spare: when it is given one),
which `baton.init()` does. So in a worker of a model-aware script, `import baton` makes the
first read of one of those variables do what `baton.init()` does (a spare waits there
until it holds a rank) before answering it, and the script's own `baton.init()` returns
that job. A script that reads them before it imports baton finds them unset, as under
plain `python`: import baton first.

Light on purpose: `import baton` loads this; torch loads only when a variable is read.
"""

from __future__ import annotations

import os
from typing import Any

TORCHRUN_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
})
_JOINING = [False]  # set while the read joins the job (and after): later reads are plain ones


class _JoiningEnviron(type(os.environ)):  # type: ignore[misc]
    """os.environ, whose first read of an unset torchrun variable joins the job first."""

    def __getitem__(self, key: str) -> str:
        try:
            return super().__getitem__(key)
        except KeyError:
            if key not in TORCHRUN_KEYS or _JOINING[0]:
                raise
        _JOINING[0] = True
        from baton.worker import job

        job.init()
        return super().__getitem__(key)


def install() -> None:
    """In a worker of a model-aware script (`baton run` says which), before the script reads."""
    env: Any = os.environ
    if isinstance(env, _JoiningEnviron) or "RANK" in env:
        return
    os.environ = _JoiningEnviron(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
