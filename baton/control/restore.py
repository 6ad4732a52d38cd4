"""A control plane restarted from its store picks the job up where its last life left it.

Everything the orchestrator decided is written on every transition (`job_record` plus one
row per slot, node, worker and rank; each rank's own durable state when it changes; the
event ledger). `restore` reads it back. Then what happened while nobody was deciding is
reconciled: every live worker gets a fresh heartbeat clock (its silence was ours), a move
that was in flight is taken up again as a recovery (its ranks may stand anywhere in it),
and the job's agent reports which workers are still alive (`Orchestrator._on_agent_sync`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from baton.control import messages as m
from baton.control.nodes import Node
from baton.control.operation import Move, Operation, RetryMove
from baton.control.paths import DataPaths
from baton.control.state import Event, EventKind, RankInfo, RankState, Slot, Worker, WorkerRole, to_json

if TYPE_CHECKING:
    from baton.control.orchestrator import Orchestrator
    from baton.store.sqlite import SqliteStore

# Mailbox sequence numbers of each life of the control plane start this far above the last.
SEQ_PER_LIFE = 10**9


def job_record(orch: Orchestrator) -> dict[str, Any]:
    op = orch.op
    return {
        "generation": orch.generation, "exit_code": orch.exit_code, "world_size": orch.config.world_size,
        "worker_ids": orch._worker_ids, "op_ids": orch._op_ids, "lives": orch.lives,
        "loop": orch.loop.model_dump() if orch.loop is not None else None, "training_since": orch.training_since,
        "setup_files": orch.setup_files,
        "home": {str(r): s for r, s in orch.home.items()},
        "training_done": orch._training_done, "final_code": orch._final_code, "failure": orch.failure,
        "retry_moves": [to_json(x) for x in orch._retry_moves],
        "data_paths": None if orch.discover_paths else orch.data_paths.names,  # --data-paths auto: as found
        "op": None if op is None else {
            "id": op.id, "kind": op.kind.value, "generation": op.generation, "phase": op.phase,
            "failed_at": op.failed_at, "target_step": op.target_step,
            "moves": [to_json(mv) for mv in op.moves.values()]},
    }


def restore(orch: Orchestrator, store: SqliteStore) -> bool:
    """Load the job's last persisted state into a fresh orchestrator (under its lock, before
    it serves anyone). False when the store holds nothing for this job."""
    job = store.all("job").get(orch.config.job_id)
    if job is None:
        return False
    now = time.time()
    orch.lives = int(job.get("lives", 0)) + 1
    for box in (orch.mail, getattr(orch.scheduler, "mail", None)):  # the agent's, under baton serve
        if box is not None:
            box.base = orch.lives * SEQ_PER_LIFE
    orch.generation = job["generation"]
    orch._worker_ids, orch._op_ids = job["worker_ids"], job["op_ids"]
    orch.loop = m.LoopInfo(**job["loop"]) if job.get("loop") else None
    orch.training_since = job.get("training_since")
    orch.setup_files = dict(job.get("setup_files") or {})
    orch.home = {int(r): s for r, s in job.get("home", {}).items()}
    orch._training_done, orch._final_code = job["training_done"], job["final_code"]
    orch.failure = job.get("failure")
    orch._retry_moves = [RetryMove(**x) for x in job.get("retry_moves", [])]
    if orch.discover_paths and job.get("data_paths") is not None:
        orch.discover_paths = False
        orch.data_paths = DataPaths(job["data_paths"])
        orch.generation_paths = list(job["data_paths"])
    for name, body in store.all("slot").items():
        orch.slots[name] = Slot(**body)
    for name, body in store.all("node").items():
        orch.nodes[name] = Node(**{**body, "failed_start": tuple(body["failed_start"])
                                   if body.get("failed_start") else None})
    for wid, body in store.all("worker").items():
        w = Worker(**{**body, "role": WorkerRole(body["role"]),
                      "transfer_addr": tuple(body["transfer_addr"]) if body.get("transfer_addr") else None})
        w.last_seen = now  # its silence while we were away was ours, not its
        orch.workers[wid] = w
    held = store.all("held")
    orch.setup_records = {int(r): m.BundleText(**body) for r, body in store.all("setup").items() if r.isdigit()}
    for key, body in store.all("rank").items():
        r = int(key)
        orch.ranks[r] = RankInfo(**{**body, "state": RankState(body["state"]), "held": held.get(key)})
    for body in store.events():
        orch.events.append(Event(**{**body, "kind": EventKind(body["kind"])}))
    if job.get("exit_code") is not None:
        orch.exit_code = job["exit_code"]
        orch.done.set()
        return True
    if job.get("op") is not None:
        _take_up(orch, job["op"])
    orch._emit("restored", {"life": orch.lives, "generation": orch.generation,
                            "in_flight": job["op"]["kind"] if job.get("op") else None})
    return True


def _take_up(orch: Orchestrator, rec: dict[str, Any]) -> None:
    """A move was in flight when the last life ended: its ranks may be anywhere in it, and
    commands they were sent may be lost. Start it over from what every rank reports now:
    a recovery (the same path as a failure in the middle of a move)."""
    op = Operation(id=rec["id"], kind=EventKind(rec["kind"]), generation=rec["generation"],
                   moves={mv["rank"]: Move(**mv) for mv in rec["moves"]}, phase=rec["phase"],
                   failed_at=rec.get("failed_at"), target_step=rec.get("target_step"))
    orch.op = op
    cause = f"the control plane restarted during a {op.kind.value} move"
    if op.kind == EventKind.UNPLANNED:
        orch._emit("note", {"message": cause + ": survivors report again"})
        orch._restart_collect(op)
        orch._advance_collect()
    else:
        orch._open_recovery(cause=cause)
