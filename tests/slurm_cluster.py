"""A real Slurm cluster on this host for the tests: one slurmctld and N slurmd "nodes".

Debian's slurm-wlm 22.05 and munge, each started here in the foreground with its own
configuration, munge socket, ports and state in a scratch directory, and stopped when the
test ends. With `netns=True` every slurmd (and so every task it starts) runs in a network
namespace of its own with its own address (tests/node_network.py), slurmctld and the
launcher on the host's address in that network; otherwise all on 127.0.0.1. Nothing system-wide is touched. Installed by `scripts/install-system-packages.sh`
(part of `make setup`); without root or the packages, `skip_reason()` says why and the tests
skip with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.node_network import NodeNetwork
from tests.rail_network import RailNetwork

BINARIES = ("slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol", "munged", "ip")


def skip_reason() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd runs tasks as the submitting user)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} missing): run "
                "scripts/install-system-packages.sh as root (make setup does)")
    if not Path("/etc/munge/munge.key").exists():
        return "no munge key at /etc/munge/munge.key (the munge package creates it)"
    return None


def _free_ports(n: int) -> list[int]:
    """n consecutive free TCP ports (Slurm's node port ranges are consecutive)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            probes = []
            for p in range(base, base + n):
                s = socket.socket()
                probes.append(s)
                s.bind(("127.0.0.1", p))
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in probes:
                s.close()
    raise RuntimeError("no run of free ports found")


class SlurmCluster:
    """`with SlurmCluster(tmp, nodes=4) as c:` - `c.env` runs Slurm commands against it."""

    def __init__(self, root: Path, nodes: int = 4, cpus_per_node: int = 2, netns: bool = False, rails: int = 0):
        self.root = Path(root)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus_per_node
        self.network = NodeNetwork(self.nodes) if netns else None
        # data rails beside the control network: the same interface names on every node
        self.rails = RailNetwork(self.network, rails) if self.network is not None and rails else None
        self._procs: dict[str, subprocess.Popen] = {}
        self.munge_dir: Path | None = None
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[var]  # a test run inside an allocation must not leak it into this one

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        if self.network is not None:
            self.network.up()
        if self.rails is not None:
            self.rails.up()
        ports = _free_ports(2 + len(self.nodes))
        self.conf.write_text(self._config(ports))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            self.start_node(node)
        self.wait_idle(timeout)

    def stop(self) -> None:
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=20)
        for name in list(self._procs):
            self._kill(name)
        if self.rails is not None:
            self.rails.down()
        if self.network is not None:
            self.network.down()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
        # Tasks outlive a SIGKILLed slurmd in their slurmstepd: end whatever this cluster ran.
        for pid in self._stepds():
            for p in [pid, *_descendants(pid)]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def start_node(self, node: str) -> None:
        prefix = self.network.run_in(node) if self.network is not None else []
        self._spawn(f"slurmd-{node}", [*prefix, "slurmd", "-D", "-N", node])

    def lose_node(self, node: str) -> None:
        """The whole node fails: its slurmd and every process on it killed, its link cut."""
        assert self.network is not None, "losing a node needs netns=True"
        self.network.lose(node)
        p = self._procs.pop(f"slurmd-{node}", None)
        if p is not None:
            p.wait(timeout=10)

    def revive_node(self, node: str, timeout: float = 60.0) -> None:
        """Power a lost node back on: link up, slurmd started, returned to service."""
        assert self.network is not None
        self.network.restore(node)
        self.start_node(node)
        start = time.time()
        deadline = start + timeout
        cleared = False
        while time.time() < deadline:
            self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            state = self.node_states().get(node)
            if state in ("idle", "mixed", "allocated"):
                return
            if state == "completing" and not cleared and time.time() - start > 15:
                # The killed job's steps still count as completing on the node (slurmctld
                # waits for an epilog the lost slurmd never ran): what an admin does, down
                # then resume, clears them.
                self.run("scontrol", "update", f"nodename={node}", "state=down", "reason=baton-test-revive",
                         check=False)
                cleared = True
            time.sleep(0.5)
        raise RuntimeError(f"{node} did not come back: {self.node_states()}")

    def node_reasons(self) -> dict[str, tuple[str, str]]:
        """node -> (state, reason) as sinfo shows them."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", check=False).stdout
        return {p[0]: (p[1], p[2]) for p in (line.split("|") for line in out.splitlines()) if len(p) == 3}

    def _stepds(self) -> list[int]:
        """This cluster's slurmstepd processes (they inherit slurmd's SLURM_CONF)."""
        found = subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True, text=True).stdout.split()
        return [int(p) for p in found if _environ(int(p)).get("SLURM_CONF") == str(self.conf)]

    # ---------------------------------------------------------------- queries
    def run(self, *argv: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        while time.time() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode}: {self.log_tail(name)}")
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f}s: {states}\n{self.log_tail('slurmctld')}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        f = self.root / "log" / f"{name}.log"
        return "\n".join(f.read_text(errors="replace").splitlines()[-lines:]) if f.exists() else ""

    # ---------------------------------------------------------------- internals
    def _start_munge(self) -> None:
        # munged runs as user munge, which must reach its directory: pytest's temporary
        # directories are root-only, so it gets one of its own directly under /tmp.
        d = self.munge_dir = Path(tempfile.mkdtemp(prefix="baton-munge-"))
        shutil.chown(d, "munge", "munge")
        d.chmod(0o755)  # clients (slurmd, srun) must reach the socket in it
        self._spawn("munged", ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={d}/munge.sock",
                               f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                               f"--seed-file={d}/munged.seed"])
        deadline = time.time() + 15
        while not (d / "munge.sock").exists():
            if self._procs["munged"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"munged did not start: {(d / 'munged.log').read_text(errors='replace')}"
                                   if (d / "munged.log").exists() else "munged did not start")
            time.sleep(0.05)

    def _config(self, ports: list[int]) -> str:
        d = self.root
        host = socket.gethostname()
        if self.network is None:
            nodes = [f"NodeName=n[1-{len(self.nodes)}] NodeHostname={host} NodeAddr=127.0.0.1 "
                     f"Port=[{ports[2]}-{ports[2] + len(self.nodes) - 1}] CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"]
        else:  # one address per node: they can all listen on the same port
            nodes = [f"NodeName={n} NodeHostname={host} NodeAddr={self.network.addrs[n]} Port={ports[2]} "
                     f"CPUs={self.cpus} RealMemory=4000 State=UNKNOWN" for n in self.nodes]
        ctld_addr = self.network.host_addr if self.network is not None else "127.0.0.1"
        return "\n".join([
            "ClusterName=batontest",
            f"SlurmctldHost={host}({ctld_addr})",
            "SlurmUser=root",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            # cred_expire: also how long Slurm holds a requeued job before it may run again
            f"AuthInfo=socket={self.munge_dir}/munge.sock,cred_expire=10",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdTimeout=30",
            "KillWait=2",
            *nodes,
            # Two tiers over the same nodes: a request in "debug" (the default) preempts jobs in
            # "low" by requeueing them, as a site lends idle capacity to low-priority work.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "JobRequeue=1",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=10",
            "PartitionName=low Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE",
            "",
        ])

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self._procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def _kill(self, name: str) -> None:
        p = self._procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw.split(b"\0") if b"=" in x)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _descendants(k)]
