"""Launching the contenders on bench/workload.py, killing ranks on a schedule, and
reading back what happened from the workload's progress log.

One function, `run_job`, serves both the steady-state and the failure sections:
a run with no kills is a failure-free run; its step times are the overhead figure.

    plain DDP          torchrun --nproc-per-node N
    checkpoint-restart torchrun --max-restarts R --rdzv-backend c10d, workload --ckpt-every K
    TorchFT            its lighthouse + one `torchrun --nproc-per-node 1 --max-restarts R`
                       per replica group (peers venv)
    baton              baton run --nproc N --spares S [--verify-every V]

Steady-state CPU (run_job(..., cpu_window=True)): the CPU-seconds that the whole process
tree of a run spends between the end of warm-up and the last step, per step. The window is
the one the step-time figures use: from rank 0 reporting step `warmup` to rank 0 reporting
the last step. Each rank reads its own CPU time (getrusage, every thread) at its own two
boundaries (workload.py writes cpu.rank<R>.json); every other process of the tree (launcher,
torchrun agents, baton's warm spare, TorchFT's lighthouse, anything they started) is read
from /proc by this harness when it sees rank 0's two reports (see CpuWindow). The tree is
every process descending (by parent pid) from what the harness launched, or in the session
of one of those; a process or thread that exits inside the window counts with the last value
read (the harness re-reads the known processes every 0.5 s), one that starts inside it
counts from zero.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common import free_port

BENCH = Path(__file__).resolve().parent
WORKLOAD = BENCH / "workload.py"
NOCODE_WORKLOAD = BENCH / "nocode_workload.py"  # the same training as a script that never imports baton


@dataclass(frozen=True)
class Workload:
    """What every contender trains: the same model, data, step count and world size."""

    params_m: float = 2.0
    steps: int = 60
    nproc: int = 3
    step_sleep: float = 0.0
    warmup: int = 10  # steps left out of the step-time median and the CPU window
    comm_hook: str = ""  # nocode_workload only: "fp16" registers DDP's fp16_compress_hook

    def args(self) -> list[str]:
        return ["--params-m", str(self.params_m), "--steps", str(self.steps), "--step-sleep", str(self.step_sleep),
                "--warmup", str(self.warmup), *(["--comm-hook", self.comm_hook] if self.comm_hook else [])]


@dataclass(frozen=True)
class Contender:
    """One way to run the workload. `python` is the interpreter of its environment."""

    kind: str  # "ddp" | "baton" | "torchft" | "plain" (torchrun, nocode_workload) | "nocode" (baton run, same file)
    python: str
    ckpt_every: int = 0  # ddp: checkpoint-restart when > 0
    spares: int = 0  # baton
    verify_every: int = 0  # baton: `--verify-every N`, the periodic replica-agreement check
    restarts: int = 0  # ddp (whole job) / torchft (per replica group)
    tail_copies: bool = True  # nocode: `--no-tail-copies` when False
    hot_spares: bool = False  # baton: `--hot-spares`, its spares mirroring the replicated state every step

    @property
    def key(self) -> str:
        if self.kind == "ddp" and self.ckpt_every:
            return f"ckpt-k{self.ckpt_every}"
        if self.kind == "baton" and self.verify_every:
            return "baton-verify"
        if self.kind == "baton" and self.hot_spares:
            return "baton-hot"
        if self.kind == "nocode" and not self.tail_copies:
            return "nocode-no-tail"
        return self.kind


@dataclass
class Launched:
    procs: list[subprocess.Popen]
    helpers: list[subprocess.Popen] = field(default_factory=list)  # e.g. the TorchFT lighthouse

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def roots(self) -> list[int]:
        return [p.pid for p in [*self.procs, *self.helpers]]

    def kill_all(self) -> None:
        """SIGKILL every process of the trees, not only the sessions started here: torchrun puts
        each rank in a session of its own, and a killed torchrun leaves them training."""
        roots = [p.pid for p in [*self.procs, *self.helpers]]
        for pid in tree_cpu(roots):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in [*self.procs, *self.helpers]:
            p.wait()


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def launch(c: Contender, w: Workload, run_dir: Path) -> Launched:
    run_dir.mkdir(parents=True, exist_ok=True)
    if c.kind in ("plain", "nocode"):
        script = [str(NOCODE_WORKLOAD), *w.args(), "--run-dir", str(run_dir)]
        if c.kind == "plain":
            cmd = [c.python, "-m", "torch.distributed.run", "--nproc-per-node", str(w.nproc),
                   "--master-port", str(free_port()), *script]
        else:
            cmd = [c.python, "-m", "baton.cli", "run", "--nproc", str(w.nproc), "--spares", str(c.spares), "--quiet",
                   *([] if c.tail_copies else ["--no-tail-copies"]), "--run-dir", str(run_dir / "baton"), *script]
        return Launched([_spawn(cmd, run_dir / "launcher.log")])
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
        verify = ["--verify-every", str(c.verify_every)] if c.verify_every else []
        hot = ["--hot-spares"] if c.hot_spares else []
        cmd = [c.python, "-m", "baton.cli", "run", "--nproc", str(w.nproc), "--spares", str(c.spares), "--quiet",
               *verify, *hot, "--run-dir", str(run_dir / "baton"), *script]
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


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[int, int, float, str] | None:
    """(parent pid, session id, utime + stime in seconds, command name) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    head, _, tail = data.rpartition(b")")
    rest = tail.split()  # rest[0] is field 3 (state): ppid 4, session 6, utime 14, stime 15
    try:
        return (int(rest[1]), int(rest[3]), (int(rest[11]) + int(rest[12])) / CLK_TCK,
                head.partition(b"(")[2].decode(errors="replace"))
    except (IndexError, ValueError):
        return None


def tree_cpu(roots: list[int]) -> dict[int, tuple[float, str]]:
    """{pid: (CPU seconds so far, command name)} for every live process in the trees under
    `roots`: their descendants by parent pid, and every process in a root's session."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None:
                procs[int(name)] = st
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _, _, _) in procs.items():
        children[ppid].append(pid)
    sessions = set(roots)
    found = {pid for pid, (_, sid, _, _) in procs.items() if sid in sessions or pid in sessions}
    todo = list(found)
    while todo:  # and everything below them (a rank its launcher started in a session of its own)
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return {pid: (procs[pid][2], procs[pid][3]) for pid in found}


def threads_ns(pid: int) -> dict[int, int]:
    """{thread id: CPU nanoseconds} of every live thread of `pid` (/proc/<pid>/task/*/schedstat)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


class CpuWindow:
    """The harness's reads of the whole process tree at the two edges of the steady-state window.

    Every process but the ranks is read twice over: utime + stime from /proc/<pid>/stat (the
    whole process, threads that exited included, but in 10 ms clock ticks) and the nanosecond
    runtime of each of its threads (/proc/<pid>/task/*/schedstat). The thread sum is the
    figure; a process whose tick count grew more than 2 ticks beyond it had threads that came
    and went between two reads, and its tick count is used instead (counted in "tick_fallbacks").
    """

    POLL_S = 0.5

    def __init__(self, roots: list[int], rank_pids: Callable[[], set[int]]):
        self.roots = roots
        self.rank_pids = rank_pids  # the ranks read their own CPU time: no need to follow their threads
        self.start: dict[int, dict] | None = None
        self.end: dict[int, dict] | None = None
        self.last: dict[int, dict] = {}  # latest read of every process seen in the window
        self.exited: list[int] = []
        self.t_start = self.t_end = 0.0
        self._polled = 0.0

    def _read(self, pid: int, ticks: float, comm: str, ranks: set[int]) -> dict:
        return {"comm": comm, "ticks_s": ticks, "threads": {} if pid in ranks else threads_ns(pid)}

    def _snapshot(self) -> dict[int, dict]:
        ranks = self.rank_pids()
        return {pid: self._read(pid, ticks, comm, ranks) for pid, (ticks, comm) in tree_cpu(self.roots).items()}

    def _merge(self, pid: int, new: dict) -> None:
        """Fold a new read of `pid` into `last`, keeping the last value of threads that exited."""
        old = self.last.get(pid)
        if old is not None:
            new["threads"] = {**old["threads"], **new["threads"]}
        self.last[pid] = new

    def mark_start(self) -> None:
        self.t_start = time.time()
        self.start = self._snapshot()
        self.last = {pid: {**v, "threads": dict(v["threads"])} for pid, v in self.start.items()}

    def poll(self) -> None:
        """Inside the window: re-read the known processes, in case a process or thread exits before the end."""
        now = time.monotonic()
        if self.start is None or self.end is not None or now - self._polled < self.POLL_S:
            return
        self._polled = now
        ranks = self.rank_pids()
        for pid, v in list(self.last.items()):
            st = _stat(pid)
            if st is not None:
                self._merge(pid, self._read(pid, st[2], v["comm"], ranks))

    def mark_end(self) -> None:
        self.t_end = time.time()
        now = self._snapshot()
        self.exited = [pid for pid in self.last if pid not in now]
        for pid, v in now.items():
            self._merge(pid, v)
        self.end = self.last

    def others(self, exclude: set[int]) -> tuple[float, dict[str, float], int]:
        """CPU seconds in the window of every process but `exclude` (the ranks), per process, and
        how many processes fell back to their tick count."""
        assert self.start is not None and self.end is not None
        per, fallbacks = {}, 0
        for pid, v in self.end.items():
            if pid in exclude:
                continue
            s0 = self.start.get(pid, {"ticks_s": 0.0, "threads": {}})
            ticks = v["ticks_s"] - s0["ticks_s"]
            precise = sum(ns - s0["threads"].get(tid, 0) for tid, ns in v["threads"].items()) / 1e9
            if ticks - precise > 2 / CLK_TCK:
                precise, fallbacks = ticks, fallbacks + 1
            per[f"{v['comm']}[{pid}]"] = precise
        return sum(per.values()), per, fallbacks


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
            timeout: float = 600, straggler_grace: float = 20.0, cpu_window: bool = False) -> dict:
    """Run one job to completion, `kill -9` rank `kill_rank` the first time rank 0 reports
    each step in `kill_at` (the next kill waits until a replacement process holds the rank),
    and summarise the progress log. With `cpu_window` (runs without kills), also the
    CPU-seconds per step of the whole process tree between warm-up and the last step.
    Raises if the job fails or times out."""
    progress = run_dir / "progress.jsonl"
    t0 = time.time()
    job = launch(c, w, run_dir)
    cpu = CpuWindow(job.roots(), lambda: _rank_pids(run_dir, w.nproc)) if cpu_window and not kill_at else None
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
            if cpu is not None:
                done_steps = [e["step"] for e in events if e["ev"] == "step"]
                if cpu.start is None and any(k >= w.warmup for k in done_steps):
                    cpu.mark_start()
                if cpu.start is not None and cpu.end is None and any(k >= w.steps for k in done_steps):
                    cpu.mark_end()
                cpu.poll()
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
    out = summarise(seen, kills, w, total_s=(t_done or t_end) - t0, run_dir=run_dir)
    if cpu is not None:
        out.update(cpu_summary(cpu, seen, w, run_dir))
    if c.hot_spares:
        out.update(_hot_spare_figures(run_dir / "baton" / "events.jsonl", seen, w))
    return out


def _hot_spare_figures(events_log: Path, progress: list[dict], w: Workload) -> dict:
    """What keeping the spare hot took, as the orchestrator logged it when the spare kept pace
    (bytes of step records per optimizer step, its replay of a step), and whether that was
    before the CPU window began (else the window saw part of the spare's start, not its pace)."""
    hot = []
    if events_log.exists():
        for line in events_log.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("event") == "hot-spare":
                hot.append(entry)
    if not hot:
        return {"hot_note": "the spare never kept pace with the feeding rank"}
    first = hot[0]
    window_start = next((e["t"] for e in progress if e["ev"] == "step" and e["step"] >= w.warmup), None)
    return {"hot_bytes_per_step": first["data"]["bytes_per_step"], "hot_replay_s": first["data"]["replay_s"],
            "hot_before_window": window_start is not None and first["t"] <= window_start}


def _rank_pids(run_dir: Path, nproc: int) -> set[int]:
    pids = set()
    for r in range(nproc):
        try:
            pids.add(int((run_dir / f"pid.rank{r}").read_text()))
        except (OSError, ValueError):
            pass
    return pids


def cpu_summary(cpu: CpuWindow, events: list[dict], w: Workload, run_dir: Path) -> dict:
    """The steady-state CPU figure of one run (see the module docstring); None with a reason
    in "cpu_note" when a part is missing."""
    n = w.steps - w.warmup
    out: dict = {"cpu_s_per_step": None, "cpu_others_s_per_step": None, "mean_step_s": None}
    steps = [e for e in events if e["ev"] == "step"]
    t_warm = next((e["t"] for e in steps if e["step"] >= w.warmup), None)
    t_last = next((e["t"] for e in steps if e["step"] >= w.steps), None)
    if t_warm is not None and t_last is not None and n > 0:
        out["mean_step_s"] = (t_last - t_warm) / n  # wall time per step over the window: periodic work included
    ranks = []
    for r in range(w.nproc):
        f = run_dir / f"cpu.rank{r}.json"
        if not f.exists():
            return {**out, "cpu_note": f"no {f.name}"}
        ranks.append(json.loads(f.read_text()))
    if any(rk["warm"]["step"] != w.warmup or rk["end"]["step"] != w.steps for rk in ranks):
        return {**out, "cpu_note": "a rank's window is not warmup..steps"}
    if cpu.start is None or cpu.end is None:
        return {**out, "cpu_note": "the harness did not see both edges of the window"}
    ranks_s = sum(rk["end"]["cpu_s"] - rk["warm"]["cpu_s"] for rk in ranks)
    rank_pids = {rk["pid"] for rk in ranks}
    others_s, per_process, fallbacks = cpu.others(rank_pids)
    missing = rank_pids - set(cpu.end)
    if all("baton" in rk["warm"] and "baton" in rk["end"] for rk in ranks):
        # baton's own count, bottom up: its share of the ranks' CPU, plus every process outside
        # the ranks (launcher, spare), which is baton's and nothing else.
        own = {k: sum(rk["end"]["baton"][k] - rk["warm"]["baton"][k] for rk in ranks)
               for k in ("entry_s", "threads_s", "baton_s")}
        out["own_cpu_s_per_step"] = (own["baton_s"] + others_s) / n
        out["own_cpu_split_s_per_step"] = {"rank entry points": own["entry_s"] / n,
                                           "rank threads": own["threads_s"] / n,
                                           "outside the ranks": others_s / n}
    out.update({
        "cpu_s_per_step": (ranks_s + others_s) / n,
        "cpu_others_s_per_step": others_s / n,
        "cpu_detail": {
            "window_steps": n,
            "ranks_s": ranks_s,
            "others_s": others_s,
            "others_by_process_s": per_process,
            "others_processes": len(per_process),
            # what the same window looks like when the ranks too are read from /proc (a cross-check)
            "ranks_proc_s": sum(cpu.end[p]["ticks_s"] - cpu.start[p]["ticks_s"] for p in rank_pids
                                if p in cpu.end and p in cpu.start),
            "ranks_not_in_tree": len(missing),
            "exited_in_window": len(cpu.exited),
            # how late the harness read /proc after rank 0's report at each edge
            "harness_lag_s": [cpu.t_start - (t_warm or cpu.t_start), cpu.t_end - (t_last or cpu.t_end)],
            # processes read by their tick count (10 ms resolution) instead of their threads' ns
            "tick_fallbacks": fallbacks,
        },
    })
    return out


def summarise(events: list[dict], kills: list[dict], w: Workload, *, total_s: float, run_dir: Path) -> dict:
    steps = [e for e in events if e["ev"] == "step"]
    absorbed = [e for e in events if e["ev"] == "absorbed"]
    done = next(e for e in events if e["ev"] == "done")
    # step time: gaps between consecutive step reports of one process, after warm-up
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])
            if a["step"] >= w.warmup and b["step"] == a["step"] + 1 and a.get("attempt") == b.get("attempt")]
    failures = []
    for k in kills:
        # back past the step it had reached when the rank was killed: a completed step; an attempt
        # that failed and was absorbed ("absorbed" events, baton) is not progress
        regained = next((e for e in steps if e["t"] > k["t"] and e["step"] > k["step"]), None)
        failures.append({"killed_at_step": k["step"], "stall_s": regained["t"] - k["t"] if regained else None})
    saves = [e["save_s"] for e in events if e["ev"] == "save"]
    out = {
        "total_s": total_s,
        "train_s": done["t"] - steps[0]["t"],
        "step_s": statistics.median(gaps) if gaps else None,
        "steps_executed": len(steps) + len(absorbed),
        # TorchFT: iterations not committed; baton: attempts absorbed and run again
        "steps_recomputed": len(steps) + len(absorbed) - w.steps,
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
