"""The TorchFT contender: the same model, data and loop as bench/workload.py under
TorchFT's DDP wrapper, one replica group of one rank per process, its lighthouse
running. Runs in the peers venv (bash bench/peers/setup.sh).

Workload (one replica group; torchrun hosts that group's TCPStore):

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=3 \\
        torchrun --nproc-per-node 1 --master-port P bench/torchft_workload.py --steps 60 --out r0.json

Driver (starts the lighthouse and N replica groups; steady-state step time, and the
same workload as plain DDP under torchrun with the same interpreter, interleaved):

    bench/.peers-venv/bin/python bench/torchft_workload.py drive --nproc 3 --steps 60 --runs 3 \\
        [--out bench/results/torchft-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import cycle, free_port  # noqa: E402 - bench/ is on the path just above




def workload(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from workload import build_model

    torch.set_num_threads(1)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])

    torch.manual_seed(0)
    model = build_model(args.params_m)
    g = torch.Generator().manual_seed(1)
    n = args.batch * groups * 64
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
    # The same shards as plain DDP with world size = number of replica groups.
    loader = DataLoader(data, batch_size=args.batch, drop_last=True,
                        sampler=DistributedSampler(data, num_replicas=groups, rank=replica, shuffle=True, seed=3))

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_{replica}", timeout=timedelta(seconds=30),
                      init_sync=False)  # every replica starts from the same seed
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-4))

    times = []
    last = time.perf_counter()
    for i, (x, y) in zip(range(args.steps), cycle(loader)):
        opt.zero_grad()  # starts the quorum
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()  # should_commit barrier; steps only if every replica's allreduce succeeded
        now = time.perf_counter()
        if i >= args.warmup:
            times.append(now - last)
        last = now
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mode": "torchft", "replica": replica, "params": sum(q.numel() for q in model.parameters()),
                       "step_times": times, "world": groups, "manager_step": manager.current_step()}, f)
    manager.shutdown(wait=False)


# ----------------------------------------------------------------------------- driver


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_torchft(nproc: int, params_m: float, steps: int, tmp: Path, timeout: float = 600) -> dict:
    lh_port = free_port()
    lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
    lh = subprocess.Popen([str(lighthouse), "--min_replicas", str(nproc), "--quorum_tick_ms", "100",
                           "--join_timeout_ms", "10000", "--bind", f"[::]:{lh_port}"],
                          stdout=open(tmp / "lighthouse.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
    procs, outs = [], []
    try:
        for r in range(nproc):
            out = tmp / f"torchft-{time.time_ns()}-r{r}.json"
            outs.append(out)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "REPLICA_GROUP_ID": str(r),
                   "NUM_REPLICA_GROUPS": str(nproc), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                   str(free_port()), str(Path(__file__).resolve()), "--params-m", str(params_m),
                   "--steps", str(steps), "--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp / f"replica{r}.log", "a"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        t_end = time.time() + timeout
        for p in procs:
            rc = p.wait(timeout=max(1, t_end - time.time()))
            if rc != 0:
                raise RuntimeError(f"torchft replica exited {rc}; see {tmp}/replica*.log")
    finally:
        for p in [*procs, lh]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return json.loads(outs[0].read_text())


def run_ddp(nproc: int, params_m: float, steps: int, tmp: Path) -> dict:
    out = tmp / f"ddp-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(HERE / "workload.py"), "--mode", "ddp", "--params-m", str(params_m),
           "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)
    return json.loads(out.read_text())


def drive(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="torchft_workload.py drive")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    from importlib.metadata import version

    tmp = Path(tempfile.mkdtemp(prefix="baton-torchft-"))
    med: dict[str, list[float]] = {"ddp": [], "torchft": []}
    ratios = []
    params = None
    for i in range(args.runs):
        pair = {}
        for mode in (("ddp", "torchft") if i % 2 == 0 else ("torchft", "ddp")):
            r = (run_ddp if mode == "ddp" else run_torchft)(args.nproc, args.params_m, args.steps, tmp)
            params = r["params"]
            pair[mode] = statistics.median(r["step_times"])
            med[mode].append(pair[mode])
        ratios.append(pair["torchft"] / pair["ddp"])
        print(f"  run {i + 1}/{args.runs}: ddp {pair['ddp'] * 1e3:.2f} ms, torchft {pair['torchft'] * 1e3:.2f} ms, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    result = {"contender": "torchft (DDP wrapper, replica groups of one rank, lighthouse)",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "versions": {"torch": torch.__version__, "torchft-nightly": version("torchft-nightly")},
              "params": params, "nproc": args.nproc, "steps": args.steps,
              "ddp_step_s": _median_range(med["ddp"]), "torchft_step_s": _median_range(med["torchft"]),
              "ratio": _median_range(ratios)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"results: {args.out}")
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        sys.exit(drive(sys.argv[2:]))
    workload(sys.argv[1:])
