"""The checkpoint-restart contender: plain DDP under `torchrun --max-restarts`,
a checkpoint (model + optimizer + step) every K steps, resume from the latest
one after a restart. Same model and data as bench/workload.py.

Workload (one process per rank, under torchrun):

    torchrun --nproc-per-node 3 --max-restarts 3 bench/checkpoint_restart.py \\
        --run-dir /tmp/cr --steps 60 --ckpt-every 10

Driver (a failure-free run and a run with `kill -9` of one rank at fixed steps,
interleaved; compares the final parameters bit for bit):

    python bench/checkpoint_restart.py drive --nproc 3 --steps 60 --ckpt-every 10 \\
        --kill-at 35 --kill-rank 1 --runs 1 [--out bench/results/checkpoint-restart.json]

What the workload leaves in --run-dir:
  progress.jsonl   rank 0, one line per event: {"ev": "start"|"resume"|"step"|"save"|"done", ...}
                   with wall-clock "t" (time.time()) and the restart count "attempt"
  pid.rank<R>      the current pid of rank R (rewritten at every restart)
  ckpt/            step-<N>.pt checkpoints, written atomically by rank 0
  final.pt         rank 0's final parameters
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
from pathlib import Path

T_PROCESS_START = time.time()

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import free_port  # noqa: E402 - bench/ is on the path just above


# ----------------------------------------------------------------------------- workload
def _batches(data, world: int, rank: int, batch: int, start_step: int):
    """The same batches as bench/workload.py's DataLoader + DistributedSampler cycled over
    epochs, computed from the step index so a restart resumes at the right position."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    per_epoch = len(sampler) // batch  # drop_last
    step = start_step
    while True:
        epoch, i = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        idx = list(sampler)[i * batch:(i + 1) * batch]
        yield step, data[idx]
        step += 1


def _latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def workload(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ckpt-every", type=int, default=10, help="K: save after every K-th step")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fixed-buckets", action="store_true",
                   help="DDP(find_unused_parameters=True): never rebuild buckets, so the first step after a "
                        "restart reduces with the same layout as before it (bit-for-bit resume)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from workload import build_model

    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    ckpt_dir = run_dir / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives restarts and the gloo mesh keys are not per attempt: without
        # a prefix, restarted ranks dial the dead ranks' addresses (connectFullMesh refused).
        from datetime import timedelta

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"cr/attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (run_dir / f"pid.rank{rank}").write_text(str(os.getpid()))
    log = open(run_dir / "progress.jsonl", "a", buffering=1) if rank == 0 else None

    def emit(ev: str, **kw) -> None:
        if log is not None:
            log.write(json.dumps({"ev": ev, "t": time.time(), "attempt": attempt, **kw}) + "\n")

    emit("start", process_start=T_PROCESS_START)

    torch.manual_seed(0)
    model = build_model(args.params_m)
    g = torch.Generator().manual_seed(1)
    n = args.batch * world * 64
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
    # Plain DDP reduces its first step with one bucket, then rebuilds buckets in gradient-ready
    # order: a restarted job's first step sums in a different order than the uninterrupted run.
    model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=args.fixed_buckets)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    start = 0
    latest = _latest_checkpoint(ckpt_dir)
    if latest is not None:
        t0 = time.perf_counter()
        state = torch.load(latest, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        emit("resume", step=start, load_s=time.perf_counter() - t0)

    for step, (x, y) in _batches(data, world, rank, args.batch, start):
        if step >= args.steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        emit("step", step=done)
        if rank == 0 and done % args.ckpt_every == 0 and done < args.steps:
            t0 = time.perf_counter()
            tmp = ckpt_dir / f".step-{done}.pt.tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, ckpt_dir / f"step-{done}.pt")
            emit("save", step=done, save_s=time.perf_counter() - t0)

    if rank == 0:
        torch.save(model.module.state_dict(), run_dir / "final.pt")
        emit("done", step=args.steps)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by kill -9
            pass
    return out


def run_once(run_dir: Path, *, nproc: int, steps: int, ckpt_every: int, params_m: float,
             kill_at: list[int], kill_rank: int, max_restarts: int, step_sleep: float = 0.0,
             fixed_buckets: bool = False, timeout: float = 600) -> dict:
    """One torchrun job; kill -9 rank `kill_rank` when rank 0 first reports each step in
    `kill_at` (in order). Returns timings and counts, measured from progress.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    progress = run_dir / "progress.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           # c10d rendezvous: a fresh round per restart (static rendezvous reuses the store, and the
           # restarted ranks then dial the dead ranks' gloo addresses)
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(Path(__file__).resolve()), "--run-dir", str(run_dir), "--steps", str(steps),
           "--ckpt-every", str(ckpt_every), "--params-m", str(params_m), "--step-sleep", str(step_sleep),
           *(["--fixed-buckets"] if fixed_buckets else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=open(run_dir / "torchrun.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[dict] = []
    pending = list(kill_at)
    offset = 0  # bytes of progress.jsonl already scanned
    try:
        while proc.poll() is None:
            if time.time() - t0 > timeout:
                raise TimeoutError(f"checkpoint-restart run timed out: {run_dir}")
            if pending and progress.exists():
                with open(progress) as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[:chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                for line in complete.splitlines():
                    ev = json.loads(line)
                    if pending and ev["ev"] == "step" and ev["step"] >= pending[0] \
                            and ev["attempt"] == len(kills):
                        pid = int((run_dir / f"pid.rank{kill_rank}").read_text())
                        t_kill = time.time()
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t": t_kill, "step": ev["step"], "target_step": pending.pop(0),
                                      "pid": pid})
                        break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    t_end = time.time()
    events = _read_events(progress)
    ok = proc.returncode == 0 and any(e["ev"] == "done" for e in events)
    executed = sum(1 for e in events if e["ev"] == "step")
    saves = [e["save_s"] for e in events if e["ev"] == "save"]
    step_times = [b["t"] - a["t"] for a, b in zip(events, events[1:])
                  if a["ev"] == "step" and b["ev"] == "step" and a["attempt"] == b["attempt"]]
    per_failure = []
    for i, k in enumerate(kills):
        nxt = [e for e in events if e["attempt"] == i + 1]
        first_step = next((e for e in nxt if e["ev"] == "step"), None)
        resume = next((e for e in nxt if e["ev"] == "resume"), None)
        start = next((e for e in nxt if e["ev"] == "start"), None)
        per_failure.append({
            "killed_at_step": k["step"],
            "resumed_from_step": resume["step"] if resume else 0,
            "kill_to_new_process_s": start["process_start"] - k["t"] if start else None,
            "kill_to_first_step_s": first_step["t"] - k["t"] if first_step else None,
            "load_s": resume["load_s"] if resume else None,
        })
    return {"ok": ok, "returncode": proc.returncode, "total_s": t_end - t0, "steps": steps,
            "ckpt_every": ckpt_every, "kills": len(kills),
            "restarts": max((e["attempt"] for e in events), default=0),
            "steps_executed": executed, "steps_recomputed": executed - steps if ok else None,
            "median_step_s": statistics.median(step_times) if step_times else None,
            "save_s": statistics.median(saves) if saves else None, "n_saves": len(saves),
            "failures": per_failure, "final": str(run_dir / "final.pt")}


def _same_params(a: str, b: str) -> bool:
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def drive(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="checkpoint_restart.py drive")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--kill-at", default="35", help="comma-separated steps at which to kill -9")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fixed-buckets", action="store_true", help="see the workload's --fixed-buckets")
    p.add_argument("--runs", type=int, default=1, help="interleaved pairs (failure-free, with kills)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    kill_at = [int(s) for s in args.kill_at.split(",") if s]
    tmp = Path(tempfile.mkdtemp(prefix="baton-cr-"))
    common = dict(nproc=args.nproc, steps=args.steps, ckpt_every=args.ckpt_every, params_m=args.params_m,
                  kill_rank=args.kill_rank, max_restarts=args.max_restarts, step_sleep=args.step_sleep,
                  fixed_buckets=args.fixed_buckets)
    pairs = []
    for i in range(args.runs):
        pair = {}
        for kind in (("free", "kill") if i % 2 == 0 else ("kill", "free")):
            pair[kind] = run_once(tmp / f"{kind}-{i}", kill_at=kill_at if kind == "kill" else [], **common)
            r = pair[kind]
            print(f"  run {i + 1}/{args.runs} {kind}: ok={r['ok']} total {r['total_s']:.2f}s, "
                  f"kills {r['kills']}, restarts {r['restarts']}, recomputed {r['steps_recomputed']}, "
                  f"save {r['save_s'] and r['save_s'] * 1e3:.1f} ms, step {r['median_step_s'] and r['median_step_s'] * 1e3:.1f} ms",
                  flush=True)
        free, kill = pair["free"], pair["kill"]
        pair["params_match"] = free["ok"] and kill["ok"] and _same_params(free["final"], kill["final"])
        pair["lost_per_failure_s"] = ((kill["total_s"] - free["total_s"]) / kill["kills"]
                                      if kill["kills"] and free["ok"] and kill["ok"] else None)
        print(f"    params match failure-free run: {pair['params_match']}; time lost per failure "
              f"{pair['lost_per_failure_s']}", flush=True)
        pairs.append(pair)
    good = [q for q in pairs if q["lost_per_failure_s"] is not None]
    result = {
        "contender": "checkpoint-restart (torchrun --max-restarts + torch.save every K steps)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": {**common, "kill_at": kill_at},
        "summary": {
            "total_free_s": _median_range([q["free"]["total_s"] for q in good]) if good else None,
            "total_kill_s": _median_range([q["kill"]["total_s"] for q in good]) if good else None,
            "lost_per_failure_s": _median_range([q["lost_per_failure_s"] for q in good]) if good else None,
            "steps_recomputed": _median_range([q["kill"]["steps_recomputed"] for q in good]) if good else None,
            "save_s": _median_range([q["free"]["save_s"] for q in good if q["free"]["save_s"]]) if good else None,
            "params_match_all": all(q["params_match"] for q in pairs),
        },
        "runs": pairs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"results: {args.out}")
    else:
        print(json.dumps(result["summary"], indent=2))
    return 0 if good and result["summary"]["params_match_all"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        sys.exit(drive(sys.argv[2:]))
    workload(sys.argv[1:])
