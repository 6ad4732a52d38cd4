"""The zygote: workers forked from one warm process behave as `python script.py args` would.

Real processes: a zygote started as `baton run` starts it, scripts forked from it, signals.
Each test runs twice: with the launcher's own zygote, and with one `baton warm` forked for it
(the session's, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton import procfs
from baton.schedulers.forked import Zygote, ZygoteGone
from baton.schedulers.processes import WorkerProcesses

SEES = '''
import json, os, sys
from pathlib import Path
Path(sys.argv[1]).write_text(json.dumps({
    "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
    "x": os.environ.get("X"), "inherited": os.environ.get("ZYGOTE_TEST_BASE"), "ppid": os.getppid(),
    "sid": os.getsid(0) == os.getpid(), "cmdline": Path("/proc/self/cmdline").read_bytes().decode(),
    "torch_loaded": "torch" in sys.modules, "random": __import__("random").random(),
    "numpy_random": __import__("numpy").random.rand()}))
sys.exit(int(sys.argv[2]))
'''


@pytest.fixture(params=["own", "warm"], autouse=True)
def how(request, monkeypatch):
    """Whose fork the zygote is: the launcher's own child, or the session's `baton warm`'s."""
    if request.param == "own":
        monkeypatch.delenv("BATON_WARM", raising=False)
    elif not os.environ.get("BATON_WARM"):
        pytest.skip("BATON_TEST_WARM=0: the session runs no warm process")
    return request.param


@pytest.fixture
def zygote(tmp_path, how):
    z = Zygote(sys.executable, _env())
    z.start()
    assert z.warm == (how == "warm")
    yield z
    z.close()


def _env(**extra: str) -> dict[str, str]:
    """A job's environment, with what `baton run` gives every worker (`baton warm` starts with it)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "ZYGOTE_TEST_BASE": "base",
            **extra}


def test_a_forked_script_sees_what_python_script_py_would(zygote, tmp_path):
    script = tmp_path / "sub" / "sees.py"
    script.parent.mkdir()
    script.write_text(SEES)
    out = tmp_path / "seen.json"
    proc = zygote.spawn([sys.executable, str(script), str(out), "3"], env=_env(X="mine"), start_new_session=True)
    assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(script), str(out), "3"]
    assert seen["name"] == "__main__" and seen["file"] == str(script)
    assert seen["path0"] == str(script.parent) and seen["cwd"] == os.getcwd()
    assert seen["x"] == "mine" and seen["inherited"] == "base"
    assert seen["ppid"] == zygote._pid and seen["sid"]
    assert seen["cmdline"].startswith(f"{sys.executable} {script} {out} 3")  # what `ps` shows
    assert seen["torch_loaded"]  # imported once, in the zygote
    again = tmp_path / "again.json"
    proc = zygote.spawn([sys.executable, str(script), str(again), "0"], env=_env(X="mine"))
    assert proc.wait(timeout=60) == 0
    other = json.loads(again.read_text())  # seeded from the OS, as two fresh pythons would be
    assert other["random"] != seen["random"] and other["numpy_random"] != seen["numpy_random"]


def test_a_module_runs_as_python_dash_m_and_an_error_prints_from_the_scripts_frame(tmp_path, capfd):
    pkg = tmp_path / "zpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text("import sys\nprint('tool', __name__, sys.argv[1:], flush=True)\n")
    zygote = Zygote(sys.executable, _env(PYTHONPATH=str(tmp_path)))
    zygote.start()
    with pytest.raises(ZygoteGone, match="other values of PYTHONPATH, read only at start"):
        zygote.spawn([sys.executable, "-m", "zpkg.tool"], env=_env())
    proc = zygote.spawn([sys.executable, "-m", "zpkg.tool", "a", "b"], env=_env(PYTHONPATH=str(tmp_path)))
    assert proc.wait(timeout=60) == 0
    proc = zygote.spawn([sys.executable, "-m", "baton.transparent.worker"], env=_env(PYTHONPATH=str(tmp_path)))
    assert proc.wait(timeout=60) == 2  # its usage: run afresh, though the zygote imported it
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    raise ValueError('the script own bug')\nf()\n")
    proc = zygote.spawn([sys.executable, str(bad)], env=_env(PYTHONPATH=str(tmp_path)))
    assert proc.wait(timeout=60) == 1
    zygote.close()
    out, err = capfd.readouterr()
    assert "tool __main__ ['a', 'b']" in out and "RuntimeWarning" not in err
    tb = err[err.index("Traceback"):]
    assert tb.splitlines()[1].startswith(f'  File "{bad}", line 3, in <module>'), tb
    assert "zygote" not in tb and "ValueError: the script own bug" in tb


def test_a_killed_worker_reports_its_signal_and_a_dead_zygote_takes_its_workers(zygote, tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    proc = zygote.spawn([sys.executable, str(sleeper)], env=_env())
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    survivor = zygote.spawn([sys.executable, str(sleeper)], env=_env())
    os.kill(zygote._pid, signal.SIGKILL)
    assert survivor.wait(timeout=30) == -signal.SIGKILL
    assert not procfs.running(survivor.pid)  # it died with its parent, as with the launcher
    with pytest.raises(ZygoteGone):
        zygote.spawn([sys.executable, str(sleeper)], env=_env())


def test_workers_start_as_new_processes_once_the_zygote_is_gone(tmp_path, capfd):
    ended: list[tuple[str, int]] = []
    zygote = Zygote(sys.executable, _env())
    procs = WorkerProcesses(lambda wid, code: ended.append((wid, code)), zygote=zygote)
    script = tmp_path / "quick.py"
    script.write_text("import sys\nsys.exit(5)\n")
    first = procs.start("w0", [sys.executable, str(script)], env=_env())
    assert first.wait(timeout=60) == 5 and not isinstance(first, subprocess.Popen)
    os.kill(zygote._pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while zygote._gone is None:  # its reader sees the end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = procs.start("w1", [sys.executable, str(script)], env=_env())
    assert isinstance(second, subprocess.Popen) and second.wait(timeout=60) == 5
    assert "starting workers as new processes (slower start): the zygote exited" in capfd.readouterr().err
    deadline = time.monotonic() + 30
    while len(ended) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted(ended) == [("w0", 5), ("w1", 5)]
    procs.shutdown(lambda _p: None, lambda _p: None, 1.0)


def test_nothing_forks_with_the_switch_off(tmp_path):
    zygote = Zygote(sys.executable, _env(BATON_ZYGOTE="0"))
    zygote.start()
    assert zygote._proc is None
    with pytest.raises(ZygoteGone, match="BATON_ZYGOTE=0"):
        zygote.spawn([sys.executable, str(Path(__file__))], env=_env())
