"""A script's own DDP comm hook under no code change, against the same file under torchrun.

    PYTHONPATH=. python bench/comm_hook.py --rounds 3   # writes bench/results/comm-hook-<ts>.json
                                                        # and the README's <!-- comm-hook --> sentence

The workload is bench/nocode_workload.py (bench/workload_parts.py's model and data) with
`--comm-hook fp16`: DDP's fp16_compress_hook, registered by the script. Under baton the
hook runs inside baton's, each of its all-reduces recorded before the backward goes on (no
overlap with the backward); torchrun's overlaps them. Four runs a round, interleaved, order
rotated: torchrun and no-code, each without and with the hook. Ratios within a round,
medians (min-max) over rounds: step time and the whole process tree's CPU per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from common import (add_round_args, fmt_range, interleave, median_range, round_ratio, save_results,
                    write_readme_sentence)
from contenders import Contender, Workload, run_job

BENCH = Path(__file__).resolve().parent
README = BENCH.parent / "README.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_args(p, steps=100, warmup=20)
    args = p.parse_args()
    py = sys.executable
    plain = Workload(params_m=args.params_m, steps=args.steps, nproc=args.nproc, warmup=args.warmup)
    hooked = dataclasses.replace(plain, comm_hook="fp16")
    runs = {"torchrun": (Contender("plain", py), plain), "torchrun-hook": (Contender("plain", py), hooked),
            "no-code": (Contender("nocode", py, spares=1), plain),
            "no-code-hook": (Contender("nocode", py, spares=1), hooked)}
    tmp = args.results_dir / "tmp" / f"comm-hook-{int(time.time())}"
    rounds = interleave(list(runs), args.rounds,
                        lambda key, i: run_job(*runs[key], tmp / f"{key}-{i}", cpu_window=True))
    summary = {}
    for what, field in (("step", "step_s"), ("cpu", "cpu_s_per_step")):
        summary[f"{what}_hook_nocode_vs_torchrun"] = round_ratio(rounds, "no-code-hook", "torchrun-hook", field)
        summary[f"{what}_plain_nocode_vs_torchrun"] = round_ratio(rounds, "no-code", "torchrun", field)
        summary[f"{what}_hook_vs_plain_torchrun"] = round_ratio(rounds, "torchrun-hook", "torchrun", field)
        summary[f"{what}_s"] = {k: median_range(r[k].get(field) for r in rounds) for k in runs}
    path = save_results(args, "comm-hook", summary=summary, rounds=rounds)
    s = summary
    text = (f" Measured with `bench/comm_hook.py` ({path.name}: {args.nproc} ranks, a {args.params_m:g}M-parameter "
            f"MLP, {args.rounds} interleaved rounds, medians with min-max): with the script's fp16_compress_hook, "
            f"no code change against torchrun runs at {fmt_range(s['step_hook_nocode_vs_torchrun'])} the step time and "
            f"{fmt_range(s['cpu_hook_nocode_vs_torchrun'])} the CPU per step (without a hook, in the same rounds: "
            f"{fmt_range(s['step_plain_nocode_vs_torchrun'])} and {fmt_range(s['cpu_plain_nocode_vs_torchrun'])}). ")
    print(text)
    if not args.no_readme:
        write_readme_sentence(README, "comm-hook", "bench/comm_hook.py", text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    raise SystemExit(main())
