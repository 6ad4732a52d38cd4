"""The worker's line to the orchestrator, kept off the training hot path.

Two background threads: one long-polls commands, one sends heartbeats (UDP datagrams,
see baton.control.beats; HTTP where the launcher gave no datagram address) and queued
reports. The main thread only ever looks at local fields under an
uncontended lock at a step boundary; the one decision that must be atomic with
the step loop (can this rank still stop before step T?) is taken under that
same lock by the poller when a pause request arrives.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable
from urllib.parse import urlparse

import httpx
from pydantic import BaseModel, ValidationError

from baton import selfcost
from baton.control import messages as m
from baton.control.beats import BeatSender
from baton.control.reach import OrchestratorGone, Reach

__all__ = ["ControlChannel", "OrchestratorGone"]

log = logging.getLogger("baton.worker")

# Heartbeats per heartbeat timeout: a rank must miss several before it is declared hung; an
# idle spare only has to look fresh when a move picks one (within two timeouts).
RANK_BEATS_PER_TIMEOUT = 4
SPARE_BEATS_PER_TIMEOUT = 2


def cpu_report() -> m.CpuReport:
    use = selfcost.snapshot()
    return m.CpuReport(process_s=use.process_s, baton_s=use.baton_s)


class ControlChannel:
    def __init__(self, url: str, token: str, worker_id: str):
        self.worker_id = worker_id
        self._token = token
        self._beats: BeatSender | None = None  # UDP heartbeats, once register() said where
        # Until register() says the orchestrator's control_grace_s: what the launcher set.
        self.reach = Reach(url, token, grace_s=float(os.environ.get("BATON_CONTROL_GRACE", "10")))
        self._http = self.reach.client(timeout=30.0)
        self._poll_http = self.reach.client(timeout=70.0)
        self.commands: queue.Queue[BaseModel] = queue.Queue()
        # (report, queued at); None only wakes the report loop for a beat (outside_steps)
        self._outbox: queue.Queue[tuple[dict[str, Any], float] | None] = queue.Queue()
        self._seq = 0
        self._stopped = threading.Event()
        # Step-loop state shared with the main thread (guarded by `lock`).
        self.lock = threading.Lock()
        self.started = -1  # index of the last step this rank began
        self.pause_at: int | None = None
        self.pause_op: int | None = None
        self.pause_leave = False  # this rank leaves at the pause (Pause.leave)
        self.abort_generation: int | None = None
        self.pre_copy_op: int | None = None  # a planned move asked this rank to feed its joiner
        self.newest_abort = -1  # the newest generation any Abort named (never cleared)
        self.attention = False  # hot-path flag: the boundary must look closer
        self.hot_feed_op: int | None = None  # HotFeed: start feeding the hot spares (-1: stop)
        self.hot_base_drop: int | None = None  # HotFeed(drop_base): that feed's base copy is no longer needed
        # What the heartbeat carries: latest boundary, step time, metrics.
        self.heartbeat: dict[str, Any] = {}
        self.step_reached: float | None = None  # time.monotonic() when heartbeat["step"] was reached
        self._beat_now = threading.Event()  # send the next heartbeat without waiting for its period
        self.heartbeat_timeout_s = 3.0  # the orchestrator's, from register()
        self.beat_every = self.heartbeat_timeout_s / RANK_BEATS_PER_TIMEOUT
        self.on_abort: Callable[[], None] | None = None
        self._on_form: Callable[[m.Form], None] | None = None
        self.first_form_at: float | None = None  # perf_counter() when the first Form arrived (a joiner's pause)
        self._links: Any = None  # baton.net.links.LinkWatcher of the node's data paths, when the job has some
        self._responder: Any = None  # baton.net.probe.Responder: answers peers' probes on each path
        self.path_peers: list[dict[str, Any]] = []  # where the generation's other members answer probes
        self._reprobing: dict[str, Any] = {}  # path -> its Reprober, while it is silent
        self.receive_pool: Any = None  # baton.transfer.pool.ReceivePool: a spare's receive memory, mapped ahead

    # ------------------------------------------------------------------ requests
    def _post(self, path: str, body: dict[str, Any], client: httpx.Client | None = None) -> dict[str, Any]:
        resp = self.reach.request(client or self._http, "POST", path, json=body)
        if resp.status_code >= 400:
            try:
                message = resp.json().get("error", resp.text)
            except ValueError:
                message = resp.text
            if resp.status_code == 410:
                raise OrchestratorGone(message)
            raise RuntimeError(f"orchestrator refused {path}: {message}")
        return resp.json()

    def register(self, pid: int, transfer_addr: tuple[str, int]) -> m.Registered:
        body = m.Register(pid=pid, transfer_addr=tuple(transfer_addr)).model_dump(mode="json")
        reg = m.Registered.model_validate(self._post(f"/v1/workers/{self.worker_id}/register", body))
        self.heartbeat_timeout_s = reg.heartbeat_timeout_s
        self.reach.grace_s = reg.control_grace_s
        per = RANK_BEATS_PER_TIMEOUT if reg.role == "rank" else SPARE_BEATS_PER_TIMEOUT
        self.beat_every = reg.heartbeat_timeout_s / per
        if reg.heartbeat_addr is not None:
            try:
                self._beats = BeatSender(self._token, self.worker_id, reg.heartbeat_addr)
            except OSError as exc:
                log.warning("heartbeats go over HTTP: cannot reach %s over UDP (%s)", reg.heartbeat_addr, exc)
        if reg.data_paths and self._links is None:
            self._watch_links(reg.data_paths)
        if reg.receive_mb:
            self._prepare_receive(reg.receive_mb)
        if reg.discover_paths:
            from baton.net.discover import discover

            found = discover(urlparse(self.reach.url).hostname or "127.0.0.1")
            self.report(m.PathsFound(interfaces=found.names, detail=found.detail[:2000]))
        return reg

    def _prepare_receive(self, receive_mb: float) -> None:
        """Map receive memory for the state this spare may take over (a larger size: again)."""
        from baton.transfer.pool import ReceivePool

        nbytes = int(receive_mb * 2**20)
        if self.receive_pool is None or (not self.receive_pool.used and self.receive_pool.nbytes < nbytes):
            if self.receive_pool is not None:
                self.receive_pool.close()
            self.receive_pool = ReceivePool(nbytes)

    def _watch_links(self, names: list[str]) -> None:
        """Report each change of the node's data links as it is seen (a link already down
        at the start too): the orchestrator routes the job's groups around it."""
        from baton.net.links import LinkWatcher

        def changed(name: str, up: bool, _at: float) -> None:
            down = [n for n, ok in self._links.state.items() if not ok] if self._links is not None else []
            self.report(m.PathChanged(interface=name, up=up, down_now=down))

        self._links = LinkWatcher(names, changed).start()
        for name, up in self._links.state.items():
            if not up:
                changed(name, False, time.time())
        if len(names) > 1:  # a path silent with its link up is told from the others by probes
            from baton.net.probe import Responder

            self._responder = Responder(names)
            self.report(m.PathsReady(addrs=self._responder.addrs))

    def probe_paths(self, in_use: tuple[str, ...]) -> None:
        """After a failed collective: report each path in use that is silent towards a peer
        another path reached (then re-probed until it answers, and reported up)."""
        if len(in_use) < 2 or not self.path_peers:
            return
        from baton.net.probe import Reprober, silent_paths

        peers = [{n: tuple(a) for n, a in p.items() if n in in_use} for p in self.path_peers]
        for name, towards in silent_paths(peers).items():  # type: ignore[arg-type]
            if name in self._reprobing:
                continue
            detail = f"silent towards {', '.join(towards)} while another path answered"
            log.warning("data path %s: %s", name, detail)
            self.report(m.PathChanged(interface=name, up=False, detail=detail))

            def back(n: str) -> None:
                self._reprobing.pop(n, None)
                self.report(m.PathChanged(interface=n, up=True, detail="answers probes again"))
            self._reprobing[name] = Reprober(name, [tuple(p[name]) for p in peers if name in p], back)

    def report(self, msg: BaseModel) -> None:
        """Queue a report; the reporter thread sends it (never blocks the caller)."""
        self._outbox.put((msg.model_dump(mode="json"), time.monotonic()))

    def report_now(self, msg: BaseModel) -> dict[str, Any]:
        """Send a report and wait for the orchestrator to have it (what must be durable)."""
        return self._post(f"/v1/workers/{self.worker_id}/reports", msg.model_dump(mode="json"))

    # ------------------------------------------------------------------ threads
    def start(self) -> None:
        selfcost.spawn(self._poll_loop, "baton-poll")
        selfcost.spawn(self._report_loop, "baton-report")

    def stop(self) -> None:
        self._stopped.set()
        self.reach.stopped = True
        if self._links is not None:
            self._links.stop()
        if self._responder is not None:
            self._responder.close()
        for r in self._reprobing.values():
            r.stop()

    def outside_steps(self, outside: bool) -> None:
        """The rank enters (True) or leaves (False) a part of the script outside its steps (a
        boundary function, the region after a step loop): said at once, not with the next
        beat, so that a planned move's target is not extrapolated at the step rate past a
        rank that stopped stepping just after its last beat."""
        if self.heartbeat.get("outside_steps", False) == outside:
            return
        self.heartbeat["outside_steps"] = outside
        self._beat_now.set()
        self._outbox.put(None)  # wakes the report loop

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.time() + timeout
        while not self._outbox.empty() and time.time() < deadline:
            time.sleep(0.01)

    def _poll_loop(self) -> None:
        refused = 0
        while not self._stopped.is_set():
            try:
                resp = self.reach.request(self._poll_http, "GET", f"/v1/workers/{self.worker_id}/commands",
                                     params={"after": self._seq, "timeout": 10})
                if resp.status_code >= 400:
                    raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                refused = 0
                for raw in resp.json()["commands"]:
                    self._seq = max(self._seq, int(raw.pop("seq")))
                    try:
                        cmd = m.COMMAND.validate_python(raw)
                    except ValidationError as exc:
                        log.error("ignored a malformed command %s: %s", raw.get("type"), exc)
                        continue
                    self._handle(cmd)
            except OrchestratorGone as exc:
                if not self._stopped.is_set():
                    log.error("%s: exiting", exc)
                    os._exit(3)
                return
            except ValueError as exc:  # refused, or a garbled answer: the server is up but says no
                refused += 1
                if refused > 40:
                    log.error("command polls keep failing (%s): exiting", exc)
                    os._exit(3)
                time.sleep(0.25)

    def _handle(self, cmd: BaseModel) -> None:
        if isinstance(cmd, m.WatchPaths):
            if self._links is None:
                self._watch_links(cmd.names)
            return
        if isinstance(cmd, m.PrepareReceive):
            self._prepare_receive(cmd.receive_mb)
            return
        if isinstance(cmd, m.PreCopy):  # taken at the next boundary (Runtime._boundary)
            with self.lock:
                self.pre_copy_op = -1 if cmd.stop else cmd.op
                self.attention = True
            return
        if isinstance(cmd, m.HotFeed):  # taken at the next boundary (Runtime._attend)
            with self.lock:
                if cmd.drop_base:
                    self.hot_base_drop = cmd.op
                else:
                    self.hot_feed_op = -1 if cmd.stop else cmd.op
                self.attention = True
            return
        if isinstance(cmd, m.Pause):
            target = cmd.at_step
            with self.lock:
                ok = self.started < target
                if ok:
                    self.pause_at, self.pause_op, self.pause_leave = target, cmd.op, cmd.leave
                    self.attention = True
                next_step = self.started + 1
            self.report(m.PauseAck(op=cmd.op, ok=ok, next_step=max(0, next_step)))
            return
        if isinstance(cmd, m.Assign):  # a spare becomes a rank: the tight hang timeout applies
            self.beat_every = self.heartbeat_timeout_s / RANK_BEATS_PER_TIMEOUT
        if isinstance(cmd, m.Abort):
            with self.lock:
                self.abort_generation = cmd.generation
                self.newest_abort = max(self.newest_abort, cmd.generation)
                self.attention = True
            if self.on_abort is not None:
                self.on_abort()
        on_form = self._on_form
        if isinstance(cmd, m.Form) and self.first_form_at is None:
            self.first_form_at = time.perf_counter()
        if isinstance(cmd, m.Form) and on_form is not None:
            on_form(cmd)
        self.commands.put(cmd)

    def _report_loop(self) -> None:
        from baton.health.gpu import GpuReader

        gpu = GpuReader()  # NVML for this slot's GPU, read here, off the training thread
        last_beat = 0.0
        while not self._stopped.is_set():
            try:
                item = self._outbox.get(timeout=max(0.0, last_beat + self.beat_every - time.time()))
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    body, queued_at = item
                    if "queued_s" in body:  # it dates a move's start or end (messages._Dated)
                        body["queued_s"] = round(time.monotonic() - queued_at, 4)
                    self._post(f"/v1/workers/{self.worker_id}/reports", body)
                if self._beat_now.is_set() or time.time() - last_beat >= self.beat_every:
                    self._beat_now.clear()
                    reached = self.step_reached
                    age = {} if reached is None else {"step_age": round(max(0.0, time.monotonic() - reached), 4)}
                    self._beat(m.Heartbeat(**self.heartbeat, **age, cpu=cpu_report(), gpu=gpu.read()))
                    last_beat = time.time()
            except OrchestratorGone:
                if not self._stopped.is_set():
                    log.error("orchestrator gone: exiting")
                    os._exit(3)
                return
            except RuntimeError as exc:
                log.warning("report refused: %s", exc)

    def _beat(self, beat: m.Heartbeat) -> None:
        if self._beats is not None:
            try:
                self._beats.send(beat)
                return
            except OSError as exc:  # e.g. ECONNREFUSED from an earlier datagram: say it over HTTP
                log.debug("heartbeat datagram not sent (%s): posting it", exc)
        self._post(f"/v1/workers/{self.worker_id}/reports", beat.model_dump(mode="json"))

    # ------------------------------------------------------------------ main-thread helpers
    def watch_forms(self, fn: Callable[[m.Form], None] | None) -> None:
        """Show each Form to `fn` as it arrives (on the poll thread), and now those already
        queued; they stay queued for the step loop. None stops it."""
        self._on_form = fn
        if fn is None:
            return
        with self.commands.mutex:
            queued = [c for c in self.commands.queue if isinstance(c, m.Form)]
        for form in queued:
            fn(form)

    def wait_command(self, timeout: float | None = None) -> BaseModel | None:
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None
