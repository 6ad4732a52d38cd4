"""What `baton warm` saves a job: the time until its ranks train, and the CPU of everything it starts.

    PYTHONPATH=. python bench/warm.py --rounds 5   # writes bench/results/warm-<ts>.json
                                                   # and the README's <!-- warm --> sentence

Two contenders, in interleaved rounds with the order rotated: `baton run` starting its own
zygote (which imports torch, torch._dynamo and baton's runtime), and `baton run` with
BATON_WARM set, its zygote forked from one `baton warm` started before the rounds (whose own
start, paid once a machine, is reported apart). The job: baton/examples/train.py, 2 ranks and
a warm spare, a few steps: a short job, where the start is most of the cost.

Per run: the seconds from launch until the job reports `started` (its first generation
formed: the ranks train), until it exits, and the CPU-seconds of everything the run started.
CPU comes from a cpuacct cgroup (cgroup v1, root) that holds the warm process and each run's
launcher, and so everything they start (a zygote the warm process forks stays in its cgroup,
and `baton warm` refuses a launcher in another: the job's CPU must be charged where the
launcher's is). A run's CPU is the cgroup's growth while it runs; the warm process itself
only waits. Without cgroups, the bench says so and stops.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import RESULTS, fmt_range, interleave, median_range, round_ratio, save_results, write_readme_sentence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
README = REPO / "README.md"
TRAIN = REPO / "baton" / "examples" / "train.py"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Cgroup:
    """A cpuacct cgroup of its own: what its processes (and their children) used, in CPU-seconds."""

    def __init__(self, name: str):
        self.path = CPUACCT / f"baton-bench-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)

    def usage_s(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def command(self, argv: list[str]) -> list[str]:
        """`argv`, run inside this cgroup (its first process moves itself in, then execs)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def start_warm(sock: Path, group: Cgroup) -> tuple[subprocess.Popen, dict]:
    """`baton warm` in `group`; its start's wall and CPU seconds."""
    before = group.usage_s()
    t0 = time.perf_counter()
    proc = subprocess.Popen(group.command([sys.executable, "-m", "baton.cli", "warm", "--socket", str(sock)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not sock.exists():
        if proc.poll() is not None:
            raise SystemExit(f"baton warm exited ({proc.returncode})")
        time.sleep(0.01)
    return proc, {"wall_s": time.perf_counter() - t0, "cpu_s": group.usage_s() - before}


def run_once(how: str, folder: Path, steps: int, sock: Path, group: Cgroup) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BATON_WARM", None)
    if how == "warm":
        env["BATON_WARM"] = str(sock)
    before = group.usage_s()
    cmd = [sys.executable, "-m", "baton.cli", "run", "--nproc", "2", "--spares", "1", "--run-dir",
           str(folder / "run"), str(TRAIN), "--steps", str(steps)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(group.command(cmd), cwd=folder, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    started: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if not started and line.startswith("[baton] started"):
                started.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=600)
    exit_s = time.perf_counter() - t0
    reader.join(timeout=30)
    cpu = group.usage_s() - before
    if code != 0 or not started:
        raise SystemExit(f"{how} run failed (exit {code}):\n{''.join(lines)[-3000:]}")
    refused = [line.strip() for line in lines if "did not fork this job's zygote" in line]
    if refused:
        raise SystemExit(f"the warm process did not serve the run: {refused[0]}")
    return {"started_s": started[0], "exit_s": exit_s, "cpu_s": cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args()
    if not CPUACCT.is_dir() or not os.access(CPUACCT, os.W_OK):
        raise SystemExit(f"bench/warm.py needs cgroup v1 cpuacct at {CPUACCT}, writable (root)")
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-warm-"))
    sock = tmp / "warm.sock"
    group = Cgroup("warm")
    proc, warm_start = start_warm(sock, group)
    try:
        rounds = interleave(["own", "warm"], args.rounds,
                            lambda how, i: run_once(how, tmp / f"{how}-{i}", args.steps, sock, group))
    finally:
        proc.terminate()
        proc.wait()
    summary = {"warm_start": warm_start}
    for field in ("started_s", "exit_s", "cpu_s"):
        summary[field] = {k: median_range(r[k][field] for r in rounds) for k in ("own", "warm")}
        summary[f"{field}_warm_vs_own"] = round_ratio(rounds, "warm", "own", field)
    path = save_results(args, "warm", summary=summary, rounds=rounds)
    s = summary

    def secs(r: dict) -> str:
        return f"{r['median']:.2f} s ({r['min']:.2f}-{r['max']:.2f})"

    text = (f" Measured with `bench/warm.py` ({path.name}: `baton run` of baton/examples/train.py, 2 ranks and a "
            f"warm spare, {args.steps} steps, {args.rounds} interleaved rounds, medians with min-max, CPU of "
            f"everything the run started from a cpuacct cgroup): with its own zygote, the ranks trained "
            f"{secs(s['started_s']['own'])} after launch and the run used {secs(s['cpu_s']['own'])} of CPU; with "
            f"`baton warm`, {secs(s['started_s']['warm'])} and {secs(s['cpu_s']['warm'])} "
            f"({fmt_range(s['started_s_warm_vs_own'])} and {fmt_range(s['cpu_s_warm_vs_own'])}). "
            f"`baton warm`'s own start, once a machine: {warm_start['wall_s']:.2f} s, "
            f"{warm_start['cpu_s']:.2f} CPU-s. ")
    print(text)
    if not args.no_readme:
        write_readme_sentence(README, "warm", "bench/warm.py", text)
    print(f"wrote {path}")
    group.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
