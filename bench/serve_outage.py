"""Control-plane downtime a running job tolerates without a training stall.

    python bench/serve_outage.py --outages 5,20,60   # writes bench/results/serve-outage-<ts>.json
                                                     # and the README's sentence between its markers

One `baton serve` (SQLite state) and one attached job (baton/examples/train.py, 3 ranks + 1
spare, 0.05 s steps, rank 0 appends a line per step). For each outage D the server is
killed with SIGKILL, left down D seconds, and started again on the same port and store.
Measured from the progress file, sampled every 50 ms: the step rate during the outage
against the rate in the 5 s before it, and the longest time without a new step from the
kill until 5 s after the restart (a stall would show there). Also how long the restarted
server took to answer again (reload from SQLite). At the end the job is stopped and its
ledger must be empty: no worker was lost or moved because the control plane was away.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import write_readme_sentence  # noqa: E402
from tests.jobs import Job  # noqa: E402
from tests.test_serve import Server, _run_args  # noqa: E402

MARK = "bench:serve-outage"


class Progress:
    """(time, steps done) every 50 ms, from rank 0's progress file."""

    def __init__(self, path: Path):
        self.path, self.samples = path, [(time.time(), 0)]
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            n = len(self.path.read_text().splitlines()) if self.path.exists() else 0
            self.samples.append((time.time(), n))

    def at(self, t: float) -> int:
        return max((n for ts, n in self.samples if ts <= t), default=0)

    def longest_pause(self, t0: float, t1: float) -> float:
        """Longest stretch within [t0, t1] with no new step."""
        last_change, longest, prev = t0, 0.0, self.at(t0)
        for ts, n in self.samples:
            if t0 < ts <= t1 and n != prev:
                longest, last_change, prev = max(longest, ts - last_change), ts, n
        return max(longest, t1 - last_change)

    def stop(self) -> None:
        self._stop.set()


def sentence(result: dict) -> str:
    parts = [f"{o['down_s']:.0f} s: {o['rate_ratio']:.0%} of the step rate before, longest pause "
             f"{o['longest_pause_s']:.2f} s" for o in result["outages"]]
    return ("`baton serve` killed with SIGKILL mid-job and started again after an outage of "
            + "; ".join(parts)
            + f" (steps are ~{result['step_s'] * 1000:.0f} ms here). The restarted server answered again "
            f"{min(o['restart_s'] for o in result['outages']):.1f}–{max(o['restart_s'] for o in result['outages']):.1f} s "
            f"after it was started (reload from SQLite); ledger events caused by the outages: {result['events']} "
            f"(`bench/serve_outage.py`, {result['machine']}, {result['when']}). Workers and the job's agent "
            f"retry for `--control-grace` (600 s); a boundary function (an epoch end, an evaluation) waits for "
            f"the control plane, steps do not.")


def update_readme(result: dict, readme: Path = REPO / "README.md") -> None:
    write_readme_sentence(readme, MARK, "bench/serve_outage.py", sentence(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", default="5,20,60", help="seconds the server stays down, comma-separated")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    outages = [float(x) for x in args.outages.split(",")]
    work = Path(tempfile.mkdtemp(prefix="baton-serve-outage-"))
    server = Server(work, f"sqlite:{work / 'state'}", work / "token")
    progress_file = work / "progress"
    job = Job(work, nproc=3, spares=1, steps=100_000, name="job", run_args=_run_args([server], "bench"),
              script_args=["--step-sleep", "0.05", "--progress-file", str(progress_file)])
    results = []
    try:
        job.wait_step(20, timeout=120)
        prog = Progress(progress_file)
        time.sleep(6)
        for down in outages:
            t0 = time.time()
            before = (prog.at(t0) - prog.at(t0 - 5)) / 5
            server.kill9()
            time.sleep(down)
            t1 = time.time()
            server.start()
            restart_s = time.time() - t1
            during = (prog.at(t1) - prog.at(t0)) / (t1 - t0)
            time.sleep(5)
            results.append({"down_s": round(t1 - t0, 2), "rate_before": round(before, 2),
                            "rate_during": round(during, 2), "rate_ratio": round(during / before, 3),
                            "longest_pause_s": round(prog.longest_pause(t0, time.time()), 3),
                            "restart_s": round(restart_s, 2)})
            print(results[-1], flush=True)
        prog.stop()
        events = job.events()
        step_s = 1 / max(r["rate_before"] for r in results)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGTERM)
            try:
                job.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                job.kill()
        server.stop()
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
              "outages": results, "events": len(events), "step_s": step_s}
    out = REPO / "bench" / "results" / f"serve-outage-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    print(sentence(result))
    if not args.no_readme:
        update_readme(result)
    return 0 if not events else 1


if __name__ == "__main__":
    raise SystemExit(main())
