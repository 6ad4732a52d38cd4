"""Bad input gets a clear error and changes nothing; a user's bug ends the job with its traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.jobs import REPO, Job

ARGS = ["--step-sleep", "0.05"]


def _cli(job: Job, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args, "--run-dir", str(job.run_dir)],
                          capture_output=True, text=True, cwd=job.dir, timeout=60)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("bad"), nproc=2, spares=1, steps=100000, script_args=ARGS)
    job.wait_step(2)
    yield job
    job.kill()


def test_token_file_is_private(running):
    assert (running.run_dir / "token").stat().st_mode & 0o777 == 0o600


def test_unauthenticated_and_malformed_requests_are_refused(running):
    url = running.client.url
    before = running.status()
    cases = [
        ("get", "/v1/status", None, {}),
        ("post", "/v1/migrate", {"rank": 0}, {"Authorization": "Bearer wrong"}),
    ]
    for method, path, body, headers in cases:
        r = httpx.request(method, url + path, json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert "token" in r.json()["error"]
    token = (running.run_dir / "token").read_text()
    auth = {"Authorization": f"Bearer {token}"}
    malformed = [
        ("/v1/migrate", {"rank": "zero"}),
        ("/v1/migrate", {"rank": -1}),
        ("/v1/migrate", {}),
        ("/v1/migrate", {"rank": 0, "extra": 1}),
        ("/v1/taint", {"slot": "local/0"}),
        ("/v1/taint", {"slot": "", "reason": "x"}),
    ]
    for path, body in malformed:
        r = httpx.post(url + path, json=body, headers=auth)
        assert 400 <= r.status_code < 500, (path, body, r.status_code)
        assert r.json()["error"], r.text
    r = httpx.post(url + "/v1/migrate", content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert 400 <= r.status_code < 500 and "error" in r.json()
    r = httpx.post(url + "/v1/workers/w99/reports", json={"type": "heartbeat"}, headers=auth)
    assert r.status_code == 404 and "unknown worker" in r.json()["error"]
    r = httpx.post(url + "/v1/workers/w0/reports", json={"type": "bogus"}, headers=auth)
    assert r.status_code == 400 and "unknown report type" in r.json()["error"]
    after = running.status()
    assert [(r["rank"], r["pid"], r["slot"]) for r in after["ranks"]] == \
        [(r["rank"], r["pid"], r["slot"]) for r in before["ranks"]]
    assert after["taints"] == [] and after["operation"] is None
    assert running.events() == []


def test_alert_webhook_refuses_malformed_bodies_and_ignores_other_targets(running):
    """Alertmanager's webhook body: validated, token required; an alert for a machine this
    job does not use is answered 200 "ignored" (Alertmanager retries anything else)."""
    url = running.client.url + "/v1/alerts"
    auth = {"Authorization": f"Bearer {(running.run_dir / 'token').read_text()}"}
    body = {"version": "4", "status": "firing", "receiver": "baton",
            "alerts": [{"status": "firing", "labels": {"alertname": "Hot", "node": "gpu-17"}}]}
    assert httpx.post(url, json=body).status_code == 401
    r = httpx.post(url, json=body, headers=auth)
    assert r.status_code == 200 and r.json()["results"][0]["action"] == "ignored", r.text
    for bad in ({"alerts": "x"}, {"alerts": [{"status": "burning", "labels": {}}]}, {}):
        r = httpx.post(url, json=bad, headers=auth)
        assert r.status_code == 422 and r.json()["error"].startswith("invalid request"), r.text
    assert running.status()["taints"] == [] and running.events() == []


def test_cli_errors_are_clear(running):
    out = _cli(running, "migrate", "--rank", "99")
    assert out.returncode != 0
    assert "unknown rank 99" in out.stderr and "0..1" in out.stderr
    out = _cli(running, "taint", "no/such", "--reason", "ecc")
    assert out.returncode != 0
    assert "unknown slot or node 'no/such'" in out.stderr and "local/0" in out.stderr
    out = _cli(running, "untaint", "no/such")
    assert out.returncode != 0 and "unknown slot" in out.stderr
    out = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--run-dir", str(running.dir / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no running job found" in out.stderr
    assert running.events() == []


def test_status_json_shape(running):
    out = _cli(running, "status", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    job = data["jobs"][0]
    for key in ("id", "world_size", "ranks", "spares", "taints", "yoco_ratio"):
        assert key in job
    assert job["world_size"] == 2
    for r in job["ranks"]:
        assert set(["rank", "pid", "slot", "step", "state"]) <= set(r)
    assert len(job["spares"]) == 1


def test_user_bug_ends_the_job_with_its_traceback(tmp_path):
    job = Job(tmp_path, nproc=3, spares=1, steps=40, script_args=["--bug-at-step", "5"])
    code = job.wait(timeout=120)
    assert code == 1, job.log()
    log = job.log()
    assert "ValueError: user bug at step 5" in log
    assert "Traceback" in log and "train.py" in log
    # It is not treated as a hardware failure: nothing was migrated.
    assert job.events() == []


def _run(tmp_path, source: str, nproc: int = 2, spares: int = 0, timeout: float = 120):
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "baton.cli", "run", "--nproc", str(nproc), "--spares",
                           str(spares), "--run-dir", str(tmp_path / "run"), str(script)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_exit_code_is_the_scripts(tmp_path):
    """Code after job.finish() decides the exit code, as under torchrun."""
    out = _run(tmp_path, "import sys, baton\njob = baton.init()\njob.finish()\n"
                         "sys.exit(3 if job.rank == 0 else 0)\n")
    assert out.returncode == 3, out.stderr


def test_a_rank_that_exits_early_is_an_error_not_a_hang(tmp_path):
    out = _run(tmp_path, "import sys, baton\njob = baton.init()\nsys.exit(0)\n")
    assert out.returncode == 1, out.stderr
    assert "before job.finish()" in out.stderr


@pytest.mark.parametrize("source, expect", [
    ("import baton\ndef broken(:\n    pass\n", "SyntaxError"),
    ("import os, baton\nos.environ['NO_SUCH_VARIABLE']\njob = baton.init()\n", "KeyError: 'NO_SUCH_VARIABLE'"),
])
def test_an_error_before_init_fails_fast_with_its_traceback(tmp_path, source, expect):
    """No respawn loop: the first worker that dies before baton.init() ends the job."""
    t0 = __import__("time").monotonic()
    out = _run(tmp_path, source, spares=1)
    assert out.returncode == 1, out.stderr
    assert expect in out.stderr and "before baton.init()" in out.stderr
    assert __import__("time").monotonic() - t0 < 60
    assert out.stderr.count("Traceback") <= 3  # one per started worker at most: nothing respawned


def test_a_scheduler_created_before_init_is_refused_by_name_before_it_could_diverge(tmp_path):
    """Objects created before baton.init() are not noted as the script makes them; the first
    ranks look for them (a scan of every live object) as their step loop starts, and refuse.
    (A joiner runs the same script and skips the scan: it is 0.2 s on its way to the rank.)"""
    out = _run(tmp_path, "import torch, baton\nnet = torch.nn.Linear(4, 1)\n"
                         "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
                         "sched = torch.optim.lr_scheduler.StepLR(opt, 5)\n"
                         "job = baton.init()\nmodel = job.wrap(net)\njob.track(optimizer=opt)\n"
                         "for step in job.steps(5):\n    with step:\n"
                         "        model(torch.ones(2, 4)).sum().backward()\n        opt.step()\n"
                         "        opt.zero_grad()\n        sched.step()\njob.finish()\n")
    assert out.returncode == 1, out.stderr
    assert "created before baton.init() and are not tracked" in out.stderr and "StepLR" in out.stderr, out.stderr


def test_a_script_that_never_calls_init_gets_told_what_to_add(tmp_path):
    out = _run(tmp_path, "import torch, baton\nprint('training without baton')\n")
    assert out.returncode == 1, out.stderr
    assert "without calling baton.init()" in out.stderr and "job = baton.init()" in out.stderr


def test_a_script_without_baton_runs_as_under_torchrun(tmp_path):
    """No code change: a script that never imports baton runs on every rank with torchrun's
    environment, and its exit code is the job's."""
    out = _run(tmp_path, "import os, sys, torch\nsys.stdout.write(f\"rank {os.environ['RANK']} of "
                         "{os.environ['WORLD_SIZE']}\\n\")\nsys.exit(0)\n")  # one write a line: no interleaving
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("rank")) == ["rank 0 of 2", "rank 1 of 2"]


def test_script_outside_baton_run_gets_a_clear_error(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import baton\nbaton.init()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if not k.startswith("BATON_")})
    assert out.returncode != 0 and "must run under `baton run`" in out.stderr


STRAY_DRAW = """
import numpy as np, torch, baton
job = baton.init()
model = job.wrap(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in job.steps(40):
    with step:
        model(torch.randn(8, 4)).sum().backward()
        if step.index == {at}:
            {draw}  # after backward: a re-run of the next step could not replay it
        opt.step()
        opt.zero_grad()
job.finish()
"""


@pytest.mark.parametrize("draw, at, caught_before", [
    ("torch.rand(1)", 10, 11),  # every stream is checked before every step
    ("np.random.rand()", 20, 21),
    ("np.random.randn(3)", 20, 21),
])
def test_random_numbers_drawn_after_backward_are_refused(tmp_path, draw, at, caught_before):
    out = _run(tmp_path, STRAY_DRAW.format(draw=draw, at=at))
    assert out.returncode == 1, out.stderr
    stream = "torch" if draw.startswith("torch") else "numpy"
    assert f"random numbers ({stream}) were drawn before step {caught_before}" in out.stderr, out.stderr


@pytest.mark.parametrize("flags, expect", [
    (["--nodes", "2"], "needs --scheduler slurm"),
    (["--scheduler", "slurm"], "not inside a Slurm allocation"),
    (["--nodes", "0", "--scheduler", "slurm"], "--nodes must be at least 1"),
])
def test_multi_node_flags_outside_slurm_are_refused_before_anything_starts(tmp_path, flags, expect):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "baton.cli", "run", "--nproc", "1", *flags, "--run-dir",
                          str(tmp_path / "run"), str(REPO / "baton" / "examples" / "train.py")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0 and expect in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_a_report_cut_off_by_its_senders_death_leaves_no_traceback(running):
    """A worker killed -9 while it posts a report leaves the request's body half sent; its
    loss is handled where its exit is seen, so the control plane neither fails nor logs a
    traceback for it (they once buried the lines a user needs at the end of a failed job)."""
    url = urlsplit(running.client.url)
    token = (running.run_dir / "token").read_text()
    before = running.status()
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port)) as s:
            s.sendall(f"POST /v1/workers/w0/reports HTTP/1.1\r\nHost: {url.netloc}\r\n"
                      f"Authorization: Bearer {token}\r\ncontent-type: application/json\r\n"
                      f"Content-Length: 100000\r\n\r\n{{\"type\": \"heart".encode())
            time.sleep(0.2)
    time.sleep(1.0)
    log = running.log(tail=None)
    assert "Exception in ASGI application" not in log and "ClientDisconnect" not in log, log[-4000:]
    after = running.status()
    assert after["state"] == "running" and after["operation"] is None
    assert [(r["rank"], r["pid"]) for r in after["ranks"]] == [(r["rank"], r["pid"]) for r in before["ranks"]]
    assert running.events() == []


def test_the_ledger_says_why_the_job_ended_and_survives_a_damaged_database(tmp_path):
    """A rank that leaves early ends the job: the ledger holds that end (never empty), with the
    step the rank left at; with state.db damaged, `baton events` reads the copy in events.jsonl."""
    out = _run(tmp_path, "import sys, torch, baton\njob = baton.init()\nmodel = job.wrap(torch.nn.Linear(2, 1))\n"
                         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor step in job.steps(3):\n"
                         "    with step:\n        model(torch.ones(4, 2)).sum().backward()\n        opt.step()\n"
                         "sys.exit(0)\n")
    assert out.returncode == 1, out.stderr
    assert "exited with code 0 at step 3" in out.stderr, out.stderr

    def events() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "baton.cli", "events", "--json", "--run-dir",
                               str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=tmp_path)

    read = events()
    assert read.returncode == 0, read.stderr
    ledger = json.loads(read.stdout)["events"]
    assert [(e["kind"], e["status"]) for e in ledger] == [("fatal", "failed")], ledger
    assert "before job.finish()" in ledger[0]["cause"]
    (tmp_path / "run" / "state.db").write_bytes(b"this is not an SQLite database" * 200)
    again = events()
    assert again.returncode == 0, again.stderr
    assert "cannot be read" in again.stderr and json.loads(again.stdout)["events"] == ledger
