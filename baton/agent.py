"""`baton run --server URL`: a job attached to a `baton serve` control plane.

The job's own process (this one, in the Slurm allocation or on the machine) keeps what must
live next to the workers: the rendezvous store (a child it restarts if it dies) and the scheduler that starts and kills
them. The server decides. So the server can die and come back (or fail over to a standby)
without the job noticing more than late answers: this agent and every worker keep
retrying for `--control-grace` seconds, and when the server is back the agent tells it
which workers still run and how the others ended (`AgentSync`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from baton.control import messages as m
from baton.control.reach import OrchestratorGone, Reach
from baton.launcher import RunOptions, _placement, make_scheduler, validate, worker_env
from baton.rundir import RunDir, RunDirError
from baton.store.rendezvous_process import RendezvousProcess, StoreStartError
from baton.store.sqlite import SqliteStore

log = logging.getLogger("baton.agent")


@dataclass
class ServerOptions:
    urls: str  # one URL, or several (comma-separated) of servers sharing one store
    admin_token: str
    priority: int = 0
    grace_s: float = 600.0  # how long the job waits for an unreachable control plane


def run_attached(opts: RunOptions, server: ServerOptions) -> int:
    validate(opts)
    placement = _placement(opts)
    logging.basicConfig(level=os.environ.get("BATON_LOG", "WARNING"))
    run_dir = RunDir(opts.run_dir)
    try:
        run_dir.create()
    except RunDirError as exc:
        raise SystemExit(f"baton run: {exc}") from None
    store: RendezvousProcess | None = None
    try:
        try:
            store = RendezvousProcess(placement.advertise_addr).start()
        except StoreStartError as exc:
            raise SystemExit(f"baton run: {exc}") from None
        reach = Reach(server.urls, server.admin_token, grace_s=min(server.grace_s, 60.0))
        features = ["nodes", "borrow"] if placement.allocation is not None else []
        spec = m.AttachJob(job_id=opts.job_id, world_size=placement.world_size, spares=placement.spares,
                           slots=placement.slots, priority=server.priority, features=features,
                           host=socket.gethostname(),
                           op_timeout_s=opts.op_timeout_s, heartbeat_timeout_s=opts.heartbeat_timeout_s,
                           formation_timeout_s=opts.formation_timeout_s, spare_wait_s=opts.spare_wait_s,
                           verify_every=opts.verify_every, redundancy=opts.redundancy,
                           ranks_per_node=opts.nproc if placement.allocation is not None else 0,
                           return_home=opts.return_home, pre_copy=opts.pre_copy, hot_spares=opts.hot_spares,
                           straggler_factor=opts.straggler_factor,
                           straggler_steps=opts.straggler_steps, borrow_spares=opts.borrow_spares,
                           control_grace_s=server.grace_s, mode=opts.mode,
                           data_paths=list(opts.data_paths), path_hold_down_s=opts.path_hold_down_s,
                           path_grace_s=opts.path_grace_s)
        try:
            resp = reach.request(reach.client(30.0), "POST", "/v1/jobs", json=spec.model_dump(mode="json"))
        except OrchestratorGone as exc:
            raise SystemExit(f"baton run: no baton serve answers at {server.urls}: {exc}") from None
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code >= 400:
            raise SystemExit(f"baton run: {reach.url} refused the job ({resp.status_code}): "
                             f"{body.get('error', resp.text[:300])}")
        token, path = body["token"], body["path"]
        job_urls = ",".join(u + path for u in reach.urls)
        run_dir.token_file.write_text(token)  # `baton status` etc. act on this job with it
        run_dir.write_endpoint(reach.url + path)
        print(f"[baton] job {opts.job_id} attached to {reach.url} (priority {server.priority})",
              file=sys.stderr, flush=True)
        agent = Agent(job_urls, token, server.grace_s)
        opts.env["BATON_CONTROL_GRACE"] = str(server.grace_s)  # workers registering while it is away wait too
        agent.sched = make_scheduler(placement, opts, worker_env(opts, job_urls, token, placement.advertise_addr,
                                                                 store.port), agent.exited_now)
        code = agent.run()
        agent.keep_ledger(run_dir)
        return code
    finally:
        if store is not None:
            store.stop()
        run_dir.endpoint_file.unlink(missing_ok=True)
        run_dir.release()


class Agent:
    def __init__(self, urls: str, token: str, grace_s: float):
        self.reach = Reach(urls, token, grace_s)
        self._poll = self.reach.client(70.0)
        self._post = self.reach.client(30.0)
        self.sched: Any = None
        self.outbox: queue.Queue[BaseModel] = queue.Queue()
        self._lock = threading.Lock()
        self.started: set[str] = set()
        self.exited: dict[str, int] = {}
        self.end: m.EndJob | None = None
        self.gone: str | None = None  # why the control plane was given up on
        self._synced_outages = 0

    # -------------------------------------------------------------- scheduler -> server
    def exited_now(self, worker_id: str, code: int) -> None:
        with self._lock:
            self.exited[worker_id] = code
        self.outbox.put(m.WorkerExited(worker_id=worker_id, returncode=code))

    def _sync(self) -> m.AgentSync:
        with self._lock:
            live = [w for w in self.started if w not in self.exited]
            return m.AgentSync(live=live, exited=dict(self.exited))

    def _report_loop(self) -> None:
        while self.end is None and self.gone is None:
            try:
                item = self.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                resp = self.reach.request(self._post, "POST", "/v1/agent/reports",
                                          json=item.model_dump(mode="json"))
            except OrchestratorGone as exc:
                self.gone = str(exc)
                return
            if resp.status_code >= 400:
                log.warning("the control plane refused %s: %s", item.type, resp.text[:300])  # type: ignore[attr-defined]

    # -------------------------------------------------------------- server -> scheduler
    def _apply(self, cmd: BaseModel) -> None:
        sched = self.sched
        if isinstance(cmd, m.StartWorker):
            with self._lock:
                if cmd.worker_id in self.started:
                    return  # sent again by a restarted control plane
                self.started.add(cmd.worker_id)
            try:
                sched.start(cmd.worker_id, cmd.slot)
            except OSError as exc:
                log.error("could not start %s on %s: %s", cmd.worker_id, cmd.slot, exc)
                self.exited_now(cmd.worker_id, 127)
        elif isinstance(cmd, m.KillWorker):
            threading.Thread(target=sched.kill, args=(cmd.worker_id, cmd.dump_stacks), daemon=True).start()
        elif isinstance(cmd, m.ProbeNode):
            node = cmd.node
            sched.probe_node(node, lambda ok, detail: self.outbox.put(
                m.NodeProbed(node=node, ok=ok, detail=detail[:500])))
        elif isinstance(cmd, m.ReadLinks):
            node = cmd.node
            sched.probe_links(node, cmd.names, lambda up, detail: self.outbox.put(
                m.NodeLinks(node=node, up=up, detail=detail[:500])))
        elif isinstance(cmd, m.BorrowNode):
            sched.borrow(lambda node, text: self.outbox.put(
                m.NodeBorrowed(node=node, lender=text if node else "", detail="" if node else text[:500])))
        elif isinstance(cmd, m.ReleaseNode):
            sched.release(cmd.node)
        elif isinstance(cmd, m.DrainNode):
            sched.drain(cmd.node, cmd.reason)
        elif isinstance(cmd, m.ResumeNode):
            sched.resume(cmd.node)
        elif isinstance(cmd, m.EndJob):
            self.end = cmd

    def keep_ledger(self, run_dir: RunDir) -> None:
        """The job's ledger into the run directory, as an embedded run leaves it: `baton
        events` reads it there once the job is over."""
        if self.end is None:
            return
        try:
            events = self.reach.request(self._post, "GET", "/v1/events").json()["events"]
        except (OrchestratorGone, ValueError, KeyError) as exc:
            log.warning("could not copy the job's ledger into %s: %s", run_dir.path, exc)
            return
        db = SqliteStore(run_dir.db)
        for e in events:
            db.put_event(e["id"], e)
        db.close()

    def run(self) -> int:
        def on_signal(signum: int, _frame: Any) -> None:
            print(f"[baton] received signal {signum}: stopping the job", file=sys.stderr, flush=True)
            self.outbox.put(m.Interrupted(signum=signum))

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        reporter = threading.Thread(target=self._report_loop, name="baton-agent-report", daemon=True)
        reporter.start()
        seq = 0
        try:
            while self.end is None and self.gone is None:
                try:
                    resp = self.reach.request(self._poll, "GET", "/v1/agent/commands",
                                              params={"after": seq, "timeout": 10})
                except OrchestratorGone as exc:
                    self.gone = str(exc)
                    break
                if self.reach.outages != self._synced_outages:
                    # Back after an outage: what happened to our workers meanwhile.
                    self._synced_outages = self.reach.outages
                    self.outbox.put(self._sync())
                if resp.status_code >= 400:
                    log.warning("command poll refused (%s): %s", resp.status_code, resp.text[:300])
                    time.sleep(0.5)
                    continue
                for raw in resp.json().get("commands", []):
                    seq = max(seq, int(raw.pop("seq")))
                    try:
                        self._apply(m.AGENT_COMMAND.validate_python(raw))
                    except ValidationError as exc:
                        log.error("ignored a malformed command %s: %s", raw.get("type"), exc)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if self.end is not None:
            code = self.end.exit_code
            if self.end.failure and code != 0:
                time.sleep(0.5)  # the failing rank prints its own traceback first
                print(f"[baton] job failed (exit code {code}):\n{self.end.failure}", file=sys.stderr, flush=True)
        else:
            code = 3
            print(f"[baton] giving up on the control plane: {self.gone}; stopping the job",
                  file=sys.stderr, flush=True)
        self.sched.shutdown(grace_s=5.0 if code == 0 else 2.0)
        return code
