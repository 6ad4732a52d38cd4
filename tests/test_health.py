"""The straggler detector's rule, driven directly; the end-to-end move is in
test_control_plane.py."""

from __future__ import annotations

from baton.health.straggler import StragglerDetector


def test_a_rank_slow_for_n_consecutive_steps_is_reported_once():
    d = StragglerDetector(factor=2.0, steps=3)
    for step in range(1, 4):
        for r in (0, 2):
            assert d.observe(r, step, 0.10) is None
        assert d.observe(1, step, 0.10) is None
    got = [d.observe(1, s, 0.35) for s in (4, 5, 6)]
    assert got[:2] == [None, None] and got[2].startswith("straggler:") and "350 ms" in got[2] and "2x" in got[2]
    assert d.observe(1, 7, 0.35) is None  # forgotten once reported: three more steps before again


def test_a_slow_spell_shorter_than_n_steps_or_a_stale_report_is_not_a_straggler():
    d = StragglerDetector(factor=2.0, steps=3)
    for r in (0, 2):
        d.observe(r, 1, 0.10)
    assert d.observe(1, 1, 0.50) is None
    assert d.observe(1, 2, 0.50) is None
    assert d.observe(1, 3, 0.15) is None  # back to normal: the count starts over
    assert d.observe(1, 4, 0.50) is None
    assert d.observe(1, 4, 0.50) is None  # the same step again (a heartbeat between steps) counts once
    assert d.observe(1, 5, 0.50) is None
    assert StragglerDetector(factor=0).observe(1, 9, 100.0) is None  # off


def test_wall_time_equal_everywhere_is_not_what_it_reads():
    """Two ranks only: the other rank's busy time is the median, not an average with itself."""
    d = StragglerDetector(factor=1.5, steps=1)
    d.observe(0, 1, 0.1)
    assert d.observe(1, 1, 0.2) is not None


def test_tiny_steps_made_slower_by_scheduling_noise_are_not_stragglers():
    d = StragglerDetector(factor=2.0, steps=1)
    d.observe(0, 1, 0.004)
    assert d.observe(1, 1, 0.030) is None  # 7.5x, but only 26 ms: a busy core, not a bad machine
