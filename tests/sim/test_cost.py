"""`baton cost`: the closed-form model pinned to the published figures."""

from __future__ import annotations

import json
import math

import pytest

from baton.cli import main
from baton.sim.model import (
    CostInputs,
    compute_cost,
    daly_interval,
    mttf_for_gpus,
    waste_fraction,
    young_interval,
)


def test_published_307k_per_month_at_1024_gpus():
    # $3/GPU-h, 1.5 h interval (half lost), 10 + 5 + 5 min restart, MTTF 7.9 h, 730 h month.
    r = compute_cost(CostInputs())
    expected = 730 / 7.9 * (0.75 + 20 / 60) * 1024 * 3
    assert r.checkpoint_restart.lost_usd_per_month == pytest.approx(expected, rel=1e-12)
    assert round(r.checkpoint_restart.lost_usd_per_month, -3) == 308_000  # "about $307,000"
    assert 306_500 < r.checkpoint_restart.lost_usd_per_month < 308_000
    assert r.checkpoint_restart.lost_usd_per_year == pytest.approx(12 * expected)


def test_published_3h_per_day_vs_under_10_min_with_migration():
    # 1.5 h interval, 15 min bring-up, MTTF 7.9 h: ~3 h of progress lost per day.
    base = dict(node_replacement_min=5, restore_min=5, startup_min=5, mttf_h=7.9)
    r = compute_cost(CostInputs(**base))
    assert r.checkpoint_restart.lost_hours_per_day == pytest.approx(24 / 7.9 * 1.0)
    assert 2.9 < r.checkpoint_restart.lost_hours_per_day < 3.1
    for minutes in (2.0, 3.0):
        lm = compute_cost(CostInputs(migration_min=minutes, **base)).live_migration
        assert lm.lost_hours_per_day * 60 < 10.0
    assert compute_cost(CostInputs(migration_min=3.0, **base)).live_migration.lost_hours_per_day * 60 == pytest.approx(
        24 / 7.9 * 3
    )


def test_yoco_ratio_mixes_migration_and_fallback():
    r = compute_cost(CostInputs(yoco_ratio=0.9, migration_min=3))
    per_failure = 0.9 * 3 / 60 + 0.1 * (0.75 + 20 / 60)
    assert r.live_migration.lost_hours_per_failure == pytest.approx(per_failure)
    assert r.live_migration.lost_hours_per_day == pytest.approx(24 / 7.9 * per_failure)


@pytest.mark.parametrize(
    "mttf_h, save_min, daly_min, waste",
    [
        # waste(tau) = delta/(tau+delta) + (tau/2 + R)/M, R = 20 min; closed forms worked by hand.
        (7.9, 5.0, 63.848, 0.182168),
        (1.8, 5.0, 27.863, 0.466327),
        (7.9, 1.0, 29.790, 0.106096),
    ],
)
def test_young_daly_optimum_and_waste(mttf_h, save_min, daly_min, waste):
    delta = save_min / 60
    assert young_interval(delta, mttf_h) == pytest.approx(math.sqrt(2 * delta * mttf_h))
    tau = daly_interval(delta, mttf_h)
    assert tau * 60 == pytest.approx(daly_min, abs=1e-3)
    r = compute_cost(CostInputs(mttf_h=mttf_h, checkpoint_save_min=save_min))
    assert r.optimal_interval_h == pytest.approx(tau)
    assert r.optimal_waste_fraction == pytest.approx(waste, abs=1e-6)
    closed = math.sqrt(2 * delta / mttf_h) - delta / (2 * mttf_h) + (20 / 60) / mttf_h
    assert r.optimal_waste_fraction == pytest.approx(closed)
    # It is the minimum: nudging the interval either way wastes more.
    for k in (0.8, 1.25):
        assert waste_fraction(tau * k, delta, 20 / 60, mttf_h) > r.optimal_waste_fraction


def test_mttf_power_law_through_measured_points():
    assert mttf_for_gpus(1024).hours == pytest.approx(7.9)
    assert mttf_for_gpus(16384).hours == pytest.approx(1.8)
    assert mttf_for_gpus(4096).source == "interpolated"
    assert 1.8 < mttf_for_gpus(4096).hours < 7.9
    big = mttf_for_gpus(100_000)
    assert big.extrapolated and big.hours == pytest.approx(0.686, abs=0.01)
    assert mttf_for_gpus(64).extrapolated


def test_cli_json_keys(capsys):
    assert main(["cost", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for strategy in ("checkpoint_restart", "live_migration"):
        for key in (
            "failures_per_day",
            "lost_hours_per_day",
            "lost_gpu_hours_per_month",
            "lost_usd_per_month",
            "lost_usd_per_year",
        ):
            assert isinstance(out[strategy][key], float), (strategy, key)
    assert "daly_interval_h" in out["optimal_checkpoint"]
    assert "waste_fraction" in out["optimal_checkpoint"]
    assert out["inputs"]["mttf_source"] == "measured"


def test_cli_table_and_extrapolation_note(capsys):
    assert main(["cost", "--gpus", "100000", "--checkpoint-save-min", "2"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint-restart" in out and "live migration" in out
    assert "extrapolated" in out
    assert "Daly" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--gpus", "-8"], "--gpus"),
        (["--gpus", "0"], "--gpus"),
        (["--checkpoint-interval-h", "0"], "--checkpoint-interval-h"),
        (["--mttf-h", "-1"], "--mttf-h"),
        (["--yoco-ratio", "1.5"], "--yoco-ratio"),
        (["--restore-min", "-5"], "--restore-min"),
    ],
)
def test_cli_bad_input_names_field(capsys, argv, field):
    assert main(["cost", *argv]) == 2
    err = capsys.readouterr().err
    assert field in err
    assert "Traceback" not in err
