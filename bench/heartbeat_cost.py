"""CPU per heartbeat at both ends, HTTP report against UDP datagram, on a running bench job.

    .venv/bin/python bench/heartbeat_cost.py [--seconds 10] [--rounds 3] [--rate 50]

Starts the overhead benchmark's baton job (3 ranks + 1 spare), then, in alternating windows,
sends heartbeats in the spare's name at `--rate` per second: as HTTP reports (the transport
before the datagrams) and as signed datagrams (what workers send now). The launcher's extra
CPU over an idle window, divided by the beats sent, is its cost per beat; the sender's is this
thread's CPU time around each send. Medians (min-max) over rounds. A diagnostic: its figures
go in notes and docstrings, not in the README.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import median_range  # noqa: E402
from contenders import Contender, Workload, _stat, launch  # noqa: E402
from cpu_by_thread import _wait_steps  # noqa: E402

from baton.control import messages as m  # noqa: E402
from baton.control.beats import BeatSender  # noqa: E402

def _fmt(xs: list[float]) -> str:
    r = median_range(xs)
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def _cpu_s(pid: int) -> float:
    return _stat(pid)[2]  # utime + stime, seconds


def _window(launcher: int, seconds: float, rate: float, send=None) -> tuple[float, float, int]:
    """(launcher CPU-s per second, sender CPU-s per beat, beats sent) over one window."""
    c0, t0, n, mine = _cpu_s(launcher), time.time(), 0, 0.0
    while time.time() - t0 < seconds:
        if send is not None:
            s = time.thread_time()
            send()
            mine += time.thread_time() - s
            n += 1
        time.sleep(1 / rate)
    return (_cpu_s(launcher) - c0) / (time.time() - t0), mine / max(n, 1), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=50.0)
    args = ap.parse_args()

    run = Path(tempfile.mkdtemp(prefix="baton-heartbeat-cost-"))
    w = Workload(params_m=2.2, steps=100_000, nproc=3, warmup=10)
    job = launch(Contender("baton", sys.executable, spares=1), w, run)
    try:
        _wait_steps(run, 30)
        rd = run / "baton"
        url, token = (rd / "endpoint").read_text().strip(), (rd / "token").read_text().strip()
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
        status = client.get("/v1/status").json()
        spare = status["jobs"][0]["spares"][0]["worker"]
        sender = BeatSender(token, spare, tuple(status["heartbeat_addr"]))
        sender._seq = 1 << 40  # newer than anything the spare sent (its own beats are dropped after)
        beat = m.Heartbeat()
        body = beat.model_dump(mode="json")

        def http() -> None:
            client.post(f"/v1/workers/{spare}/reports", json=body).raise_for_status()

        launcher = job.procs[0].pid
        out: dict[str, dict[str, list[float]]] = {"http": {"launcher": [], "sender": []},
                                                  "udp": {"launcher": [], "sender": []}}
        for _ in range(args.rounds):
            idle, _, _ = _window(launcher, args.seconds, args.rate)
            for name, send in (("http", http), ("udp", lambda: sender.send(beat))):
                busy, per_send, n = _window(launcher, args.seconds, args.rate, send)
                out[name]["launcher"].append((busy - idle) * args.seconds / n * 1e3)
                out[name]["sender"].append(per_send * 1e3)
        print(f"CPU-ms per heartbeat, {args.rounds} rounds of {args.seconds:.0f} s at {args.rate:.0f}/s, median (min-max):")
        for name, sides in out.items():
            print(f"  {name:4s}  launcher {_fmt(sides['launcher'])}   sender {_fmt(sides['sender'])}")
        ratio = statistics.median(out["http"]["launcher"]) / max(statistics.median(out["udp"]["launcher"]), 1e-9)
        print(f"  launcher http/udp: {ratio:.0f}x")
    finally:
        job.kill_all()
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
