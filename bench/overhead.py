"""Steady-state overhead: the same model, data and world size under plain DDP (torchrun),
plain DDP again (an A/A comparison: how far two identical runs differ on this machine),
baton (job.wrap + job.steps, one warm spare waiting), baton with `--verify-every N` (the
periodic replica-agreement check), baton with `--hot-spares` (the spare mirrors the
replicated state from rank 0's gradients at every step) and TorchFT (its DDP wrapper, replica groups of one rank,
lighthouse running), interleaved.

Per run, over the same window for every contender (from rank 0 reporting step `warmup` to
rank 0 reporting the last step):
  step_s          median step time (gaps between rank 0's step reports)
  mean_step_s     window wall time / steps in it: includes work done every N steps, which the
                  median leaves out (the periodic check)
  cpu_s_per_step  CPU-seconds of the whole process tree (ranks, launcher and agents, spares,
                  lighthouse) in the window / steps in it; see contenders.py
A contender's ratio to plain DDP is taken within each round, and the median (min-max) over
rounds is reported; baton-verify is also compared with baton, round by round.
"""

from __future__ import annotations

from pathlib import Path

from common import interleave, median_range, ratio
from contenders import Contender, Workload, run_job

METRICS = {"step_s": "ratio_vs_ddp", "mean_step_s": "mean_ratio_vs_ddp", "cpu_s_per_step": "cpu_ratio_vs_ddp"}


def bench_overhead(py: str, peer_py: str | None, *, sizes_m: list[float], steps: int, warmup: int, nproc: int,
                   rounds: int, tmp: Path, verify_every: int = 10, hot_spares: bool = True) -> dict:
    # ddp-again: plain DDP a second time in every round (an A/A comparison): its ratio to plain DDP
    # is the noise floor that baton's ratio must be read against.
    contenders = {"ddp": Contender("ddp", py), "ddp-again": Contender("ddp", py),
                  "baton": Contender("baton", py, spares=1)}
    if verify_every:
        contenders["baton-verify"] = Contender("baton", py, spares=1, verify_every=verify_every)
    if hot_spares:
        contenders["baton-hot"] = Contender("baton", py, spares=1, hot_spares=True)
    if peer_py:
        contenders["torchft"] = Contender("torchft", peer_py)
    out = []
    for size in sizes_m:
        w = Workload(params_m=size, steps=steps, nproc=nproc, warmup=warmup)

        def one(key: str, i: int) -> dict:
            r = run_job(contenders[key], w, tmp / f"overhead-{size}M-{key}-{i}", cpu_window=True)
            cpu = r.get("cpu_s_per_step")
            others = r.get("cpu_others_s_per_step")
            own = r.get("own_cpu_s_per_step")
            print(f"  {size}M params round {i + 1}/{rounds} {key:>12}: step {r['step_s'] * 1e3:.1f} ms (median), "
                  + (f"{r['mean_step_s'] * 1e3:.1f} ms (mean), " if r.get("mean_step_s") else "")
                  + (f"CPU {cpu * 1e3:.1f} ms/step, of which {others * 1e3:.1f} outside the ranks"
                     if cpu is not None else f"CPU: none ({r.get('cpu_note')})")
                  + (f", baton's own (counted) {own * 1e3:.2f}" if own is not None else ""), flush=True)
            return r

        results = interleave(list(contenders), rounds, one)
        row: dict = {"params": results[0]["ddp"]["params"]}
        for metric, ratio_key in METRICS.items():
            row[metric] = {k: median_range(rnd[k].get(metric) for rnd in results) for k in contenders}
            row[ratio_key] = {k: median_range(ratio(rnd[k].get(metric), rnd["ddp"].get(metric)) for rnd in results)
                              for k in contenders if k != "ddp"}
        row["cpu_others_s_per_step"] = {k: median_range(rnd[k].get("cpu_others_s_per_step") for rnd in results)
                                        for k in contenders}
        # baton's own CPU, counted by baton as it ran (bottom up), against plain DDP's whole tree
        # in the same round: what it adds, resolved far below the A/A noise of the ratios above.
        own = {k: [rnd[k].get("own_cpu_s_per_step") for rnd in results] for k in contenders}
        own = {k: v for k, v in own.items() if any(x is not None for x in v)}
        row["own_cpu_s_per_step"] = {k: median_range(v) for k, v in own.items()}
        row["own_cpu_vs_ddp"] = {k: median_range(ratio(rnd[k].get("own_cpu_s_per_step"),
                                                        rnd["ddp"].get("cpu_s_per_step")) for rnd in results)
                                 for k in own}
        row["own_cpu_split_s_per_step"] = {
            k: {part: median_range((rnd[k].get("own_cpu_split_s_per_step") or {}).get(part) for rnd in results)
                for part in ("rank entry points", "rank threads", "outside the ranks")} for k in own}
        if "baton-verify" in contenders:
            row["verify_vs_baton"] = {
                metric: median_range(ratio(rnd["baton-verify"].get(metric), rnd["baton"].get(metric))
                                     for rnd in results) for metric in METRICS}
        if "baton-hot" in contenders:
            # --hot-spares against baton's default mode, round by round, and what the spare took
            row["hot_vs_baton"] = {
                metric: median_range(ratio(rnd["baton-hot"].get(metric), rnd["baton"].get(metric))
                                     for rnd in results) for metric in METRICS}
            row["hot"] = {"bytes_per_step": median_range(rnd["baton-hot"].get("hot_bytes_per_step") for rnd in results),
                          "replay_s": median_range(rnd["baton-hot"].get("hot_replay_s") for rnd in results),
                          "kept_pace_before_window": [rnd["baton-hot"].get("hot_before_window") for rnd in results],
                          "notes": sorted({rnd["baton-hot"]["hot_note"] for rnd in results
                                           if rnd["baton-hot"].get("hot_note")})}
        details = [rnd[k].get("cpu_detail") for rnd in results for k in contenders]
        details = [d for d in details if d]
        row["cpu_check"] = {
            # the ranks read from /proc by the harness vs by themselves: how far apart the two reads are
            "ranks_proc_over_self": median_range(d["ranks_proc_s"] / d["ranks_s"] for d in details if d["ranks_s"]),
            "max_harness_lag_s": max((max(d["harness_lag_s"]) for d in details), default=None),
            "tick_fallbacks": sum(d["tick_fallbacks"] for d in details),
            "processes_exited_in_window": sum(d["exited_in_window"] for d in details),
            "ranks_not_in_tree": sum(d["ranks_not_in_tree"] for d in details),
            "notes": sorted({rnd[k]["cpu_note"] for rnd in results for k in contenders if rnd[k].get("cpu_note")}),
        }
        out.append(row)
    return {"nproc": nproc, "steps": steps, "warmup": warmup, "runs": rounds,
            "baton_spares": 1, "verify_every": verify_every if "baton-verify" in contenders else None,
            "cpu_method": "whole process tree: each rank by getrusage(RUSAGE_SELF) at its own window edges, "
                          "every other process by the harness from /proc (its threads' schedstat runtime) "
                          "when rank 0 reports each edge",
            "sizes": out}
