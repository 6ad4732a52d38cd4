"""Test helper: run a real `baton run` job in a subprocess and poke it like a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from baton.control.client import ApiClient
from baton.rundir import RunDir

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "baton" / "examples" / "train.py"


class Job:
    """`launch` goes before `baton run` (e.g. `salloc -N3` to run it inside a Slurm allocation)."""

    def __init__(self, tmp: Path, nproc: int = 3, spares: int = 1, steps: int = 40,
                 script_args: list[str] | None = None, run_args: list[str] | None = None,
                 env: dict[str, str] | None = None, name: str = "job", script: Path = TRAIN,
                 run_dir: Path | None = None, launch: list[str] | None = None, out_arg: bool = True,
                 leash: int = 0, leash_cap: int | None = None, leash_from: int = 0):
        """`leash`: the ranks run at most that many steps ahead of the furthest step the test last saw
        (a wait's status reads move it on), never past `leash_cap` (where they hold, taking
        commands), until `wait` lets go (tests/inject/baton_test_faults.py, BATON_TEST_LEASH): a
        test's faults then land mid-run on a slow machine, where the test itself is starved,
        and on a fast one, where the run would end first. `leash_from`: the step a resumed run
        starts at (its ranks show step 0 until they have run one)."""
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.leash, self.leash_cap, self.leash_file = leash, leash_cap, self.dir / "leash"
        self.leash_from = leash_from
        if leash:
            self.leash_file.write_text(str(leash_from + leash))
            inject = str(REPO / "tests" / "inject")
            path = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p and p != inject]
            env = {**(env or {}), "PYTHONPATH": os.pathsep.join([inject, *path]),
                   "BATON_TEST_LEASH": str(self.leash_file)}
        self.out = self.dir / "final.pt"
        self.run_dir = run_dir or self.dir / "run"
        cmd = [*(launch or []), sys.executable, "-m", "baton.cli", "run", "--nproc", str(nproc), "--spares", str(spares),
               "--run-dir", str(self.run_dir), *(run_args or []), str(script),
               *(["--steps", str(steps)] if script == TRAIN else []),
               *(["--out", str(self.out)] if out_arg else []), *(script_args or [])]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.stdout = open(self.dir / "stdout.log", "w")
        self.stderr_path = self.dir / "stderr.log"
        self.stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.dir, env=full_env, stdout=self.stdout, stderr=self.stderr,
                                     start_new_session=True)
        self._client: ApiClient | None = None

    @property
    def client(self) -> ApiClient:
        if self._client is None:
            deadline = time.time() + 60
            while True:
                try:
                    url, token = RunDir(self.run_dir).read()
                    if not url or not token:  # read while the launcher was writing it
                        raise FileNotFoundError(self.run_dir)
                    self._client = ApiClient(url, token)
                    break
                except FileNotFoundError:
                    if time.time() > deadline or self.proc.poll() is not None:
                        raise AssertionError(f"job never came up:\n{self.log()}")
                    time.sleep(0.1)
        return self._client

    def status(self) -> dict[str, Any]:
        return self.client.status()["jobs"][0]

    def wait_spare(self, timeout: float = 120.0) -> dict[str, Any]:
        """Until a spare is ready to take a rank: a move asked for before then is refused ("no
        spare available"), and on a busy machine the spare's start can lag the first steps."""
        return self.wait_until(lambda st: any(s["state"] == "spare" for s in st["spares"]), timeout=timeout,
                               what="a spare ready")

    def wait_until(self, predicate, timeout: float = 60.0, what: str = "condition",
                   pull: bool | Callable[[dict[str, Any]], bool] = True) -> dict[str, Any]:
        """Until `predicate(status)`. A leashed job's ranks go on as the test sees them (`pull`),
        or only while `pull(status)` holds: a wait for something else (a spare starting) then
        costs the run no steps."""
        deadline = time.time() + timeout
        last = "none yet"  # the last status read, or why it failed: said when the wait fails
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"job exited ({self.proc.returncode}) while waiting for {what} "
                                     f"(last status: {last}):\n{self.log()}")
            try:
                st = self.status()
            except Exception as exc:  # noqa: BLE001 - the API may be momentarily busy
                last = f"{type(exc).__name__}: {exc}"[:500]
                time.sleep(0.1)
                continue
            last = json.dumps({k: st.get(k) for k in ("state", "ranks")}, default=str)[:500]
            if pull is True or (callable(pull) and pull(st)):
                self._pull_leash(st)
            if predicate(st):
                return st
            time.sleep(0.1)  # each read costs the job's control plane CPU: 17 a second took ~8% of a core
        raise AssertionError(f"timed out waiting for {what} (last status: {last}):\n{self.log()}")

    def _pull_leash(self, st: dict[str, Any]) -> None:
        if self.leash and self.leash_file.exists() and st.get("ranks"):
            # The furthest rank: a rank unheard for a while (its control link down) shows a stale step.
            gate = max(self.leash_from, *(r["step"] for r in st["ranks"])) + self.leash
            if self.leash_cap is not None:
                gate = min(gate, self.leash_cap)
            if gate > int(self.leash_file.read_text() or 0):
                tmp = self.leash_file.with_suffix(".new")
                tmp.write_text(str(gate))
                tmp.replace(self.leash_file)  # the ranks never read a half-written step

    def let_go(self) -> None:
        """The ranks run on to the end (a leashed job)."""
        self.leash_file.unlink(missing_ok=True)

    def wait_step(self, step: int, timeout: float = 60.0) -> dict[str, Any]:
        """Every rank at `step` or past it; a leashed job's ranks hold at its cap, so a wait for
        a step past the cap waits for the cap (a slow machine's moves landing late had a test
        wait for step 20 of ranks held at 18: CI, after two moves that ended at step 16)."""
        if self.leash and self.leash_cap is not None and self.leash_file.exists():
            step = min(step, self.leash_cap)
        return self.wait_until(lambda st: st["state"] == "running" and min(r["step"] for r in st["ranks"]) >= step,
                               timeout, f"step {step}")

    def rank_pid(self, rank: int) -> int:
        return next(r["pid"] for r in self.status()["ranks"] if r["rank"] == rank)

    def store_pid(self, timeout: float = 30.0) -> int:
        """The pid of the job's rendezvous store process (under `baton run`: forked by its zygote,
        which `baton warm` may have forked, or the launcher's own child)."""
        deadline = time.time() + timeout
        while True:
            parents, cmdlines = {}, {}
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                    cmdlines[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
                except (OSError, ValueError, IndexError):
                    continue
            # its zygote: the launcher's child, or a fork of `baton warm` that names the launcher
            ours = {pid for pid, cmdline in cmdlines.items() if parents.get(pid) == self.proc.pid
                    or f"(forked by baton warm for launcher {self.proc.pid})".encode() in cmdline}
            for pid, cmdline in cmdlines.items():
                if b"baton.store.rendezvous_process" in cmdline and (
                        parents.get(pid) == self.proc.pid or parents.get(pid) in ours):
                    return pid
            assert time.time() < deadline, f"no rendezvous store process under {self.proc.pid}:\n{self.log()}"
            time.sleep(0.1)

    def signal_rank(self, rank: int, sig: int) -> int:
        pid = self.rank_pid(rank)
        os.kill(pid, sig)
        return pid

    def wait(self, timeout: float = 120.0, stall: float = 60.0) -> int:
        """Until the job exits, its exit code. Bounded by progress, not by a guess of how fast a
        shared machine runs it: past `timeout` it goes on waiting while the job moves (a rank's
        step, the job's state or operation changed), and fails, with the log, once nothing
        moved for `stall` seconds: a hang fails at `timeout`, a slow machine passes."""
        self.let_go()
        begun = time.time()
        seen, moved_at = None, begun
        try:
            while True:
                try:
                    return self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                try:
                    st = self.status()
                    now = (st["state"], st.get("operation"), tuple(r["step"] for r in st["ranks"]))
                except Exception:  # noqa: BLE001 - the API may be momentarily busy, or the job ending
                    now = seen
                if now != seen:
                    seen, moved_at = now, time.time()
                if time.time() - begun > timeout and time.time() - moved_at > stall:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
                    raise AssertionError(f"job did not finish in {timeout:.0f}s and made no progress in the last "
                                         f"{stall:.0f}s (last seen: {seen}):\n{self.log()}")
        finally:
            self.stdout.close()
            self.stderr.close()

    def wait_progress(self, stall: float = 90.0) -> int:
        """Until the job exits, however long, as long as it makes progress (see `wait`)."""
        return self.wait(timeout=stall, stall=stall)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log(self, tail: int | None = 6000) -> str:
        if not self.stderr.closed:
            self.stderr.flush()
        text = self.stderr_path.read_text()
        return text[-tail:] if tail else text

    def events(self) -> list[dict[str, Any]]:
        """The ledger: from the API while the job runs (a wait polls it, and a `baton events`
        process per poll took seconds on a busy machine, longer than a short job's steps),
        else as `baton events` reads it from the ended job's run directory."""
        if self.proc.poll() is None:
            try:
                return self.client.events()["events"]
            except Exception:  # noqa: BLE001 - ended meanwhile, or momentarily busy: ask the CLI
                pass
        out = subprocess.run([sys.executable, "-m", "baton.cli", "events", "--json", "--run-dir",
                              str(self.run_dir)], capture_output=True, text=True, cwd=self.dir, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["events"]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics read as Prometheus reads it: (name, labels other than the job's) -> value."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        token = (self.run_dir / "token").read_text()
        r = httpx.get(self.client.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        out = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job")))] = s.value
        return out

    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out)

    def all_rank_params(self, nproc: int) -> list[dict[str, torch.Tensor]]:
        """Every rank's final-state file (OUT.rankN)."""
        return [torch.load(f"{self.out}.rank{r}") for r in range(nproc)]


def state_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ in any bit (also dtype or shape), or that one side lacks."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    out = []
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            out.append(k)
            continue
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(raw(x), raw(y)):
                out.append(k)
        elif x != y:
            out.append(k)
    return out


def assert_ranks_equal(job: Job, reference: list[dict[str, Any]]) -> None:
    """Every rank's full final state equals the failure-free run's, bit for bit."""
    for rank, (got, want) in enumerate(zip(job.all_rank_params(len(reference)), reference)):
        d = state_diff(got, want)
        assert not d, f"rank {rank} differs from the failure-free run in {d}:\n{job.log()}"


def ended_equal(job: Job, reference: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """The job ends with exit 0 and every rank exact; its ledger's events."""
    assert job.wait(timeout=timeout) == 0, job.log()
    assert_ranks_equal(job, reference)
    return job.events()


def check_resolved_exact(job: Job, reference: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """The job ends with exit 0, every rank exact, every ledger event resolved with no step lost."""
    events = ended_equal(job, reference, timeout)
    assert events and all(e["status"] == "resolved" and e["steps_lost"] == 0 for e in events), events
    return events


def bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return not state_diff(a, b)


# The training of a small model-aware script, after `job = baton.init()` and its setup (a
# test's script puts its own lines around it): 60 steps of a linear model over a loader.
AWARE_TRAINING = """
model = job.wrap(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, job.world_size, job.rank, seed=1))
job.track(model=model, optimizer=opt, data=loader)
for step in job.steps(60):
    with step:
        x, y = step.batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
job.finish()
"""
