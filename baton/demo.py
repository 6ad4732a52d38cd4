"""`baton demo`: a 4-rank CPU job with one warm spare survives a planned move, a taint and a
`kill -9` of rank 0, and ends bit-for-bit equal to an uninterrupted reference run.

It drives a real `baton run` the way a user would (the CLI's API, a real SIGKILL)
and prints progress and events live.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baton.commands import format_events
from baton.control.client import ApiClient
from baton.control.state import yoco_ratio
from baton.rundir import RunDir

TRAIN = Path(__file__).parent / "examples" / "train.py"
NPROC = 4


def _launch(workdir: Path, steps: int, spares: int, quiet: bool) -> tuple[subprocess.Popen, Path]:
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "baton.cli", "run", "--nproc", str(NPROC), "--spares", str(spares),
           "--run-dir", str(run_dir), "--quiet", str(TRAIN), "--steps", str(steps),
           "--width", "128", "--depth", "3", "--step-sleep", "0.02", "--out", str(workdir / "final.pt")]
    log = open(workdir / "launcher.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, run_dir


def _client(run_dir: Path, proc: subprocess.Popen) -> ApiClient:
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited early (code {proc.returncode})")
        try:
            url, token = RunDir(run_dir).read()
            return ApiClient(url, token)
        except FileNotFoundError:
            time.sleep(0.1)
    raise RuntimeError("the job did not come up in 120 s")


class Progress:
    """Prints the job's step and loss, and each orchestrator event once, as they happen."""

    def __init__(self, run_dir: Path):
        self.events_file = run_dir / "events.jsonl"
        self.offset = 0
        self.last_step = -1
        self.last_print = 0.0

    def poll(self, client: ApiClient) -> dict[str, Any] | None:
        try:
            job = client.status()["jobs"][0]
        except Exception:  # noqa: BLE001 - the job may be finishing
            return None
        step = min(r["step"] for r in job["ranks"])
        loss = job["ranks"][0].get("metrics", {}).get("loss")
        now = time.time()
        if step != self.last_step and now - self.last_print > 0.5:
            slots = " ".join(f"r{r['rank']}@{r['slot'] or '-'}" for r in job["ranks"])
            loss_txt = f"loss {loss:.4f}" if loss is not None else "loss -"
            print(f"  step {step:>4}  {loss_txt}  [{job['state']}]  {slots}", flush=True)
            self.last_step, self.last_print = step, now
        self._events()
        return job

    def _events(self) -> None:
        if not self.events_file.exists():
            return
        with open(self.events_file) as f:
            f.seek(self.offset)
            for line in f:
                row = json.loads(line)
                kind, ev = row["event"], row["data"]
                if kind == "resolved":
                    print(f"  >> {ev['kind']} move of rank {ev['rank']} resolved at step {ev['step']}: "
                          f"{ev['from_slot']} -> {ev['to_slot']}, downtime {ev['downtime_s']:.3f}s, "
                          f"steps lost {ev['steps_lost']}, re-run {ev['steps_rerun']}", flush=True)
                elif kind in ("migration", "recovery", "taint", "untaint", "worker-lost", "waiting-for-spare"):
                    detail = ", ".join(f"{k}={v}" for k, v in ev.items())
                    print(f"  >> {kind}: {detail}", flush=True)
            self.offset = f.tell()


def _wait_step(client: ApiClient, progress: Progress, proc: subprocess.Popen, step: int) -> dict[str, Any]:
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the demo could act on it")
        job = progress.poll(client)
        if job and job["state"] == "running" and min(r["step"] for r in job["ranks"]) >= step:
            return job
        time.sleep(0.1)


def main(steps: int = 300, run_dir: Path | None = None) -> int:
    import torch

    base = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="baton-demo-"))
    ref_dir, live_dir = base / "reference", base / "live"
    ref_dir.mkdir(parents=True, exist_ok=True)
    live_dir.mkdir(parents=True, exist_ok=True)
    print(f"baton demo: {NPROC} ranks + 1 warm spare on CPU (gloo), {steps} steps, AdamW, "
          f"DataLoader + DistributedSampler. Work dir: {base}")

    print("\n1/2 uninterrupted reference run ...", flush=True)
    t0 = time.time()
    ref, _ = _launch(ref_dir, steps, spares=0, quiet=True)
    if ref.wait() != 0:
        print((ref_dir / "launcher.log").read_text()[-3000:])
        return 1
    print(f"    done in {time.time() - t0:.1f}s")

    print("\n2/2 the same run, with failures injected:", flush=True)
    proc, live_run = _launch(live_dir, steps, spares=1, quiet=True)
    client = _client(live_run, proc)
    progress = Progress(live_run)
    try:
        _wait_step(client, progress, proc, 15)
        print("  -> baton migrate --rank 1   (planned: maintenance)", flush=True)
        client.migrate(1)
        job = _wait_spare(client, progress, proc)
        slot = next(r["slot"] for r in job["ranks"] if r["rank"] == 2)
        print(f"  -> baton taint {slot} --reason ecc   (pre-emptive: ECC errors rising)", flush=True)
        client.taint(slot, "ecc")
        job = _wait_spare(client, progress, proc)
        pid = next(r["pid"] for r in job["ranks"] if r["rank"] == 0)
        print(f"  -> kill -9 {pid}   (unplanned: rank 0's process dies mid-step)", flush=True)
        os.kill(pid, signal.SIGKILL)
        while proc.poll() is None:
            progress.poll(client)
            time.sleep(0.1)
    except Exception:
        proc.kill()
        raise
    progress._events()
    if proc.returncode != 0:
        print((live_dir / "launcher.log").read_text()[-3000:])
        return 1

    from baton.store.sqlite import SqliteStore

    store = SqliteStore(live_run / "state.db")
    events = store.events()
    store.close()
    ref_params = torch.load(ref_dir / "final.pt")
    live_params = torch.load(live_dir / "final.pt")
    equal = ref_params.keys() == live_params.keys() and all(
        torch.equal(ref_params[k], live_params[k]) for k in ref_params)
    n = sum(t.numel() for t in ref_params.values())
    print("\nevents:")
    print(format_events(events))
    resolved = all(e["status"] == "resolved" and e["steps_lost"] == 0 for e in events)
    print(f"\nfinal parameters equal to the uninterrupted reference run: "
          f"{'YES, bit for bit' if equal else 'NO'} ({len(ref_params)} tensors, {n:,} parameters)")
    yoco = yoco_ratio(events)
    print(f"every failure resolved without rollback: {'yes' if resolved else 'no'}  "
          f"(YOCO ratio {'n/a' if yoco is None else f'{yoco:.0%}'})")
    return 0 if equal and resolved and len(events) == 3 else 1


def _wait_spare(client: ApiClient, progress: Progress, proc: subprocess.Popen) -> dict[str, Any]:
    """Wait until the previous move finished and a warm spare is ready again."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before the demo could act on it")
        job = progress.poll(client)
        if job and job["operation"] is None and any(s["state"] == "spare" for s in job["spares"]):
            return job
        time.sleep(0.1)
