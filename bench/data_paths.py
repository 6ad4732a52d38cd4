"""Data paths on a real Slurm cluster whose nodes have two data rails each (the test
cluster: slurmctld and 3 slurmd in network namespaces, tests/rail_network.py; needs root,
Slurm and munge as `make setup` installs them).

    python bench/data_paths.py --rounds 3        # writes bench/results/data-paths-<ts>.json
                                                 # and the README's sentence between its markers

Each round, in alternating order:
  "failover": 2 nodes x 1 rank + a spare node, `--data-paths rail1,rail2 --path-hold-down 1`
      (baton/examples/train.py, a 256-wide MLP, 1500 steps). At step 20 rank 1's node's
      rail1 is set down; then, once the job runs over rail2, set up again. Measured: from the
      link set down to every rank training again (the ledger's resumed_at, same host clock),
      the ledger's downtime, steps lost and re-run; from the link set up to the job back on
      both rails, and that restore's pause.
  "two rails" / "one rail": the same job, steady, over rail1 and rail2 or rail1 only: the
      median step time the ranks report (steps 20-1200).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import median_range, write_readme_sentence  # noqa: E402
from tests.jobs import Job  # noqa: E402
from tests.slurm_cluster import SlurmCluster, skip_reason  # noqa: E402

MARK = "bench:data-paths"
RUN_ARGS = ["--nodes", "2", "--spare-nodes", "1", "--heartbeat-timeout", "2", "--op-timeout", "5",
            "--path-hold-down", "1"]
SCRIPT_ARGS = ["--width", "256", "--depth", "3"]


def _job(cluster: SlurmCluster, work: Path, name: str, paths: str, steps: int) -> Job:
    cluster.wait_idle(120)  # the previous run's allocation released (a killed one takes a moment)
    return Job(work, nproc=1, steps=steps, script_args=SCRIPT_ARGS, env=cluster.env, name=name,
               run_args=[*RUN_ARGS, "--data-paths", paths], launch=["salloc", "-N3", "--no-kill", "--quiet"])


def _rank_node(st: dict, rank: int) -> str:
    return next(r["slot"] for r in st["ranks"] if r["rank"] == rank).split("/")[0]


def failover(cluster: SlurmCluster, work: Path, i: int) -> dict:
    job = _job(cluster, work, f"failover-{i}", "rail1,rail2", 1500)
    node = None
    try:
        st = job.wait_step(20, timeout=180)
        node = _rank_node(st, 1)
        t_down = cluster.rails.set_link(node, "rail1", False)
        job.wait_until(lambda s: s["data_paths"]["in_use"] == ["rail2"] and not s["operation"], timeout=120,
                       what="failover")
        t_up = cluster.rails.set_link(node, "rail1", True)
        node = None
        job.wait_until(lambda s: s["data_paths"]["in_use"] == ["rail1", "rail2"] and not s["operation"],
                       timeout=120, what="restore")
        if job.wait(timeout=300) != 0:
            raise RuntimeError(f"failover round {i}: the job failed:\n{job.log()}")
        events = job.events()
    finally:
        job.kill()
        cluster.run("scancel", "--full", "-u", "root", check=False)
        if node is not None:
            cluster.rails.set_link(node, "rail1", True)
    down = next(e for e in events if e["kind"] == "path-failover")
    back = next(e for e in events if e["kind"] == "path-restored")
    return {"since_down_s": round(down["resumed_at"] - t_down, 4), "failover_downtime_s": down["downtime_s"],
            "steps_lost": down["steps_lost"], "steps_rerun": down["steps_rerun"],
            "since_up_s": round(back["resumed_at"] - t_up, 4), "restore_pause_s": back["downtime_s"],
            "spares_used": sum(1 for e in events if e["kind"] in ("unplanned", "planned", "pre-emptive"))}


def steady(cluster: SlurmCluster, work: Path, paths: str, i: int) -> dict:
    job = _job(cluster, work, f"steady-{paths.replace(',', '-')}-{i}", paths, 1500)
    samples = []
    try:
        job.wait_step(20, timeout=180)
        while True:
            st = job.status()
            if st["ranks"][0]["step"] >= 1200 or job.proc.poll() is not None:
                break
            samples += [r["metrics"]["step_time"] for r in st["ranks"] if r["metrics"].get("step_time")]
            time.sleep(0.2)
        job.wait(timeout=120)
    finally:
        job.kill()
        cluster.run("scancel", "--full", "-u", "root", check=False)
    return {"step_s": statistics.median(samples) if samples else None, "samples": len(samples)}


def _mr(x: dict, unit: str = "s", digits: int = 3) -> str:
    return f"{x['median']:.{digits}f} {unit} ({x['min']:.{digits}f}-{x['max']:.{digits}f}, n={x['n']})"


def sentence(r: dict) -> str:
    return (f"On the test Slurm cluster (3 nodes in network namespaces, two data rails each; {r['machine']}, "
            f"`bench/data_paths.py`, {r['when']}): a rail set down on a rank's node mid-training, to every rank "
            f"training again over the other rail {_mr(r['since_down_s'])} (ledger downtime "
            f"{_mr(r['failover_downtime_s'])}, {r['steps_lost']} steps lost, {r['spares_used']} spares used); "
            f"the rail set up again, to the job back on both rails {_mr(r['since_up_s'])} (1 s hold-down "
            f"included), that restore pausing training {_mr(r['restore_pause_s'])}; steady step time over "
            f"both rails {_mr(r['two_rails_step_s'], 'ms', 1)} against one rail {_mr(r['one_rail_step_s'], 'ms', 1)} "
            f"(medians and min-max over rounds; on loopback-speed links the rails add no bandwidth a step needs).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    why = skip_reason()
    if why:
        raise SystemExit(f"cannot run: {why}")
    import os

    work = Path(tempfile.mkdtemp(prefix="baton-data-paths-"))
    runs: dict[str, list[dict]] = {"failover": [], "two rails": [], "one rail": []}
    with SlurmCluster(work / "cluster", nodes=3, netns=True, rails=2) as cluster:
        for i in range(args.rounds):
            kinds = list(runs)
            for kind in kinds[i % 3:] + kinds[:i % 3]:
                got = failover(cluster, work, i) if kind == "failover" else \
                    steady(cluster, work, "rail1,rail2" if kind == "two rails" else "rail1", i)
                runs[kind].append(got)
                print(kind, i, got, flush=True)
    f = runs["failover"]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "runs": runs,
        **{k: median_range([x[k] for x in f]) for k in
           ("since_down_s", "failover_downtime_s", "since_up_s", "restore_pause_s")},
        "steps_lost": sum(x["steps_lost"] for x in f), "spares_used": sum(x["spares_used"] for x in f),
        "two_rails_step_s": median_range([x["step_s"] * 1000 for x in runs["two rails"] if x["step_s"]]),
        "one_rail_step_s": median_range([x["step_s"] * 1000 for x in runs["one rail"] if x["step_s"]]),
    }
    out = REPO / "bench" / "results" / f"data-paths-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    print(sentence(result))
    if not args.no_readme:
        write_readme_sentence(REPO / "README.md", MARK, "bench/data_paths.py", sentence(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
