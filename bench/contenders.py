"""Launching the contenders on bench/workload.py, killing ranks on a schedule, and
reading back what happened from the workload's progress log.

One function, `run_job`, serves both the steady-state and the failure sections:
a run with no kills is a failure-free run; its step times are the overhead figure.

    plain DDP          torchrun --nproc-per-node N
    checkpoint-restart torchrun --max-restarts R --rdzv-backend c10d, workload --ckpt-every K
    TorchFT            its lighthouse + one `torchrun --nproc-per-node 1 --max-restarts R`
                       per replica group (peers venv)
    baton              baton run --nproc N --spares S
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import free_port

BENCH = Path(__file__).resolve().parent
WORKLOAD = BENCH / "workload.py"


@dataclass(frozen=True)
class Workload:
    """What every contender trains: the same model, data, step count and world size."""

    params_m: float = 2.0
    steps: int = 60
    nproc: int = 3
    step_sleep: float = 0.0
    warmup: int = 10  # steps left out of the step-time median

    def args(self) -> list[str]:
        return ["--params-m", str(self.params_m), "--steps", str(self.steps), "--step-sleep", str(self.step_sleep)]


@dataclass(frozen=True)
class Contender:
    """One way to run the workload. `python` is the interpreter of its environment."""

    kind: str  # "ddp" | "baton" | "torchft"
    python: str
    ckpt_every: int = 0  # ddp: checkpoint-restart when > 0
    spares: int = 0  # baton
    restarts: int = 0  # ddp (whole job) / torchft (per replica group)

    @property
    def key(self) -> str:
        return f"ckpt-k{self.ckpt_every}" if self.kind == "ddp" and self.ckpt_every else self.kind


@dataclass
class Launched:
    procs: list[subprocess.Popen]
    helpers: list[subprocess.Popen] = field(default_factory=list)  # e.g. the TorchFT lighthouse

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill_all(self) -> None:
        for p in [*self.procs, *self.helpers]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def launch(c: Contender, w: Workload, run_dir: Path) -> Launched:
    run_dir.mkdir(parents=True, exist_ok=True)
    script = [str(WORKLOAD), "--mode", c.kind, *w.args(), "--run-dir", str(run_dir)]
    if c.kind == "ddp":
        if c.restarts:
            # c10d rendezvous: a fresh round per restart (the static one reuses the store)
            rdzv = ["--max-restarts", str(c.restarts), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        else:
            rdzv = ["--master-port", str(free_port())]
        ckpt = ["--ckpt-every", str(c.ckpt_every)] if c.ckpt_every else []
        cmd = [c.python, "-m", "torch.distributed.run", "--nproc-per-node", str(w.nproc), *rdzv, *script, *ckpt]
        return Launched([_spawn(cmd, run_dir / "launcher.log")])
    if c.kind == "baton":
        cmd = [c.python, "-m", "baton.cli", "run", "--nproc", str(w.nproc), "--spares", str(c.spares), "--quiet",
               "--run-dir", str(run_dir / "baton"), *script]
        return Launched([_spawn(cmd, run_dir / "launcher.log")])
    if c.kind == "torchft":
        lh_port = free_port()
        lighthouse = _spawn([str(Path(c.python).parent / "torchft_lighthouse"),
                             "--min_replicas", str(max(1, w.nproc - 1)),  # keeps going with one replica out
                             "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                             "--bind", f"[::]:{lh_port}"], run_dir / "lighthouse.log")
        procs = []
        for r in range(w.nproc):
            env = {"REPLICA_GROUP_ID": str(r), "NUM_REPLICA_GROUPS": str(w.nproc),
                   "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}"}
            cmd = [c.python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                   "--max-restarts", str(c.restarts), "--master-port", str(free_port()), *script]
            procs.append(_spawn(cmd, run_dir / f"replica{r}.log", env))
        return Launched(procs, [lighthouse])
    raise ValueError(f"unknown contender kind {c.kind!r}")


def _read_events(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines of `path` from byte `offset`; returns them and the new offset."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[:chunk.rfind(b"\n") + 1]
    events = []
    for line in complete.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by kill -9
            pass
    return events, offset + len(complete)


def run_job(c: Contender, w: Workload, run_dir: Path, *, kill_at: tuple[int, ...] = (), kill_rank: int = 1,
            timeout: float = 600, straggler_grace: float = 20.0) -> dict:
    """Run one job to completion, `kill -9` rank `kill_rank` the first time rank 0 reports
    each step in `kill_at` (the next kill waits until a replacement process holds the rank),
    and summarise the progress log. Raises if the job fails or times out."""
    progress = run_dir / "progress.jsonl"
    t0 = time.time()
    job = launch(c, w, run_dir)
    pending, kills, offset, seen = list(kill_at), [], 0, []
    reached, since = -1, 0.0  # highest step rank 0 reported after the last kill, and when that was
    t_done = None
    try:
        while job.running():
            now = time.time()
            if now - t0 > timeout:
                raise TimeoutError(f"{c.key} did not finish in {timeout:.0f}s: see {run_dir}")
            events, offset = _read_events(progress, offset)
            seen += events
            reached = max([reached, *(e["step"] for e in events if e["ev"] == "step" and e["t"] > since)])
            if t_done is None and any(e["ev"] == "done" for e in events):
                t_done = now
            if t_done is not None and now - t_done > straggler_grace:
                break  # TorchFT: a restarted replica that never caught up waits for a quorum forever
            if pending:
                pid_file = run_dir / f"pid.rank{kill_rank}"
                if reached >= pending[0] and pid_file.exists():
                    pid = int(pid_file.read_text())
                    if not kills or pid != kills[-1]["pid"]:
                        t_kill = time.time()
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t": t_kill, "step": reached, "pid": pid})
                        pending.pop(0)
                        reached, since = -1, t_kill
            time.sleep(0.002)
    finally:
        job.kill_all()
    t_end = time.time()
    seen += _read_events(progress, offset)[0]
    if not any(e["ev"] == "done" for e in seen) or not (run_dir / "final.pt").exists():
        raise RuntimeError(f"{c.key} did not finish its {w.steps} steps (exit codes "
                           f"{[p.returncode for p in job.procs]}): see {run_dir}")
    return summarise(seen, kills, w, total_s=(t_done or t_end) - t0, run_dir=run_dir)


def summarise(events: list[dict], kills: list[dict], w: Workload, *, total_s: float, run_dir: Path) -> dict:
    steps = [e for e in events if e["ev"] == "step"]
    done = next(e for e in events if e["ev"] == "done")
    # step time: gaps between consecutive step reports of one process, after warm-up
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
            if a["step"] >= w.warmup and b["step"] == a["step"] + 1 and a.get("attempt") == b.get("attempt")]
    failures = []
    for k in kills:
        # back past the step it had reached when the rank was killed
        regained = next((e for e in steps if e["t"] > k["t"] and e["step"] > k["step"]), None)
        failures.append({"killed_at_step": k["step"], "stall_s": regained["t"] - k["t"] if regained else None})
    saves = [e["save_s"] for e in events if e["ev"] == "save"]
    out = {
        "total_s": total_s,
        "train_s": done["t"] - steps[0]["t"],
        "step_s": statistics.median(gaps) if gaps else None,
        "steps_executed": len(steps),
        "steps_recomputed": len(steps) - w.steps,  # TorchFT: iterations not committed
        "kills": len(kills),
        "failures": failures,
        "save_s": statistics.median(saves) if saves else None,
        "params": done.get("params"),
        "final": str(run_dir / "final.pt"),
    }
    if any("batches" in e for e in steps):  # TorchFT: batches committed across replicas
        out["samples_dropped_frac"] = 1 - steps[-1]["batches"] / (w.steps * w.nproc)
    return out


def same_params(a: str, b: str) -> bool:
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
