"""Does the stable torchft 0.2.0 survive losing a replica group? Checked against the pinned
nightly, same workload, same kill, no restarts (so a crashed survivor fails the job).

    .venv/bin/python bench/peers/torchft_stable_check.py --runs 5

Installs torch 2.13.0 + torchft==0.2.0 into bench/.torchft-stable-venv (gitignored), runs
3 replica groups and `kill -9` replica 1 at step 20, and records per run whether the two
survivors finished the job and whether they died on TorchFT's comm-hook assertion. Writes
bench/results/torchft-stable-check-<timestamp>.json, which bench/report.py includes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PEERS = Path(__file__).resolve().parent
BENCH = PEERS.parent
sys.path.insert(0, str(BENCH))

from contenders import Contender, Workload, run_job  # noqa: E402

STABLE_VENV = BENCH / ".torchft-stable-venv"


def install_stable() -> str:
    py = STABLE_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(STABLE_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    for req in ("torch==2.13.0", "numpy", "torchft==0.2.0"):  # torch first: the local CPU wheel
        subprocess.run([*pip, req], check=True)
    return str(py)


def one(label: str, python: str, run_dir: Path, kill_step: int) -> dict:
    w = Workload(params_m=2, steps=60, nproc=3, step_sleep=0.05)
    try:
        r = run_job(Contender("torchft", python, restarts=0), w, run_dir, kill_at=(kill_step,), kill_rank=1,
                    timeout=300)
        finished, detail = True, f"{r['steps_executed']} steps executed, stall {r['failures'][0]['stall_s']:.1f} s"
    except (RuntimeError, TimeoutError) as e:
        finished, detail = False, str(e).split(":")[0]
    logs = "".join((run_dir / f"replica{i}.log").read_text(errors="replace") for i in (0, 2))
    return {"version": label, "survivors_finished": finished, "detail": detail,
            "gloo_error_seen": "Connection reset by peer" in logs,
            "comm_hook_assertion": "assert fut._fut" in logs and "AssertionError" in logs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=20)
    args = p.parse_args()
    subprocess.run(["bash", str(PEERS / "setup.sh")], check=True)
    versions = {"torchft 0.2.0": install_stable(), "torchft-nightly 2026.10.26": str(BENCH / ".peers-venv/bin/python")}
    tmp = Path(f"/tmp/torchft-stable-check-{time.time_ns()}")
    runs = []
    for i in range(args.runs):
        for label, python in versions.items():  # interleaved
            r = one(label, python, tmp / f"{i}-{label.split()[0]}-{label.split()[-1]}", args.kill_step)
            runs.append(r)
            print(f"  run {i + 1}/{args.runs} {label}: survivors finished={r['survivors_finished']}, "
                  f"gloo error={r['gloo_error_seen']}, comm-hook assertion={r['comm_hook_assertion']} "
                  f"({r['detail']})", flush=True)
    out = BENCH / "results" / f"torchft-stable-check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": f".venv/bin/python bench/peers/torchft_stable_check.py --runs {args.runs}",
        "setup": "3 replica groups of one rank, 2.2M params, 60 steps, kill -9 replica 1 at step "
                 f"{args.kill_step}, no restarts", "runs": runs}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
