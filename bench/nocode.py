"""No code change against its model-aware port and torchrun, side by side in one run.

    PYTHONPATH=. python bench/nocode.py --rounds 5     # writes bench/results/nocode-<ts>.json
                                                       # and the README's <!-- nocode --> sentence

Four contenders train the same model on the same batches (bench/workload_parts.py):
  torchrun      bench/nocode_workload.py under torchrun: a script that never imports baton
  no-code       the same file under `baton run --spares 1`
  no-tail       the same, with `--no-tail-copies` (steady state only: what the per-step copies cost
                that let a rank lost after its last collective of a step be replaced)
  model-aware   its port to baton's API (bench/workload.py --mode baton) under `baton run --spares 1`

Steady state (runs without failures, interleaved, order rotated each round): median step
time and the CPU-seconds of the whole process tree per step over the same window (see
contenders.py); ratios are taken within each round, reported as median (min-max) over
rounds. Moves (one run per baton contender and round): a planned move of rank 1 at step
`--move-at`, then `--kills` kill -9s of rank 1 from step `--kill-at` on, `--kill-every`
steps apart, each at a random moment within a step (seeded): the planned downtime and the
new rank's setup from the ledger, each unplanned stall (from the kill to the replacement's
first completed step, from rank 1's own progress log) the same measure for both, the kills
of all rounds pooled. The moves
run again with a larger model (`--large-params-m`, 8M parameters: about 100 MB of state to
move with Adam), for the issue's "sub-second at 100 MB" against the port at the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (add_round_args, fmt_range, interleave, median_range, round_ratio, save_results,
                    write_readme_sentence)
from contenders import Contender, Workload, _read_events, launch, run_job

BENCH = Path(__file__).resolve().parent
README = BENCH.parent / "README.md"


def _moves(c: Contender, w: Workload, run_dir: Path, move_at: int, kill_at: int, kills: int, kill_every: int,
           seed: int, timeout: float = 600) -> dict:
    """One run: a planned move of rank 1 at `move_at`, then up to `kills` kill -9s of rank 1
    from `kill_at` on, `kill_every` steps apart, each once the move before it has ended and a
    spare is warm again. A kill comes at a random moment within a step (uniform over the last
    step's period, seeded): a kill sent as rank 0's progress line appears would land each
    time at the end of rank 1's optimizer step, the one moment where a no-code successor
    must run the step again, and failures do not keep time with a rank's progress log."""
    rand = random.Random(seed)
    job = launch(c, w, run_dir)
    progress, offset, reached, rank1_offset = run_dir / "progress.jsonl", 0, 0, 0
    moved, made, step_times = None, [], []
    settled = _MovesSettled(run_dir)
    t0 = time.time()
    try:
        while job.running():
            if time.time() - t0 > timeout:
                raise TimeoutError(f"{c.key} did not finish: see {run_dir}")
            events, offset = _read_events(progress, offset)
            steps = [e for e in events if e["ev"] == "step"]
            step_times = (step_times + [e["t"] for e in steps])[-8:]
            reached = max([reached, *(e["step"] for e in steps)])
            pending = made[-1] if made and made[-1]["regained"] is None else None
            if pending is not None:
                # the replacement's first completed step: a survivor may still complete the
                # step the killed rank had finished its part of, which is no return
                back, rank1_offset = _read_events(run_dir / "progress.rank1.jsonl", rank1_offset)
                after = next((e for e in back if e["ev"] == "step" and e["t"] > pending["t"]), None)
                if after is not None:
                    pending["regained"] = after["t"]
            if moved is None and reached >= move_at:
                moved = subprocess.run([sys.executable, "-m", "baton.cli", "migrate", "--rank", "1", "--run-dir",
                                        str(run_dir / "baton")], capture_output=True, text=True, timeout=60)
            next_at = kill_at + kill_every * len(made) if not made else max(kill_at + kill_every * len(made),
                                                                            made[-1]["step"] + kill_every)
            if pending is None and len(made) < kills and reached >= next_at and settled() and len(step_times) > 2:
                period = (step_times[-1] - step_times[0]) / (len(step_times) - 1)
                delay = rand.uniform(0.0, period)
                time.sleep(delay)
                os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
                made.append({"t": time.time(), "step": reached, "delay_s": round(delay, 4), "regained": None})
                _, rank1_offset = _read_events(run_dir / "progress.rank1.jsonl", rank1_offset)  # before the kill
            time.sleep(0.002)
    finally:
        job.kill_all()
    ledger = _ledger(run_dir)
    planned = next((e for e in ledger if e["kind"] == "planned"), {})
    unplanned = [e for e in ledger if e["kind"] == "unplanned"]
    each = []
    for k, ev in zip(made, unplanned + [{}] * (len(made) - len(unplanned))):
        absorbed = ev.get("status") == "resolved"  # else the job stopped, saying it could not be exact
        each.append({"step": k["step"], "delay_s": k["delay_s"], "absorbed": absorbed,
                     "stall_s": round(k["regained"] - k["t"], 4) if absorbed and k["regained"] else None,
                     "downtime_s": ev.get("downtime_s"), "setup_s": ev.get("joiner_setup_s"),
                     "phases": ev.get("phases"),
                     # killed after its last collective of a step: the successor ran that step again alone (tail)
                     "ran_again": "ran step" in (ev.get("note") or "")})
    return {"ledger": ledger, "state_bytes": planned.get("state_bytes"),
            "planned_downtime_s": planned.get("downtime_s"), "planned_setup_s": planned.get("joiner_setup_s"),
            "planned_phases": planned.get("phases"), "kills": each,
            "unplanned_stall_s": _median([k["stall_s"] for k in each]),
            "unplanned_downtime_s": _median([k["downtime_s"] for k in each if k["absorbed"]]),
            "exact": all(e["status"] == "resolved" and e["steps_lost"] == 0 for e in ledger)
            and len(ledger) == 1 + len(made) and bool(made)}


def _kills_summary(runs: list[dict]) -> dict:
    """The kills of every round pooled, per contender; the stall's ratio within rounds (of
    each run's median). A kill after the rank's last collective of a step costs a no-code
    successor that step, run again alone: those apart from the others."""
    keys = ("no-code", "model-aware")
    kills = {k: [x for r in runs for x in r[k]["kills"]] for k in keys}
    out = {f"unplanned_{f}": {k: median_range(x[f] for x in kills[k] if x["absorbed"]) for k in keys}
           for f in ("stall_s", "downtime_s", "setup_s")}
    for part, ran_again in (("ran_again", True), ("at_head", False)):
        out[f"unplanned_stall_s_{part}"] = median_range(
            x["stall_s"] for x in kills["no-code"] if x["absorbed"] and x["ran_again"] is ran_again)
    out["unplanned_ran_again"] = sum(x["ran_again"] for x in kills["no-code"])
    out["unplanned_ratio"] = round_ratio(runs, "no-code", "model-aware", "unplanned_stall_s")
    out["kills_absorbed"] = {k: sum(x["absorbed"] for x in kills[k]) for k in keys}
    out["kills"] = {k: len(kills[k]) for k in keys}
    return out


def _rank_pid(run_dir: Path, rank: int) -> int:
    """The process that is `rank` now, as the job's orchestrator recorded it: not the
    workload's pid file, which a successor's setup rewrites only where no step since the
    loop began changed it (a successor's setup is fenced: baton/worker/fence.py)."""
    db = sqlite3.connect(f"file:{run_dir / 'baton' / 'state.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT body FROM entities WHERE kind = 'worker'").fetchall()
    finally:
        db.close()
    workers = [json.loads(body) for (body,) in rows]
    return next(w["pid"] for w in workers if w["role"] == "rank" and w["rank"] == rank)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class _MovesSettled:
    """Whether the planned move is in the ledger and ended, and a new spare is warm (else the
    kill's recovery would wait for one to start): the job's events.jsonl (every ledger write
    lands there too), read on from where the last call stopped, not through the CLI, which
    takes long enough on 2 cores for the job to finish before the kill."""

    def __init__(self, run_dir: Path):
        self.path, self.offset = run_dir / "baton" / "events.jsonl", 0
        self.status: dict[int, str] = {}
        self.warm_after_move = False

    def __call__(self) -> bool:
        events, self.offset = _read_events(self.path, self.offset)
        for e in events:
            if e.get("event") == "ledger":
                self.status[e["data"]["id"]] = e["data"]["status"]
            elif e.get("event") in ("resolved", "spare"):
                self.warm_after_move = e["event"] == "spare"
        return bool(self.status) and "in-progress" not in self.status.values() and self.warm_after_move


def _own_share(run_dir: Path) -> float | None:
    """baton's own CPU in the ranks over the whole run, as baton counted it bottom up, as a
    share of the ranks' CPU (the job's `finished` event)."""
    events, _ = _read_events(run_dir / "baton" / "events.jsonl", 0)
    cpu = next((e["data"]["cpu"] for e in events if e.get("event") == "finished"), None)
    return cpu["ranks_baton_s"] / cpu["ranks_s"] if cpu and cpu.get("ranks_s") else None


def _pct(r: dict) -> str:
    return f"{r['median'] * 100:.1f}% ({r['min'] * 100:.1f}-{r['max'] * 100:.1f})"


def _range_or_none(r: dict) -> str:
    return "none" if r["median"] is None else fmt_range(r, unit="s")


def _large_sentence(large: dict, params_m: float) -> str:
    mb = large["state_mb"]
    return (f"With a {params_m:g}M-parameter MLP ({mb['median']:.0f} MB of state to move): a "
            f"planned move's downtime {fmt_range(large['planned_downtime_s']['no-code'], unit='s')} against "
            f"{fmt_range(large['planned_downtime_s']['model-aware'], unit='s')} "
            f"({fmt_range(large['planned_ratio'])} within rounds), a kill -9's downtime in the ledger "
            f"{fmt_range(large['unplanned_downtime_s']['no-code'], unit='s')} against "
            f"{fmt_range(large['unplanned_downtime_s']['model-aware'], unit='s')} "
            f"and its stall "
            f"{fmt_range(large['unplanned_stall_s']['no-code'], unit='s')} against "
            f"{fmt_range(large['unplanned_stall_s']['model-aware'], unit='s')} "
            f"({fmt_range(large['unplanned_ratio'])} within rounds); kills absorbed bit for bit "
            f"{large['kills_absorbed']['no-code']} of {large['kills']['no-code']} and "
            f"{large['kills_absorbed']['model-aware']} of {large['kills']['model-aware']}"
            + ("" if large["all_moves_exact"] else "; not every move was exact: see the results file") + ". ")


def _ledger(run_dir: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "baton.cli", "events", "--json", "--run-dir", str(run_dir / "baton")],
                         capture_output=True, text=True, timeout=60)
    try:
        return json.loads(out.stdout).get("events", [])
    except ValueError:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_args(p, steps=400, warmup=30)  # 150 left the rounds' spread at +-15% on 2 shared cores
    p.add_argument("--move-at", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--large-params-m", type=float, default=8.0,
                   help="the moves again at this size (0: not run); 8M parameters move about 100 MB")
    p.add_argument("--kills", type=int, default=3, help="kill -9s of rank 1 in each moves run")
    p.add_argument("--kill-every", type=int, default=80, help="steps at least between the kills of a run")
    p.add_argument("--large-steps", type=int, default=300, help="steps of each larger run (past its kills)")
    p.add_argument("--large-kill-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="of the kills' moments within a step")
    args = p.parse_args()
    py = sys.executable
    w = Workload(params_m=args.params_m, steps=args.steps, nproc=args.nproc, warmup=args.warmup)
    tmp = args.results_dir / "tmp" / f"nocode-{int(time.time())}"
    contenders = {"torchrun": Contender("plain", py), "no-code": Contender("nocode", py, spares=1),
                  "no-tail": Contender("nocode", py, spares=1, tail_copies=False),
                  "model-aware": Contender("baton", py, spares=1)}
    steady = interleave(list(contenders), args.rounds,
                        lambda key, i: run_job(contenders[key], w, tmp / f"steady-{key}-{i}", cpu_window=True))
    for i, r in enumerate(steady):
        for key in ("no-code", "no-tail", "model-aware"):
            r[key]["own_share"] = _own_share(tmp / f"steady-{key}-{i}")
    moves = interleave(["no-code", "model-aware"], args.rounds,
                       lambda key, i: _moves(contenders[key], w, tmp / f"moves-{key}-{i}", args.move_at, args.kill_at,
                                             args.kills, args.kill_every, seed=args.seed + i))
    large = Workload(params_m=args.large_params_m, steps=args.large_steps, nproc=args.nproc, warmup=args.warmup)
    moves_large = [] if not args.large_params_m else interleave(
        ["no-code", "model-aware"], args.rounds,
        lambda key, i: _moves(contenders[key], large, tmp / f"moves-large-{key}-{i}", args.move_at, args.kill_at,
                              args.kills, args.large_kill_every, seed=args.seed + 100 + i))
    summary = {
        "step_ratio_nocode_vs_aware": round_ratio(steady, "no-code", "model-aware", "step_s"),
        "cpu_ratio_nocode_vs_aware": round_ratio(steady, "no-code", "model-aware", "cpu_s_per_step"),
        "step_ratio_nocode_vs_torchrun": round_ratio(steady, "no-code", "torchrun", "step_s"),
        "cpu_ratio_nocode_vs_torchrun": round_ratio(steady, "no-code", "torchrun", "cpu_s_per_step"),
        "step_ratio_nocode_vs_no_tail": round_ratio(steady, "no-code", "no-tail", "step_s"),
        "cpu_ratio_nocode_vs_no_tail": round_ratio(steady, "no-code", "no-tail", "cpu_s_per_step"),
        "step_ratio_no_tail_vs_aware": round_ratio(steady, "no-tail", "model-aware", "step_s"),
        "step_s": {k: median_range(r[k]["step_s"] for r in steady) for k in contenders},
        # baton's own CPU in the ranks as baton counted it (baton/selfcost.py): steadier than
        # whole-tree ratios, which swing by 10% from round to round on 2 shared cores
        "own_share": {k: median_range(r[k]["own_share"] for r in steady) for k in ("no-code", "no-tail", "model-aware")},
        "cpu_s_per_step": {k: median_range(r[k].get("cpu_s_per_step") for r in steady) for k in contenders},
    }
    for key in ("planned_downtime_s", "planned_setup_s"):
        summary[key] = {k: median_range(r[k][key] for r in moves) for k in ("no-code", "model-aware")}
    summary.update(_kills_summary(moves))
    summary["planned_ratio"] = round_ratio(moves, "no-code", "model-aware", "planned_downtime_s")
    summary["all_moves_exact"] = all(r[k]["exact"] for r in moves for k in r)
    if moves_large:
        summary["large"] = {
            "state_mb": median_range(r[k]["state_bytes"] / 1e6 for r in moves_large for k in r if r[k]["state_bytes"]),
            "planned_downtime_s": {k: median_range(r[k]["planned_downtime_s"] for r in moves_large)
                                   for k in ("no-code", "model-aware")},
            "planned_ratio": round_ratio(moves_large, "no-code", "model-aware", "planned_downtime_s"),
            **_kills_summary(moves_large),
            "all_moves_exact": all(r[k]["exact"] for r in moves_large for k in r),
        }

    def without_ledger(rounds: list[dict]) -> list[dict]:
        return [{k: {x: y for x, y in v.items() if x != "ledger"} for k, v in r.items()} for r in rounds]

    path = save_results(args, "nocode", summary=summary, steady=steady, moves=without_ledger(moves),
                        moves_large=without_ledger(moves_large))
    s = summary
    text = (f" Measured with `bench/nocode.py` ({path.name}: {args.nproc} ranks, a {args.params_m:g}M-parameter MLP, "
            f"{args.steps} steps, {args.rounds} interleaved rounds, medians with min-max): against its model-aware "
            f"port, the unmodified script's step time is {fmt_range(s['step_ratio_nocode_vs_aware'])} and its whole tree's CPU per step "
            f"{fmt_range(s['cpu_ratio_nocode_vs_aware'])} (against torchrun: {fmt_range(s['step_ratio_nocode_vs_torchrun'])} "
            f"and {fmt_range(s['cpu_ratio_nocode_vs_torchrun'])}); of that, the per-step copies that let a rank lost after "
            f"its last collective of a step be replaced cost {fmt_range(s['step_ratio_nocode_vs_no_tail'])} in step time "
            f"and {fmt_range(s['cpu_ratio_nocode_vs_no_tail'])} in CPU (against `--no-tail-copies`, whose step time is "
            f"{fmt_range(s['step_ratio_no_tail_vs_aware'])} the port's); baton's own CPU, counted bottom up by baton "
            f"in the ranks, {_pct(s['own_share']['no-code'])} of the ranks' CPU ({_pct(s['own_share']['no-tail'])} "
            f"with `--no-tail-copies`) against {_pct(s['own_share']['model-aware'])} for the port; a planned move's "
            f"downtime "
            f"{fmt_range(s['planned_downtime_s']['no-code'], unit='s')} against "
            f"{fmt_range(s['planned_downtime_s']['model-aware'], unit='s')}, a kill -9's stall (from the kill to "
            f"the new rank's first step) {fmt_range(s['unplanned_stall_s']['no-code'], unit='s')} against "
            f"{fmt_range(s['unplanned_stall_s']['model-aware'], unit='s')} and its downtime in the ledger (from the "
            f"loss seen to every rank running) {fmt_range(s['unplanned_downtime_s']['no-code'], unit='s')} against "
            f"{fmt_range(s['unplanned_downtime_s']['model-aware'], unit='s')} (kills at a random moment within a "
            f"step, {s['kills']['no-code']} and {s['kills']['model-aware']}); {s['unplanned_ran_again']} of "
            f"{s['kills']['no-code']} kills landed after the rank's last collective of a step, whose successor then "
            f"ran that step again alone (stall {_range_or_none(s['unplanned_stall_s_ran_again'])} against "
            f"{_range_or_none(s['unplanned_stall_s_at_head'])} for the others); the new rank's script setup, from "
            f"its assignment to its step loop, {fmt_range(s['unplanned_setup_s']['no-code'], unit='s')} against "
            f"{fmt_range(s['unplanned_setup_s']['model-aware'], unit='s')} after a kill and "
            f"{fmt_range(s['planned_setup_s']['no-code'], unit='s')} against "
            f"{fmt_range(s['planned_setup_s']['model-aware'], unit='s')} in a planned move. Kills from outside "
            f"absorbed bit for bit: "
            f"{s['kills_absorbed']['no-code']} of {s['kills']['no-code']} for the unmodified script, "
            f"{s['kills_absorbed']['model-aware']} of {s['kills']['model-aware']} for the port"
            + ("" if s["kills_absorbed"]["no-code"] == s["kills"]["no-code"] else
               "; each other one stopped the job non-zero, saying why it could not be exact") + ". "
            + (_large_sentence(s["large"], args.large_params_m) if "large" in s else ""))
    print(text)
    if not args.no_readme:
        write_readme_sentence(README, "nocode", "bench/nocode.py", text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    raise SystemExit(main())
