"""What a one-GPU machine can tell about NCCL and the GPU paths baton relies on (issue 32 item 5).

    python bench/nccl_probe.py --out DIR      # on a machine with CUDA; prints one JSON object

Each check runs in its own process, bounded in time, and reports what it saw:

  versions        torch, CUDA, NCCL, and whether the loaded libnccl knows
                  NCCL_IB_RESILIENCY_PORT_FAILOVER (NCCL's own port failover, 2.29.7+).
  env_reread      whether NCCL reads NCCL_SOCKET_IFNAME again for a process's second
                  communicator: one rank forms a group with it set to one interface, destroys
                  the group, sets it to another and forms a new one; NCCL_DEBUG=INFO lines
                  name the interface each used. This is what "the next generation formed
                  without the failed interface" needs from a surviving process.
  two_ranks       two NCCL ranks on the one GPU (what NCCL says about it).
  gloo_cuda       two processes all-reduce a CUDA tensor over gloo (baton's live group).
  nvml            baton's GpuReader on slot n0/0: temperature and ECC counts.
  rng_cuda        baton's random-stream capture carries the CUDA generator: a dropout mask
                  drawn after restoring a captured state equals the one drawn after capture,
                  also once the state has crossed baton's codec (JSON skeleton + tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int | None, str]:
    try:
        p = subprocess.run([sys.executable, __file__, *args], env={**os.environ, **env}, timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out + f"\n[timed out after {timeout}s]"


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None, "nccl": None,
           "libnccl": None, "knows_port_failover": None}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    # the libnccl the process maps once NCCL is loaded: search it for the failover knob's name
    if torch.cuda.is_available():
        torch.cuda.nccl.version()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libnccl" in line:
            path = line.split()[-1]
            out["libnccl"] = path
            out["knows_port_failover"] = b"NCCL_IB_RESILIENCY_PORT_FAILOVER" in Path(path).read_bytes()
            break
    return out


def _interfaces() -> list[str]:
    return sorted(p.name for p in Path("/sys/class/net").iterdir())


def _child_env_reread(first: str, second: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    for i, ifname in enumerate((first, second)):
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
        print(f"PROBE generation {i}: NCCL_SOCKET_IFNAME={ifname}", flush=True)
        store = dist.TCPStore("127.0.0.1", port + i, 1, True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        print(f"PROBE generation {i}: all_reduce ok", flush=True)


def env_reread() -> dict:
    ifaces = _interfaces()
    others = [i for i in ifaces if i != "lo"]
    first, second = "lo", (others[0] if others else "lo")
    rc, log = _run(["--child", "env_reread", first, second, str(_free_port())],
                   {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,BOOTSTRAP"})
    chosen: list[list[str]] = []
    for line in log.splitlines():
        if line.startswith("PROBE generation") and "NCCL_SOCKET_IFNAME" in line:
            chosen.append([])
        elif chosen and re.search(r"(Bootstrap|NET/Socket|NET/IB)\s*:?.*Using", line):
            chosen[-1].append(line.split("NCCL INFO", 1)[-1].strip())
    return {"interfaces": ifaces, "asked": [first, second], "rc": rc, "using_lines_per_generation": chosen,
            "rereads": (len(chosen) == 2 and bool(chosen[1]) and chosen[0] != chosen[1]),
            "log_tail": log[-3000:]}


def _child_rank(backend: str, rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    kw = {"device_id": torch.device("cuda:0")} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, **kw)
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"PROBE rank {rank}: {backend} all_reduce of a CUDA tensor gave {t[0].item()} (expected 3.0)", flush=True)
    dist.destroy_process_group()


def two_ranks(backend: str) -> dict:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "rank", backend, str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "NCCL_DEBUG": "WARN"}) for r in range(2)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=120)
            out.append({"rc": p.returncode, "tail": stdout[-1500:]})
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
            out.append({"rc": None, "tail": (stdout or "")[-1500:] + "\n[timed out after 120s]"})
    return {"ranks": out, "ok": all(r["rc"] == 0 and "gave 3.0" in r["tail"] for r in out)}


def nvml() -> dict:
    sys.path.insert(0, str(REPO))
    from baton.health.gpu import GpuReader

    reader = GpuReader("n0/0")
    reading = reader.read()
    return {"reason": reader.reason, "reading": reading.model_dump() if reading else None}


def rng_cuda() -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from baton.transfer import codec
    from baton.worker import rng

    torch.cuda.init()
    torch.randn(3, device="cuda")  # the CUDA generator in use
    state = rng.capture()
    meta, tensors = codec.encode(state)
    first = torch.nn.functional.dropout(torch.ones(1 << 16, device="cuda"), 0.5)
    torch.randn(100, device="cuda")  # move every stream on
    rng.restore(codec.decode(meta, tensors))
    again = torch.nn.functional.dropout(torch.ones(1 << 16, device="cuda"), 0.5)
    return {"streams": sorted(state), "cuda_in_state": "cuda" in state, "same_mask": bool(torch.equal(first, again))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "env_reread":
            _child_env_reread(rest[0], rest[1], int(rest[2]))
        else:
            _child_rank(rest[0], int(rest[1]), int(rest[2]))
        return 0
    import torch

    result: dict = {"versions": versions()}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device on this machine"
    else:
        for name, fn in (("env_reread", env_reread), ("two_ranks_nccl", lambda: two_ranks("nccl")),
                         ("gloo_cuda", lambda: two_ranks("gloo")), ("nvml", nvml),
                         ("rng_cuda", rng_cuda)):
            try:
                result[name] = fn()
            except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"probe {name}: done", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nccl_probe.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
