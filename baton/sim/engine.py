"""Monte Carlo of one training job under each recovery strategy.

Discrete-event and vectorised over trials: the Python loop runs once per
failure *event* (k-th failure of every trial at once), never per step, and all
strategies read the same failure stream. Between events progress is linear
(piecewise linear for replica-group drop while groups heal), so each event is
a handful of numpy operations on arrays of length `trials`.

Progress P is measured in hours of failure-free work at full speed. Periodic
checkpoint saves are amortised into the progress rate (tau / (tau + delta)),
and a rollback returns to the last multiple of tau (or to a pre-emptive
checkpoint). Failures arrive in wall-clock time; one arriving while the job is
restarting restarts the restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.sim.failures import MECH_MIGRATION, MECH_PATH, MECH_RESTART, FailureStream, Mechanism
from baton.sim.scenario import Scenario

# A trial still running after this many times its failure-free duration is
# reported as not finished (the strategy cannot outrun the failures).
MAX_SLOWDOWN = 25.0


@dataclass
class StrategyRun:
    """Per-trial outcomes of one strategy, plus the trace of trial 0 for plotting."""

    name: str
    completion_h: np.ndarray
    events: np.ndarray
    yoco_events: np.ndarray
    rollback_h: np.ndarray  # work recomputed
    spare_wait_h: np.ndarray
    spare_gpus: int = 0
    interval_h: float = 0.0
    trace_t: list[float] = field(default_factory=list)
    trace_p: list[float] = field(default_factory=list)
    marks_t: list[float] = field(default_factory=list)
    marks_p: list[float] = field(default_factory=list)


class _State:
    def __init__(self, trials: int):
        self.P = np.zeros(trials)
        self.ck = np.zeros(trials)  # progress at the last checkpoint
        self.t_up = np.zeros(trials)  # job runs from here until the next event
        self.t_restart = np.full(trials, -np.inf)  # end of the current full restart
        self.done = np.zeros(trials, dtype=bool)
        self.t_done = np.full(trials, np.inf)
        self.events = np.zeros(trials, dtype=np.int64)
        self.yoco = np.zeros(trials, dtype=np.int64)
        self.rollback = np.zeros(trials)
        self.spare_wait = np.zeros(trials)


def _committed(st: _State, tau: float) -> np.ndarray:
    return np.maximum(st.ck, np.floor(st.P / tau + 1e-9) * tau)


def _full_restart(st: _State, rows: np.ndarray, F: np.ndarray, tau: float, restart_h: float) -> None:
    """Roll back to the last checkpoint and restart every rank (also: a failure during a restart)."""
    c = _committed(st, tau)
    st.rollback[rows] += st.P[rows] - c[rows]
    st.P[rows] = c[rows]
    st.ck[rows] = c[rows]
    end = np.maximum(st.t_up, F + restart_h)
    st.t_up[rows] = end[rows]
    st.t_restart[rows] = end[rows]


def _healthy_gain(t_up: np.ndarray, F: np.ndarray, until: np.ndarray, groups: int) -> np.ndarray:
    """Full-rate-equivalent hours of running in [t_up, F] with groups down until `until`."""
    span = np.maximum(F - t_up, 0.0)
    down = np.clip(np.minimum(until, F[:, None]) - t_up[:, None], 0.0, None).sum(axis=1)
    return np.maximum(span - down / groups, 0.0)


def _time_to_reach(t_up: np.ndarray, need: np.ndarray, until: np.ndarray, groups: int) -> np.ndarray:
    """Wall time after t_up at which `need` full-rate hours are done, groups healing at `until`."""
    c = np.sort(np.maximum(until, t_up[:, None]), axis=1)
    x = np.concatenate([t_up[:, None], c], axis=1)
    seg = np.diff(x, axis=1)
    frac = np.arange(groups) / groups  # share of groups up in segment j
    contrib = seg * frac
    cum = np.cumsum(contrib, axis=1)
    crosses = cum >= need[:, None] - 1e-12
    any_cross = crosses.any(axis=1)
    j = np.argmax(crosses, axis=1)
    rows = np.arange(len(t_up))
    prev = cum[rows, j] - contrib[rows, j]
    inside = x[rows, j] + (need - prev) / np.where(frac[j] > 0, frac[j], 1.0)
    after = c[:, -1] + (need - cum[:, -1])
    return np.where(any_cross, inside, after) - t_up


def checkpoint_interval(scn: Scenario, name: str) -> float:
    """Hours of work between checkpoints for one strategy.

    The scenario's interval when it gives one; otherwise the Young/Daly
    optimum for the failures that actually roll this strategy back: all of
    them for checkpoint-restart, only the restart-class ones (software bugs,
    silent corruption, ...) for strategies that survive the rest.
    """
    if scn.checkpoint.interval_h is not None:
        return scn.checkpoint.interval_h
    shares = {c.mechanism: 0.0 for c in scn.classes}
    for c in scn.classes:
        shares[c.mechanism] += c.share
    total = sum(shares.values())
    if name == "checkpoint_restart":
        rollback_share = 1.0
    else:
        rollback_share = shares.get(Mechanism.RESTART, 0.0) / total
        if name == "live_migration" and scn.live_migration.spare_pool == 0:
            rollback_share += shares.get(Mechanism.MIGRATION, 0.0) / total
    if rollback_share <= 0.0:
        return scn.job.work_h  # nothing ever rolls back: no periodic checkpoint needed
    return scn.checkpoint.interval_for(scn.arrivals.mean_gap_h / rollback_share)


def simulate_strategy(scn: Scenario, name: str, stream: FailureStream) -> StrategyRun:
    """Run all trials of one strategy against the shared failure stream."""
    trials = stream.trials
    job = scn.job
    W = job.work_h
    step_h = job.step_s / 3600.0
    tau = checkpoint_interval(scn, name)
    save_h = scn.checkpoint.save_min / 60.0
    eff = tau / (tau + save_h)
    cr = scn.checkpoint_restart
    restart_h = cr.restart_h
    cap = W * MAX_SLOWDOWN
    st = _State(trials)
    run = StrategyRun(name, st.t_done, st.events, st.yoco, st.rollback, st.spare_wait, interval_h=tau)

    if name == "checkpoint_restart":
        rate = eff
    elif name == "replica_group_drop":
        ft = scn.replica_group_drop
        rate = eff / (1.0 + ft.step_overhead)
        until = np.full((trials, ft.groups), -np.inf)
    elif name == "live_migration":
        lm = scn.live_migration
        rate = eff / (1.0 + lm.step_overhead)
        avail = np.zeros((trials, max(lm.spare_pool, 1)))
        run.spare_gpus = lm.spare_pool * lm.spare_gpus
    else:
        raise ValueError(f"unknown strategy {name!r}")

    run.trace_t.append(0.0)
    run.trace_p.append(0.0)
    k = 0
    while not st.done.all():
        stream.ensure(k + 1)
        F = stream.times[:, k]
        cls = stream.cls[:, k]
        warned = stream.warned[:, k]
        mech = stream.mechanism[cls]
        active = ~st.done

        # 1. progress from t_up to this failure; some trials finish first.
        if name == "replica_group_drop":
            gain = rate * _healthy_gain(st.t_up, F, until, ft.groups)
        else:
            gain = rate * np.maximum(F - st.t_up, 0.0)
        fin = active & (st.P + gain >= W)
        if fin.any():
            need = (W - st.P[fin]) / rate
            if name == "replica_group_drop":
                st.t_done[fin] = st.t_up[fin] + _time_to_reach(st.t_up[fin], need, until[fin], ft.groups)
            else:
                st.t_done[fin] = st.t_up[fin] + need
            st.done |= fin
        stuck = active & ~fin & (F > cap)
        st.done |= stuck  # t_done stays inf: did not finish
        ev = active & ~fin & ~stuck
        if not ev.any():
            k += 1
            continue
        st.P[ev] += gain[ev]
        st.events[ev] += 1
        p_before = st.P[0]

        # 2. the failure, as this strategy handles it.
        in_restart = F < st.t_restart
        if name == "checkpoint_restart":
            pre = ev & warned & ~in_restart  # warned: checkpoint first, nothing lost
            st.ck[pre] = st.P[pre]
            st.yoco[pre] += 1
            _full_restart(st, ev, F, tau, restart_h)
            st.t_up[pre] += save_h
            st.t_restart[pre] += save_h
        elif name == "replica_group_drop":
            restart = ev & ((mech == MECH_RESTART) | in_restart)
            _full_restart(st, restart, F, tau, restart_h)
            until[restart] = -np.inf
            drop = ev & ~restart
            if drop.any():
                rows = np.flatnonzero(drop)
                g = np.argmin(until[rows], axis=1)
                until[rows, g] = np.maximum(until[rows, g], F[rows]) + ft.heal_min / 60.0
                c = _committed(st, tau)
                lost = np.minimum(step_h, st.P[rows] - c[rows])
                st.P[rows] -= lost
                st.rollback[rows] += lost
                st.t_up[rows] = np.maximum(st.t_up[rows], F[rows]) + ft.failover_pause_s / 3600.0
                st.yoco[rows] += 1
        else:
            no_spare = lm.spare_pool == 0
            restart = ev & ((mech == MECH_RESTART) | in_restart | ((mech == MECH_MIGRATION) & no_spare))
            _full_restart(st, restart, F, tau, restart_h)
            path = ev & ~restart & (mech == MECH_PATH)
            st.t_up[path] = np.maximum(st.t_up[path], F[path]) + lm.path_failover_s / 3600.0
            st.yoco[path] += 1
            mig = ev & ~restart & (mech == MECH_MIGRATION)
            if mig.any():
                rows = np.flatnonzero(mig)
                h = np.maximum(st.t_up[rows], F[rows])
                j = np.argmin(avail[rows], axis=1)
                start = np.maximum(h, avail[rows, j])
                avail[rows, j] = start + lm.spare_replenish_h
                st.spare_wait[rows] += start - h
                w = warned[rows]
                down = np.where(w, lm.planned_downtime_min, lm.unplanned_downtime_min) / 60.0
                st.t_up[rows] = start + down
                c = _committed(st, tau)
                lost = np.where(w, 0.0, np.minimum(step_h, st.P[rows] - c[rows]))
                st.P[rows] -= lost
                st.rollback[rows] += lost
                st.yoco[rows] += 1

        if ev[0]:
            run.trace_t += [float(F[0]), float(F[0]), float(max(st.t_up[0], F[0]))]
            run.trace_p += [float(p_before), float(st.P[0]), float(st.P[0])]
            run.marks_t.append(float(F[0]))
            run.marks_p.append(float(p_before))
        k += 1

    if np.isfinite(st.t_done[0]):
        run.trace_t.append(float(st.t_done[0]))
        run.trace_p.append(W)
    return run


@dataclass
class SimulationResult:
    scenario: Scenario
    runs: dict[str, StrategyRun]
    elapsed_s: float = 0.0


def simulate(scn: Scenario, trials: int | None = None, seed: int | None = None) -> SimulationResult:
    """Every strategy of the scenario against one shared failure stream."""
    import time

    t0 = time.perf_counter()
    n = trials if trials is not None else scn.trials
    stream = FailureStream(scn.arrivals, scn.classes, n, scn.seed if seed is None else seed)
    expected = int(scn.job.work_h * 2.0 / scn.arrivals.mean_gap_h) + 16
    stream.ensure(expected)
    runs = {s: simulate_strategy(scn, s, stream) for s in scn.strategies}
    return SimulationResult(scn, runs, time.perf_counter() - t0)


def summarize(result: SimulationResult) -> dict:
    """Per-strategy statistics over trials (the JSON output of `baton simulate`)."""
    scn = result.scenario
    job = scn.job
    out: dict[str, dict] = {}
    for name, run in result.runs.items():
        t = run.completion_h
        finished = np.isfinite(t)
        tf = t[finished]
        wasted = job.gpus * (tf - job.work_h)
        spare = run.spare_gpus * tf
        usd = (wasted + spare) * job.gpu_hour_usd
        goodput = job.work_h / tf
        ev = run.events.sum()

        def pct(a: np.ndarray) -> dict | None:
            if a.size == 0:  # no trial finished: nothing to take percentiles of
                return None
            return {
                "mean": float(np.mean(a)),
                "p5": float(np.percentile(a, 5)),
                "p50": float(np.percentile(a, 50)),
                "p95": float(np.percentile(a, 95)),
            }

        out[name] = {
            "completion_h": pct(tf),
            "goodput": pct(goodput),
            "wasted_gpu_hours": pct(wasted),
            "spare_gpu_hours": pct(spare),
            "wasted_usd": pct(usd),
            "yoco_ratio": float(run.yoco_events.sum() / ev) if ev else 1.0,
            "failures": pct(run.events[finished]),
            "rollback_h": pct(run.rollback_h[finished]),
            "spare_wait_h": pct(run.spare_wait_h[finished]),
            "unfinished_trials": int((~finished).sum()),
            "checkpoint_interval_h": run.interval_h,
        }
    return out
