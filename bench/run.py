"""baton's benchmarks, side by side with what users would run instead, in one run.

    make bench                          # quick preset (19.5 min on a 2-core Xeon, bench-20261128-025501.json;
                                        # 38.4 min on a 2-core AMD EPYC, bench-20261129-010401.json)
    .venv/bin/python bench/run.py --full
    .venv/bin/python bench/run.py --only overhead,failures --rounds 3
    .venv/bin/python bench/run.py --preset tiny --only overhead   # does it work? (a minute or two;
                                        # results to a temp dir, the page is left alone)

Sections (each figure: a median over interleaved runs, with min-max):
  overhead   step time and CPU-seconds per step of the whole process tree: plain DDP vs
             baton vs baton --verify-every N vs TorchFT, same model/data/world size
  failures   job time with kill -9 on a fixed schedule: checkpoint-restart (two K),
             TorchFT, baton with a warm spare; time lost per failure, steps recomputed,
             final parameters vs the failure-free run
  downtime   planned/unplanned migration downtime vs state size, next to raw TCP and
             shared-memory copies of the same bytes
  gpu        capture of ~10 GB of GPU state to host, when a CUDA device exists

Peers (TorchFT) are installed by bench/peers/setup.sh into bench/.peers-venv. Raw
results go to bench/results/bench-<timestamp>.json; docs/benchmarks.md and its plots
are regenerated from them (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS_PY = BENCH / ".peers-venv" / "bin" / "python"

PRESETS = {
    "quick": {
        "overhead": {"sizes_m": [2, 10], "steps": 70, "warmup": 10, "nproc": 3, "verify_every": 10},
        "failures": {"params_m": 2, "steps": 48, "nproc": 3, "step_sleep": 0.05, "kill_at": [24], "kill_rank": 1},
        "downtime": {"sizes_mb": [10, 100, 1000]},
        "gpu": {"state_gb": 10},
        "rounds": 4,  # 5 took 31.9 min (bench-20261127-235702.json) in a slow hour; 4: 19.5 min in a faster one
    },
    "full": {
        "overhead": {"sizes_m": [2, 10, 50], "steps": 60, "warmup": 10, "nproc": 3, "verify_every": 10},
        "failures": {"params_m": 2, "steps": 150, "nproc": 3, "step_sleep": 0.05, "kill_at": [50, 100],
                     "kill_rank": 1},
        "downtime": {"sizes_mb": [10, 30, 100, 300, 1000, 2000]},
        "gpu": {"state_gb": 10},
        "rounds": 7,
    },
    # Checks that every section runs end to end; its figures mean nothing. Never written to
    # bench/results or the page unless --results-dir says where.
    "tiny": {
        "overhead": {"sizes_m": [0.5], "steps": 14, "warmup": 4, "nproc": 3, "verify_every": 10},
        "failures": {"params_m": 0.5, "steps": 16, "nproc": 3, "step_sleep": 0.05, "kill_at": [8], "kill_rank": 1},
        "downtime": {"sizes_mb": [10]},
        "gpu": {"state_gb": 1},
        "rounds": 1,
    },
}
SECTIONS = ("overhead", "failures", "downtime", "gpu")


def machine() -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torchft": None, "cpu_model": platform.processor() or None,
            "memory_gib": None}
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                                     info["cpu_model"])
    except OSError:
        pass
    return info


def install_peers() -> tuple[str | None, str | None]:
    """(peers python, torchft version) or (None, why not)."""
    r = subprocess.run(["bash", str(BENCH / "peers" / "setup.sh")], capture_output=True, text=True)
    if r.returncode != 0 or not PEERS_PY.exists():
        return None, f"bench/peers/setup.sh failed: {(r.stderr or r.stdout).strip()[-300:]}"
    v = subprocess.run([str(PEERS_PY), "-c", "from importlib.metadata import version; "
                        "print(version('torchft-nightly'))"], capture_output=True, text=True)
    return str(PEERS_PY), f"torchft-nightly {v.stdout.strip()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the full preset: 3 model sizes, 2 kills, 5 state sizes")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="quick (default, `make bench`), full (= --full) or tiny (a smoke test: one small size, "
                        "one round; results go to a temp dir and the page is not rewritten)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where bench-<timestamp>.json goes (default bench/results; tiny: a temp dir)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (runs per contender); "
                   "at least 5 for published figures")
    p.add_argument("--no-report", action="store_true", help="do not regenerate docs/benchmarks.md")
    p.add_argument("--keep-runs", action="store_true", help="keep every run's directory (logs, progress, "
                   "cpu.rank*.json) and print where")
    args = p.parse_args(argv)
    sys.path.insert(0, str(BENCH))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if args.full and args.preset not in (None, "full"):
        p.error("--full and --preset disagree")
    preset_name = args.preset or ("full" if args.full else "quick")
    preset = PRESETS[preset_name]
    if preset_name == "tiny" and args.results_dir is None:
        args.results_dir = Path(tempfile.mkdtemp(prefix="baton-bench-tiny-"))
        args.no_report = True  # a smoke test's figures must not become the published page
    rounds = args.rounds or preset["rounds"]
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")

    t_start = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = (args.results_dir or REPO / "bench" / "results").resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / f"bench-{stamp}.json"
    # schema 2: overhead has CPU-seconds per step and baton-verify; failures' baton stall no
    # longer counts an absorbed (failed) attempt as progress
    result: dict = {"schema": 2, "preset": preset_name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "commands": [{"quick": "make bench", "full": "make bench ARGS=--full"}.get(
                                     preset_name, f"make bench ARGS='--preset {preset_name}'"),
                                 " ".join(["python bench/run.py", *(argv if argv is not None else sys.argv[1:])])],
                    "machine": machine(), "rounds": rounds}
    py = sys.executable
    peer_py = None
    if {"overhead", "failures"} & set(only):
        print("installing peers (bench/peers/setup.sh) ...", flush=True)
        peer_py, what = install_peers()
        result["machine"]["torchft"] = what if peer_py else None
        if peer_py is None:
            result["torchft_skipped"] = what
            print(f"  TorchFT left out: {what}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-"))

    def save() -> None:
        result["duration_s"] = time.time() - t_start
        out.write_text(json.dumps(result, indent=2))

    try:
        for section in only:
            t0 = time.time()
            print(f"\n== {section} ({preset_name} preset, {rounds} rounds)", flush=True)
            try:
                result[section] = run_section(section, preset, rounds, py, peer_py, tmp / section)
            except Exception as e:  # one broken section must not lose the others' figures
                result[section] = {"skipped": f"failed: {type(e).__name__}: {e}"}
                print(f"  {section} FAILED: {e}", flush=True)
            print(f"  ({section}: {time.time() - t0:.0f} s)", flush=True)
            result.setdefault("section_s", {})[section] = round(time.time() - t0, 1)
            save()
    finally:
        if args.keep_runs:
            print(f"run directories kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    save()
    shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    print(f"\nresults: {shown} ({(time.time() - t_start) / 60:.1f} min)")
    if not args.no_report:
        from report import update_readme, write_report

        page = write_report(result, out, REPO)
        print(f"page:    {page.relative_to(REPO)}" + (" (and README.md's headline table)"
                                                        if update_readme(result, out, REPO) else ""))
    failed = [s for s in only if "failed:" in str(result.get(s, {}).get("skipped", ""))]
    return 1 if failed else 0


def run_section(section: str, preset: dict, rounds: int, py: str, peer_py: str | None, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = preset[section]
    if section == "overhead":
        from overhead import bench_overhead

        return bench_overhead(py, peer_py, rounds=rounds, tmp=tmp, **cfg)
    if section == "failures":
        from failures import bench_failures

        return bench_failures(py, peer_py, rounds=rounds, tmp=tmp, **cfg)
    if section == "downtime":
        from downtime import bench_downtime

        return bench_downtime(cfg["sizes_mb"], rounds, tmp, py)
    from gpu import bench_gpu

    return bench_gpu(cfg["state_gb"], rounds)


if __name__ == "__main__":
    sys.exit(main())
