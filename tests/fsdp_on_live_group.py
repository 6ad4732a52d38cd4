"""Test helper, one rank of a small FSDP2 job: `python fsdp_on_live_group.py MODE RANK WORLD PORT OUT`.

MODE `plain`: torch.distributed's own gloo process group (what torchrun gives a script).
MODE `live`: baton's LiveGroup as the default group, with a new generation formed halfway
and the first generation's sockets shut, so the second half can only run on the new one.
Both train the same per-block `fully_shard` model with AdamW and clip_grad_norm_, and save
this rank's sharded state (the DCP helpers' get_state_dict) to OUT, for a bitwise compare.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from baton.examples import plain_exit

STEPS = 6


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 16))


def main(mode: str, rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if mode == "plain":
        dist.init_process_group("gloo")
        group: dist.ProcessGroup = dist.group.WORLD
        swap = None
    else:
        from baton.store.rendezvous import RendezvousClient
        from baton.worker.group import LiveGroup, install_as_world

        os.environ["TORCH_DIST_INIT_BARRIER"] = "0"
        client = RendezvousClient("127.0.0.1", port, 60.0)
        live = LiveGroup(rank, world)
        install_as_world(live, client.store)
        live.form(client, 0, 30.0)
        group = live

        def swap() -> None:
            old = list(live._transport_fds)
            live.form(client, 1, 30.0)
            for fd in old:  # the first generation is gone: only the new one can carry a collective
                try:
                    sock = socket.socket(fileno=os.dup(fd))
                except OSError:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)  # the same initial weights on every rank, as a script seeds them
    model = nn.Sequential(*[_block() for _ in range(3)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batches and dropout
    for step in range(STEPS):
        if step == STEPS // 2 and swap is not None:
            swap()
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)  # a round trip changes nothing
    state = {f"model.{k}": v.to_local().clone() for k, v in msd.items()}
    for key, s in osd["state"].items():
        state.update({f"opt.{key}.{k}": (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in s.items()})
    state["rng"] = torch.get_rng_state()
    torch.save(state, out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    plain_exit.leave()  # past gloo's exit-time abort, as the examples' torchrun versions end
