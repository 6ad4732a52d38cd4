"""`baton simulate`: engine behaviour, shipped scenarios, CLI output and errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from baton.cli import main
from baton.sim.engine import simulate, summarize
from baton.sim.failures import LLAMA3_405B, Mechanism
from baton.sim.scenario import load_scenario, parse_scenario, shipped_scenarios

ROOT = Path(__file__).resolve().parents[2]


def _raw(**sections):
    raw = {
        "trials": 50,
        "seed": 1,
        "job": {"gpus": 1024, "work_hours": 200.0, "step_seconds": 10.0},
        "failures": {"mttf_hours": 7.9},
        "checkpoint": {"save_seconds": 60.0},
    }
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v) if isinstance(v, dict) else raw.__setitem__(k, v)
    return raw


def test_llama3_table_counts_and_shares():
    assert sum(c.count for c in LLAMA3_405B) == 419
    assert sum(c.share for c in LLAMA3_405B) == pytest.approx(1.0)
    by_name = {c.name: c for c in LLAMA3_405B}
    assert by_name["GPU HBM3 memory"].share == pytest.approx(0.172, abs=5e-4)
    assert by_name["software bug"].mechanism is Mechanism.RESTART
    assert by_name["network switch/cable"].mechanism is Mechanism.PATH_FAILOVER


def test_shipped_scenarios_present():
    assert {"1024-gpus", "16384-gpus", "100k-gpus", "64xh200-scout"} <= set(shipped_scenarios())
    assert load_scenario("1024-gpus").arrivals.mttf_h == pytest.approx(7.9)
    assert load_scenario("16384-gpus").arrivals.mttf_h == pytest.approx(1.8)
    assert load_scenario("100k-gpus").mttf_source == "extrapolated"


def test_no_failures_means_no_loss():
    # One class, a failure every ~10 years: every strategy finishes at work / rate.
    scn = parse_scenario("quiet", _raw(failures={"mttf_hours": 1e5}))
    res = simulate(scn, trials=20)
    s = summarize(res)
    assert s["checkpoint_restart"]["completion_h"]["p50"] == pytest.approx(
        200.0 * (1 + 1 / 60 / res.runs["checkpoint_restart"].interval_h), rel=1e-6
    )
    assert s["live_migration"]["completion_h"]["p50"] < 200.0 * 1.02
    assert s["replica_group_drop"]["completion_h"]["p50"] > 200.0 * 1.14  # its per-step overhead


def test_checkpoint_restart_matches_closed_form():
    # Exponential failures, fixed interval: mean loss per failure = tau/2 + restart, to first order.
    raw = _raw(failures={"mttf_hours": 20.0}, checkpoint={"save_seconds": 0.0, "interval_hours": 1.0})
    raw["trials"] = 300
    scn = parse_scenario("cf", raw)
    t = summarize(simulate(scn))["checkpoint_restart"]["completion_h"]["mean"]
    per_failure = 0.5 + 20 / 60
    predicted = 200.0 / (1 - per_failure / 20.0)
    assert t == pytest.approx(predicted, rel=0.03)


def test_spare_exhaustion_makes_the_job_wait():
    base = _raw(failures={"mttf_hours": 4.0, "classes": [{"name": "gpu", "share": 1.0, "mechanism": "migration"}]})
    plenty = parse_scenario("plenty", {**base, "live_migration": {"spare_pool": 50, "spare_replenish_h": 1.0}})
    scarce = parse_scenario("scarce", {**base, "live_migration": {"spare_pool": 1, "spare_replenish_h": 3.0}})
    s_plenty = summarize(simulate(plenty))["live_migration"]
    s_scarce = summarize(simulate(scarce))["live_migration"]
    assert s_plenty["spare_wait_h"]["mean"] == 0.0
    assert s_scarce["spare_wait_h"]["mean"] > 10.0
    assert s_scarce["completion_h"]["p50"] > s_plenty["completion_h"]["p50"] + 10.0
    none = parse_scenario("none", {**base, "live_migration": {"spare_pool": 0}})
    assert summarize(simulate(none))["live_migration"]["yoco_ratio"] == 0.0  # all fall back


def test_hopeless_strategy_is_reported_unfinished(capsys):
    # Replacement slower than failures arrive, spares never come back: the job cannot finish.
    raw = _raw(
        failures={"mttf_hours": 0.5, "classes": [{"name": "gpu", "share": 1.0, "mechanism": "migration"}]},
        live_migration={"spare_pool": 1, "spare_replenish_h": 1000.0},
    )
    s = summarize(simulate(parse_scenario("hopeless", raw), trials=10))
    assert s["live_migration"]["unfinished_trials"] == 10
    assert s["live_migration"]["completion_h"] is None
    json.dumps(s, allow_nan=False)  # valid JSON, no NaN


def test_restart_class_failures_are_never_yoco():
    raw = _raw(failures={"mttf_hours": 5.0, "classes": [{"name": "bug", "share": 1.0, "mechanism": "restart"}]})
    s = summarize(simulate(parse_scenario("bugs", raw)))
    for name in ("checkpoint_restart", "replica_group_drop", "live_migration"):
        assert s[name]["yoco_ratio"] == 0.0
    assert s["live_migration"]["rollback_h"]["mean"] > 1.0


def test_weibull_and_reproducible_seed():
    raw = _raw(failures={"mttf_hours": 5.0, "distribution": "weibull", "weibull_shape": 0.7})
    a = summarize(simulate(parse_scenario("w", raw)))
    b = summarize(simulate(parse_scenario("w", raw)))
    assert a == b


def test_scout_ordering_and_distance_to_published():
    scn = load_scenario("64xh200-scout")
    s = summarize(simulate(scn))
    minutes = {k: v["completion_h"]["p50"] * 60 for k, v in s.items()}
    # Published: live migration 405 < checkpoint-restart 818 < TorchFT 930.
    assert minutes["live_migration"] < minutes["checkpoint_restart"] < minutes["replica_group_drop"]
    assert minutes["live_migration"] == pytest.approx(405, rel=0.15)
    assert minutes["replica_group_drop"] == pytest.approx(930, rel=0.15)
    # Checkpoint-restart with the published cost-model restart (20 min) lands short of 818:
    # documented in docs/economics.md; pin where it is so a change is noticed.
    assert minutes["checkpoint_restart"] == pytest.approx(818, rel=0.25)


def test_100k_scenario_is_fast():
    scn = load_scenario("100k-gpus")
    t0 = time.perf_counter()
    res = simulate(scn)
    elapsed = time.perf_counter() - t0
    assert res.runs["live_migration"].completion_h.shape == (200,)
    assert elapsed < 60.0, elapsed  # the target is < 30 s on 2 cores; measured ~1 s
    s = summarize(res)
    assert s["live_migration"]["goodput"]["p50"] > s["checkpoint_restart"]["goodput"]["p50"]


def test_cli_json_keys(capsys):
    assert main(["simulate", "64xh200-scout", "--trials", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "64xh200-scout" and out["trials"] == 20
    for name in ("checkpoint_restart", "replica_group_drop", "live_migration"):
        st = out["strategies"][name]
        for key in ("completion_h", "goodput", "wasted_gpu_hours", "wasted_usd"):
            assert {"p50", "p95", "mean"} <= set(st[key]), (name, key)
        assert 0.0 <= st["yoco_ratio"] <= 1.0
    assert out["published_min"]["checkpoint_restart"] == 818


def test_cli_table_and_plot(tmp_path, capsys):
    png = tmp_path / "scout.png"
    assert main(["simulate", "64xh200-scout", "--trials", "10", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "live migration" in out and "published" in out and "p95" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_set_override_and_file(tmp_path, capsys):
    f = tmp_path / "mine.toml"
    f.write_text('[job]\ngpus = 512\nwork_hours = 10.0\n[failures]\nmttf_hours = 5.0\n')
    assert main(["simulate", str(f), "--trials", "5", "--set", "live_migration.spare_pool=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 512 and out["scenario"] == "mine"


@pytest.mark.parametrize(
    "argv, field",
    [
        (["1024-gpus", "--set", "job.gpus=-5"], "job.gpus"),
        (["1024-gpus", "--set", "checkpoint.interval_hours=0"], "checkpoint.interval_hours"),
        (["64xh200-scout", "--set", "checkpoint.interval_steps=0"], "checkpoint.interval_steps"),
        (["1024-gpus", "--set", "live_migration.spare_poool=3"], "live_migration.spare_poool"),
        (["1024-gpus", "--set", "jobs.gpus=3"], "jobs"),
        (["1024-gpus", "--set", "failures.distribution='gamma'"], "failures.distribution"),
        (["no-such-scenario"], "scenario"),
        (["1024-gpus", "--trials", "0"], "--trials"),
    ],
)
def test_cli_bad_input_names_field(capsys, argv, field):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and "error" in err
    assert "Traceback" not in err


def test_bad_input_via_subprocess_exits_nonzero_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "cost", "--gpus", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--gpus" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "simulate", "64xh200-scout", "--set", "job.gpus=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "job.gpus" in proc.stderr and "Traceback" not in proc.stderr


def test_sim_does_not_import_torch():
    code = "import sys, baton.sim.cli, baton.sim.engine, baton.sim.plot; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False"


def test_replica_group_heal_integrals():
    from baton.sim.engine import _healthy_gain, _time_to_reach

    t_up = np.array([0.0, 0.0])
    until = np.array([[1.0, -np.inf], [1.0, 2.0]])  # trial 1: both groups down, healing at 1 h and 2 h
    gain = _healthy_gain(t_up, np.array([2.0, 2.0]), until, 2)
    assert gain == pytest.approx([1.5, 0.5])
    t = _time_to_reach(t_up, np.array([1.0, 1.0]), until, 2)
    assert t == pytest.approx([1.5, 2.5])
