"""`baton serve`: the control plane as a long-lived service for several jobs.

Each attached job gets its own orchestrator, state store, agent link and token; its API
is the embedded one, under `/v1/jobs/<id>/`. Everything a job's orchestrator decides is
in the store (SQLite files in a directory, or etcd), so a server killed with -9 and
started again (or a standby taking over) reloads every job and goes on: workers and
agents retry meanwhile (`baton.control.reach`). Only the leader acts: with SQLite, the one
holding the directory's lock; with etcd, the one holding the leader key's lease. A
standby answers 503, which clients take as "try again, or the next URL".
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from baton.control import messages as m
from baton.control.agent_link import AgentLink
from baton.control.api import bearer_ok, create_app, json_errors
from baton.control.errors import RequestError
from baton.control.lending import Party, SpareBroker
from baton.control.orchestrator import TICK_S, Config, Orchestrator
from baton.control.state import RankState, WorkerRole
from baton.store.etcd import EtcdClient, EtcdError, EtcdLeader, EtcdStore
from baton.store.sqlite import SqliteStore

log = logging.getLogger("baton.serve")


# ------------------------------------------------------------------ where state lives
class Leader(Protocol):
    on_lost: Callable[[str], None]

    def try_acquire(self) -> bool: ...

    def holder(self) -> str | None: ...

    def release(self) -> None: ...


class _DirLock:
    """SQLite's leader election: an exclusive lock on a file in the state directory. The
    kernel drops it when its holder dies, however it dies."""

    def __init__(self, path: Path, ident: str):
        self.path, self.ident = path, ident
        self.on_lost: Callable[[str], None] = lambda why: None
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, self.ident.encode())
        self._fd = fd
        return True

    def holder(self) -> str | None:
        try:
            return self.path.read_text() or None
        except OSError:
            return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Backend:
    """The server's store: `sqlite:DIR` (a file per job, default) or `etcd://HOST:PORT`."""

    def __init__(self, spec: str):
        self.spec = spec
        self.etcd: EtcdClient | None = None
        if spec.startswith("etcd://"):
            self.etcd = EtcdClient("http://" + spec[len("etcd://"):])
        else:
            self.dir = Path(spec[len("sqlite:"):] if spec.startswith("sqlite:") else spec)
            try:
                self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                (self.dir / "jobs").mkdir(exist_ok=True, mode=0o700)
            except OSError as exc:
                raise SystemExit(f"baton serve: cannot use {self.dir} for state: {exc}") from None

    def registry(self) -> SqliteStore | EtcdStore:
        """The jobs this server hosts (their specs and tokens)."""
        if self.etcd is not None:
            return EtcdStore(self.etcd, "baton/server/")
        return SqliteStore(self.dir / "server.db")

    def job_store(self, job_id: str) -> SqliteStore | EtcdStore:
        if self.etcd is not None:
            return EtcdStore(self.etcd, f"baton/jobs/{job_id}/")
        return SqliteStore(self.dir / "jobs" / f"{job_id}.db")

    def leader(self, ident: str) -> Leader:
        if self.etcd is not None:
            return EtcdLeader(self.etcd, "baton/leader", ident)
        return _DirLock(self.dir / "leader.lock", ident)


# ------------------------------------------------------------------ the jobs
@dataclass
class HostedJob:
    spec: m.AttachJob
    token: str
    orch: Orchestrator
    link: AgentLink
    app: Any
    end_sent: bool = field(default=False)

    def summary(self) -> dict[str, Any]:
        o = self.orch
        with o._lock:
            spares = [w for w in o.workers.values() if w.role == WorkerRole.SPARE]
            return {"job_id": self.spec.job_id, "priority": self.spec.priority,
                    "state": "ended" if o.exit_code is not None else
                    ("moving" if o.op is not None else "running"),
                    "exit_code": o.exit_code, "world_size": o.config.world_size, "generation": o.generation,
                    "step": min((i.step for i in o.ranks.values()), default=0),
                    "ranks_running": sum(i.state == RankState.RUNNING for i in o.ranks.values()),
                    "spares_ready": len(spares), "events": len(o.events), "lives": o.lives,
                    "slots_lent": {s.name: s.lent_to for s in o.slots.values() if s.lent_to},
                    "borrowed": {n.name: n.lender for n in o.nodes.values() if n.lender and n.state == "healthy"},
                    "agent_seen_s_ago": round(time.time() - self.link.last_seen, 1)}


def _config(spec: m.AttachJob) -> Config:
    return Config(world_size=spec.world_size, spares=spec.spares, job_id=spec.job_id,
                  op_timeout_s=spec.op_timeout_s, heartbeat_timeout_s=spec.heartbeat_timeout_s,
                  formation_timeout_s=spec.formation_timeout_s, spare_wait_s=spec.spare_wait_s,
                  verify_every=spec.verify_every, redundancy=spec.redundancy,
                  ranks_per_node=spec.ranks_per_node,
                  return_home=spec.return_home, pre_copy=spec.pre_copy, hot_spares=spec.hot_spares,
                  straggler_factor=spec.straggler_factor,
                  straggler_steps=spec.straggler_steps,
                  # a local job borrows idle spares of lower-priority jobs on its host (lending.py)
                  borrow_spares=spec.borrow_spares or "nodes" not in spec.features,
                  control_grace_s=spec.control_grace_s, mode=spec.mode, data_paths=tuple(spec.data_paths),
                  path_hold_down_s=spec.path_hold_down_s, path_grace_s=spec.path_grace_s)


def _printer(job_id: str) -> Callable[[str, dict[str, Any]], None]:
    def emit(kind: str, data: dict[str, Any]) -> None:
        if kind not in ("spare", "ledger"):
            print(f"[baton serve] job {job_id}: {kind} " + " ".join(f"{k}={v}" for k, v in data.items()),
                  file=sys.stderr, flush=True)
    return emit


_STANDBY = 503


class ControlServer:
    def __init__(self, backend: Backend, admin_token: str, host: str = "127.0.0.1", port: int = 0):
        self.backend = backend
        self.admin = f"bearer {admin_token}".encode()
        self.jobs: dict[str, HostedJob] = {}
        self._jobs_lock = threading.Lock()
        self.leading = threading.Event()
        self.stopping = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"baton serve: cannot listen on {host}:{port}: {exc}") from None
        self.host, self.port = self.sock.getsockname()[:2]
        self.leader = backend.leader(self.url)
        self.leader.on_lost = self._lost_leadership
        self.registry: SqliteStore | EtcdStore | None = None
        self.broker = SpareBroker(self._parties)
        self.admin_app = self._admin_app()
        config = uvicorn.Config(self, log_level="warning", access_log=False, http="httptools",
                                timeout_keep_alive=75, timeout_graceful_shutdown=2, lifespan="off")
        self.server = uvicorn.Server(config)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -------------------------------------------------------------- HTTP
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if not self.leading.is_set():
            holder = self.leader.holder()
            await JSONResponse({"error": "standby: this baton serve does not hold the leader lease"
                                         + (f" ({holder} does)" if holder else "")},
                               status_code=_STANDBY)(scope, receive, send)
            return
        parts = scope["path"].split("/", 4)  # "", "v1", "jobs", id, rest
        if len(parts) == 5 and parts[1] == "v1" and parts[2] == "jobs":
            job = self.jobs.get(parts[3])
            if job is None:
                await JSONResponse({"error": f"unknown job {parts[3][:64]!r}"}, status_code=404)(scope, receive, send)
                return
            prefix = "/".join(parts[:4])
            # The job's own app checks the job's own token: another job's (or the admin's) is refused.
            await job.app({**scope, "path": "/" + parts[4], "root_path": scope.get("root_path", "") + prefix},
                          receive, send)
            return
        if not bearer_ok(scope, self.admin):
            await JSONResponse({"error": "missing or wrong token (the server's admin token: send "
                                         "'Authorization: Bearer <token>')"}, status_code=401)(scope, receive, send)
            return
        await self.admin_app(scope, receive, send)

    def _admin_app(self) -> FastAPI:
        app = FastAPI(title="baton serve", version="1", docs_url=None, redoc_url=None)
        json_errors(app)

        @app.get("/v1/jobs")
        def jobs() -> dict[str, Any]:
            return {"jobs": [j.summary() for j in sorted(self.jobs.values(),
                                                          key=lambda j: (-j.spec.priority, j.spec.job_id))],
                    "leader": self.url, "store": self.backend.spec}

        @app.post("/v1/jobs", status_code=201)
        def attach(spec: m.AttachJob) -> dict[str, Any]:
            return self.attach(spec)

        return app

    # -------------------------------------------------------------- jobs
    def _host(self, spec: m.AttachJob, token: str, restoring: bool) -> HostedJob:
        store = self.backend.job_store(spec.job_id)
        orch = Orchestrator(_config(spec), store)  # type: ignore[arg-type]
        store.on_error = lambda text: orch.handle(m.StoreFailed(message=text))
        link = AgentLink(spec.slots, spec.features, spec.job_id, self.broker)
        orch.scheduler = link
        orch.listeners.append(_printer(spec.job_id))
        if restoring:
            orch.restore()
        app = create_app(orch, token, beat_addr=None, link=link)
        return HostedJob(spec, token, orch, link, app)

    def attach(self, spec: m.AttachJob) -> dict[str, Any]:
        assert self.registry is not None
        with self._jobs_lock:
            if spec.job_id in self.jobs:
                raise RequestError(f"a job named {spec.job_id!r} is attached already (ended or not): "
                                   "give this one another --job-id", 409)
            if len(spec.slots) < spec.world_size + spec.spares:
                raise RequestError(f"{spec.world_size + spec.spares} slots needed (ranks + spares), "
                                   f"the agent offers {len(spec.slots)}", 422)
            token = secrets.token_urlsafe(32)
            job = self._host(spec, token, restoring=False)
            self.registry.put("job", spec.job_id, {"spec": spec.model_dump(mode="json"), "token": token})
            self.jobs[spec.job_id] = job
        job.orch.start()
        return {"job_id": spec.job_id, "token": token, "path": f"/v1/jobs/{spec.job_id}"}

    def _load(self) -> None:
        """Now leading: every job in the store is hosted again, from its last state."""
        self.registry = self.backend.registry()
        for job_id, row in sorted(self.registry.all("job").items()):
            spec = m.AttachJob.model_validate(row["spec"])
            try:
                self.jobs[job_id] = self._host(spec, row["token"], restoring=True)
            except (OSError, EtcdError, ValueError, KeyError) as exc:
                log.error("job %s: cannot reload its state (%s): not hosted", job_id, exc)
        if self.jobs:
            print(f"[baton serve] reloaded {len(self.jobs)} job(s) from {self.backend.spec}: "
                  + ", ".join(self.jobs), file=sys.stderr, flush=True)

    def _lost_leadership(self, why: str) -> None:
        # Fail-stop: a standby may be acting already; two deciding orchestrators would be worse
        # than a restart. Workers and agents retry until one leads again.
        print(f"[baton serve] {why}: stopping (a standby takes over)", file=sys.stderr, flush=True)
        os._exit(4)

    # -------------------------------------------------------------- run
    def serve_forever(self, ready: Callable[[], None] | None = None) -> None:
        import asyncio

        api = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                               name="baton-serve-api", daemon=True)
        api.start()
        while not self.server.started:
            time.sleep(0.01)
        print(f"[baton serve] listening on {self.url}, state in {self.backend.spec}", file=sys.stderr, flush=True)
        waited = False
        while not self.stopping.is_set():
            try:
                if self.leader.try_acquire():
                    break
            except EtcdError as exc:
                log.warning("leader election: %s", exc)
            if not waited:
                print(f"[baton serve] standby: {self.leader.holder() or 'another server'} leads",
                      file=sys.stderr, flush=True)
                waited = True
            self.stopping.wait(1.0)
        if self.stopping.is_set():
            return
        self._load()
        self.broker.reconcile()
        self.leading.set()
        print("[baton serve] leading", file=sys.stderr, flush=True)
        if ready is not None:
            ready()
        while not self.stopping.wait(TICK_S):
            now = time.time()
            for job in list(self.jobs.values()):
                orch = job.orch
                if orch.exit_code is None:
                    orch.handle(m.Tick(now=now))
                elif not job.end_sent:
                    job.link.end(orch.exit_code, orch.failure)
                    job.end_sent = True
            try:
                self.broker.step()
            except Exception:  # noqa: BLE001 - lending is a bonus; the jobs' ticks must go on
                log.exception("spare broker")

    def _parties(self) -> dict[str, Party]:
        return {j.spec.job_id: Party(j.spec.job_id, j.spec.priority, j.spec.host, "nodes" not in j.spec.features,
                                     j.orch) for j in list(self.jobs.values())}

    def stop(self) -> None:
        self.stopping.set()
        for job in self.jobs.values():
            job.orch.mail.close()
            job.link.mail.close()
        self.server.should_exit = True
        self.leader.release()
