"""baton's own CPU, counted as it runs: the counting rules, and the job's summary of them."""

from __future__ import annotations

import threading
import time

import pytest

from baton import selfcost
from baton.control import messages as m
from tests.test_orchestrator import _running, report


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _entry_s() -> float:
    return selfcost.snapshot().entry_s


def test_entry_points_count_once_when_nested_and_leave_user_code_out():
    @selfcost.counted
    def inner() -> None:
        _spin(0.02)

    @selfcost.counted
    def outer() -> None:
        _spin(0.02)
        inner()  # nested: counted once, inside outer's interval
        with selfcost.outside():  # the user's code, called from baton: not baton's
            _spin(0.05)
            inner()  # ... unless it enters baton again

    before = _entry_s()
    outer()
    got = _entry_s() - before
    assert 0.06 <= got < 0.075, got


def test_a_generator_body_counts_in_next_and_an_exception_still_closes_the_interval():
    def body():
        for _ in range(3):
            _spin(0.01)
            yield 1

    before = _entry_s()
    assert sum(selfcost.counted_iter(body())) == 3
    assert 0.03 <= _entry_s() - before < 0.04

    @selfcost.counted
    def fails() -> None:
        _spin(0.01)
        raise ValueError("x")

    before = _entry_s()
    with pytest.raises(ValueError):
        fails()
    after = _entry_s()
    _spin(0.02)  # nothing stays open after the exception
    assert 0.01 <= after - before < 0.015 and _entry_s() == after


def test_threads_count_while_running_and_after_they_end():
    go = threading.Event()

    def work() -> None:
        _spin(0.03)
        go.wait(10)

    before = selfcost.snapshot().threads_s
    t = selfcost.spawn(work, "test-spin")
    time.sleep(0.2)
    live = selfcost.snapshot().threads_s - before
    go.set()
    t.join()
    ended = selfcost.snapshot().threads_s - before
    assert 0.03 <= live < 0.05 and 0.03 <= ended < 0.05 and ended >= live


def test_the_job_summary_keeps_every_worker_and_refuses_bad_figures(tmp_path):
    orch, _ = _running(tmp_path)  # 2 ranks (w0, w1), a spare (w2)
    report(orch, "w0", {"type": "heartbeat", "step": 11, "cpu": {"process_s": 10.0, "baton_s": 0.1}})
    report(orch, "w1", {"type": "heartbeat", "step": 11, "cpu": {"process_s": 12.0, "baton_s": 0.3}})
    report(orch, "w2", {"type": "heartbeat", "cpu": {"process_s": 2.0, "baton_s": 0.01}})
    cpu = orch.status()["jobs"][0]["cpu"]
    assert cpu["ranks_s"] == 22.0 and cpu["ranks_baton_s"] == pytest.approx(0.4)
    assert cpu["spares_s"] == 2.0  # a spare's whole process is baton's cost
    assert cpu["baton_s"] == pytest.approx(0.4 + 2.0 + cpu["control_plane_s"])
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))  # gone: what it used still counts
    cpu = orch.status()["jobs"][0]["cpu"]
    assert cpu["ranks_s"] + cpu["spares_s"] == 24.0 and cpu["ranks_baton_s"] >= 0.4
    for bad in ({"process_s": -1.0, "baton_s": 0.0}, {"process_s": float("nan"), "baton_s": 0.0},
                {"process_s": 1.0}, {"process_s": 1.0, "baton_s": 0.0, "extra": 1}):
        with pytest.raises(ValueError):
            report(orch, "w0", {"type": "heartbeat", "cpu": bad})
    after = orch.status()["jobs"][0]["cpu"]
    assert (after["ranks_s"], after["ranks_baton_s"], after["spares_s"]) == \
        (cpu["ranks_s"], cpu["ranks_baton_s"], cpu["spares_s"])
