"""Recovery time of a whole node lost (2 ranks at once) next to one rank lost, on a real
Slurm cluster whose nodes have their own addresses (the test cluster: slurmctld and 4
slurmd in network namespaces on this host; needs root, Slurm and munge as `make setup`
installs them).

    python bench/slurm_nodes.py --rounds 3        # writes bench/results/slurm-nodes-<ts>.json
                                                  # and the README's sentence between its markers

Each round runs the same job twice, in alternating order: 2 nodes x 2 ranks + 1 spare node
(bench: baton/examples/train.py, 0.15 s steps, --heartbeat-timeout 2, --op-timeout 3).
"node": at step 5 the node holding ranks 2 and 3 is lost (every process in its namespace
SIGKILLed, its link cut: peers get no answer, as from a machine that lost power).
"rank": at step 5 rank 2's process is SIGKILLed (its node stays up).
"borrowed": no spare node at all (--spare-nodes 0 --borrow-spares) and the two other nodes
held by low-priority jobs; rank 2's process is SIGKILLed and the recovery borrows a node
through Slurm's preemption (KillWait=2 in the test cluster), whose spare takes the rank.
Figures are the ledger's downtime_s of each recovered rank (the failure, i.e. the lost
worker's last sign of life, -> every rank formed the next generation; for a node, both
ranks' events) and since_kill_s (the moment this script killed -> the ledger's resumed_at,
same host clock). A node loss is seen by missing heartbeats (no process exit reaches the
launcher), a killed process by its exit.
"""

from __future__ import annotations

import argparse
import json
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

MARK = "bench:slurm-nodes"
RUN_ARGS = ["--nodes", "2", "--spare-nodes", "1", "--heartbeat-timeout", "2", "--op-timeout", "3"]


def _hold_with_low_priority_jobs(cluster: SlurmCluster, nodes: list[str]) -> list[str]:
    jobs = []
    for node in nodes:
        out = cluster.run("sbatch", "--parsable", "-p", "low", "--exclusive", "-N1", "-w", node, "--requeue",
                          "-J", f"lowprio-{node}", "-o", "/dev/null", "--wrap", "sleep 3600")
        jobs.append(out.stdout.strip())
    deadline = time.time() + 30
    while cluster.run("squeue", "-h", "-t", "R", "-p", "low", "-o", "%i").stdout.split() != sorted(jobs):
        if time.time() > deadline:
            raise RuntimeError("low-priority jobs did not start")
        time.sleep(0.2)
    return jobs


def one(kind: str, cluster: SlurmCluster, work: Path, i: int) -> dict:
    lenders = _hold_with_low_priority_jobs(cluster, ["n3", "n4"]) if kind == "borrowed" else []
    args = ["--nodes", "2", "--spare-nodes", "0", "--borrow-spares", *RUN_ARGS[4:]] if kind == "borrowed" else RUN_ARGS
    job = Job(work, nproc=2, steps=40, script_args=["--step-sleep", "0.15"], env=cluster.env,
              run_args=args, name=f"{kind}-{i}",
              launch=["salloc", "-N2" if kind == "borrowed" else "-N3", "--no-kill", "--quiet"])
    lost = None
    try:
        st = job.wait_step(5, timeout=120)
        node = next(r["slot"] for r in st["ranks"] if r["rank"] == 2).split("/")[0]
        t_fail = time.time()
        if kind == "node":
            lost = node
            cluster.lose_node(node)
        else:
            import os
            import signal

            os.kill(job.rank_pid(2), signal.SIGKILL)
        rc = job.wait(timeout=240)
        if rc != 0:
            raise RuntimeError(f"{kind} round {i}: job exited {rc}:\n{job.log()}")
        events = job.events()
        return {"downtime_s": [e["downtime_s"] for e in events],
                "since_kill_s": [round(e["resumed_at"] - t_fail, 3) for e in events if e.get("resumed_at")],
                "ranks": sorted(e["rank"] for e in events), "steps_lost": sum(e["steps_lost"] for e in events)}
    finally:
        job.kill()
        for j in lenders:
            cluster.run("scancel", j, check=False)
        if lost is not None:
            cluster.revive_node(lost)


def _mr(x: dict) -> str:
    return f"{x['median']:.2f} s ({x['min']:.2f}–{x['max']:.2f}, n={x['n']})"


def sentence(result: dict) -> str:
    node, rank = result["node"], result["rank"]
    return (f"On the test Slurm cluster (4 nodes, each in its own network namespace; {result['machine']}), "
            f"from the kill to every rank training again: a whole node lost with 2 ranks "
            f"{_mr(node['since_kill_s'])}, one killed rank process {_mr(rank['since_kill_s'])}, one killed rank "
            f"with no spare left, recovered onto a node borrowed from a low-priority job through Slurm's "
            f"preemption {_mr(result['borrowed']['since_kill_s'])}; steps lost: {node['steps_lost']}, "
            f"{rank['steps_lost']} and {result['borrowed']['steps_lost']} (per recovered rank, medians and min–max; "
            f"`bench/slurm_nodes.py`, {result['when']}). A dead node sends no exit, so it is found by missing "
            f"heartbeats (--heartbeat-timeout 2 s here), a killed process by its exit at once; a borrowed node "
            f"adds Slurm's preemption (KillWait=2 s in the test cluster) and a cold spare's start.")


def update_readme(result: dict, readme: Path = REPO / "README.md") -> None:
    write_readme_sentence(readme, MARK, "bench/slurm_nodes.py", sentence(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    why = skip_reason()
    if why:
        raise SystemExit(f"cannot run: {why}")
    import platform

    work = Path(tempfile.mkdtemp(prefix="baton-slurm-nodes-"))
    runs: dict[str, list[dict]] = {"node": [], "rank": [], "borrowed": []}
    with SlurmCluster(work / "cluster", nodes=4, netns=True) as cluster:
        for i in range(args.rounds):
            kinds = list(runs)
            for kind in kinds[i % 3:] + kinds[:i % 3]:
                runs[kind].append(one(kind, cluster, work, i))
                print(kind, i, runs[kind][-1], flush=True)
    import os

    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "runs": runs,
        **{k: {"downtime_s": median_range([d for r in v for d in r["downtime_s"]]),
               "since_kill_s": median_range([d for r in v for d in r["since_kill_s"]]),
               "steps_lost": sum(r["steps_lost"] for r in v)} for k, v in runs.items()},
    }
    out = REPO / "bench" / "results" / f"slurm-nodes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    print(sentence(result))
    if not args.no_readme:
        update_readme(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
