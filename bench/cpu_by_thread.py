"""Where a rank's CPU goes, thread by thread: plain DDP against baton, side by side.

    .venv/bin/python bench/cpu_by_thread.py [--params-m 2.2] [--steps 250] [--rounds 3] [--nproc 3]

The whole-tree CPU ratio in the overhead benchmark says how much more baton costs, not
where. This reads every thread's utime+stime from /proc/<rank pid>/task/* at two step
marks (after warm-up, and `--steps` steps later) and reports CPU-milliseconds per step
summed over the ranks, by thread kind: the training thread ("main"), gloo's transport loop
and work threads (named by gloo), and every other Python thread (baton's heartbeat,
command poll, bundle writer and NACK readers; the OS knows them all as "python").
Contenders alternate round by round; medians (min-max) over rounds. A diagnostic: its
figures go in notes, not in the README.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleave, median_range  # noqa: E402
from contenders import Contender, Workload, launch  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _steps(run_dir: Path) -> int:
    try:
        return sum(1 for line in open(run_dir / "progress.jsonl") if '"ev": "step"' in line)
    except FileNotFoundError:
        return 0


def _wait_steps(run_dir: Path, n: int, timeout: float = 300) -> int:
    deadline = time.time() + timeout
    while (got := _steps(run_dir)) < n:
        if time.time() > deadline:
            raise TimeoutError(f"{run_dir}: {got} of {n} steps in {timeout:.0f}s")
        time.sleep(0.1)
    return got


def _threads(pid: int) -> collections.Counter:
    """Clock ticks of CPU per thread kind of one process."""
    out: collections.Counter = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended between listing and reading
        if comm.startswith("python"):
            comm = "main" if int(tid) == pid else "other python threads"
        out[comm] += int(fields[11]) + int(fields[12])
    return out


def one_run(c: Contender, w: Workload, run_dir: Path) -> dict[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    job = launch(c, w, run_dir)
    try:
        start = _wait_steps(run_dir, w.warmup)
        pids = [int((run_dir / f"pid.rank{r}").read_text()) for r in range(w.nproc)]
        before = [_threads(p) for p in pids]
        end = _wait_steps(run_dir, start + (w.steps - w.warmup - 5))
        after = [_threads(p) for p in pids]
    finally:
        job.kill_all()
    n = end - start
    per_step: collections.Counter = collections.Counter()
    for b, a in zip(before, after):
        for kind, ticks in a.items():
            per_step[kind] += ticks - b.get(kind, 0)
    out = {kind: ticks / TICK / n * 1e3 for kind, ticks in per_step.items()}
    out["all threads"] = sum(out.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=2.2)
    p.add_argument("--steps", type=int, default=250, help="measured steps (after 30 warm-up steps)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/baton-cpu-by-thread"))
    args = p.parse_args()
    py = sys.executable
    contenders = {"ddp": Contender("ddp", py), "baton": Contender("baton", py, spares=1)}
    w = Workload(params_m=args.params_m, steps=args.steps + 35, nproc=args.nproc, warmup=30)

    def run(key: str, i: int) -> dict[str, float]:
        r = one_run(contenders[key], w, args.workdir / f"{key}-{i}")
        print(f"round {i + 1} {key:>5}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.items())), flush=True)
        return r

    rounds = interleave(list(contenders), args.rounds, run)
    kinds = sorted({k for rnd in rounds for r in rnd.values() for k in r})
    print(f"\nCPU ms per step, summed over {w.nproc} ranks, {args.params_m}M params: median (min-max) of "
          f"{args.rounds} rounds")
    for kind in kinds:
        cells = []
        for key in contenders:
            m = median_range(rnd[key].get(kind, 0.0) for rnd in rounds)
            cells.append(f"{key} {m['median']:7.2f} ({m['min']:.2f}-{m['max']:.2f})")
        print(f"  {kind:<22} " + "   ".join(cells))


if __name__ == "__main__":
    main()
