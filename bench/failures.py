"""Job completion time under failures: the same steps, the same `kill -9` schedule,
every contender, interleaved round by round.

    plain DDP, no failures   the reference every other figure is measured against
    checkpoint-restart       torchrun --max-restarts, a checkpoint every K steps; K at its
                             Young/Daly optimum for the save cost measured here, and 3x that
    TorchFT                  the killed replica group is restarted by its torchrun and heals
    baton                    one warm spare takes the killed rank

The kill step shifts by one per round (the same shift for every contender in a
round), so checkpoint-restart is neither always lucky nor always unlucky about
where a kill falls between two checkpoints.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from common import interleave, median_range
from contenders import Contender, Workload, run_job, same_params


def young_daly_k(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Checkpoint interval in steps: Young's sqrt(2 delta M) with Daly's first correction
    (minus delta), delta the save cost, M the mean time between failures."""
    tau = math.sqrt(2 * save_s * mtbf_s) - save_s
    return max(1, round(tau / step_s))


def _name(key: str, k_opt: int) -> str:
    if key == "ddp":
        return "plain DDP, no failures (reference)"
    if key.startswith("ckpt-k"):
        k = int(key[len("ckpt-k"):])
        return f"checkpoint-restart, K={k}" + (" (Young/Daly)" if k == k_opt else "")
    return {"torchft": "TorchFT, killed replica restarted", "baton": "baton, one warm spare"}[key]


def bench_failures(py: str, peer_py: str | None, *, params_m: float, steps: int, nproc: int, step_sleep: float,
                   kill_at: list[int], kill_rank: int, rounds: int, tmp: Path) -> dict:
    w = Workload(params_m=params_m, steps=steps, nproc=nproc, step_sleep=step_sleep)

    def clean(run_dir: Path) -> None:
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)

    # Calibration: what a checkpoint costs here, and how long a step takes.
    cal = run_job(Contender("ddp", py, ckpt_every=5), w, tmp / "calibrate")
    clean(tmp / "calibrate")
    mtbf_s = steps * cal["step_s"] / len(kill_at)
    k_opt = young_daly_k(cal["save_s"], mtbf_s, cal["step_s"])
    k_other = min(3 * k_opt, steps // 2)
    print(f"  calibration: save {cal['save_s'] * 1e3:.0f} ms, step {cal['step_s'] * 1e3:.0f} ms, "
          f"MTBF {mtbf_s:.1f} s -> Young/Daly K = {k_opt}, other K = {k_other}", flush=True)

    contenders = {"ddp": Contender("ddp", py),
                  f"ckpt-k{k_opt}": Contender("ddp", py, ckpt_every=k_opt, restarts=len(kill_at)),
                  f"ckpt-k{k_other}": Contender("ddp", py, ckpt_every=k_other, restarts=len(kill_at)),
                  "baton": Contender("baton", py, spares=1)}
    if peer_py:
        contenders["torchft"] = Contender("torchft", peer_py, restarts=len(kill_at))

    # Each contender's own failure-free run: what "final parameters match" is checked against.
    refs = {key: run_job(contenders[key], w, tmp / f"ref-{key}") for key in ("baton", "torchft") if key in contenders}

    def one(key: str, i: int) -> dict:
        schedule = () if key == "ddp" else tuple(k + i for k in kill_at)
        run_dir = tmp / f"round{i}-{key}"
        r = run_job(contenders[key], w, run_dir, kill_at=schedule, kill_rank=kill_rank)
        clean(run_dir)
        print(f"  round {i + 1}/{rounds} {key:>10}: total {r['total_s']:.1f} s, train {r['train_s']:.1f} s, "
              f"kills {r['kills']} at {[f['killed_at_step'] for f in r['failures']]}, stall "
              f"{[round(f['stall_s'], 2) for f in r['failures'] if f['stall_s'] is not None]} s, "
              f"recomputed {r['steps_recomputed']}", flush=True)
        return r

    results = interleave(list(contenders), rounds, one)
    for rnd in results:
        free = rnd["ddp"]
        for key, r in rnd.items():
            ref = free if key == "ddp" or key.startswith("ckpt-") else refs[key]
            r["params_match"] = same_params(r["final"], ref["final"])
            r["lost_per_failure_s"] = (r["train_s"] - free["train_s"]) / r["kills"] if r["kills"] else None

    rows = []
    for key in contenders:
        runs = [rnd[key] for rnd in results]
        lost = [r["lost_per_failure_s"] for r in runs if r["lost_per_failure_s"] is not None]
        stalls = [f["stall_s"] for r in runs for f in r["failures"] if f["stall_s"] is not None]
        dropped = [r["samples_dropped_frac"] for r in runs if "samples_dropped_frac" in r]
        rows.append({
            "key": key, "name": _name(key, k_opt), "failures": runs[0]["kills"],
            "kills_done": [r["kills"] for r in runs],
            "total_s": median_range(r["total_s"] for r in runs),
            "train_s": median_range(r["train_s"] for r in runs),
            "lost_per_failure_s": median_range(lost) if lost else None,
            "stall_s": median_range(stalls) if stalls else None,
            "steps_recomputed": median_range(r["steps_recomputed"] for r in runs),
            "samples_dropped_frac": median_range(dropped) if dropped else None,
            "params_match": all(r["params_match"] for r in runs),
            "reference": ("plain DDP failure-free run of the same round" if key == "ddp" or key.startswith("ckpt-")
                          else f"{key}'s own failure-free run"),
            "notes": _notes(key) + (f"; its own failure-free run (once, before the rounds): train "
                                    f"{refs[key]['train_s']:.2f} s, {refs[key]['step_s'] * 1e3:.0f} ms/step"
                                    if key in refs else ""),
        })
    same_as_ddp = {key: same_params(ref["final"], results[0]["ddp"]["final"]) for key, ref in refs.items()}
    return {"nproc": nproc, "params": cal["params"], "steps": steps, "step_sleep": step_sleep,
            "kill_at": kill_at, "kill_shift_per_round": 1, "kill_rank": kill_rank, "runs": rounds,
            "save_s": cal["save_s"], "step_s": cal["step_s"], "mtbf_s": mtbf_s,
            "young_daly_k": k_opt, "other_k": k_other,
            "failure_free_equals_plain_ddp": same_as_ddp,
            "own_failure_free": {key: {k: ref[k] for k in ("total_s", "train_s", "step_s")} for key, ref in refs.items()},
            "contenders": rows}


def _notes(key: str) -> str:
    if key.startswith("ckpt-"):
        return ("every failure restarts all ranks (new processes, rendezvous) and recomputes the steps since "
                "the last checkpoint; plain DDP rebuilds its gradient buckets after the first step, so the "
                "first step after a restart sums gradients in a different order")
    if key == "torchft":
        return ("survivors continue without the killed replica once the lighthouse drops it; the restarted "
                "replica heals model and optimizer from a survivor; steps taken without it average fewer "
                "gradients, so the result differs from the failure-free run")
    if key == "baton":
        return "the spare takes the rank with state from the survivors; the interrupted step is re-run"
    return ""
