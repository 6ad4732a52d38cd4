"""Steady-state overhead: the step time of the same model, data and world size under
plain DDP (torchrun), baton (job.wrap + job.steps, one warm spare waiting) and TorchFT
(its DDP wrapper, replica groups of one rank, lighthouse running), interleaved.

Each run's figure is its median step time after warm-up; a contender's ratio to plain
DDP is taken within each round, and the median over rounds is reported.
"""

from __future__ import annotations

from pathlib import Path

from common import interleave, median_range
from contenders import Contender, Workload, run_job


def bench_overhead(py: str, peer_py: str | None, *, sizes_m: list[float], steps: int, warmup: int, nproc: int,
                   rounds: int, tmp: Path) -> dict:
    contenders = {"ddp": Contender("ddp", py), "baton": Contender("baton", py, spares=1)}
    if peer_py:
        contenders["torchft"] = Contender("torchft", peer_py)
    out = []
    for size in sizes_m:
        w = Workload(params_m=size, steps=steps, nproc=nproc, warmup=warmup)

        def one(key: str, i: int) -> dict:
            r = run_job(contenders[key], w, tmp / f"overhead-{size}M-{key}-{i}")
            print(f"  {size}M params round {i + 1}/{rounds} {key:>8}: {r['step_s'] * 1e3:.1f} ms/step", flush=True)
            return r

        results = interleave(list(contenders), rounds, one)
        out.append({
            "params": results[0]["ddp"]["params"],
            "step_s": {k: median_range(rnd[k]["step_s"] for rnd in results) for k in contenders},
            "ratio_vs_ddp": {k: median_range(rnd[k]["step_s"] / rnd["ddp"]["step_s"] for rnd in results)
                             for k in contenders if k != "ddp"},
        })
    return {"nproc": nproc, "steps": steps, "warmup": warmup, "runs": rounds,
            "baton_spares": 1, "sizes": out}
