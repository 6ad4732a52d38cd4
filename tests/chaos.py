"""Seeded chaos for baton: random faults on a real 4-rank `baton run` job, checked against
the failure-free run bit for bit and against the ledger.

One *round* runs the nanoGPT-shaped example (baton/examples/gpt.py) with 4 ranks and 2
warm spares and injects faults one at a time, at random step positions, each after the
job is back to every rank "running" from the previous one:

  kill       kill -9 of a random rank (rank 0 included)          -> one unplanned event
  stop       SIGSTOP of a random rank (detected as hung)          -> one unplanned event, cause "hung"
  migrate    `migrate(rank)`; 409 (no ready spare) = skipped      -> one planned event
  taint      `taint(slot of a rank)`, `untaint` once it moved     -> one pre-emptive event
  spare-kill kill -9 of a warm (or starting) spare                -> no event
  kill2      kill -9 of two ranks at once                         -> two unplanned events

What is injected is drawn up front from `random.Random(seed)` (kind, ranks, how many
steps to wait, a sub-step delay), so a seed names a fault sequence; each block of six
faults holds every kind once. At the end: exit code 0, every rank's final state (and
rank 0's checkpoint) bitwise equal to a failure-free run with the same arguments, one
resolved event per injected rank fault of the right kind with 0 steps lost and no
rollback, nothing else in the ledger, and no wait past its time limit (a hang).

    python -m tests.chaos --rounds 1 --seed 1 --faults 6      # one round (what tests/test_chaos.py runs)
    python -m tests.chaos --minutes 30                        # the soak (`make soak`)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from baton.control.client import ApiError
from tests.gpt_job import GPT
from tests.jobs import Job, state_diff

NPROC = 4
SPARES = 2
RUN_ARGS = ["--heartbeat-timeout", "2", "--op-timeout", "2"]
KINDS = ("kill", "stop", "migrate", "taint", "spare-kill", "kill2")
EVENT_KIND = {"kill": "unplanned", "stop": "unplanned", "kill2": "unplanned", "migrate": "planned",
              "taint": "pre-emptive"}
END_MARGIN = 10  # no fault within this many steps of the end (a planned move there is cancelled)
RECOVERY_TIMEOUT_S = 90.0  # a fault not recovered from in this long is a hang
FINISH_TIMEOUT_S = 150.0


def script_args(max_iters: int) -> list[str]:
    return ["--max-iters", str(max_iters), "--eval-interval", "10", "--step-sleep", "0.04", "--eval-sleep", "0.2"]


def max_iters_for(faults: int) -> int:
    return 40 + 16 * faults


class Hang(AssertionError):
    """A wait ran past its limit: the job did not get where it should have."""


@dataclass
class FaultSpec:
    index: int
    kind: str
    ranks: list[int]  # the rank(s) it hits (unused by spare-kill)
    delay_steps: int  # steps to let pass after the previous fault recovered
    jitter_s: float  # then this long, so faults land anywhere in a step or an evaluation
    pick: float  # which spare a spare-kill takes

    def what(self) -> str:
        if self.kind == "kill2":
            return f"kill -9 ranks {self.ranks[0]}+{self.ranks[1]}"
        return {"kill": f"kill -9 rank {self.ranks[0]}", "stop": f"SIGSTOP rank {self.ranks[0]}",
                "migrate": f"migrate rank {self.ranks[0]}", "taint": f"taint the slot of rank {self.ranks[0]}",
                "spare-kill": "kill -9 a spare"}[self.kind]


@dataclass
class Fault:
    spec: FaultSpec
    outcome: str = "planned"  # injected | skipped | not-reached
    absorbed: bool = False  # the job was back to steady state after it (False: it ended first)
    note: str = ""
    t: float | None = None  # seconds since the job started
    step: int | None = None  # slowest rank's step when injected
    generation: int | None = None
    pids: list[int] = field(default_factory=list)
    slot: str | None = None
    recovered_s: float | None = None  # injection -> every rank running again
    events: list[int] = field(default_factory=list)
    downtimes: list[float] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def rank_fault(self) -> bool:
        return self.kind in EVENT_KIND

    def line(self) -> str:
        s = self.spec
        head = f"#{s.index} {s.what():<28}"
        if self.outcome != "injected":
            return f"{head} {self.outcome}: {self.note}"
        where = f"t={self.t:6.1f}s step {self.step:>3} gen {self.generation}"
        extra = f" pid {'+'.join(map(str, self.pids))}" if self.pids else ""
        extra += f" slot {self.slot}" if self.slot else ""
        rec = f", back in {self.recovered_s:.1f}s" if self.recovered_s is not None else ""
        evs = (f", event {'+'.join(map(str, self.events))} downtime "
               f"{'+'.join(f'{d:.2f}s' for d in self.downtimes)}") if self.events else ""
        return f"{head} {where}{extra}{rec}{evs}{'; ' + self.note if self.note else ''}"


def plan(seed: int, faults: int) -> list[FaultSpec]:
    """The fault sequence a seed names: every block of six holds each kind once."""
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < faults:
        block = list(KINDS)
        rng.shuffle(block)
        kinds += block
    out = []
    for i, kind in enumerate(kinds[:faults], 1):
        ranks = rng.sample(range(NPROC), 2 if kind == "kill2" else 1)
        out.append(FaultSpec(index=i, kind=kind, ranks=ranks, delay_steps=rng.randint(2, 8),
                             jitter_s=round(rng.uniform(0.0, 0.4), 3), pick=rng.random()))
    return out


# ---------------------------------------------------------------------------- state checks
@dataclass
class Reference:
    max_iters: int
    states: list[dict[str, Any]]
    ckpt: dict[str, Any]
    wall_s: float


def reference_run(workdir: Path, max_iters: int) -> Reference:
    """The failure-free run: same script and arguments, no spares."""
    (workdir / "ref" / "ckpt").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    job = Job(workdir, nproc=NPROC, spares=0, steps=0, script=GPT, name="ref", run_args=RUN_ARGS,
              script_args=[*script_args(max_iters), "--out-dir", str(workdir / "ref" / "ckpt")])
    try:
        code = job.wait(timeout=300)
        assert code == 0, f"the reference run failed ({code}):\n{job.log()}"
    finally:
        job.kill()
    ckpt = torch.load(io.BytesIO((workdir / "ref" / "ckpt" / "ckpt.pt").read_bytes()))
    return Reference(max_iters, job.all_rank_params(NPROC), ckpt, time.time() - t0)


# ---------------------------------------------------------------------------- one round
@dataclass
class Round:
    seed: int
    faults: list[Fault]
    max_iters: int
    workdir: Path
    exit_code: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    equal_ranks: int = 0
    tensors: int = 0
    wall_s: float = 0.0
    ref_wall_s: float | None = None
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def downtimes(self) -> list[float]:
        return [e["downtime_s"] for e in self.events if e.get("downtime_s") is not None]

    def report(self) -> str:
        inj = [f for f in self.faults if f.outcome == "injected"]
        lines = [f"chaos round seed={self.seed}: {NPROC} ranks + {SPARES} spares, --max-iters {self.max_iters}, "
                 f"{len(self.faults)} faults planned, {len(inj)} injected "
                 f"({_counts(Counter(f.kind for f in inj))})"]
        lines += ["  " + f.line() for f in self.faults]
        kinds = Counter(e["kind"] for e in self.events)
        lines.append(f"  ledger: {len(self.events)} events ({_counts(kinds)}); "
                     f"statuses {_counts(Counter(e['status'] for e in self.events))}; "
                     f"steps lost {sum(e.get('steps_lost') or 0 for e in self.events)}")
        d = self.downtimes()
        if d:
            lines.append(f"  downtime: median {statistics.median(d):.3f}s, max {max(d):.3f}s (n={len(d)})")
        lines.append(f"  final state: exit code {self.exit_code}, {self.equal_ranks}/{NPROC} ranks bitwise equal "
                     f"to the failure-free run ({self.tensors} entries per rank)")
        ref = f", reference {self.ref_wall_s:.1f}s" if self.ref_wall_s is not None else ""
        lines.append(f"  wall: chaos job {self.wall_s:.1f}s{ref}")
        if self.problems:
            lines.append(f"  FAIL ({len(self.problems)} problems):")
            lines += ["    - " + p for p in self.problems]
            lines.append(f"  work dir: {self.workdir}")
            lines.append("  launcher log (tail):\n" + "\n".join("    " + x for x in self.log_tail.splitlines()[-60:]))
        else:
            lines.append("  PASS")
        return "\n".join(lines)


def _counts(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"


class Driver:
    """Injects one round's faults into a running job and waits out each one."""

    def __init__(self, job: Job, rnd: Round, say: Callable[[str], None]):
        self.job = job
        self.rnd = rnd
        self.say = say
        self.t0 = time.time()
        self.expected_events = 0

    # -- looking at the job
    def _status(self) -> dict[str, Any] | None:
        try:
            return self.job.status()
        except (ApiError, KeyError, IndexError):
            return None

    def _wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any] | None:
        """Poll the job's status until `pred`; None when the job ended first; Hang after `timeout`."""
        deadline = time.time() + timeout
        last: dict[str, Any] | None = None
        while time.time() < deadline:
            if self.job.proc.poll() is not None:
                return None
            st = self._status()
            if st is not None:
                last = st
                if pred(st):
                    return st
            time.sleep(0.1)
        brief = None if last is None else {k: last[k] for k in ("state", "generation", "operation", "ranks", "spares")}
        raise Hang(f"waited {timeout:.0f}s for {what}; last status: {json.dumps(brief)}")

    @staticmethod
    def _steady(st: dict[str, Any]) -> bool:
        return st["state"] == "running" and st["operation"] is None and all(r["state"] == "running"
                                                                          for r in st["ranks"])

    @staticmethod
    def _min_step(st: dict[str, Any]) -> int:
        return min(r["step"] for r in st["ranks"])

    def _events(self) -> list[dict[str, Any]]:
        try:
            return self.job.client.events()["events"]
        except ApiError:
            return []

    # -- the round
    def run(self) -> None:
        st = self._wait(lambda s: self._steady(s) and self._min_step(s) >= 2, 120, "the job to start stepping")
        last_step = 2 if st is None else self._min_step(st)
        for fault in self.rnd.faults:
            if self.job.proc.poll() is not None:
                fault.outcome, fault.note = "not-reached", "the job had ended"
                continue
            target = last_step + fault.spec.delay_steps
            if target > self.rnd.max_iters - END_MARGIN:
                fault.outcome, fault.note = "not-reached", f"step {target} is too close to the end"
                continue
            st = self._wait(lambda s: self._steady(s) and self._min_step(s) >= target, RECOVERY_TIMEOUT_S,
                            f"step {target} before fault #{fault.spec.index}")
            if st is None:
                fault.outcome, fault.note = "not-reached", "the job had ended"
                continue
            time.sleep(fault.spec.jitter_s)
            self._inject(fault)
            self.say("  " + fault.line())
            st = self._status()
            if st is not None:
                last_step = self._min_step(st)

    def _inject(self, fault: Fault) -> None:
        st = self._status()
        if st is None or not self._steady(st):
            fault.outcome, fault.note = "skipped", "the job was not in a steady state"
            return
        fault.t, fault.step, fault.generation = time.time() - self.t0, self._min_step(st), st["generation"]
        pid_of = {r["rank"]: r["pid"] for r in st["ranks"]}
        kind, ranks = fault.kind, fault.spec.ranks
        t_inj = time.time()
        if kind in ("kill", "kill2", "stop"):
            fault.pids = [pid_of[r] for r in ranks]
            sig = signal.SIGSTOP if kind == "stop" else signal.SIGKILL
            for pid in fault.pids:
                os.kill(pid, sig)
        elif kind == "migrate":
            if not any(s["state"] == "spare" for s in st["spares"]):
                # Give a starting spare a few seconds, as an operator would; then take the answer.
                try:
                    st = self._wait(lambda s: self._steady(s) and any(x["state"] == "spare" for x in s["spares"]),
                                    8, "a ready spare") or st
                except Hang:
                    pass
                fault.step = self._min_step(st)
                pid_of = {r["rank"]: r["pid"] for r in st["ranks"]}
            fault.pids = [pid_of[ranks[0]]]
            try:
                self.job.client.migrate(ranks[0])
            except ApiError as exc:
                if self._ended(fault):
                    return
                if exc.status != 409:
                    raise
                fault.outcome, fault.note = "skipped", f"409: {exc}"
                return
        elif kind == "taint":
            fault.pids = [pid_of[ranks[0]]]
            fault.slot = next(r["slot"] for r in st["ranks"] if r["rank"] == ranks[0])
            try:
                res = self.job.client.taint(fault.slot, f"chaos #{fault.spec.index}")
            except ApiError:
                if self._ended(fault):
                    return
                raise
            if "note" in res:
                fault.note = res["note"]
        elif kind == "spare-kill":
            ready = [s for s in st["spares"] if s["state"] == "spare" and s.get("pid")]
            pool = ready or [s for s in st["spares"] if s.get("pid")]
            if not pool:
                fault.outcome, fault.note = "skipped", "no spare process to kill"
                return
            victim = pool[int(fault.spec.pick * len(pool))]
            fault.pids, fault.slot = [victim["pid"]], victim["slot"]
            if not ready:
                fault.note = "a starting spare"
            try:
                os.kill(victim["pid"], signal.SIGKILL)
            except ProcessLookupError:
                fault.outcome, fault.note = "skipped", "the spare had already exited"
                return
        fault.outcome = "injected"
        self._recover(fault, st, t_inj)

    def _ended(self, fault: Fault) -> bool:
        """The job ended just as the fault went in: nothing was injected."""
        time.sleep(0.5)
        if self.job.proc.poll() is None:
            return False
        fault.outcome, fault.note = "not-reached", "the job ended as it was injected"
        return True

    def _recover(self, fault: Fault, before: dict[str, Any], t_inj: float) -> None:
        """Wait until the fault is absorbed: new processes hold the faulted ranks, the ledger has
        its events closed, every rank runs, the generation moved on (or not, for a spare)."""
        if not fault.rank_fault:
            gone = fault.pids[0]
            if self._wait(lambda s: all(x.get("pid") != gone for x in s["spares"]), 30,
                          f"spare {gone} to be dropped") is None:
                return
            fault.absorbed = True
            st = self._status()
            if st is not None and st["generation"] != before["generation"]:
                self.rnd.problems.append(f"fault #{fault.spec.index} ({fault.spec.what()}): the generation moved "
                                         f"{before['generation']} -> {st['generation']}")
            fault.recovered_s = time.time() - t_inj
            return
        self.expected_events += len(fault.spec.ranks)
        old = dict(zip(fault.spec.ranks, fault.pids))
        want = self.expected_events

        def done(st: dict[str, Any]) -> bool:
            if not self._steady(st) or st["generation"] <= before["generation"]:
                return False
            if any(r["pid"] == old[r["rank"]] for r in st["ranks"] if r["rank"] in old):
                return False
            evs = self._events()
            return len(evs) >= want and all(e["status"] != "in-progress" for e in evs)

        what = f"recovery from fault #{fault.spec.index} ({fault.spec.what()})"
        if self._wait(done, RECOVERY_TIMEOUT_S, what) is None:
            fault.note = (fault.note + "; " if fault.note else "") + "the job ended before it was absorbed"
            return
        fault.absorbed = True
        fault.recovered_s = time.time() - t_inj
        if fault.kind == "stop":
            for pid in fault.pids:  # a replaced process must never touch anything again
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if fault.kind == "taint" and fault.slot:
            try:
                self.job.client.untaint(fault.slot)
            except ApiError:
                if self.job.proc.poll() is None:
                    raise
                return
            fault.note = (fault.note + "; " if fault.note else "") + "untainted after the move"


def check_ledger(faults: list[Fault], events: list[dict[str, Any]]) -> list[str]:
    """One closed event per injected rank fault, in order, of the right kind; nothing else."""
    problems = []
    evs = sorted(events, key=lambda e: e["id"])
    i = 0
    for f in faults:
        if f.outcome != "injected" or not f.rank_fault:
            continue
        n = len(f.spec.ranks)
        tag = f"fault #{f.spec.index} ({f.spec.what()})"
        if not f.absorbed and f.kind in ("migrate", "taint"):
            # The job reached its end before the move was seen done: a resolved or cancelled
            # event, or (a taint still waiting for a spare) none at all.
            nxt = evs[i] if i < len(evs) else None
            if nxt is None or nxt["rank"] != f.spec.ranks[0] or nxt["kind"] != EVENT_KIND[f.kind]:
                continue
            if nxt["status"] == "cancelled":
                i += 1
                f.events = [nxt["id"]]
                continue
        got, i = evs[i:i + n], i + n
        if len(got) < n:
            problems.append(f"{tag}: {n} event(s) expected, the ledger has {len(got)} left")
            continue
        f.events = [e["id"] for e in got]
        f.downtimes = [e["downtime_s"] for e in got if e.get("downtime_s") is not None]
        if sorted(e["rank"] for e in got) != sorted(f.spec.ranks):
            problems.append(f"{tag}: events {f.events} are for ranks {[e['rank'] for e in got]}")
        for e in got:
            bad = []
            if e["kind"] != EVENT_KIND[f.kind]:
                bad.append(f"kind {e['kind']!r}, expected {EVENT_KIND[f.kind]!r}")
            if f.kind == "stop" and "hung" not in e["cause"]:
                bad.append(f"cause {e['cause']!r} does not say hung")
            if f.kind in ("kill", "kill2") and "signal 9" not in e["cause"]:
                bad.append(f"cause {e['cause']!r} does not say signal 9")
            if f.kind == "taint" and f.slot and e["from_slot"] != f.slot:
                bad.append(f"from_slot {e['from_slot']!r}, tainted {f.slot!r}")
            if e["status"] != "resolved":
                bad.append(f"status {e['status']!r} ({e.get('note')})")
            if e["steps_lost"] != 0:
                bad.append(f"steps_lost {e['steps_lost']}")
            if e["resolved_without_rollback"] is not True:
                bad.append(f"resolved_without_rollback {e['resolved_without_rollback']}")
            if bad:
                problems.append(f"{tag}: event {e['id']}: " + "; ".join(bad))
    for e in evs[i:]:
        problems.append(f"unexpected event {e['id']}: {e['kind']} rank {e['rank']} cause {e['cause']!r} "
                        f"status {e['status']}")
    return problems


def run_round(workdir: Path, seed: int, faults: int, reference: Reference | None = None,
              say: Callable[[str], None] = print) -> Round:
    """One job with `faults` seeded faults, compared with `reference` (run here when None)."""
    max_iters = max_iters_for(faults) if reference is None else reference.max_iters
    workdir.mkdir(parents=True, exist_ok=True)
    rnd = Round(seed=seed, faults=[Fault(s) for s in plan(seed, faults)], max_iters=max_iters, workdir=workdir)
    if reference is None:
        say(f"chaos seed={seed}: failure-free reference run ({NPROC} ranks, --max-iters {max_iters}) ...")
        reference = reference_run(workdir, max_iters)
        rnd.ref_wall_s = reference.wall_s
    say(f"chaos seed={seed}: {faults} faults on {NPROC} ranks + {SPARES} spares ...")
    (workdir / "chaos" / "ckpt").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    job = Job(workdir, nproc=NPROC, spares=SPARES, steps=0, script=GPT, name="chaos", run_args=RUN_ARGS,
              script_args=[*script_args(max_iters), "--out-dir", str(workdir / "chaos" / "ckpt")])
    try:
        try:
            Driver(job, rnd, say).run()
            rnd.exit_code = job.wait(timeout=FINISH_TIMEOUT_S)
        except Hang as exc:
            rnd.problems.append(f"hang: {exc}")
        except AssertionError as exc:  # Job.wait's "did not finish"
            rnd.problems.append(f"hang: {str(exc).splitlines()[0]}")
    finally:
        job.kill()
        rnd.wall_s = time.time() - t0
        rnd.log_tail = job.log()
    if rnd.exit_code is not None and rnd.exit_code != 0:
        rnd.problems.append(f"the job exited with code {rnd.exit_code}")
    try:
        rnd.events = job.events()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        rnd.problems.append(f"cannot read the ledger: {exc}")
    rnd.problems += check_ledger(rnd.faults, rnd.events)
    if rnd.exit_code == 0:
        for r, want in enumerate(reference.states):
            try:
                got = torch.load(f"{job.out}.rank{r}")
            except FileNotFoundError:
                rnd.problems.append(f"rank {r} wrote no final state")
                continue
            d = state_diff(got, want)
            rnd.tensors = len(want)
            if d:
                rnd.problems.append(f"rank {r} differs from the failure-free run in {len(d)} entries: {d[:12]}")
            else:
                rnd.equal_ranks += 1
        ckpt = torch.load(workdir / "chaos" / "ckpt" / "ckpt.pt")
        want = reference.ckpt
        if ckpt["iter_num"] != want["iter_num"] or ckpt["best_val_loss"] != want["best_val_loss"] or \
                state_diff(ckpt["model"], want["model"]):
            rnd.problems.append("rank 0's checkpoint differs from the failure-free run's")
    return rnd


# ---------------------------------------------------------------------------- soak
def summary(rounds: list[Round], wall_s: float) -> str:
    faults = [f for r in rounds for f in r.faults]
    inj = Counter(f.kind for f in faults if f.outcome == "injected")
    skipped = Counter(f.kind for f in faults if f.outcome == "skipped")
    events = [e for r in rounds for e in r.events]
    d = [x for r in rounds for x in r.downtimes()]
    failed = [r for r in rounds if not r.ok]
    lines = [f"chaos summary: {len(rounds)} rounds, {len(rounds) - len(failed)} passed, {len(failed)} failed, "
             f"wall {wall_s / 60:.1f} min",
             f"  faults injected: {sum(inj.values())} ({_counts(inj)})",
             f"  faults skipped:  {sum(skipped.values())} ({_counts(skipped)})",
             f"  not reached:     {sum(1 for f in faults if f.outcome == 'not-reached')}",
             f"  ledger: {len(events)} events ({_counts(Counter(e['kind'] for e in events))}); "
             f"statuses {_counts(Counter(e['status'] for e in events))}; "
             f"steps lost {sum(e.get('steps_lost') or 0 for e in events)}"]
    if d:
        lines.append(f"  downtime: median {statistics.median(d):.3f}s, max {max(d):.3f}s (n={len(d)})")
    lines.append(f"  final states bitwise equal: {sum(r.equal_ranks for r in rounds)}/{NPROC * len(rounds)} ranks")
    for r in failed:
        lines.append(f"  FAILED seed {r.seed}: {'; '.join(r.problems)[:600]}")
    lines.append("RESULT: " + ("PASS" if not failed and rounds else "FAIL"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="run rounds until this much time has passed")
    p.add_argument("--rounds", type=int, default=None, help="run this many rounds (default 1 without --minutes)")
    p.add_argument("--seed", type=int, default=None, help="first round's seed (default: from the clock); "
                                                          "round i uses seed+i")
    p.add_argument("--faults", type=int, default=12, help="faults per round (default 12)")
    p.add_argument("--workdir", type=Path, default=None, help="keep jobs here (default: a temp dir; "
                                                              "passing rounds are deleted)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    rounds_max = args.rounds if args.rounds is not None else (None if args.minutes else 1)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="baton-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.minutes * 60 if args.minutes else None
    print(f"chaos: seeds from {seed}, {args.faults} faults per round, "
          f"{f'{args.minutes:g} min' if args.minutes else f'{rounds_max} round(s)'}, work dir {base}", flush=True)
    max_iters = max_iters_for(args.faults)
    print(f"failure-free reference run ({NPROC} ranks, --max-iters {max_iters}) ...", flush=True)
    reference = reference_run(base / "reference", max_iters)
    print(f"  done in {reference.wall_s:.1f}s", flush=True)
    rounds: list[Round] = []
    longest = 0.0
    while True:
        if rounds_max is not None and len(rounds) >= rounds_max:
            break
        if deadline is not None and rounds and time.time() + longest > deadline:
            break
        s = seed + len(rounds)
        t = time.time()
        rnd = run_round(base / f"seed-{s}", s, args.faults, reference, say=lambda x: print(x, flush=True))
        longest = max(longest, time.time() - t)
        rounds.append(rnd)
        print(rnd.report(), flush=True)
        if rnd.ok:
            shutil.rmtree(base / f"seed-{s}", ignore_errors=True)
        if deadline is not None:
            print(f"  [{(time.time() - t0) / 60:.1f} of {args.minutes:g} min]", flush=True)
    print(summary(rounds, time.time() - t0), flush=True)
    return 0 if rounds and all(r.ok for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
