"""The orchestrator's decisions, driven directly: the boundary protocol and refusals.

The scheduler here only records what it is asked to do; the end-to-end tests run the
real local scheduler with real processes.
"""

from __future__ import annotations

import time

import pytest

from baton.control import messages as m
from baton.control.orchestrator import Config, Orchestrator, RequestError
from baton.store.sqlite import SqliteStore

LOOP = {"style": "steps", "total_steps": 100}


def _bundle(rank: int, pos=(0, 0)) -> dict:
    return {"rank": rank, "pos": list(pos), "generation": 0, "seq": 0, "meta": "{}", "tensors": []}


def report(orch: Orchestrator, wid: str, body: dict) -> dict:
    """What the API does with a worker's report: validate it into its typed message first."""
    return orch.report(wid, m.REPORT.validate_python(body))


class RecordingScheduler:
    def __init__(self, n: int):
        self.n = n
        self.started: list[tuple[str, str]] = []
        self.killed: list[str] = []

    def slots(self) -> list[str]:
        return [f"local/{i}" for i in range(self.n)]

    def start(self, worker_id: str, slot: str) -> int:
        self.started.append((worker_id, slot))
        return 1000 + len(self.started)

    def kill(self, worker_id: str, dump_stacks: bool = False) -> None:
        self.killed.append(worker_id)


def _running(tmp_path, world=2, spares=1) -> tuple[Orchestrator, RecordingScheduler]:
    sched = RecordingScheduler(world + spares + 1)
    orch = Orchestrator(Config(world_size=world, spares=spares), SqliteStore(tmp_path / "s.db"), sched)
    orch.start()
    for wid, _ in list(sched.started):
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
    for r in range(world):
        report(orch, f"w{r}", {"type": "ready", "loop": LOOP, "bundle": _bundle(r)})
        report(orch, f"w{r}", {"type": "heartbeat", "step": 10})
    return orch, sched


def _commands(orch: Orchestrator, wid: str) -> list[dict]:
    return orch.mail.wait(wid, 0, 0)


def test_boundary_is_retargeted_when_a_rank_is_past_it(tmp_path):
    orch, _ = _running(tmp_path)
    op = orch.handle(m.MigrateRequest(rank=0))["op"]
    target = orch.op.target_step
    # rank 0 accepts; rank 1 was already past the target
    report(orch, "w0", {"type": "pause_ack", "op": op, "ok": True, "next_step": target})
    report(orch, "w1", {"type": "pause_ack", "op": op, "ok": False, "next_step": target + 3})
    assert orch.op.target_step == target + 5
    pauses = [c for c in _commands(orch, "w0") if c["type"] == "pause"]
    assert [p["at_step"] for p in pauses] == [target, target + 5]
    for w in ("w0", "w1"):
        report(orch, w, {"type": "pause_ack", "op": op, "ok": True, "next_step": target + 4})
    assert orch.op.phase == "pausing"
    for w in ("w0", "w1"):
        report(orch, w, {"type": "paused", "op": op, "pos": [target + 5, 0]})
    assert orch.op.phase == "forming"
    assert any(c["type"] == "publish" and c["leave"] for c in _commands(orch, "w0"))
    spare_form = [c for c in _commands(orch, "w2") if c["type"] == "form"]
    assert spare_form and spare_form[0]["fetch_from"] == [["127.0.0.1", 1000]] and spare_form[0]["full_state"]


def test_a_move_is_cancelled_when_the_job_finishes_first(tmp_path):
    orch, _ = _running(tmp_path)
    orch.handle(m.MigrateRequest(rank=1))
    for w in ("w0", "w1"):
        report(orch, w, {"type": "finished", "pos": [11, 0]})
    assert orch.exit_code is None  # ranks may still run code after finish(): wait for them
    orch.handle(m.WorkerExited(worker_id="w0", returncode=0))
    orch.handle(m.WorkerExited(worker_id="w1", returncode=0))
    assert orch.exit_code == 0
    ev = orch.event_list()[0]
    assert ev["status"] == "cancelled" and "finished" in ev["note"]
    assert orch.yoco_ratio() is None  # a cancelled move is not a failure


def test_refusals_change_nothing(tmp_path):
    orch, sched = _running(tmp_path)
    with pytest.raises(RequestError, match="unknown rank 7") as e:
        orch.handle(m.MigrateRequest(rank=7))
    assert e.value.status == 404
    with pytest.raises(RequestError, match="unknown slot 'x/1'"):
        orch.handle(m.TaintRequest(slot="x/1", reason="ecc"))
    orch.handle(m.MigrateRequest(rank=0))
    with pytest.raises(RequestError, match="already in progress") as e:
        orch.handle(m.MigrateRequest(rank=1))
    assert e.value.status == 409
    assert len(orch.event_list()) == 1


def test_no_spare_for_a_planned_move_is_a_clear_conflict(tmp_path):
    orch, _ = _running(tmp_path, spares=0)
    with pytest.raises(RequestError, match="no spare available") as e:
        orch.handle(m.MigrateRequest(rank=0))
    assert e.value.status == 409 and orch.op is None


def test_a_lost_rank_during_startup_fails_clearly(tmp_path):
    sched = RecordingScheduler(3)
    orch = Orchestrator(Config(world_size=2, spares=1), SqliteStore(tmp_path / "s.db"), sched)
    orch.start()
    for wid, _ in list(sched.started):
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    assert orch.exit_code == 1 and "during startup" in orch.failure


def test_state_is_persisted_after_transitions(tmp_path):
    orch, _ = _running(tmp_path)
    orch.handle(m.TaintRequest(slot="local/3", reason="thermal"))
    rows = SqliteStore(tmp_path / "s.db").all("slot")
    assert rows["local/3"]["taint"] == "thermal"


def _expire(orch: Orchestrator) -> None:
    """Let the current phase's deadline pass, as the ticker would see it."""
    orch.op.deadline = 0.0
    orch.handle(m.Tick(now=time.time()))


def test_a_rank_that_never_answers_the_pause_request_is_asked_again_then_lost(tmp_path):
    orch, sched = _running(tmp_path, spares=2)
    op = orch.handle(m.MigrateRequest(rank=0))["op"]
    report(orch, "w0", {"type": "pause_ack", "op": op, "ok": True, "next_step": 11})
    _expire(orch)
    assert orch.op.phase == "agree" and "w1" not in sched.killed
    assert len([c for c in _commands(orch, "w1") if c["type"] == "pause"]) == 2  # asked once more
    _expire(orch)
    assert "w1" in sched.killed
    assert orch.op.kind.value == "unplanned" and orch.op.phase == "collect"
    lost = [e for e in orch.event_list() if e["rank"] == 1]
    assert lost and "did not answer the pause request" in lost[0]["cause"]


def test_a_rank_that_stops_short_of_the_agreed_step_is_lost_once_the_others_waited(tmp_path):
    orch, sched = _running(tmp_path, spares=2)
    op = orch.handle(m.MigrateRequest(rank=0))["op"]
    target = orch.op.target_step
    for w in ("w0", "w1"):
        report(orch, w, {"type": "pause_ack", "op": op, "ok": True, "next_step": 11})
    report(orch, "w0", {"type": "paused", "op": op, "pos": [target, 0]})
    before = orch.op.deadline
    report(orch, "w1", {"type": "heartbeat", "step": 11})  # progress toward the boundary
    assert orch.op.phase == "pausing" and orch.op.deadline >= before
    _expire(orch)
    assert "w1" in sched.killed and orch.op.kind.value == "unplanned"
    lost = [e for e in orch.event_list() if e["rank"] == 1]
    assert lost and f"did not reach the agreed step {target}" in lost[0]["cause"]


def test_no_spare_within_spare_wait_fails_the_job_clearly(tmp_path):
    sched = RecordingScheduler(2)
    orch = Orchestrator(Config(world_size=2, spares=0, spare_wait_s=30), SqliteStore(tmp_path / "s.db"), sched)
    orch.start()
    for wid, _ in list(sched.started):
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
    for r in range(2):
        report(orch, f"w{r}", {"type": "ready", "loop": LOOP, "bundle": _bundle(r)})
        report(orch, f"w{r}", {"type": "heartbeat", "step": 10})
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    report(orch, "w0", {"type": "recover", "generation": orch.generation, "pos": [10, 0]})
    assert orch.op.phase == "spares" and orch.status()["jobs"][0]["state"] == "waiting-for-spare"
    _expire(orch)
    assert orch.exit_code == 1 and "no spare became ready for rank(s) [1] within 30s" in orch.failure
    ev = orch.event_list()[0]
    assert ev["status"] == "failed" and ev["resolved_without_rollback"] is False


def test_a_planned_moves_leaver_lost_after_a_survivors_report_is_not_moved_twice(tmp_path):
    """The survivor's report of a failed collective can arrive before the leaver's exit: the
    move is kept to run again, then dropped once the leaver is known lost (the recovery moves
    the rank), so the replacement is not moved a second time."""
    orch, sched = _running(tmp_path, spares=2)
    orch.handle(m.MigrateRequest(rank=1))
    report(orch, "w0", {"type": "recover", "generation": orch.generation, "pos": [10, 0],
                        "error": "connection reset by peer"})
    assert orch.op.kind.value == "unplanned"
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    planned, unplanned = orch.event_list()
    assert planned["kind"] == "planned" and planned["status"] == "failed"
    assert "superseded by the loss of its leaver" in planned["note"]
    assert unplanned["kind"] == "unplanned" and unplanned["rank"] == 1
    assert not orch._retry_moves  # nothing left to run once the recovery is over


def test_reports_from_before_a_restart_do_not_make_the_next_plan(tmp_path):
    """Rank 1 dies; rank 2 completed the step, rank 0 abandoned it and is told to fetch from
    rank 2; rank 2 dies while serving. Rank 0's first report (step 10) no longer says where
    its state is, and neither does one it sent before it heard of the restart: the next plan
    waits for a report made after the restart's Abort."""
    orch, _ = _running(tmp_path, world=3, spares=2)
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    g1 = orch.op.generation
    report(orch, "w0", {"type": "recover", "generation": g1, "pos": [10, 0], "in_step": True})
    report(orch, "w2", {"type": "recover", "generation": g1, "pos": [11, 0]})
    assert orch.op.phase == "forming" and orch.op.target == (11, 0)
    seen = len(_commands(orch, "w0"))
    orch.handle(m.WorkerExited(worker_id="w2", returncode=-9))
    g2 = orch.op.generation
    assert g2 > g1 and orch.op.phase == "collect"
    report(orch, "w0", {"type": "recover", "generation": g1, "pos": [10, 0], "in_step": True})
    new = _commands(orch, "w0")[seen:]
    assert [c["type"] for c in new] == ["abort"] and new[0]["generation"] == g2
    report(orch, "w0", {"type": "recover", "generation": g2, "pos": [10, 0], "in_step": True})
    forms = [c for c in _commands(orch, "w0")[seen:] if c["type"] == "form"]
    assert len(forms) == 1 and forms[0]["generation"] == g2 and forms[0]["pos"] == [10, 0] and forms[0]["publish"]
