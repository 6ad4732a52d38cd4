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


def test_gpu_thresholds_name_what_was_crossed():
    from baton.health.gpu import GpuReading, GpuThresholds

    limits = GpuThresholds(temp_c=90, ecc_uncorrected=1, ecc_corrected=100)
    assert limits.judge(GpuReading(temp_c=70, ecc_uncorrected=0, ecc_corrected=3)) is None
    assert limits.judge(GpuReading(temp_c=91)).startswith("thermal: GPU at 91 C")
    assert limits.judge(GpuReading(temp_c=95, ecc_uncorrected=2)).startswith("ecc: 2 uncorrected")
    assert limits.judge(GpuReading(ecc_corrected=100)).startswith("ecc: 100 corrected")
    assert GpuThresholds(temp_c=0, ecc_uncorrected=0).judge(GpuReading(temp_c=120, ecc_uncorrected=9)) is None
    assert limits.judge(GpuReading()) is None  # a GPU without ECC or sensors reports nothing


def test_without_nvml_the_reader_says_why_and_reads_nothing():
    from baton.health.gpu import GpuReader

    reader = GpuReader("local/0")
    if reader.reason is None:
        import pytest

        pytest.skip("this machine has NVML and a GPU: the reader is live (checked on GPU machines)")
    assert reader.read() is None and ("NVML" in reader.reason or "nvidia-ml-py" in reader.reason)
