"""Seeded chaos on a 4-rank job: kill -9 (rank 0 included), SIGSTOP, planned migrate, taint
(then untaint), a warm spare killed, two ranks killed at once, one at a time at random step
positions (tests/chaos.py draws them from the seed). The job ends with exit code 0 and every
rank's state bit-for-bit equal to the failure-free run's; the ledger holds exactly one
resolved event of the right kind per rank fault, 0 steps lost; no wait runs past its limit.

`make soak` runs the same driver for 30 minutes, a new seed per round."""

from __future__ import annotations

import pytest

from tests.chaos import run_round

SEED = 1
FAULTS = 6  # one of each kind (each block of six faults holds every kind once)


@pytest.mark.timeout(360)
def test_seeded_chaos_ends_bitwise_equal_with_a_matching_ledger(tmp_path):
    rnd = run_round(tmp_path, seed=SEED, faults=FAULTS)  # kills every job it started, pass or fail
    report = rnd.report()
    print(report)
    assert rnd.ok, report
    injected = [f for f in rnd.faults if f.outcome == "injected"]
    assert len({f.kind for f in injected}) >= 4, f"too few fault kinds were injected:\n{report}"
