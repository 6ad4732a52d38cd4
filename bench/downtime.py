"""Migration downtime versus state size, next to raw copies of the same bytes, same run.

    python bench/downtime.py --sizes 10,100,1000 --moves 3      # prints the result as JSON

For each state size (MB of fp32 params + two AdamW moments, so params ~= MB * 1e6 / 12) a
baton job of 2 ranks + 1 warm spare runs bench/workload.py; the driver makes `moves`
planned moves (`/v1/migrate`) and `moves` unplanned recoveries (`kill -9` of a rank),
alternating, and reads the ledger. Then the job is stopped (so it uses no CPU) and the
raw loopback TCP and shared-memory copies of the ledger's `state_bytes` are measured
`moves` times each (bench/rawcopy.py: long-lived receiver, warm buffers), right after.

What is measured:
  planned_s           ledger downtime_s: first rank paused -> every rank formed the next
                      generation (the orchestrator's clock), the whole state moved in the pause
                      (`baton migrate --no-pre-copy`, the default)
  pre_copied_s        the same for a pre-copied planned move (`--pre-copy`): the joiner copied the
                      replicated state and followed the leaver's optimizer steps beforehand
  pre_copy            what those pre-copies did beside training (the ledger's pre_copy, medians):
                      the copy's seconds and bytes, optimizer steps followed, and their cost to the
                      leaver: its copy of the state at one boundary, its capture per step
  transfer_s          ledger transfer_s of the planned moves: the joiner's fetch_state time
  unplanned_s         kill -9 (taken just before os.kill) -> every rank formed again
                      (ledger resumed_at; same host clock)
  unplanned_ledger_s  ledger downtime_s of the recovery: failure detected -> every rank formed
  phases              per kind, the ledger's phases of each move (the slowest joiner's fetch,
                      load, form, verify; the rest) and its joiner's script setup, medians;
                      check_after_resume: not downtime, what the first step after the move
                      waited for the state check's pass over the large tensors (run beside it)
  hot                 a second job of the same size run with --hot-spares: min(moves, 2) times, a
                      planned move of rank 1 to the hot spare (its pause: planned_s), then a
                      recovery of rank 1 (kill -9), each once the spare's mirror keeps pace with
                      rank 0, which feeds it; for the recoveries: kill -> all formed (unplanned_s), the ledger's downtime and that
                      less the joiner's script setup, the bytes the recovery moved, phases; the
                      feed's bytes per optimizer step and the spare's replay of a step; recoveries
                      whose mirror was not used are not timed, their reasons listed (fallbacks)
  raw_tcp_s, raw_shm_s  see rawcopy.tcp_copy_s / rawcopy.shm_copy_s
Each is {"median", "min", "max", "n"} over the repetitions. `fit` is a least-squares line
downtime_median = slope * raw_tcp_median + intercept_s across the sizes (numpy.polyfit):
slope < 1.5 with a small intercept is the aim.
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
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rawcopy, common: as the other bench files

import rawcopy  # noqa: E402
from common import median_range, ratio  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workload.py"

STEP_SLEEP = 0.02
HOT_MOVES = 2  # planned moves and recoveries per size of the --hot-spares job (the quick preset took 31.9 min with 3)


class BenchError(RuntimeError):
    """The benchmark job did not do what was asked in time; the message names its log."""


# ----------------------------------------------------------------------------- the job
class _Job:
    """One `baton run` of the workload with an API client; stop() always cleans up."""

    def __init__(self, python: str, run_dir: Path, log_path: Path, params_m: float, start_timeout: float,
                 hot: bool = False):
        from baton.control.client import ApiClient
        from baton.rundir import RunDir

        self.run_dir, self.log_path = run_dir, log_path
        cmd = [python, "-m", "baton.cli", "run", "--nproc", "2", "--spares", "1", "--quiet",
               *(["--hot-spares"] if hot else []),
               "--run-dir", str(run_dir), str(WORKLOAD), "--mode", "baton", "--params-m", f"{params_m:.6f}",
               "--steps", "100000", "--step-sleep", str(STEP_SLEEP)]
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids: set[int] = set()  # every worker pid seen in a status answer
        self.token = ""
        deadline = time.time() + start_timeout
        while True:
            self.check_alive()
            try:
                url, self.token = RunDir(run_dir).read()
                self.client = ApiClient(url, self.token)
                break
            except FileNotFoundError:
                if time.time() > deadline:
                    raise BenchError(f"baton run did not publish its API within {start_timeout:.0f}s; "
                                     f"see {log_path}") from None
                time.sleep(0.2)

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise BenchError(f"the baton job exited early (code {code}); see {self.log_path}")

    def status(self) -> dict:
        self.check_alive()
        st = self.client.status()["jobs"][0]
        for w in [*st["ranks"], *st["spares"]]:
            if w.get("pid"):
                self.pids.add(int(w["pid"]))
        return st

    def wait(self, what: str, timeout: float, pred: Callable[[], Any], every: float = 0.1) -> Any:
        """Poll pred() until it returns something truthy; BenchError naming the log after timeout."""
        deadline = time.time() + timeout
        while True:
            self.check_alive()
            got = pred()
            if got:
                return got
            if time.time() > deadline:
                raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.log_path}")
            time.sleep(every)

    def ready(self, timeout: float, min_step: int = 3, hot: bool = False) -> dict:
        """No operation under way, a warm spare waiting (`hot`: its mirror keeping pace with the
        feeding rank), every rank running at step >= min_step."""
        def pred() -> dict | None:
            st = self.status()
            ok = (st["operation"] is None and st["state"] == "running"
                  and any(s["state"] == "spare" and (not hot or s.get("hot", {}).get("state") == "current")
                          for s in st["spares"])
                  and all(r["state"] == "running" and r["step"] >= min_step for r in st["ranks"]))
            return st if ok else None

        return self.wait(f"the job to be running with a {'hot' if hot else 'warm'} spare", timeout, pred, every=0.2)

    def event(self, event_id: int) -> dict:
        return self.client.events()["events"][event_id - 1]

    def event_count(self) -> int:
        return len(self.client.events()["events"])

    def resolved_event(self, after: int, kind: str, timeout: float) -> dict:
        """The first event of `kind` with id > after, once resolved."""
        def pred() -> dict | None:
            for ev in self.client.events()["events"][after:]:
                if ev["kind"] != kind:
                    continue
                if ev["status"] == "resolved":
                    return ev
                if ev["status"] not in ("in-progress",):
                    raise BenchError(f"{kind} event {ev['id']} ended {ev['status']}: {ev.get('note')}; "
                                     f"see {self.log_path}")
            return None

        return self.wait(f"the {kind} event to resolve", timeout, pred)

    def _ours(self, pid: int) -> bool:
        """A pid is one of this job's workers if its environment carries this job's token."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return f"BATON_TOKEN={self.token}".encode() in env

    def stop(self) -> None:
        """Stop the launcher (it stops its workers), then kill whatever of ours is left."""
        try:
            if self.proc.poll() is None:
                try:
                    self.status()  # records the pids of the workers alive now
                except Exception:  # noqa: BLE001 - the API may be gone already
                    pass
                try:
                    os.kill(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            # Workers run in their own sessions: kill any left (only those carrying our token).
            for pid in sorted(self.pids):
                if self.token and self._ours(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            deadline = time.time() + 30
            while any(self.token and self._ours(p) for p in self.pids) and time.time() < deadline:
                time.sleep(0.1)
            self._log.close()


# ----------------------------------------------------------------------------- one size
def st_step(job: "_Job") -> int:
    """The step every rank has passed: a move's first step after it is done one further on."""
    return min(r["step"] for r in job.status()["ranks"])


def _one_size(mb: float, moves: int, tmp: Path, python: str, hot: bool = True) -> dict:
    params_m = mb * 1e6 / 12 / 1e6  # fp32 params + two fp32 AdamW moments = 12 bytes per param
    tag = f"{mb:g}MB"
    # Bounded waits that grow with the state: building, broadcasting and stepping get slower.
    slack = 1.0 + mb / 100.0
    start_timeout = 120 + 30 * slack
    op_timeout = 60 + 20 * slack
    log_path = tmp / f"downtime-{tag}.log"
    print(f"  [{tag}] starting 2 ranks + 1 spare ({params_m:.2f}M params); log {log_path}", flush=True)
    planned, transfer, unplanned, unplanned_ledger, state_bytes = [], [], [], [], []
    pre_copied: list[float] = []  # the pause of a pre-copied planned move
    fallbacks: list[str] = []  # why a move asked to pre-copy took the whole state instead
    background: list[dict] = []  # what each pre-copy did beside training (the ledger's pre_copy)
    phases: dict[str, list[dict]] = {"planned": [], "pre_copied": [], "unplanned": []}  # each move's ledger phases
    job = _Job(python, tmp / f"run-{tag}", log_path, params_m, start_timeout)
    try:
        job.ready(start_timeout)
        for i in range(moves):
            rank = i % 2
            n = job.event_count()
            job.client.migrate(rank, pre_copy=False)
            ev = job.resolved_event(n, "planned", op_timeout)
            planned.append(ev["downtime_s"])
            transfer.append(ev["transfer_s"])
            phases["planned"].append({**(ev.get("phases") or {}), "joiner_setup": ev.get("joiner_setup_s") or 0.0})
            if ev["state_bytes"]:
                state_bytes.append(int(ev["state_bytes"]))
            print(f"  [{tag}] planned move {i + 1}/{moves} (rank {rank}): downtime {ev['downtime_s']:.3f}s "
                  f"({(ev['state_bytes'] or 0) / 1e6:.1f} MB, transfer {ev['transfer_s'] or 0:.3f}s)", flush=True)

            job.ready(op_timeout, min_step=st_step(job) + 1)
            phases["planned"][-1]["check_after_resume"] = job.event(ev["id"]).get("check_after_resume_s") or 0.0

            n = job.event_count()
            job.client.migrate(1 - rank, pre_copy=True)
            ev = job.resolved_event(n, "planned", op_timeout)
            st = job.ready(op_timeout, min_step=st_step(job) + 1)
            ev = job.event(ev["id"])  # with the joiner's final word on its pre-copy
            pc = ev.get("pre_copy") or {}
            if pc.get("ok"):
                pre_copied.append(ev["downtime_s"])
                phases["pre_copied"].append({**(ev.get("phases") or {}),
                                             "check_after_resume": ev.get("check_after_resume_s") or 0.0})
                background.append(pc)
                print(f"  [{tag}] pre-copied planned move {i + 1}/{moves} (rank {1 - rank}): pause "
                      f"{ev['downtime_s']:.3f}s ({(ev['state_bytes'] or 0) / 1e6:.2f} MB in it); beside training: "
                      f"{pc['base_bytes'] / 1e6:.1f} MB in {pc['base_s']:.3f}s, then {pc['steps']} optimizer steps "
                      "followed", flush=True)
            else:  # it took the whole state in its pause: counted apart, never as a pre-copied pause
                fallbacks.append(pc.get("detail") or "no pre-copy ran")
                print(f"  [{tag}] pre-copied planned move {i + 1}/{moves} (rank {1 - rank}) fell back to the whole "
                      f"state ({fallbacks[-1]}): downtime {ev['downtime_s']:.3f}s", flush=True)
            victim = (i + 1) % 2
            pid = next(r["pid"] for r in st["ranks"] if r["rank"] == victim)
            n = job.event_count()
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            ev = job.resolved_event(n, "unplanned", op_timeout)
            unplanned.append(ev["resumed_at"] - t_kill)
            unplanned_ledger.append(ev["downtime_s"])
            phases["unplanned"].append({**(ev.get("phases") or {}), "joiner_setup": ev.get("joiner_setup_s") or 0.0})
            print(f"  [{tag}] unplanned recovery {i + 1}/{moves} (kill -9 rank {victim}): kill -> all formed "
                  f"{ev['resumed_at'] - t_kill:.3f}s (ledger downtime {ev['downtime_s']:.3f}s)", flush=True)
            job.ready(op_timeout, min_step=st_step(job) + 1)
            phases["unplanned"][-1]["check_after_resume"] = job.event(ev["id"]).get("check_after_resume_s") or 0.0
    finally:
        job.stop()

    if not state_bytes:
        raise BenchError(f"no planned move reported its state size; see {log_path}")
    nbytes = int(statistics.median(state_bytes))
    # Raw copies of the same bytes, right after the job stopped (no rank competes for the CPU).
    # One untimed copy of each kind first: allocation and pre-faulting are not part of a copy.
    rawcopy.tcp_copy_s(nbytes)
    rawcopy.shm_copy_s(nbytes)
    tcp, shm = [], []
    for i in range(moves):
        tcp.append(rawcopy.tcp_copy_s(nbytes))
        shm.append(rawcopy.shm_copy_s(nbytes))
        print(f"  [{tag}] raw copy {i + 1}/{moves} of {nbytes / 1e6:.1f} MB: tcp {tcp[-1]:.4f}s "
              f"({nbytes / tcp[-1] / 1e9:.2f} GB/s), shm {shm[-1]:.4f}s ({nbytes / shm[-1] / 1e9:.2f} GB/s)",
              flush=True)
    rawcopy.close()  # frees both sides' buffers before the next, bigger job

    out = {"state_mb": mb, "state_bytes": nbytes, "params": nbytes // 12,
           "params_requested": round(params_m * 1e6),
           "planned_s": median_range(planned), "pre_copied_s": median_range(pre_copied),
           "unplanned_s": median_range(unplanned),
           "unplanned_ledger_s": median_range(unplanned_ledger), "transfer_s": median_range(transfer),
           "raw_tcp_s": median_range(tcp), "raw_shm_s": median_range(shm)}
    # Where each kind's downtime went, phase by phase (the ledger's), medians over the moves.
    out["phases"] = {kind: {k: median_range([p.get(k, 0.0) for p in runs])
                            for k in dict.fromkeys(k for p in runs for k in p)}
                     for kind, runs in phases.items() if runs}
    # A pre-copy's work beside training: the joiner's copy of the replicated state, the optimizer
    # steps it followed, and what feeding it cost the leaver's steps (one copy of the state at a
    # boundary; each step's gradients captured).
    out["pre_copy"] = {
        "fallbacks": fallbacks,
        "base_s": median_range([b["base_s"] for b in background]),
        "base_bytes": int(statistics.median(b["base_bytes"] for b in background)) if background else None,
        "steps_followed": median_range([b["steps"] for b in background]),
        "leaver_base_s": median_range([b.get("leaver_base_s", 0.0) for b in background]),
        "leaver_capture_s_per_step": median_range([b.get("leaver_capture_s", 0.0) / max(1, b.get("leaver_steps", 0))
                                                   for b in background]),
    }
    out["hot"] = _hot_recoveries(mb, min(moves, HOT_MOVES), tmp, python) if hot else None
    if out["hot"]:
        out["hot_unplanned_s"] = out["hot"]["unplanned_s"]
        out["hot_planned_s"] = out["hot"]["planned_s"]
    out["planned_over_tcp"] = ratio(out["planned_s"]["median"], out["raw_tcp_s"]["median"])
    out["unplanned_over_tcp"] = ratio(out["unplanned_s"]["median"], out["raw_tcp_s"]["median"])
    pc_s = out["pre_copied_s"]["median"]
    print(f"  [{tag}] {nbytes / 1e6:.1f} MB: planned {out['planned_s']['median']:.3f}s (pre-copied: pause "
          f"{f'{pc_s:.3f}s' if pc_s is not None else 'none'}, {len(fallbacks)} fell back), unplanned "
          f"{out['unplanned_s']['median']:.3f}s, raw tcp {out['raw_tcp_s']['median']:.4f}s, raw shm "
          f"{out['raw_shm_s']['median']:.4f}s -> planned/tcp {out['planned_over_tcp']:.2f}x, "
          f"unplanned/tcp {out['unplanned_over_tcp']:.2f}x", flush=True)
    return out


def _hot_recoveries(mb: float, moves: int, tmp: Path, python: str) -> dict:
    """`moves` unplanned recoveries of a job run with --hot-spares: each waits for the spare's
    mirror to keep pace, then kills rank 1 (rank 0 feeds the spare: its loss is the case where
    the mirror may lack the last step, counted under `fallbacks` when it happens)."""
    params_m = mb * 1e6 / 12 / 1e6
    tag = f"{mb:g}MB-hot"
    slack = 1.0 + mb / 100.0
    start_timeout, op_timeout = 120 + 30 * slack, 60 + 20 * slack
    log_path = tmp / f"downtime-{tag}.log"
    print(f"  [{tag}] starting 2 ranks + 1 hot spare; log {log_path}", flush=True)
    kill_to_formed, ledger, moved, fallbacks, phases, setup, planned = [], [], [], [], [], [], []
    job = _Job(python, tmp / f"run-{tag}", log_path, params_m, start_timeout, hot=True)
    try:
        for i in range(moves):
            job.ready(start_timeout if i == 0 else op_timeout, min_step=st_step(job) + 1, hot=True)
            n = job.event_count()
            job.client.migrate(1, pre_copy=False)  # to the hot spare: the pause moves the leaver's own state only
            ev = job.resolved_event(n, "planned", op_timeout)
            if (ev.get("hot_spare") or {}).get("used"):
                planned.append(ev["downtime_s"])
                print(f"  [{tag}] planned move {i + 1}/{moves} (rank 1) to the hot spare: pause {ev['downtime_s']:.3f}s "
                      f"({(ev.get('state_bytes') or 0) / 1e6:.3f} MB in it)", flush=True)
            else:
                fallbacks.append("planned: " + ((ev.get("hot_spare") or {}).get("detail") or "no hot spare took it"))
            st = job.ready(op_timeout, min_step=st_step(job) + 1, hot=True)
            pid = next(r["pid"] for r in st["ranks"] if r["rank"] == 1)
            n = job.event_count()
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            ev = job.resolved_event(n, "unplanned", op_timeout)
            hot = ev.get("hot_spare") or {}
            if not hot.get("used"):
                fallbacks.append(hot.get("detail") or "no hot spare took the rank")
                print(f"  [{tag}] recovery {i + 1}/{moves}: the spare's mirror was not used ({fallbacks[-1]})",
                      flush=True)
                continue
            kill_to_formed.append(ev["resumed_at"] - t_kill)
            ledger.append(ev["downtime_s"])
            moved.append(ev.get("state_bytes") or 0)
            setup.append(ev.get("joiner_setup_s") or 0.0)
            phases.append({**(ev.get("phases") or {}), "joiner_setup": ev.get("joiner_setup_s") or 0.0,
                           "mirror_catch_up": hot.get("catch_up_s", 0.0)})
            print(f"  [{tag}] recovery {i + 1}/{moves} (kill -9 rank 1) from the hot spare's mirror: kill -> all "
                  f"formed {kill_to_formed[-1]:.3f}s (ledger downtime {ev['downtime_s']:.3f}s, of it the joiner's "
                  f"setup {setup[-1]:.3f}s; {moved[-1] / 1e6:.3f} MB moved)", flush=True)
        st = job.ready(op_timeout, min_step=st_step(job) + 1)
    finally:
        job.stop()
    hot_log = [json.loads(line) for line in (tmp / f"run-{tag}" / "events.jsonl").read_text().splitlines()
               if '"hot-spare"' in line] if (tmp / f"run-{tag}" / "events.jsonl").exists() else []
    return {"planned_s": median_range(planned),
            "unplanned_s": median_range(kill_to_formed), "unplanned_ledger_s": median_range(ledger),
            "ledger_minus_setup_s": median_range([d - s for d, s in zip(ledger, setup)]),
            "bytes_moved": median_range(moved), "fallbacks": fallbacks,
            "phases": {k: median_range([p.get(k, 0.0) for p in phases]) for k in dict.fromkeys(k for p in phases for k in p)},
            "bytes_per_step": median_range([h["data"]["bytes_per_step"] for h in hot_log]),
            "replay_s": median_range([h["data"]["replay_s"] for h in hot_log]),
            "base_s": median_range([h["data"]["base_s"] for h in hot_log])}


def _fit(sizes: list[dict], key: str) -> dict | None:
    """Least-squares downtime_median = slope * raw_tcp_median + intercept_s over the sizes."""
    pts = [(s["raw_tcp_s"]["median"], s[key]["median"]) for s in sizes
           if s["raw_tcp_s"]["median"] is not None and s[key]["median"] is not None]
    if len({x for x, _ in pts}) < 2:
        return None  # a line needs two distinct sizes
    import numpy as np

    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    slope, intercept = np.polyfit(x, y, 1)
    return {"slope": float(slope), "intercept_s": float(intercept)}


def bench_downtime(sizes_mb: list[float], moves: int, tmp: Path, python: str = sys.executable) -> dict:
    """Planned and unplanned downtime per state size, next to raw TCP/shm copies; see the module doc."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"migration downtime vs state size ({', '.join(f'{s:g}' for s in sizes_mb)} MB), "
          f"2 ranks + 1 warm spare, {moves} planned + {moves} unplanned per size:", flush=True)
    sizes = [_one_size(mb, moves, tmp, python) for mb in sizes_mb]
    fit = {"planned": _fit(sizes, "planned_s"), "unplanned": _fit(sizes, "unplanned_s")}
    for k, f in fit.items():
        if f:
            print(f"  fit {k}: downtime = {f['slope']:.3f} x raw_tcp + {f['intercept_s']:.3f}s", flush=True)
    return {"nproc": 2, "spares": 1, "moves": moves, "step_sleep_s": STEP_SLEEP, "sizes": sizes, "fit": fit}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,1000", help="state sizes in MB (params + AdamW), comma-separated")
    p.add_argument("--moves", type=int, default=3, help="planned moves and unplanned recoveries per size")
    p.add_argument("--tmp", default=None, help="where run directories and job logs go (default: a new temp dir)")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs baton")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    tmp = Path(args.tmp) if args.tmp else Path(tempfile.mkdtemp(prefix="baton-downtime-"))
    result = bench_downtime([float(s) for s in args.sizes.split(",")], args.moves, tmp, args.python)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
