"""Each test's CPU, whole process tree, for finding where the suite's time goes.

    BATON_TEST_CPU=/tmp/cpu.jsonl make test      # then: python -m tests.cpu_by_test /tmp/cpu.jsonl

Wall time on 2 busy cores says little about what a test costs (it waits for its neighbour's
CPU). Each pytest process (an xdist worker) moves itself into a cgroup of its own, which
every process it starts inherits (jobs, their workers, torchrun references, servers); a
test's CPU is that cgroup's usage across the test. A process that outlives its test (the
session's warm process, a session's Slurm cluster) is charged to whichever test runs while
it works. Needs root and the cgroup v1 cpuacct controller; otherwise it says so and
records nothing. Off unless BATON_TEST_CPU names the file to append to.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuByTest:
    def __init__(self, out: Path, group: Path):
        self.out, self.group = out, group

    def usage_s(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):  # noqa: ANN001, ANN201
        cpu0, t0 = self.usage_s(), time.monotonic()
        yield
        row = {"test": item.nodeid, "cpu_s": round(self.usage_s() - cpu0, 2), "wall_s": round(time.monotonic() - t0, 2)}
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("BATON_TEST_CPU")
    if not out:
        return
    if os.geteuid() != 0 or not (CPUACCT / "cgroup.procs").exists():
        print("BATON_TEST_CPU: needs root and the cgroup v1 cpuacct controller; not measured", file=sys.stderr)
        return
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    # Under the group this process is in (cpuacct counts a group's subgroups): a caller that
    # measures the whole run by its own group still sees all of it.
    here = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                 if "cpuacct" in line.split(":", 2)[1].split(",")), "/")
    group = CPUACCT / here.lstrip("/") / f"baton-tests-{os.getppid() if worker != 'main' else os.getpid()}" / worker
    group.mkdir(parents=True, exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    config.pluginmanager.register(CpuByTest(Path(out), group), "baton-cpu-by-test")


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.pluginmanager.get_plugin("baton-cpu-by-test")
    if plugin is None:
        return
    (plugin.group.parent.parent / "cgroup.procs").write_text(str(os.getpid()))  # out, so the group can go
    for group in (plugin.group, plugin.group.parent):
        try:
            group.rmdir()
        except OSError:
            pass  # a process of a test still in it, or another worker's group beside it


def summary(path: Path, top: int = 40) -> str:
    """The costliest tests and files, and the total."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_file: dict[str, float] = defaultdict(float)
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu_s"]
    total = sum(r["cpu_s"] for r in rows)
    lines = [f"{len(rows)} tests, {total:.0f} CPU-s", "", "by file:"]
    lines += [f"{cpu:8.1f}  {name}" for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])]
    lines += ["", f"the {top} costliest tests:"]
    lines += [f"{r['cpu_s']:8.1f}  {r['wall_s']:7.1f} s  {r['test']}" for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
