"""Random real faults of unmodified torchrun scripts under `baton run`, each run compared bit
for bit with the same file's failure-free torchrun run.

    PYTHONPATH=. python bench/nocode_faults.py --runs 8     # writes bench/results/nocode-faults-<ts>.json
                                                            # and the README's <!-- nocode-faults --> sentence

Each preset below runs `--runs` jobs of tests/campaign_nocode.py (the test suite's harness:
tests/nocode's five shapes, real processes, real signals): every run seeds where its faults
land (a random rank, a random step, a random moment within it), sends them one after
another, each once the one before was resolved, and ends exact (every rank's state and the
files it wrote equal torchrun's), stopped (non-zero, saying why), or diverged (exit 0 with
other state: the bug this product must never have). The counts are what this reports, per
preset and in all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import save_results, write_readme_sentence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
README = ROOT / "README.md"

_SHAPES = {  # tests/nocode's scripts, with the arguments tests/test_nocode_moves.py runs them with
    "fsdp2": ("fsdp2_example.py", None, 60),
    "nanogpt": ("nanogpt_train.py", ["--out_dir={d}/out", "--max_iters=72", "--eval_interval=18"], 72),
    "trainer": ("trainer_ddp.py", ["9", "4", "--snapshot-path", "{d}/snapshot.pt"], 72),
    "imagenet": ("imagenet_main.py", ["--epochs", "9", "--out-dir", "{d}/out"], 72),
    "accumulating": ("accumulating_amp.py", ["--epochs", "9", "--checkpoint", "{d}/ckpt.pt"], 72),
}
PRESETS = [(shape, "SIGKILL", 1) for shape in _SHAPES] + [(shape, "SIGKILL", 2) for shape in _SHAPES] + \
    [(shape, "SIGSTOP", 1) for shape in ("fsdp2", "trainer", "nanogpt")]


def _run_preset(shape: str, sig: str, faults: int, runs: int, out: Path) -> list[dict]:
    script, args, steps = _SHAPES[shape]
    env = {**os.environ, "CAMPAIGN_SCRIPT": script, "CAMPAIGN_STEPS": str(steps), "CAMPAIGN_N": str(runs),
           "CAMPAIGN_KILLS": str(faults), "CAMPAIGN_SIGNAL": sig, "CAMPAIGN_OUT": str(out)}
    if args is not None:
        env["CAMPAIGN_ARGS"] = json.dumps(args)
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "tests/campaign_nocode.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    # a run that ended 0 with other state fails its comparison; one with no line failed before its end
    failed = {int(m) for m in re.findall(r"^FAILED \S+::test_campaign\[(\d+)\]", done.stdout, re.M)}
    for r in rows:
        r["outcome"] = "stopped" if r["code"] != 0 else "diverged" if r["i"] in failed else "exact"
    seen = {r["i"] for r in rows}
    rows += [{"i": i, "outcome": "no result", "output": done.stdout[-3000:]} for i in range(runs) if i not in seen]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=8, help="runs per preset")
    p.add_argument("--results-dir", type=Path, default=BENCH / "results")
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args()
    t0 = time.time()
    presets = []
    for shape, sig, faults in PRESETS:
        rows = _run_preset(shape, sig, faults, args.runs, Path(f"/tmp/baton-nocode-faults-{os.getpid()}.jsonl"))
        counts = {k: sum(r["outcome"] == k for r in rows) for k in ("exact", "stopped", "diverged", "no result")}
        went_back = sum(bool(r.get("went_back")) for r in rows)
        presets.append({"shape": shape, "signal": sig, "faults_per_run": faults, "runs": len(rows), **counts,
                        "went_back": went_back, "rows": rows})
        print(f"{shape:12s} {sig} x{faults}: {counts} (went back a step: {went_back})", flush=True)
    total = {k: sum(x[k] for x in presets) for k in ("runs", "exact", "stopped", "diverged", "no result")}
    total["faults"] = sum(x["runs"] * x["faults_per_run"] for x in presets)
    path = save_results(args, "nocode-faults", presets=presets, total=total, seconds=round(time.time() - t0))
    print(f"wrote {path}: {total}")
    if not args.no_readme:
        kills = sum(x["runs"] * x["faults_per_run"] for x in presets if x["signal"] == "SIGKILL")
        stops = sum(x["runs"] for x in presets if x["signal"] == "SIGSTOP")
        text = (f" Random faults, measured with `bench/nocode_faults.py` ({path.name}: {total['runs']} runs of the "
                f"five shapes above on {os.cpu_count()} cores, {kills} kill -9s and {stops} SIGSTOPs of a random rank "
                f"at a random step and moment, one or two a run): {total['exact']} runs ended bit for bit equal to "
                f"torchrun's, {total['stopped']} stopped saying why, {total['diverged']} diverged"
                + (f", {total['no result']} gave no result (see the results file)" if total["no result"] else "") + ". ")
        write_readme_sentence(README, "nocode-faults", "bench/nocode_faults.py", text)
    return 1 if total["diverged"] or total["no result"] else 0


if __name__ == "__main__":
    sys.exit(main())
