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
import json
import os
import platform
import sys
import time
from pathlib import Path

from common import fmt_range, interleave, median_range, ratio, write_readme_sentence
from contenders import Contender, Workload, run_job

BENCH = Path(__file__).resolve().parent
README = BENCH.parent / "README.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--params-m", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--results-dir", type=Path, default=BENCH / "results")
    p.add_argument("--no-readme", action="store_true")
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
        summary[f"{what}_hook_nocode_vs_torchrun"] = median_range(
            ratio(r["no-code-hook"].get(field), r["torchrun-hook"].get(field)) for r in rounds)
        summary[f"{what}_plain_nocode_vs_torchrun"] = median_range(
            ratio(r["no-code"].get(field), r["torchrun"].get(field)) for r in rounds)
        summary[f"{what}_hook_vs_plain_torchrun"] = median_range(
            ratio(r["torchrun-hook"].get(field), r["torchrun"].get(field)) for r in rounds)
        summary[f"{what}_s"] = {k: median_range(r[k].get(field) for r in rounds) for k in runs}
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "workload": vars(args) | {"results_dir": str(args.results_dir)}, "summary": summary, "rounds": rounds}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"comm-hook-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=2, default=str))
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
