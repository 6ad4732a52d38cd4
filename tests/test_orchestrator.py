"""The orchestrator's decisions, driven directly: the boundary protocol and refusals.

The scheduler here only records what it is asked to do; the end-to-end tests run the
real local scheduler with real processes.
"""

from __future__ import annotations

import json
import time

import pytest

from baton.control import messages as m
from baton.control.orchestrator import Config, Orchestrator, RequestError
from baton.store.sqlite import SqliteStore

LOOP = {"style": "steps", "total_steps": 100}
SHARDED = {**LOOP, "sharded": ["model", "optimizer"]}  # an FSDP2 job's loop


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


def _registered(tmp_path, sched, config: Config) -> Orchestrator:
    """An orchestrator whose workers all registered, before any rank reached its loop."""
    orch = Orchestrator(config, SqliteStore(tmp_path / "s.db"), sched)
    orch.start()
    for wid, _ in list(sched.started):
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
        if len(config.data_paths) > 1:  # where it answers probes: the first generation waits for every rank's
            report(orch, wid, {"type": "paths_ready", "addrs": {p: ["10.0.0.1", 2000 + int(wid[1:])]
                                                                for p in config.data_paths}})
    return orch


def _started(tmp_path, sched, config: Config, loop: dict = LOOP,
             setup: dict[int, dict] | None = None) -> Orchestrator:
    """An orchestrator whose workers all registered and whose ranks are at step 10 (with
    `setup`, the ranks' records of the setup's collectives, by rank)."""
    orch = _registered(tmp_path, sched, config)
    for r in range(config.world_size):
        report(orch, f"w{r}", {"type": "ready", "loop": loop, "bundle": _bundle(r),
                               **({"setup": setup[r]} if setup is not None and r in setup else {})})
        report(orch, f"w{r}", {"type": "heartbeat", "step": 10})
    return orch


def _running(tmp_path, world=2, spares=1) -> tuple[Orchestrator, RecordingScheduler]:
    sched = RecordingScheduler(world + spares + 1)
    return _started(tmp_path, sched, Config(world_size=world, spares=spares)), sched


def _commands(orch: Orchestrator, wid: str) -> list[dict]:
    return orch.mail.wait(wid, 0, 0)


def test_boundary_is_retargeted_when_a_rank_is_past_it(tmp_path):
    orch, _ = _running(tmp_path)
    op = orch.handle(m.MigrateRequest(rank=0))["op"]
    _joiners_ready(orch)
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


def test_a_leaver_serves_its_joiner_as_it_pauses_and_a_failure_before_the_rest_pause_calls_the_move_off(tmp_path):
    """The leaver's Publish and its joiner's Form go out as the leaver pauses at the agreed
    boundary: the copy runs while the other ranks finish their step, and they form when they
    pause (the ledger's boundary phase ends where the copy began). A rank lost after that,
    before the others paused, calls the move off as one lost before it: the leaver, not yet
    released, stays (Abort), and the joiner is stopped."""
    for lost in (False, True):
        (tmp_path / str(lost)).mkdir()
        orch, sched = _running(tmp_path / str(lost), world=3)
        op = orch.handle(m.MigrateRequest(rank=1))["op"]
        _joiners_ready(orch)
        target, joiner = orch.op.target_step, orch.op.moves[1].to_worker
        for w in ("w0", "w1", "w2"):
            report(orch, w, {"type": "pause_ack", "op": op, "ok": True, "next_step": target})
        seen = len(_commands(orch, "w0"))
        report(orch, "w1", {"type": "paused", "op": op, "pos": [target, 0]})
        assert orch.op.phase == "pausing"
        assert [c["type"] for c in _commands(orch, "w1")][-1] == "publish"
        forms = [c for c in _commands(orch, joiner) if c["type"] == "form"]
        assert len(forms) == 1 and forms[0]["pos"] == [target, 0] and forms[0]["full_state"]
        assert not any(c["type"] == "form" for c in _commands(orch, "w0")[seen:])
        if lost:
            orch.handle(m.WorkerExited(worker_id="w2", returncode=-9))
            assert orch.op.kind.value == "unplanned" and joiner in sched.killed
            assert _commands(orch, "w1")[-1]["type"] == "abort"
            planned = orch.event_list()[0]
            assert planned["status"] == "failed" and "runs again after it" in planned["note"], planned
            continue
        time.sleep(0.05)
        for w in ("w0", "w2"):
            report(orch, w, {"type": "paused", "op": op, "pos": [target, 0]})
        assert orch.op.phase == "forming"
        assert len([c for c in _commands(orch, joiner) if c["type"] == "form"]) == 1  # not sent twice
        assert len([c for c in _commands(orch, "w1") if c["type"] == "publish"]) == 1
        gen = orch.op.generation
        for w in ("w0", "w2", joiner):
            report(orch, w, {"type": "formed", "generation": gen, "pos": [target, 0],
                             **({"phases": {"fetch": 0.01}} if w == joiner else {})})
        ev = orch.event_list()[0]
        assert ev["status"] == "resolved" and ev["phases"]["boundary"] == 0.0, ev  # the leaver paused first


def test_a_planned_move_pauses_nobody_until_its_joiner_is_at_its_step_loop(tmp_path):
    """The joiner runs the script's setup while the ranks train on: they are asked to pause
    only once it said Ready. A joiner lost in its setup stops nothing (no Abort, no re-form):
    another spare takes its place; and one still in its setup at --formation-timeout has
    the ranks pause for it anyway."""
    sched = RecordingScheduler(6)
    orch = _started(tmp_path, sched, Config(world_size=2, spares=2, formation_timeout_s=30))
    op = orch.handle(m.MigrateRequest(rank=1))["op"]
    first = orch.op.moves[1].to_worker
    assert orch.op.phase == "prepare" and not any(c["type"] == "pause" for c in _commands(orch, "w0"))
    assert [c["type"] for c in _commands(orch, first)] == ["assign"]
    orch.handle(m.WorkerExited(worker_id=first, returncode=-9))  # killed in its setup
    assert not any(c["type"] in ("pause", "abort") for w in ("w0", "w1") for c in _commands(orch, w))
    ev = orch.event_list()[0]
    assert (ev["status"], ev["note"]) == ("failed", "its joiner was lost before the ranks paused; the move runs again")
    assert orch.op is not None and orch.op.id != op and orch.op.phase == "prepare"
    second = orch.op.moves[1].to_worker
    assert second not in (None, first)
    orch.op.deadline = time.time() - 1  # still in its setup at the formation timeout
    orch.handle(m.Tick(now=time.time()))
    pauses = [c for c in _commands(orch, "w0") if c["type"] == "pause"]
    assert orch.op.phase == "agree" and len(pauses) == 1 and pauses[0]["at_step"] == orch.op.target_step


def test_a_no_code_planned_move_pauses_nobody_until_its_joiners_setup_is_done(tmp_path):
    """A no-code joiner cannot say Ready before it walked to the rank's place, which the
    pause decides; it says SetupDone where its script reached the loops around its step
    loop, and only then are the ranks asked to pause. (A rebuild's SetupDone changes nothing.)"""
    sched = RecordingScheduler(5)
    script_loop = {"style": "script", "total_steps": 0, "step_loop": "train.py:40", "nest": ["train.py:30"]}
    orch = _started(tmp_path, sched, Config(world_size=2, spares=1, formation_timeout_s=30), loop=script_loop)
    orch.handle(m.MigrateRequest(rank=1))
    joiner = orch.op.moves[1].to_worker
    report(orch, "w0", {"type": "setup_done", "setup_s": 0.5})  # not the move's joiner: nothing
    assert orch.op.phase == "prepare" and not any(c["type"] == "pause" for c in _commands(orch, "w0"))
    report(orch, joiner, {"type": "setup_done", "setup_s": 0.5})
    pauses = [c for c in _commands(orch, "w0") if c["type"] == "pause"]
    assert orch.op.phase == "agree" and len(pauses) == 1 and pauses[0]["at_step"] == orch.op.target_step
    with pytest.raises(ValueError):
        m.REPORT.validate_python({"type": "setup_done", "setup_s": -1})


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


def test_nothing_starts_moving_once_a_rank_has_run_its_last_step(tmp_path):
    """A rank that has finished never pauses again: a move started then would wait for it
    until the pausing phase's deadline, call every rank hung and end a job that was about
    to finish (seen: a taint a few steps before the end ended the job with code 1). The
    taint is kept; nothing moves; the job ends as it would have."""
    orch, _ = _running(tmp_path)
    report(orch, "w1", {"type": "finished", "pos": [100, 0]})
    answer = orch.handle(m.TaintRequest(slot="local/1", reason="ecc"))
    assert answer["moving_ranks"] == [] and "finishing" in answer["note"] and orch.op is None
    assert orch.slots["local/1"].taint == "ecc"
    with pytest.raises(RequestError, match="finishing"):
        orch.handle(m.MigrateRequest(rank=0))
    report(orch, "w0", {"type": "finished", "pos": [100, 0]})
    for w in ("w0", "w1"):
        orch.handle(m.WorkerExited(worker_id=w, returncode=0))
    assert orch.exit_code == 0 and orch.event_list() == []


def test_a_moves_downtime_runs_from_the_first_pause_to_the_last_formation_as_the_reports_date_them(tmp_path):
    """A report waits in its worker's outbox while that worker trains (the reporter thread
    competes with it for the GIL): the pause began, and training ran again, that long
    before each report arrived. Each says how long it waited; the downtime counts neither
    wait, on no clock but the orchestrator's."""
    orch, _ = _running(tmp_path)
    op = orch.handle(m.MigrateRequest(rank=1))["op"]
    _joiners_ready(orch)
    target = orch.op.target_step
    for w in ("w0", "w1"):
        report(orch, w, {"type": "pause_ack", "op": op, "ok": True, "next_step": target})
    t0 = time.time()
    report(orch, "w0", {"type": "paused", "op": op, "pos": [target, 0], "queued_s": 0.2})
    report(orch, "w1", {"type": "paused", "op": op, "pos": [target, 0]})
    gen = orch.op.generation
    time.sleep(0.5)
    report(orch, "w0", {"type": "formed", "generation": gen, "pos": [target, 0], "queued_s": 0.4})
    report(orch, "w2", {"type": "formed", "generation": gen, "pos": [target, 0], "queued_s": 0.3})
    t1 = time.time()
    ev = orch.event_list()[0]
    assert ev["status"] == "resolved"
    # from w0's pause (0.2 s before it arrived, after t0) to w2's formation (0.3 s before it
    # arrived, at least 0.5 s after the pause arrived, before t1)
    assert 0.5 + 0.2 - 0.3 <= ev["downtime_s"] <= (t1 - t0) + 0.2 - 0.3, ev
    with pytest.raises(ValueError):
        m.REPORT.validate_python({"type": "formed", "generation": gen, "pos": [target, 0], "queued_s": -1})


def test_a_joiner_that_runs_to_the_end_before_the_move_closes_still_counts_as_finished(tmp_path):
    """A rank lost in the region after the step loop: its successor takes it over there and
    can finish the script before the survivor's Formed closes the move. Its Finished must
    count (it holds the rank), or the job waits for it forever."""
    orch, _ = _running(tmp_path)
    report(orch, "w0", {"type": "finished", "pos": [10, 0]})
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    gen = orch.op.generation
    report(orch, "w0", {"type": "recover", "generation": gen, "pos": [10, 0]})
    report(orch, "w2", {"type": "formed", "generation": gen, "pos": [10, 0]})
    report(orch, "w2", {"type": "finished", "pos": [10, 0]})  # before the survivor's Formed
    assert orch.op is not None
    report(orch, "w0", {"type": "formed", "generation": gen, "pos": [10, 0]})
    report(orch, "w0", {"type": "finished", "pos": [10, 0]})
    assert orch.op is None and orch.ranks[1].worker == "w2"
    assert all(any(c["type"] == "done" for c in _commands(orch, w)) for w in ("w0", "w2"))


def test_a_ready_report_without_its_bundle_is_refused_unless_a_joiner_sent_it():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="reports its bundle"):
        m.REPORT.validate_python({"type": "ready", "loop": LOOP})
    assert m.REPORT.validate_python({"type": "ready", "loop": LOOP, "joined": True}).bundle is None


def test_refusals_change_nothing(tmp_path):
    orch, sched = _running(tmp_path)
    with pytest.raises(RequestError, match="unknown rank 7") as e:
        orch.handle(m.MigrateRequest(rank=7))
    assert e.value.status == 404
    with pytest.raises(RequestError, match="unknown slot or node 'x/1'; slots are: local/0, .*; nodes: local"):
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
    orch = _registered(tmp_path, RecordingScheduler(3), Config(world_size=2, spares=1))
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
    _joiners_ready(orch)
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
    _joiners_ready(orch)
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
    orch = _started(tmp_path, RecordingScheduler(2), Config(world_size=2, spares=0, spare_wait_s=30))
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


class NodeScheduler(RecordingScheduler):
    """Slots on three nodes of two; records probes, drains and resumes (Slurm does them for real)."""

    def __init__(self):
        super().__init__(6)
        self.probes: list[tuple[str, object]] = []
        self.drained: list[tuple[str, str]] = []
        self.resumed: list[str] = []

    def slots(self) -> list[str]:
        return [f"n{n}/{i}" for n in (1, 2, 3) for i in (0, 1)]

    def probe_node(self, node, done) -> None:
        self.probes.append((node, done))

    def drain(self, node: str, reason: str) -> None:
        self.drained.append((node, reason))

    def resume(self, node: str) -> None:
        self.resumed.append(node)


def _on_nodes(tmp_path, sched: NodeScheduler | None = None, **config) -> tuple[Orchestrator, NodeScheduler]:
    """4 ranks, 2 per node; spares on the third node unless `config` says otherwise."""
    sched = sched or NodeScheduler()
    return _started(tmp_path, sched, Config(**{"world_size": 4, "spares": 2, "ranks_per_node": 2, **config})), sched


def test_a_lost_node_recovers_its_ranks_in_one_move_and_is_drained(tmp_path):
    orch, sched = _on_nodes(tmp_path)
    orch.handle(m.WorkerExited(worker_id="w2", returncode=-9))
    orch.handle(m.WorkerExited(worker_id="w3", returncode=-9))
    assert sorted(orch.op.moves) == [2, 3]
    assert [p[0] for p in sched.probes] == ["n2"]  # probed once, while suspect
    for w in ("w0", "w1"):
        report(orch, w, {"type": "recover", "generation": orch.op.generation, "pos": [10, 0]})
    forms = {w: [c for c in _commands(orch, w) if c["type"] == "form"] for w in ("w4", "w5")}
    assert all(forms.values())  # both spares on n3 take the node's ranks in the same generation
    # Buddies are on the other node: rank 2's state is pushed to rank 0 first, rank 3's to rank 1.
    assert orch._buddies(2)[0] == 0 and orch._buddies(3)[0] == 1
    sched.probes[0][1](False, "Task launch failed on node n2: Communication connection failure")
    node = {n["node"]: n for n in orch.status()["jobs"][0]["nodes"]}["n2"]
    assert node["state"] == "lost" and "Communication connection failure" in node["reason"]
    assert sched.drained and sched.drained[0][0] == "n2" and sched.drained[0][1].startswith("baton: node lost")
    assert all(s["taint"] for s in orch.status()["jobs"][0]["slots"] if s["slot"].startswith("n2/"))
    started_on = [slot for _, slot in sched.started]
    assert started_on.count("n2/0") == 1 and started_on.count("n2/1") == 1  # only the first ranks


def test_a_healthy_probe_returns_the_node_to_the_pool(tmp_path):
    orch, sched = _on_nodes(tmp_path)
    orch.handle(m.WorkerExited(worker_id="w2", returncode=-9))
    for w in ("w0", "w1", "w3"):
        report(orch, w, {"type": "recover", "generation": orch.op.generation, "pos": [10, 0]})
    joiner = orch.op.moves[2].to_worker
    report(orch, joiner, {"type": "formed", "generation": orch.op.generation, "pos": [10, 0]})
    for w in ("w0", "w1", "w3"):
        report(orch, w, {"type": "formed", "generation": orch.op.generation, "pos": [10, 0]})
    assert orch.op is None
    assert "n2/0" not in [slot for _, slot in sched.started[6:]]  # suspect: no spare there yet
    sched.probes[0][1](True, "")
    assert [slot for _, slot in sched.started[6:]] == ["n2/0"] and not sched.drained


def test_taint_of_a_node_moves_all_its_ranks_in_one_move_and_untaint_resumes_it(tmp_path):
    orch, sched = _on_nodes(tmp_path)
    out = orch.handle(m.TaintRequest(slot="n2", reason="maintenance"))
    assert out["moving_ranks"] == [2, 3] and orch.op is not None and sorted(orch.op.moves) == [2, 3]
    assert sched.drained == [("n2", "baton: maintenance")]
    assert {e["rank"] for e in orch.event_list()} == {2, 3}
    assert all(e["kind"] == "pre-emptive" for e in orch.event_list())
    orch.handle(m.UntaintRequest(slot="n2"))
    assert sched.resumed == ["n2"]
    assert not any(s["taint"] for s in orch.status()["jobs"][0]["slots"])


def _joiners_ready(orch: Orchestrator) -> None:
    """The planned move's joiners reach their step loop (Ready): the ranks are asked to pause."""
    assert orch.op is not None and orch.op.phase == "prepare" and not orch.op.target_step
    for mv in list(orch.op.moves.values()):
        report(orch, mv.to_worker, {"type": "ready", "loop": LOOP, "joined": True})
    assert orch.op.phase == "agree"


def _run_planned(orch: Orchestrator, step: int = 12) -> None:
    """Drive the current planned move to its end as the workers would."""
    if orch.op.phase == "prepare":
        _joiners_ready(orch)
    op = orch.op
    holders = {r: i.worker for r, i in orch.ranks.items()}
    for r, wid in holders.items():
        report(orch, wid, {"type": "pause_ack", "op": op.id, "ok": True, "next_step": step})
    for r, wid in holders.items():
        report(orch, wid, {"type": "paused", "op": op.id, "pos": [op.target_step, 0]})
    for r in orch.ranks:
        wid = op.moves[r].to_worker if r in op.moves else holders[r]
        report(orch, wid, {"type": "formed", "generation": op.generation, "pos": [op.target_step, 0]})
    assert orch.op is None
    for r, mv in op.moves.items():
        orch.handle(m.WorkerExited(worker_id=mv.from_worker, returncode=0))


def test_migrate_to_a_named_slot_uses_the_spare_there_and_refuses_what_cannot_be(tmp_path):
    orch, _ = _on_nodes(tmp_path)
    with pytest.raises(RequestError, match="rank 2 is already on n2/0"):
        orch.handle(m.MigrateRequest(rank=2, to="n2/0"))
    with pytest.raises(RequestError, match="no warm spare on n1 and no free slot there"):
        orch.handle(m.MigrateRequest(rank=2, to="n1"))
    with pytest.raises(RequestError, match="unknown slot or node 'n9'"):
        orch.handle(m.MigrateRequest(rank=2, to="n9"))
    spare = next(w for w in orch.workers.values() if w.slot == "n3/1")
    out = orch.handle(m.MigrateRequest(rank=2, to="n3/1"))
    assert out["to"] == "n3/1" and orch.op.moves[2].to_worker == spare.id


def test_return_home_moves_ranks_back_once_their_node_is_untainted(tmp_path):
    orch, sched = _on_nodes(tmp_path, return_home=True)
    orch.handle(m.TaintRequest(slot="n1", reason="maintenance"))
    _run_planned(orch)
    assert {orch.workers[orch.ranks[r].worker].slot.split("/")[0] for r in (0, 1)} == {"n3"}
    orch.handle(m.UntaintRequest(slot="n1"))
    fresh = [wid for wid, slot in sched.started if slot.startswith("n1/")][2:]  # spares on the home node
    assert len(fresh) == 2 and orch.op is None
    for wid in fresh:
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
    assert orch.op is not None and sorted(orch.op.moves) == [0, 1]
    assert {orch.op.moves[r].to_worker for r in (0, 1)} == set(fresh)
    assert orch.event_list()[-1]["cause"] == "return home: its node is healthy again"
    _run_planned(orch, step=20)
    assert {orch.workers[orch.ranks[r].worker].slot.split("/")[0] for r in (0, 1)} == {"n1"}
    assert orch.op is None  # home again: nothing more to do


def test_alertmanager_alerts_taint_and_untaint_what_their_labels_name(tmp_path):
    from baton.health.alerts import AlertBatch

    orch, sched = _on_nodes(tmp_path)

    def alerts(*items):
        return orch.handle(AlertBatch.model_validate({"version": "4", "status": "firing", "receiver": "baton",
                                                      "groupLabels": {}, "alerts": list(items)}))

    firing = {"status": "firing", "labels": {"alertname": "NodeHot", "instance": "n2.cluster:9100"},
              "annotations": {"summary": "GPU 91C"}, "startsAt": "2026-11-22T10:00:00Z"}
    other = {"status": "firing", "labels": {"alertname": "NodeHot", "instance": "elsewhere:9100"}}
    out = alerts(firing, other)["results"]
    assert out[0]["target"] == "n2" and out[0]["action"] == "tainted" and out[0]["moving_ranks"] == [2, 3]
    assert out[1]["action"] == "ignored"
    assert sched.drained == [("n2", "baton: alert NodeHot: GPU 91C")]
    assert alerts(firing)["results"][0]["action"] == "ignored"  # re-sent while firing: nothing new
    slot_alert = {"status": "firing", "labels": {"alertname": "EccErrors", "baton_slot": "n1/1"}}
    assert alerts(slot_alert)["results"][0] == {"target": "n1/1", "action": "tainted", "moving_ranks": [1]}
    assert alerts({**firing, "status": "resolved"})["results"][0]["action"] == "untainted"
    assert sched.resumed == ["n2"]
    wrong = {"status": "resolved", "labels": {"alertname": "Other", "baton_slot": "n1/1"}}
    assert alerts(wrong)["results"][0]["action"] == "ignored"  # another alert's taint stays


def test_a_spare_that_fails_to_start_on_slurm_is_judged_after_its_node_is_probed(tmp_path):
    """srun cannot start a step on a dead node and exits 1 like a broken script would: the node
    is probed first. A bad node is tainted and the job goes on; a good node means the script
    itself failed, and the job ends with that."""
    orch, sched = _on_nodes(tmp_path)
    orch.handle(m.WorkerExited(worker_id="w4", returncode=0))  # the spare on n3/0 leaves; another starts
    orch.handle(m.Tick(now=time.time()))
    fresh, where = sched.started[-1]
    assert fresh == "w6" and where == "n3/0"
    orch.handle(m.WorkerExited(worker_id=fresh, returncode=1))
    assert orch.exit_code is None and sched.probes[-1][0] == "n3"
    sched.probes[-1][1](False, "Unable to create step: Requested node configuration is not available")
    assert orch.exit_code is None and {n["node"]: n["state"] for n in orch.status()["jobs"][0]["nodes"]}["n3"] == "lost"

    (tmp_path / "again").mkdir()
    orch2, sched2 = _on_nodes(tmp_path / "again")
    orch2.handle(m.WorkerExited(worker_id="w4", returncode=0))
    orch2.handle(m.Tick(now=time.time()))
    fresh = sched2.started[-1][0]
    orch2.handle(m.WorkerExited(worker_id=fresh, returncode=1))
    sched2.probes[-1][1](True, "")
    assert orch2.exit_code == 1 and "exited with code 1 before baton.init()" in orch2.failure


class BorrowingScheduler(NodeScheduler):
    def __init__(self):
        super().__init__()
        self.borrows: list[object] = []
        self.released: list[str] = []

    def slots(self) -> list[str]:
        return [f"n{n}/{i}" for n in (1, 2) for i in (0, 1)]

    def borrow(self, done) -> None:
        self.borrows.append(done)

    def release(self, node: str) -> None:
        self.released.append(node)


def test_with_no_spare_left_a_node_is_borrowed_and_given_back_once_it_holds_no_rank(tmp_path):
    orch, sched = _on_nodes(tmp_path, BorrowingScheduler(), spares=0, borrow_spares=True)
    orch.handle(m.WorkerExited(worker_id="w3", returncode=-9))
    for w in ("w0", "w1", "w2"):
        report(orch, w, {"type": "recover", "generation": orch.op.generation, "pos": [10, 0]})
    assert orch.op.phase == "spares" and len(sched.borrows) == 1
    report(orch, "w0", {"type": "recover", "generation": orch.op.generation, "pos": [10, 0]})
    assert len(sched.borrows) == 1  # one request at a time
    sched.borrows[0]("n7", "job 31 (lowprio, alice, partition low)")
    wid, slot = sched.started[-1]
    assert slot == "n7/0"
    spare = orch.status()["jobs"][0]["spares"][0]
    assert spare["kind"] == "borrowed" and spare["from"] == "job 31 (lowprio, alice, partition low)"
    orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 2000)))
    assert orch.op.phase == "forming" and orch.op.moves[3].to_worker == wid
    for w in ("w0", "w1", "w2", wid):
        report(orch, w, {"type": "formed", "generation": orch.op.generation, "pos": [10, 0]})
    assert orch.op is None and not sched.released  # it holds rank 3 now
    nodes = {n["node"]: n for n in orch.status()["jobs"][0]["nodes"]}
    assert nodes["n7"]["ranks"] == [3] and nodes["n7"]["borrowed_from"].startswith("job 31")
    # Rank 3 goes back to its first slot (n2 probed fine: only a process died there); the
    # borrowed node then holds no rank and is given back.
    assert sched.probes[-1][0] == "n2"
    sched.probes[-1][1](True, "")
    out = orch.handle(m.MigrateRequest(rank=3, to="n2/1"))
    assert out["queued"] and sched.started[-1][1] == "n2/1"
    home = sched.started[-1][0]
    orch.register(home, m.Register(pid=1, transfer_addr=("127.0.0.1", 2001)))
    assert orch.op is not None and orch.op.moves[3].to_worker == home
    _run_planned(orch, step=20)
    assert sched.released == ["n7"]
    nodes = {n["node"]: n for n in orch.status()["jobs"][0]["nodes"]}
    assert nodes["n7"]["state"] == "released" and nodes["n7"]["ranks"] == []
    assert not any(s.startswith("n7/") for _, s in sched.started[-1:])


def test_gpu_readings_past_a_threshold_taint_the_slot_and_move_its_rank(tmp_path):
    orch, sched = _on_nodes(tmp_path)
    report(orch, "w1", {"type": "heartbeat", "step": 11, "gpu": {"temp_c": 70.0, "ecc_uncorrected": 0}})
    assert orch.op is None and orch.status()["jobs"][0]["ranks"][1]["gpu"] == {"temp_c": 70.0, "ecc_uncorrected": 0}
    report(orch, "w1", {"type": "heartbeat", "step": 12, "gpu": {"temp_c": 71.0, "ecc_uncorrected": 1}})
    assert orch.op is not None and sorted(orch.op.moves) == [1]
    ev = orch.event_list()[0]
    assert ev["kind"] == "pre-emptive" and ev["cause"].startswith("taint: ecc: 1 uncorrected")
    # A spare on a hot GPU: its slot is tainted and the spare stopped, so no rank goes there.
    report(orch, "w5", {"type": "heartbeat", "gpu": {"temp_c": 97.0}})
    assert orch.status()["jobs"][0]["taints"][-1]["reason"].startswith("thermal: GPU at 97 C")


def _reloaded(tmp_path, sched, config: Config) -> Orchestrator:
    """A second life of the control plane on the first one's store (what `baton serve` does
    after a restart)."""
    orch = Orchestrator(config, SqliteStore(tmp_path / "s.db"), sched)
    assert orch.restore()
    return orch


def test_a_restarted_control_plane_reloads_the_job_and_numbers_commands_above_its_last_life(tmp_path):
    orch, sched = _running(tmp_path, world=3)
    orch.handle(m.TaintRequest(slot="local/4", reason="ecc"))
    before = orch.status()["jobs"][0]
    last_seq = max(c["seq"] for c in _commands(orch, "w1"))
    orch.store.close()

    again = _reloaded(tmp_path, RecordingScheduler(sched.n), orch.config)
    after = again.status()["jobs"][0]
    assert after["ranks"] == before["ranks"] and after["spares"] == before["spares"]
    assert after["taints"] == before["taints"] and again.generation == orch.generation
    # each rank's own durable state (as JSON: a position comes back as a list)
    assert all(again.ranks[r].held == json.loads(json.dumps(orch.ranks[r].held)) for r in range(3))
    again.handle(m.MigrateRequest(rank=1))
    _joiners_ready(again)
    pauses = [c for c in _commands(again, "w1") if c["type"] == "pause"]
    assert pauses and pauses[0]["seq"] > last_seq  # a worker polling `after=last_seq` gets them


def test_after_a_restart_the_agent_reports_what_died_meanwhile_and_it_is_recovered(tmp_path):
    orch, sched = _running(tmp_path, world=3)
    orch.store.close()
    again = _reloaded(tmp_path, RecordingScheduler(sched.n), orch.config)
    # w1 (rank 1) died while nobody was deciding; w0, w2 and the spare w3 run; w9 is unknown.
    again.handle(m.AgentSync(live=["w0", "w2", "w3", "w9"], exited={"w1": -9}))
    assert again.op is not None and list(again.op.moves) == [1]
    assert again.workers["w1"].role.value == "gone"
    assert "w9" in again.scheduler.killed  # started by a life that never wrote it down
    assert again._worker_ids >= 10  # and its id is never handed out again
    aborts = [c for c in _commands(again, "w0") if c["type"] == "abort"]
    assert aborts and aborts[0]["generation"] == again.op.generation


def test_a_restarted_control_plane_still_gives_each_joiner_its_ranks_record_of_the_setups_collectives(tmp_path):
    """Rank 1's setup ran a collective whose result was its own (it sent its record), rank
    2's did not: a joiner of rank 1 gets rank 1's record, one of rank 2 rank 0's."""
    sched = RecordingScheduler(6)
    records = {0: {**_bundle(0), "meta": '{"seed": 1234}'}, 1: {**_bundle(1), "meta": '{"seed": 5678}'}}
    orch = _started(tmp_path, sched, Config(world_size=3, spares=2), setup=records)
    orch._persist(force=True)
    orch.store.close()
    again = _reloaded(tmp_path, RecordingScheduler(sched.n), orch.config)
    again.handle(m.AgentSync(live=["w0", "w3", "w4"], exited={"w1": -9, "w2": -9}))
    report(again, "w0", {"type": "recover", "generation": again.op.generation, "pos": [10, 0]})
    assigns = {c["rank"]: c for w in again.workers for c in _commands(again, w) if c["type"] == "assign" and c["joiner"]}
    assert sorted(assigns) == [1, 2], assigns
    assert assigns[1]["setup"]["meta"] == '{"seed": 5678}' and assigns[2]["setup"]["meta"] == '{"seed": 1234}'


def test_a_move_in_flight_when_the_control_plane_died_is_taken_up_as_a_recovery(tmp_path):
    orch, sched = _running(tmp_path, world=3)
    orch.handle(m.MigrateRequest(rank=2))
    assert orch.op is not None and orch.op.kind.value == "planned"
    orch.store.close()
    again = _reloaded(tmp_path, RecordingScheduler(sched.n), orch.config)
    op = again.op
    assert op is not None and op.kind.value == "unplanned" and op.moves == {}  # every rank re-forms in place
    assert op.generation > orch.generation
    assert [r.rank for r in again._retry_moves] == [2]  # the move itself runs again afterwards
    for wid in ("w0", "w1", "w2"):
        assert any(c["type"] == "abort" for c in _commands(again, wid))


def _hsdp_recovery(tmp_path, lost: list[int], own: dict[int, list[list[int]]]) -> Orchestrator:
    """A 2x2 HSDP job (ranks 0 and 2 hold the same shards, 1 and 3 too) with --redundancy 1,
    at step 10, loses `lost`; each survivor reports its own snapshots (`own`, default steps
    9 and 10) and its wards' copies of both."""
    orch = _started(tmp_path, RecordingScheduler(4 + 3 + 1), Config(world_size=4, spares=3, redundancy=1), SHARDED)
    for r in lost:
        orch.handle(m.WorkerExited(worker_id=f"w{r}", returncode=-9))
    gen = orch.op.generation
    for r in sorted(set(range(4)) - set(lost)):
        wards = [w for w in range(4) if r in orch._buddies(w)]
        report(orch, f"w{r}", {"type": "recover", "generation": gen, "pos": [10, 0], "in_step": True,
                               "snapshots": own.get(r, [[9, 0], [10, 0]]),
                               "held": {str(w): [[9, 0], [10, 0]] for w in wards}, "replicas": [(r + 2) % 4]})
    return orch


def _joiner_form(orch: Orchestrator) -> dict:
    joiner = next(w for w in orch.workers.values() if w.rank == 1 and w.role.value == "rank")
    return [c for c in _commands(orch, joiner.id) if c["type"] == "form"][-1]


def test_a_lost_hsdp_rank_takes_its_shards_from_the_other_replica_group(tmp_path):
    orch = _hsdp_recovery(tmp_path, lost=[1], own={})
    holder = next(b for b in orch._buddies(1))
    form = _joiner_form(orch)
    assert form["pos"] == [10, 0] and form["snapshot"], form
    assert form["shards_from"] == {"3": ["127.0.0.1", 1003]}, form  # rank 3 holds rank 1's shards
    assert form["fetch_from"] == [["127.0.0.1", 1000 + holder]], form  # its buddy: the rest of its state


def test_hsdp_goes_back_a_boundary_when_the_replica_has_no_snapshot_of_the_newest(tmp_path):
    orch = _hsdp_recovery(tmp_path, lost=[1], own={3: [[8, 0], [9, 0]]})
    form = _joiner_form(orch)
    assert form["pos"] == [9, 0] and form["shards_from"] == {"3": ["127.0.0.1", 1003]}, form
    rewinds = [c for c in _commands(orch, "w0") if c["type"] == "form"]
    assert rewinds[-1]["pos"] == [9, 0] and rewinds[-1]["rewind"], rewinds


def test_hsdp_ranks_lost_with_every_replica_of_their_shards_fail_clearly(tmp_path):
    orch = _hsdp_recovery(tmp_path, lost=[1, 3], own={})
    assert orch.failure and "rank(s) 1, 3 lost together with every other replica group's copy of their " \
        "HSDP shards" in orch.failure, orch.failure
    assert {e.status for e in orch.events} == {"failed"}


def test_without_redundancy_a_sharded_job_stops_on_the_lost_rank_even_when_a_survivor_reports_first(tmp_path):
    """--redundancy 0, FSDP2: rank 0's failed collective reaches the orchestrator before rank
    1's death does (the usual order after kill -9). The job is stopped when rank 1 is known
    lost, with that rank's failed event in the ledger, not before and not without it."""
    orch = _started(tmp_path, RecordingScheduler(4), Config(world_size=2, spares=1, redundancy=0), SHARDED)
    report(orch, "w0", {"type": "recover", "generation": orch.generation, "pos": [10, 0], "in_step": True,
                        "error": "Connection closed by peer"})
    assert not orch.failure, "stopped before any rank was known lost"
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))
    assert orch.failure and "--redundancy 0 (no buddy holds a copy)" in orch.failure, orch.failure
    assert [(e.kind.value, e.status, e.rank) for e in orch.events] == [("unplanned", "failed", 1)]


def test_a_data_path_down_on_a_node_with_ranks_re_forms_the_job_over_the_others(tmp_path):
    """--data-paths rail1,rail2: rail1 seen down on the ranks' node aborts the generation
    and the next forms over rail2 alone, every rank where it stands, no rank moved, no spare
    used; the ledger holds a path-failover dated when the link was seen down. A repeated
    report, a path of no interest and a spare's node change nothing."""
    sched = RecordingScheduler(4)
    orch = _started(tmp_path, sched, Config(world_size=2, spares=1, data_paths=("rail1", "rail2")))
    assert orch.register("w2", m.Register(pid=1, transfer_addr=("127.0.0.1", 1002)))["data_paths"] == \
        ["rail1", "rail2"]
    first = [c for c in _commands(orch, "w0") if c["type"] == "form"]
    assert first and first[0]["paths"] == ["rail1", "rail2"]
    report(orch, "w0", {"type": "path", "interface": "eth9", "up": False})  # not a data path
    assert orch.op is None
    t0 = time.time()
    report(orch, "w1", {"type": "path", "interface": "rail1", "up": False, "queued_s": 0.25})
    op = orch.op
    assert op is not None and op.moves == {}
    gen = op.generation
    assert all(any(c["type"] == "abort" and c["generation"] == gen for c in _commands(orch, w)) for w in ("w0", "w1"))
    report(orch, "w0", {"type": "path", "interface": "rail1", "up": False})  # the same node's other rank
    assert orch.op is op and len(orch.event_list()) == 1
    for w in ("w0", "w1"):
        report(orch, w, {"type": "recover", "generation": gen, "pos": [10, 0], "in_step": True})
    forms = {w: [c for c in _commands(orch, w) if c["type"] == "form" and c["generation"] == gen] for w in ("w0", "w1")}
    assert all(f and f[0]["paths"] == ["rail2"] and f[0]["pos"] == [10, 0] for f in forms.values()), forms
    assert not any(c["type"] in ("assign", "form") for c in _commands(orch, "w2"))  # the spare stays a spare
    for w in ("w0", "w1"):
        report(orch, w, {"type": "formed", "generation": gen, "pos": [10, 0]})
    assert orch.op is None
    ev = orch.event_list()[0]
    assert (ev["kind"], ev["status"], ev["rank"], ev["node"], ev["interface"]) == \
        ("path-failover", "resolved", None, "local", "rail1"), ev
    assert ev["steps_lost"] == 0 and ev["steps_rerun"] == 1 and ev["detected_at"] <= t0 - 0.2
    st = orch.status()["jobs"][0]["data_paths"]
    assert st["in_use"] == ["rail2"] and [x["up"] for x in st["links"]] == [False]


def test_data_paths_auto_takes_the_interfaces_every_node_of_the_first_generation_has(tmp_path):
    """--data-paths auto: the workers say their nodes' candidates; the first generation waits
    for every rank's, then runs over the names all the ranks' nodes have (a spare's node does
    not narrow them); workers registered before are told to watch them, later ones at
    registration, and a restarted control plane keeps them."""
    sched = NodeScheduler()
    orch = Orchestrator(Config(world_size=4, spares=2, ranks_per_node=2, data_paths=("auto",)),
                        SqliteStore(tmp_path / "s.db"), sched)
    notes: list[str] = []
    orch.listeners.append(lambda kind, data: notes.append(data.get("message", "")) if kind == "note" else None)
    orch.start()
    found = {"n1": ["eth1", "rail1", "rail2"], "n2": ["rail1", "rail2"], "n3": ["rail1"]}
    for wid, slot in list(sched.started)[:5]:  # the last spare registers later
        reg = orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
        assert reg["discover_paths"] and reg["data_paths"] == []
    assert orch.status()["jobs"][0]["data_paths"]["configured"] == []
    for wid, slot in list(sched.started)[:4]:
        assert not any(c["type"] == "assign" for c in _commands(orch, "w0"))
        report(orch, wid, {"type": "paths_found", "interfaces": found[slot.split("/")[0]], "detail": "eth0 (x)"})
    assert any("data paths found on every node: rail1, rail2" in n for n in notes), notes
    for wid in ("w0", "w4"):  # a rank and the spare registered before: told to watch them
        assert [c["names"] for c in _commands(orch, wid) if c["type"] == "watch_paths"] == [["rail1", "rail2"]]
    report(orch, "w4", {"type": "paths_found", "interfaces": ["rail1"]})  # too late to narrow anything
    assert not any(c["type"] == "assign" for c in _commands(orch, "w0"))  # two paths: probes' answerers first
    for wid, _ in list(sched.started)[:4]:
        report(orch, wid, {"type": "paths_ready", "addrs": {p: ["10.0.0.1", 2000] for p in ("rail1", "rail2")}})
    forms = [c for c in _commands(orch, "w0") if c["type"] == "form"]
    assert forms and forms[0]["paths"] == ["rail1", "rail2"], forms
    late = orch.register("w5", m.Register(pid=1, transfer_addr=("127.0.0.1", 1005)))
    assert late["data_paths"] == ["rail1", "rail2"] and not late["discover_paths"]
    orch.store.close()
    again = _reloaded(tmp_path, NodeScheduler(), orch.config)
    assert again.data_paths.names == ["rail1", "rail2"] and not again.discover_paths


def test_data_paths_auto_with_no_name_on_every_node_runs_over_the_default_device_and_says_why(tmp_path):
    sched = RecordingScheduler(3)
    orch = Orchestrator(Config(world_size=2, spares=1, data_paths=("auto",)), SqliteStore(tmp_path / "s.db"), sched)
    notes: list[str] = []
    orch.listeners.append(lambda kind, data: notes.append(data.get("message", "")) if kind == "note" else None)
    orch.start()
    for wid, _ in list(sched.started):
        orch.register(wid, m.Register(pid=1, transfer_addr=("127.0.0.1", 1000 + int(wid[1:]))))
    for wid in ("w0", "w1"):
        report(orch, wid, {"type": "paths_found", "interfaces": [], "detail": "not data paths: eth0 (the control plane's)"})
    forms = [c for c in _commands(orch, "w0") if c["type"] == "form"]
    assert forms and forms[0]["paths"] == [], forms
    assert any("no interface is a data path on every node" in n and "eth0 (the control plane's)" in n
               for n in notes), notes


def _fail_over(orch: Orchestrator, wid: str, interface: str) -> None:
    """`interface` seen down by `wid`'s node: every rank re-forms where it stands (step 10)."""
    report(orch, wid, {"type": "path", "interface": interface, "up": False})
    gen = orch.op.generation
    holders = [i.worker for i in orch.ranks.values()]
    for w in holders:
        report(orch, w, {"type": "recover", "generation": gen, "pos": [10, 0]})
    for w in holders:
        report(orch, w, {"type": "formed", "generation": gen, "pos": [10, 0]})
    assert orch.op is None


def _planned_reform(orch: Orchestrator) -> list[dict]:
    """The ranks agree, pause and form (no rank moves): the Forms they got."""
    op = orch.op
    for w in ("w0", "w1"):
        report(orch, w, {"type": "pause_ack", "op": op.id, "ok": True, "next_step": op.target_step})
    for w in ("w0", "w1"):
        report(orch, w, {"type": "paused", "op": op.id, "pos": [op.target_step, 0]})
    forms = [c for c in _commands(orch, "w0") if c["type"] == "form" and c["generation"] == op.generation]
    for w in ("w0", "w1"):
        report(orch, w, {"type": "formed", "generation": op.generation, "pos": [op.target_step, 0]})
    assert orch.op is None
    return forms


def test_a_data_path_back_for_its_hold_down_is_used_again_from_a_planned_boundary(tmp_path):
    sched = RecordingScheduler(4)
    orch = _started(tmp_path, sched, Config(world_size=2, spares=1, data_paths=("rail1", "rail2"),
                                            path_hold_down_s=0.3, heartbeat_timeout_s=60))
    _fail_over(orch, "w1", "rail1")
    report(orch, "w1", {"type": "path", "interface": "rail1", "up": True})
    orch.handle(m.Tick(now=time.time()))
    assert orch.op is None  # not up for its hold-down yet
    time.sleep(0.35)
    orch.handle(m.Tick(now=time.time()))
    assert orch.op is not None and orch.op.kind.value == "path-restored" and orch.op.moves == {}
    forms = _planned_reform(orch)
    assert forms and forms[0]["paths"] == ["rail1", "rail2"] and not forms[0]["fetch_from"]
    kinds = [(e["kind"], e["status"], e["steps_rerun"], e["steps_lost"]) for e in orch.event_list()]
    assert kinds == [("path-failover", "resolved", 0, 0), ("path-restored", "resolved", 0, 0)], kinds
    assert orch.status()["jobs"][0]["data_paths"]["in_use"] == ["rail1", "rail2"]
    assert orch.yoco_ratio() == 1.0  # the failover counts as a failure resolved; the restore does not count


def test_a_node_left_with_no_data_path_its_peers_have_is_cut_off_at_once(tmp_path):
    """n2 loses rail2 (the job fails over to rail1), then n1 loses rail1: each still has a
    path, but none in common, so no collective can include both. The node whose loss
    split them is tainted and its ranks lost now (rebuilt on the spares), not left to stall
    until --op-timeout."""
    orch, sched = _on_nodes(tmp_path, data_paths=("rail1", "rail2"))
    _fail_over(orch, "w2", "rail2")
    report(orch, "w0", {"type": "path", "interface": "rail1", "up": False})
    taints = {t["slot"]: t["reason"] for t in orch.status()["jobs"][0]["taints"]}
    assert taints.get("n1/0") == taints.get("n1/1") == "node n1: network: no data path shared with n2", taints
    lost = [e for e in orch.event_list() if e["kind"] == "unplanned"]
    assert sorted(e["rank"] for e in lost) == [0, 1], lost
    assert all("shares no working data path with n2" in e["cause"] for e in lost), lost


def test_a_flapping_data_path_is_damped_and_costs_one_failover(tmp_path):
    """rail1 goes down and up every moment: the first down fails over; it never stays up for
    the hold-down, so it is never restored; its third down damps it (the ledger says so),
    and while damped it is not used even once up for the hold-down."""
    sched = RecordingScheduler(4)
    orch = _started(tmp_path, sched, Config(world_size=2, spares=1, data_paths=("rail1", "rail2"),
                                            path_hold_down_s=0.2, heartbeat_timeout_s=60))
    _fail_over(orch, "w1", "rail1")
    for _ in range(3):
        report(orch, "w1", {"type": "path", "interface": "rail1", "up": True})
        orch.handle(m.Tick(now=time.time()))
        report(orch, "w1", {"type": "path", "interface": "rail1", "up": False})
        assert orch.op is None  # not in use: its downs re-form nothing
    report(orch, "w1", {"type": "path", "interface": "rail1", "up": True})
    time.sleep(0.25)
    orch.handle(m.Tick(now=time.time()))
    assert orch.op is None
    events = orch.event_list()
    assert [e["kind"] for e in events] == ["path-failover", "path-damped"], events
    assert "flapping (down 3 times" in events[1]["cause"] and events[1]["node"] == "local"
    link = orch.status()["jobs"][0]["data_paths"]["links"][0]
    assert link["damped"] and link["downs"] == 4


def test_a_rank_silent_while_the_others_step_on_is_not_hung_but_one_they_wait_for_is(tmp_path):
    """Its control path down, a rank's heartbeats stop while it trains: the others reach two
    steps past the last it reported, which they could not without it. It is not lost. A
    rank whose peers stop at most one step past its last is hung, as before."""
    sched = RecordingScheduler(4)
    orch = _started(tmp_path, sched, Config(world_size=2, spares=1, heartbeat_timeout_s=1.0))
    said: list[tuple[str, dict]] = []
    orch.listeners.append(lambda kind, data: said.append((kind, data)))
    orch.workers["w1"].last_seen -= 5
    report(orch, "w0", {"type": "heartbeat", "step": 12})
    orch.handle(m.Tick(now=time.time()))
    assert orch.op is None and orch.workers["w1"].unheard
    assert any(k == "note" and "control path is down" in d["message"] for k, d in said), said
    report(orch, "w1", {"type": "heartbeat", "step": 13})  # heard from again
    assert not orch.workers["w1"].unheard
    orch.workers["w1"].last_seen -= 5
    report(orch, "w0", {"type": "heartbeat", "step": 14})  # one past its last: it may be hung there
    orch.handle(m.Tick(now=time.time()))
    assert orch.op is not None and orch.op.kind.value == "unplanned"
    assert [(e["kind"], e["rank"]) for e in orch.event_list()] == [("unplanned", 1)]


def test_a_survivor_left_connecting_to_a_rank_lost_while_forming_has_until_its_connect_times_out(tmp_path):
    """A rank lost while the others form the next generation (its node's last data path went
    down): a survivor may sit in gloo's connect to it until --op-timeout before it can take the
    Abort and report. The new collect phase gives it that long on top of the usual report
    window, so a live survivor on a busy machine is not declared hung (and the job lost)."""
    orch, _ = _running(tmp_path, world=3, spares=2)
    orch.handle(m.WorkerExited(worker_id="w2", returncode=-9))
    gen = orch.op.generation
    for w in ("w0", "w1"):
        report(orch, w, {"type": "recover", "generation": gen, "pos": [10, 0]})
    joiner = orch.op.moves[2].to_worker
    report(orch, joiner, {"type": "ready", "loop": LOOP, "joined": True})
    assert orch.op.phase == "forming", orch.op.phase
    before = time.time()
    orch.handle(m.WorkerExited(worker_id="w1", returncode=-9))  # lost while the others connect to it
    cfg = orch.config
    assert orch.op.phase == "collect" and orch.op.generation > gen
    assert orch.op.deadline >= before + cfg.op_timeout_s + cfg.op_timeout_s + cfg.collect_grace_s - 0.5


def test_a_rank_silent_after_training_finished_is_waited_for_not_recovered(tmp_path):
    """Every rank finished: one whose heartbeats stop (its closing code starves the heartbeat
    thread on a busy machine, or its process is exiting) is not lost and recovered: nothing is
    left to recover, and a recovery after the end waited for reports that never came, again
    and again, with the job never ending. Its exit ends the job as usual."""
    orch, _ = _running(tmp_path)
    notes: list[str] = []
    orch.listeners.append(lambda kind, data: notes.append(data.get("message", "")) if kind == "note" else None)
    for w in ("w0", "w1"):
        report(orch, w, {"type": "finished", "pos": [11, 0]})
    orch.handle(m.Tick(now=time.time() + 3600))
    assert orch.op is None and orch.exit_code is None
    assert sum("finished training and has not been heard from" in n for n in notes) == 2, notes
    for w in ("w0", "w1"):
        orch.handle(m.WorkerExited(worker_id=w, returncode=0))
    assert orch.exit_code == 0


def test_a_planned_move_aims_at_the_next_boundary_of_ranks_held_at_one(tmp_path):
    """The target is extrapolated from each rank's last report at its step rate, but a rank
    that had been at its step for many periods when it said so stands at a boundary (an
    evaluation, a checkpoint): the move aims at the boundary after it, not tens of steps on,
    where a short job may have ended before the move could start. So does one that said, the
    moment it entered it, that it is outside its steps, however young its step is."""
    orch, _ = _running(tmp_path)
    for w in ("w0", "w1"):
        report(orch, w, {"type": "heartbeat", "step": 40, "step_period": 0.025, "step_age": 5.0})
    orch.ranks[0].step_at = orch.ranks[1].step_at = time.time() - 0.5  # the last beat, half a second ago
    orch.handle(m.MigrateRequest(rank=1))
    _joiners_ready(orch)
    assert orch.op.target_step == 41
    (tmp_path / "stepping").mkdir()
    orch, _ = _running(tmp_path / "stepping")
    for w in ("w0", "w1"):  # stepping: 0.5 s at 25 ms a step since the beat, and 10 ms into step 40 then
        report(orch, w, {"type": "heartbeat", "step": 40, "step_period": 0.025, "step_age": 0.01})
    orch.ranks[0].step_at = orch.ranks[1].step_at = time.time() - 0.5
    orch.handle(m.MigrateRequest(rank=1))
    _joiners_ready(orch)
    assert 40 + 20 <= orch.op.target_step <= 40 + 25
    (tmp_path / "just-held").mkdir()
    orch, _ = _running(tmp_path / "just-held")
    for w in ("w0", "w1"):  # entered its evaluation 10 ms after reaching step 40, and said so at once
        report(orch, w, {"type": "heartbeat", "step": 40, "step_period": 0.025, "step_age": 0.01,
                         "outside_steps": True})
    orch.ranks[0].step_at = orch.ranks[1].step_at = time.time() - 0.5
    assert all(r["outside_steps"] for r in orch.status()["jobs"][0]["ranks"])
    orch.handle(m.MigrateRequest(rank=1))
    _joiners_ready(orch)
    assert orch.op.target_step == 41
