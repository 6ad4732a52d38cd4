"""`baton warm`: a job's zygote forked from the machine's warm process trains as its own would,
goes with its launcher, outlives the warm process, and what the warm process cannot serve
exactly starts its own zygote, saying why.

Real processes: `baton warm` started as a user starts it, `baton run` jobs, kill -9, network
namespaces the test creates. The session's other tests run their jobs through the session's
warm process (tests/conftest.py); these start their own where they kill it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from baton import procfs
from baton.schedulers import warm
from tests.jobs import Job, bitwise_equal
from tests.warm_process import WarmProcess

NPROC = 2
STEPS = 30
ARGS = ["--step-sleep", "0.03"]
IMPORTS = re.compile(r"the workers' imports, once, ([\d.]+)s")


@pytest.fixture
def warm_process(warm_process):
    if warm_process is None:
        pytest.skip("BATON_TEST_WARM=0: the session runs no warm process")
    return warm_process


def _imports_s(job: Job) -> float:
    found = IMPORTS.findall(job.log(tail=None))
    assert found, job.log()
    return float(found[-1])


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_zygote_forked_by_the_warm_process_trains_moves_and_recovers_as_the_jobs_own(tmp_path, warm_process):
    """The same job, once with its own zygote and once with one the warm process forked: each
    goes through a planned move and a kill -9, and both end with the same bits. The forked one
    imported nothing (its imports cost hundredths of a second, not seconds), and its ranks are
    its zygote's children, the zygote the warm process's."""
    runs = {}
    for how, env in (("own", {"BATON_WARM": ""}), ("warm", {})):
        job = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, env=env, name=how, leash=4)
        try:
            job.wait_step(5)
            zygote = _parent(job.rank_pid(0))
            assert _parent(zygote) == (warm_process.proc.pid if how == "warm" else job.proc.pid)
            job.wait_spare()
            job.client.migrate(1)
            job.wait_until(lambda st: any(e["kind"] == "planned" and e["status"] == "resolved"
                                          for e in job.client.events()["events"]), what="the planned move")
            job.wait_spare()
            job.signal_rank(0, signal.SIGKILL)
            assert job.wait() == 0, job.log()
        finally:
            job.kill()
        kinds = [(e["kind"], e["status"]) for e in job.events()]
        assert kinds == [("planned", "resolved"), ("unplanned", "resolved")], kinds
        runs[how] = (job.all_rank_params(NPROC), _imports_s(job))
        assert "did not fork this job's zygote" not in job.log(tail=None), job.log()
    (own, own_imports), (forked, forked_imports) = runs["own"], runs["warm"]
    assert all(bitwise_equal(a, b) for a, b in zip(own, forked))
    assert own_imports > 1.0 and forked_imports < 0.5, (own_imports, forked_imports)


def test_a_launcher_killed_takes_its_zygote_and_workers_and_a_killed_warm_process_takes_no_job(tmp_path):
    """kill -9 of a launcher: its zygote (the warm process's child) and every worker are gone,
    as with its own zygote. kill -9 of the warm process: the jobs it forked zygotes for go on
    and end bitwise as without it. As on a CI machine, the warm process starts from a shell
    without TORCHINDUCTOR_CACHE_DIR and the launchers from a process that imported torch, which
    wrote the directory into the environment they inherit: they are served all the same."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    shell = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    warm_proc = WarmProcess(env={**shell, "OMP_NUM_THREADS": "1"}).wait_ready()
    env = {"BATON_WARM": str(warm_proc.socket), "TORCHINDUCTOR_CACHE_DIR": os.path.abspath(default_cache_dir())}
    try:
        doomed = Job(tmp_path, nproc=NPROC, spares=1, steps=1000, script_args=ARGS, env=env, name="doomed")
        survivor = Job(tmp_path, nproc=NPROC, spares=1, steps=STEPS, script_args=ARGS, env=env, name="survivor",
                       leash=4)
        doomed.wait_step(2)
        doomed.wait_spare()
        workers = [r["pid"] for r in doomed.status()["ranks"]]
        zygote = _parent(workers[0])
        assert _parent(zygote) == warm_proc.proc.pid
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        deadline = time.monotonic() + 60
        while any(procfs.running(p) for p in [zygote, *workers]):
            assert time.monotonic() < deadline, [p for p in [zygote, *workers] if procfs.running(p)]
            time.sleep(0.05)

        survivor.wait_step(3)
        warm_proc.proc.kill()
        warm_proc.proc.wait()
        assert survivor.wait() == 0, survivor.log()
        ref = Job(tmp_path, nproc=NPROC, spares=0, steps=STEPS, script_args=ARGS, env={"BATON_WARM": ""}, name="ref")
        assert ref.wait() == 0, ref.log()
        assert all(bitwise_equal(a, b) for a, b in zip(survivor.all_rank_params(NPROC), ref.all_rank_params(NPROC)))
    finally:
        for job in (locals().get("doomed"), locals().get("survivor"), locals().get("ref")):
            if job is not None:
                job.kill()
        warm_proc.stop()


def test_what_the_warm_process_cannot_redo_starts_the_jobs_own_zygote_and_says_why(tmp_path):
    """Another value of a variable torch reads at start, and a launcher in another network
    namespace (a container, a Slurm step): each job says why and runs with its own zygote."""
    job = Job(tmp_path, nproc=NPROC, spares=0, steps=10, env={"OMP_NUM_THREADS": "2"}, name="omp")
    assert job.wait() == 0, job.log()
    assert "did not fork this job's zygote, starting one (slower start): it started with other values of " \
           "OMP_NUM_THREADS, read only at start" in job.log(tail=None)
    assert _imports_s(job) > 1.0
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("a network namespace needs root, unshare and ip")
    netns = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    job = Job(tmp_path, nproc=NPROC, spares=0, steps=10, name="netns", launch=netns)
    assert job.wait() == 0, job.log()
    assert "it is unreachable" not in job.log(tail=None)
    assert "the launcher runs in another net (a Slurm step, a container?)" in job.log(tail=None), job.log()


def test_a_request_the_warm_process_cannot_serve_exactly_is_refused_with_the_reason(tmp_path):
    """Each reason, as `refusal` decides it for a request (the processes are tested above)."""
    here, env = warm.where_am_i(), {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/opt/lib"}
    imported = {"numpy": {"/site"}, "baton": {str(Path(warm.__file__).parents[2])}}

    filled_in = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}  # what torch's import wrote

    def ask(uid: int = os.getuid(), **change) -> str | None:
        req = warm.Prepare(python=sys.executable, env=dict(env), cwd=str(tmp_path), umask=0o022, affinity=[0],
                           place=dict(here))
        req = req.model_copy(update=change)
        return warm.refusal(req, uid, here, env, imported, filled_in)

    assert ask() is None
    assert "uid 12345" in ask(uid=12345)
    assert "it runs" in ask(python="/usr/bin/python3.9")
    assert "another net" in ask(place={**here, "net": "net:[1]"})
    assert "other values of OMP_NUM_THREADS" in ask(env={**env, "OMP_NUM_THREADS": "4"})
    assert "other values of TORCH_LOGS" in ask(env={**env, "TORCH_LOGS": "+dynamo"})
    assert ask(env={**env, "BATON_ANYTHING": "x", "MASTER_PORT": "1"}) is None  # read after start
    # A launcher whose parent imported torch inherits the directory torch wrote: the same start.
    assert ask(env={**env, **filled_in}) is None
    assert "other values of TORCHINDUCTOR_CACHE_DIR" in ask(env={**env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})
    assert "does not end with" in ask(env={**env, "PYTHONPATH": "/elsewhere"})
    extra = tmp_path / "extra"
    extra.mkdir()
    assert ask(env={**env, "PYTHONPATH": f"{extra}:/opt/lib"}) is None
    (extra / "numpy.py").write_text("")
    assert f"{extra} holds numpy, imported here from elsewhere" in ask(env={**env, "PYTHONPATH": f"{extra}:/opt/lib"})
    (tmp_path / "numpy").mkdir()
    assert "holds numpy" in ask()  # the working directory comes first on a fresh python's path
    assert ask(cwd=str(Path(warm.__file__).parents[2])) is None  # holds baton, imported from there


def test_a_malformed_request_is_refused_and_the_warm_process_serves_on(warm_process):
    """Not JSON, a request of another type, a prepare without its descriptors: each answered
    with a refusal that says what was wrong; then a well-formed request is served."""
    import json
    import socket

    def ask(data: bytes, fds: list[int] | None = None) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect(str(warm_process.socket))
            if fds:
                socket.send_fds(conn, [data], fds)
            else:
                conn.sendall(data)
            return json.loads(conn.makefile().readline())

    assert "bad request" in ask(b"not json\n")["error"]
    assert "expected a prepare request" in ask(b'{"type": "forked", "pid": 1}\n')["error"]
    req = warm.Prepare(python=sys.executable, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                       cwd=os.getcwd(), umask=0o022,
                       affinity=sorted(os.sched_getaffinity(0)), place=warm.where_am_i())
    line = req.model_dump_json().encode() + b"\n"
    assert "with 4 descriptors, got Prepare with 0" in ask(line)["error"]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        answer = ask(line, [theirs.fileno(), 0, 1, 2])
        assert answer["type"] == "forked", answer
        from baton.schedulers.zygote import Lines, Ready

        ours.settimeout(120)
        first = Lines(ours).read()
        assert first and isinstance(first[0], Ready) and first[0].pid == answer["pid"]
    deadline = time.monotonic() + 60  # our end closed: the zygote exits, as with a launcher gone
    while procfs.running(answer["pid"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
