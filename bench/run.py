"""Benchmarks for the live-migration core, measured side by side in one run.

    make bench                 # quick preset
    python bench/run.py --runs 7 --sizes 2,10

1. Steady-state overhead: plain DDP under torchrun vs baton (job.wrap + job.steps),
   same model, data and world size, runs interleaved A B A B ...; median step time.
2. Migration downtime for ~100 MB of state (model + AdamW moments): planned
   (all ranks paused -> all stepping again) and unplanned (kill -9 -> all stepping
   again, warm spare), next to the raw loopback copy of the same bytes between two
   processes measured in the same run (TCP into a fresh buffer and into a warm one).

Results go to bench/results/core-<timestamp>.json and a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

from common import free_port  # bench/ is on the path: run as `python bench/run.py`

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workload.py"
PY = sys.executable


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# ----------------------------------------------------------------------------- overhead
def _run_workload(mode: str, params_m: float, nproc: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"{mode}-{time.time_ns()}.json"
    args = ["--mode", mode, "--params-m", str(params_m), "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if mode == "ddp":
        cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), str(WORKLOAD), *args]
    else:
        cmd = [PY, "-m", "baton.cli", "run", "--nproc", str(nproc), "--spares", "0", "--quiet",
               "--run-dir", str(tmp / f"run-{time.time_ns()}"), str(WORKLOAD), *args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    return json.loads(out.read_text())


def bench_overhead(sizes: list[float], runs: int, nproc: int, steps: int, tmp: Path) -> list[dict]:
    results = []
    for size in sizes:
        medians: dict[str, list[float]] = {"ddp": [], "baton": []}
        ratios = []
        params = None
        for i in range(runs):
            pair = {}
            for mode in (("ddp", "baton") if i % 2 == 0 else ("baton", "ddp")):
                r = _run_workload(mode, size, nproc, steps, tmp)
                params = r["params"]
                pair[mode] = statistics.median(r["step_times"])
                medians[mode].append(pair[mode])
            ratios.append(pair["baton"] / pair["ddp"])
            print(f"  overhead {size}M params run {i + 1}/{runs}: ddp {pair['ddp'] * 1e3:.2f} ms, "
                  f"baton {pair['baton'] * 1e3:.2f} ms, ratio {ratios[-1]:.4f}", flush=True)
        results.append({"params": params, "nproc": nproc, "steps": steps,
                        "ddp_step_s": _median_range(medians["ddp"]),
                        "baton_step_s": _median_range(medians["baton"]),
                        "ratio": _median_range(ratios)})
    return results


# ----------------------------------------------------------------------------- raw copy
def _receiver(port_q, nbytes: int, warm: bool, result_q) -> None:
    import numpy as np

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    buf = np.empty(nbytes, dtype=np.uint8)
    if warm:
        buf.fill(1)
    conn, _ = srv.accept()
    view = memoryview(buf)
    t0 = None
    got = 0
    while got < nbytes:
        k = conn.recv_into(view[got:], nbytes - got)
        if t0 is None:
            t0 = time.perf_counter()
        got += k
    conn.sendall(b"k")
    conn.close()
    result_q.put(got)


def raw_tcp_copy(nbytes: int, warm: bool) -> float:
    """Seconds to move nbytes between two processes over loopback TCP (sender's view)."""
    import numpy as np

    ctx = get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port_q, nbytes, warm, result_q))
    p.start()
    port = port_q.get(timeout=60)
    data = np.ones(nbytes, dtype=np.uint8)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    s.sendall(memoryview(data))
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    result_q.get(timeout=60)
    p.join()
    return dt


# ----------------------------------------------------------------------------- migration
def _status(client) -> dict:
    return client.status()["jobs"][0]


def bench_migration(params_m: float, moves: int, tmp: Path) -> dict:
    from baton.control.client import ApiClient
    from baton.rundir import RunDir

    run_dir = tmp / "mig-run"
    cmd = [PY, "-m", "baton.cli", "run", "--nproc", "2", "--spares", "1", "--quiet", "--run-dir", str(run_dir),
           str(WORKLOAD), "--mode", "baton", "--params-m", str(params_m), "--steps", "100000",
           "--step-sleep", "0.02"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "mig.log", "w"), start_new_session=True)
    planned, unplanned, unplanned_from_kill, state_bytes = [], [], [], None
    try:
        deadline = time.time() + 120
        while True:
            try:
                client = ApiClient(*RunDir(run_dir).read())
                break
            except FileNotFoundError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

        def ready() -> dict:
            t = time.time() + 180
            while time.time() < t:
                st = _status(client)
                if st["operation"] is None and any(s["state"] == "spare" for s in st["spares"]) and \
                        st["state"] == "running" and min(r["step"] for r in st["ranks"]) >= 3:
                    return st
                time.sleep(0.2)
            raise RuntimeError("job not ready: see " + str(tmp / "mig.log"))

        def last_event(n: int) -> dict:
            t = time.time() + 180
            while time.time() < t:
                evs = client.events()["events"]
                if len(evs) >= n and evs[n - 1]["status"] == "resolved":
                    return evs[n - 1]
                time.sleep(0.1)
            raise RuntimeError("move did not resolve")

        n = 0
        for i in range(moves):
            ready()
            client.migrate(i % 2)
            n += 1
            ev = last_event(n)
            planned.append(ev["downtime_s"])
            state_bytes = ev["state_bytes"]
            print(f"  planned move {i + 1}/{moves}: downtime {ev['downtime_s']:.3f}s "
                  f"({ev['state_bytes'] / 1e6:.0f} MB, transfer {ev['transfer_s']:.3f}s)", flush=True)
            st = ready()
            pid = next(r["pid"] for r in st["ranks"] if r["rank"] == (i + 1) % 2)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            n += 1
            ev = last_event(n)
            unplanned.append(ev["downtime_s"])
            unplanned_from_kill.append(ev["resumed_at"] - t_kill)
            print(f"  unplanned recovery {i + 1}/{moves}: kill -> stepping {ev['resumed_at'] - t_kill:.3f}s "
                  f"(ledger downtime {ev['downtime_s']:.3f}s)", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"state_bytes": state_bytes, "planned_downtime_s": _median_range(planned),
            "unplanned_kill_to_stepping_s": _median_range(unplanned_from_kill),
            "unplanned_ledger_downtime_s": _median_range(unplanned)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="interleaved runs per contender (median over them)")
    p.add_argument("--sizes", default="2,10", help="model sizes for the overhead, millions of params")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--state-mb", type=float, default=100.0, help="state to migrate (model + AdamW)")
    p.add_argument("--moves", type=int, default=5)
    p.add_argument("--skip-overhead", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    import torch

    result["machine"]["torch"] = torch.__version__
    if not args.skip_overhead:
        print("steady-state overhead (plain DDP under torchrun vs baton), interleaved:", flush=True)
        result["overhead"] = bench_overhead([float(s) for s in args.sizes.split(",")], args.runs, args.nproc,
                                            args.steps, tmp)
    params_m = args.state_mb * 1e6 / 4 / 3 / 1e6  # fp32 params + two AdamW moments
    print(f"migration downtime, ~{args.state_mb:.0f} MB of state, 2 ranks + 1 warm spare:", flush=True)
    mig = bench_migration(params_m, args.moves, tmp)
    nbytes = mig["state_bytes"] or int(args.state_mb * 1e6)
    cold = [raw_tcp_copy(nbytes, warm=False) for _ in range(args.moves)]
    warm = [raw_tcp_copy(nbytes, warm=True) for _ in range(args.moves)]
    mig["raw_tcp_copy_cold_s"] = _median_range(cold)
    mig["raw_tcp_copy_warm_s"] = _median_range(warm)
    mig["planned_over_raw_cold"] = mig["planned_downtime_s"]["median"] / mig["raw_tcp_copy_cold_s"]["median"]
    mig["planned_over_raw_warm"] = mig["planned_downtime_s"]["median"] / mig["raw_tcp_copy_warm_s"]["median"]
    result["migration"] = mig
    out = REPO / "bench" / "results" / f"core-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print("\nsummary")
    for o in result.get("overhead", []):
        print(f"  {o['params'] / 1e6:.1f}M params, {o['nproc']} ranks: plain DDP "
              f"{o['ddp_step_s']['median'] * 1e3:.2f} ms/step, baton {o['baton_step_s']['median'] * 1e3:.2f} ms/step, "
              f"ratio {o['ratio']['median']:.4f} (min {o['ratio']['min']:.4f}, max {o['ratio']['max']:.4f})")
    print(f"  state {nbytes / 1e6:.1f} MB: planned downtime {mig['planned_downtime_s']['median']:.3f}s "
          f"(min {mig['planned_downtime_s']['min']:.3f}, max {mig['planned_downtime_s']['max']:.3f}); "
          f"raw TCP copy {mig['raw_tcp_copy_cold_s']['median']:.3f}s cold / "
          f"{mig['raw_tcp_copy_warm_s']['median']:.3f}s warm -> ratio {mig['planned_over_raw_cold']:.1f}x cold, "
          f"{mig['planned_over_raw_warm']:.1f}x warm")
    print(f"  unplanned kill -9 -> all stepping: {mig['unplanned_kill_to_stepping_s']['median']:.3f}s "
          f"(min {mig['unplanned_kill_to_stepping_s']['min']:.3f}, max {mig['unplanned_kill_to_stepping_s']['max']:.3f})")
    print(f"results: {out}")
    return 0




if __name__ == "__main__":
    sys.exit(main())
