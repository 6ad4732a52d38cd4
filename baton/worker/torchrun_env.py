"""The environment torchrun gives each rank, so a torchrun script finds what it reads."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, master_addr: str, master_port: int, run_id: str,
                 local_world_size: int | None = None, node_rank: int = 0, nodes: int = 1,
                 restart: int = 0) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR,
    MASTER_PORT and TORCHELASTIC_* as torchrun sets them for `rank`."""
    local = local_world_size or world_size
    return dict(RANK=str(rank), LOCAL_RANK=str(rank % local), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(node_rank), GROUP_WORLD_SIZE=str(nodes),
                ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world_size), ROLE_NAME="default",
                MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), TORCHELASTIC_RUN_ID=run_id,
                TORCHELASTIC_RESTART_COUNT=str(restart), TORCHELASTIC_MAX_RESTARTS="0")
