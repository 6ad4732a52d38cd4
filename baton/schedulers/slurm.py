"""Slurm scheduler: every worker is a job step (`srun`) of the allocation baton runs in.

baton decides, Slurm starts and stops: a worker on slot `n3/1` is `srun --jobid J --overlap
-N1 -n1 -w n3 python train.py ...`, named `baton-<worker id>` so it can be found again, and
killed with `scancel --signal=KILL J.<step>` (the signal reaches the task at once; killing
only the local srun would leave the task running until Slurm's KillWait). A step's end is
reported with the same convention as the local scheduler: its exit code, or minus the
signal that killed it (srun exits with 128 + the signal).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from baton.schedulers.processes import WorkerProcesses
from baton.worker import orphan

PROBE_TIMEOUT_S = 20.0
BORROW_WAIT_S = 60  # how long Slurm may take to grant a borrowed node (preemption included)
log = logging.getLogger("baton.slurm")


class SlurmError(RuntimeError):
    """The allocation cannot hold the job, or Slurm refused a command."""


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation this process runs in (from the variables salloc/sbatch set)."""

    job_id: str
    nodes: list[str]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Allocation":
        env = dict(os.environ if env is None else env)
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        node_list = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job_id or not node_list:
            raise SlurmError("not inside a Slurm allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): run "
                             "baton inside `salloc` or an `sbatch` script, or use --scheduler local")
        out = _slurm(["scontrol", "show", "hostnames", node_list], env)
        return cls(job_id=job_id, nodes=out.split())

    def node_addr(self, node: str) -> str:
        """The address Slurm reaches `node` at (its NodeAddr; the name where it has none)."""
        try:
            out = _slurm(["scontrol", "show", "node", node], dict(os.environ))
        except SlurmError:
            return node
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith("NodeAddr=")), node)


def in_allocation(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST"))


def plan_slots(alloc: Allocation, nodes: int, per_node: int, spare_nodes: int) -> list[str]:
    """Slots `node/i`, node by node: the first `nodes` nodes hold the ranks in order (rank r
    on node r // per_node, as torchrun places them), the next `spare_nodes` the spares."""
    wanted = nodes + spare_nodes
    if len(alloc.nodes) < wanted:
        raise SlurmError(f"the allocation has {len(alloc.nodes)} node(s) ({', '.join(alloc.nodes)}) but "
                         f"--nodes {nodes} + --spare-nodes {spare_nodes} need {wanted}: allocate more "
                         "(sbatch/salloc -N) or ask for fewer")
    return [f"{n}/{i}" for n in alloc.nodes[:wanted] for i in range(per_node)]


def node_of(slot: str) -> str:
    return slot.rsplit("/", 1)[0]


class SlurmScheduler:
    def __init__(self, alloc: Allocation, slots: list[str], script: str, script_args: list[str],
                 env: dict[str, str], on_exit: Callable[[str, int], None] | None = None,
                 python: str = sys.executable, borrow_partition: str | None = None):
        self.alloc = alloc
        self._slots = list(slots)
        self.borrow_partition = borrow_partition
        self._borrowed: dict[str, str] = {}  # node -> the job id of the allocation that holds it
        self.script = script
        self.script_args = script_args
        self.base_env = env
        self.python = python
        self._procs = WorkerProcesses(on_exit, exit_code=_signal_as_negative)

    def slots(self) -> list[str]:
        return list(self._slots)

    def start(self, worker_id: str, slot: str) -> int:
        env = {**self.base_env, "BATON_WORKER_ID": worker_id, "BATON_SLOT": slot}
        env.pop("BATON_PARENT_PID", None)  # the task's parent is slurmstepd, not this process
        job = self._borrowed.get(node_of(slot), self.alloc.job_id)
        argv = ["srun", "--jobid", job, "--overlap", "--nodes=1", "--ntasks=1",
                f"--nodelist={node_of(slot)}", f"--job-name={_step_name(worker_id)}", "--kill-on-bad-exit=0",
                "--export=ALL", "--quiet", self.python, self.script, *self.script_args]
        # srun dies with the launcher, and Slurm then ends its step
        return self._procs.start(worker_id, argv, env=env, preexec_fn=orphan.ask_to_die_with_parent,
                                 start_new_session=True).pid

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        """Kill a worker's step, on a thread: scancel waits for slurmctld, which waits for the
        node, and a dead node's slurmd answers nothing for Slurm's message timeout (~20 s);
        the orchestrator must not wait with it."""
        threading.Thread(target=self._kill, args=(worker_id, dump_stacks), name=f"baton-kill-{worker_id}",
                         daemon=True).start()

    def _kill(self, worker_id: str, dump_stacks: bool) -> None:
        proc = self._procs.running(worker_id)
        if proc is None:
            return
        step = self._steps().get(worker_id)
        if step is None:  # not a step yet (srun still asking for it): stopping srun is enough
            proc.kill()
            return
        if dump_stacks:
            self._signal(step, "USR1")
            time.sleep(0.2)
        self._signal(step, "KILL")

    def pid(self, worker_id: str) -> int | None:
        return self._procs.pid(worker_id)

    def alive(self) -> list[str]:
        return self._procs.alive()

    def probe_node(self, node: str, done: Callable[[bool, str], None]) -> None:
        """Whether `node` still runs a step (`srun -w NODE true`), answered on a thread of its
        own: a dead node's slurmd does not answer, and srun gives up after Slurm's message
        timeout (10 s by default), bounded here by PROBE_TIMEOUT_S."""

        def probe() -> None:
            argv = ["srun", "--jobid", self.alloc.job_id, "--overlap", "--nodes=1", "--ntasks=1",
                    f"--nodelist={node}", "--job-name=baton-probe", "--quiet", "true"]
            try:
                r = subprocess.run(argv, env=self.base_env, capture_output=True, text=True,
                                   timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                done(False, f"srun on {node} did not finish within {PROBE_TIMEOUT_S:g}s")
                return
            except OSError as exc:
                done(False, f"srun could not run: {exc}")
                return
            lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
            done(r.returncode == 0, lines[0][:300] if lines else f"srun exited with code {r.returncode}")

        threading.Thread(target=probe, name=f"baton-probe-{node}", daemon=True).start()

    def probe_links(self, node: str, names: list[str], done: Callable[[dict[str, bool], str], None]) -> None:
        """The state of `node`'s data links, read there (`ip -o link show`, in the node's
        network namespace, as a job step), answered on a thread: up means up and running."""

        def probe() -> None:
            argv = ["srun", "--jobid", self.alloc.job_id, "--overlap", "--nodes=1", "--ntasks=1",
                    f"--nodelist={node}", "--job-name=baton-links", "--quiet", "ip", "-o", "link", "show"]
            try:
                r = subprocess.run(argv, env=self.base_env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            except (subprocess.TimeoutExpired, OSError) as exc:
                done({}, f"could not read {node}'s links: {exc}")
                return
            up = {}
            for line in r.stdout.splitlines():
                fields = line.split()
                if len(fields) > 2:
                    name = fields[1].rstrip(":").split("@")[0]
                    flags = fields[2].strip("<>").split(",")
                    if name in names:
                        up[name] = "UP" in flags and "LOWER_UP" in flags
            done(up, "" if r.returncode == 0 else r.stderr.strip()[:300])

        threading.Thread(target=probe, name=f"baton-links-{node}", daemon=True).start()

    def borrow(self, done: Callable[[str | None, str], None]) -> None:
        """Ask Slurm for one more whole node, on a thread: an exclusive allocation that Slurm
        grants by preempting (requeueing) a lower-priority job where no node is free. Answers
        done(node, lender) with who had it, or done(None, why)."""

        def ask() -> None:
            before = self._running_jobs()
            argv = ["salloc", "--no-shell", "--exclusive", "--nodes=1", f"--immediate={BORROW_WAIT_S}",
                    f"--job-name=baton-borrow-{self.alloc.job_id}",
                    *([f"--partition={self.borrow_partition}"] if self.borrow_partition else [])]
            try:
                r = subprocess.run(argv, env=self.base_env, capture_output=True, text=True,
                                   timeout=BORROW_WAIT_S + 15)
            except (OSError, subprocess.TimeoutExpired) as exc:
                done(None, f"salloc: {exc}")
                return
            granted = re.search(r"Granted job allocation (\d+)", r.stderr)
            if r.returncode != 0 or granted is None:
                lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
                done(None, lines[-1][:300] if lines else f"salloc exited with code {r.returncode}")
                return
            job = granted.group(1)
            try:
                node = _slurm(["squeue", "-h", "-j", job, "-o", "%N"], self.base_env).strip()
            except SlurmError as exc:
                _slurm_quiet(["scancel", job], self.base_env)
                done(None, str(exc))
                return
            self._borrowed[node] = job
            lenders = [f"job {j} ({name}, {user}, partition {part})" for j, name, user, part, nodes in before
                       if node in _hostnames(nodes, self.base_env) and j != job]
            done(node, ", ".join(lenders) or "a free node (nobody was preempted)")

        threading.Thread(target=ask, name="baton-borrow", daemon=True).start()

    def release(self, node: str) -> None:
        """Give a borrowed node back: its lender, requeued by Slurm, can run there again."""
        job = self._borrowed.pop(node, None)
        if job is not None:
            _slurm_quiet(["scancel", job], self.base_env)

    def _running_jobs(self) -> list[tuple[str, str, str, str, str]]:
        try:
            out = _slurm(["squeue", "-h", "-t", "R", "-o", "%i|%j|%u|%P|%N"], self.base_env)
        except SlurmError:
            return []
        rows = [tuple(line.split("|")) for line in out.splitlines() if line.count("|") == 4]
        return [r for r in rows if r[0] != self.alloc.job_id]  # type: ignore[misc]

    def drain(self, node: str, reason: str) -> None:
        """Slurm places nothing new on `node` and shows why (`sinfo -R`)."""
        try:
            _slurm(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"], self.base_env)
        except SlurmError as exc:
            log.warning("could not drain %s in Slurm: %s", node, exc)

    def resume(self, node: str) -> None:
        try:
            _slurm(["scontrol", "update", f"nodename={node}", "state=resume"], self.base_env)
        except SlurmError as exc:
            log.warning("could not resume %s in Slurm: %s", node, exc)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every remaining step (SIGTERM, then SIGKILL after the grace)."""
        self._procs.shutdown(lambda procs: self._signal_steps(procs, "CONT", "TERM"),
                             lambda left: self._signal_steps(left, "KILL"), grace_s)
        for node in list(self._borrowed):
            self.release(node)

    # ---------------------------------------------------------------- internals
    def _steps(self) -> dict[str, str]:
        """Worker id -> its step id (J.S), for the steps running now: one squeue for all."""
        jobs = ",".join([self.alloc.job_id, *self._borrowed.values()])
        try:
            out = _slurm(["squeue", "-h", "-s", "-j", jobs, "-o", "%i %j"], self.base_env)
        except SlurmError:
            return {}
        names = {_step_name(w): w for w in self._procs.alive()}
        return {names[parts[1]]: parts[0] for parts in map(str.split, out.splitlines())
                if len(parts) == 2 and parts[1] in names}

    def _signal_steps(self, procs: dict[str, subprocess.Popen], *signals: str, wait_s: float = 2.0) -> None:
        """Signal the steps of `procs` in parallel, waiting at most `wait_s`: scancel of a step
        on a dead node blocks for Slurm's message timeout, and shutdown must not wait on it (the
        local srun is killed after the grace, and Slurm ends a step whose srun is gone)."""
        steps = self._steps()

        def signal_one(step: str) -> None:
            for sig in signals:
                self._signal(step, sig)

        threads = [threading.Thread(target=signal_one, args=(steps[w],), daemon=True) for w in procs if w in steps]
        for t in threads:
            t.start()
        deadline = time.time() + wait_s
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.time()))

    def _signal(self, step: str, sig: str) -> None:
        try:
            _slurm(["scancel", f"--signal={sig}", step], self.base_env)
        except SlurmError:
            pass  # the step ended meanwhile


def _step_name(worker_id: str) -> str:
    return f"baton-{worker_id}"


def _signal_as_negative(code: int) -> int:
    """srun exits with 128 + the signal that killed its task: report it as the local
    scheduler does, minus the signal."""
    return -(code - 128) if code > 128 else code


def _slurm(argv: list[str], env: dict[str, str]) -> str:
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{' '.join(argv)}: {exc}") from exc
    if r.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[:300]}")
    return r.stdout


def _slurm_quiet(argv: list[str], env: dict[str, str]) -> None:
    try:
        _slurm(argv, env)
    except SlurmError as exc:
        log.warning("%s", exc)


def _hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    try:
        return _slurm(["scontrol", "show", "hostnames", nodelist], env).split()
    except SlurmError:
        return []


