"""HTTP API over the orchestrator (FastAPI). Every route needs the job's bearer token,
`/metrics` (Prometheus) included.

Errors are always JSON `{"error": "..."}` with a 4xx status; a refused request
changes nothing.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from typing import Any

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from pydantic import ValidationError

from baton.control import messages as m
from baton.control.agent_link import AgentLink
from baton.control.beats import BeatReceiver
from baton.control.metrics import JobMetrics
from baton.control.orchestrator import Orchestrator, RequestError
from baton.health.alerts import AlertBatch


_REPORT_TYPES = {"heartbeat", "ready", "unit_done", "pause_ack", "paused", "recover", "formed", "verified",
                 "finished", "user_error", "left"}


def bearer_ok(scope: Scope, expected: bytes) -> bool:
    """Whether the request carries `Authorization: Bearer <token>` for `expected` (b"bearer <token>")."""
    given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    return given[:7].lower() == b"bearer " and hmac.compare_digest(b"bearer " + given[7:], expected)


class _BearerAuth:
    """Pure ASGI: the token is checked before routing or reading any body (a refused request
    costs the server nothing but this comparison)."""

    _REFUSED = JSONResponse({"error": "missing or wrong token (send 'Authorization: Bearer <token>')"},
                            status_code=401)

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.expected = f"bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not bearer_ok(scope, self.expected):
            await self._REFUSED(scope, receive, send)
            return
        await self.app(scope, receive, send)


def json_errors(app: FastAPI) -> None:
    """Every refusal as `{"error": "..."}` with its 4xx status, never FastAPI's own shapes."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {err.get('msg')}")
        return JSONResponse({"error": "invalid request: " + "; ".join(parts)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, __: ClientDisconnect) -> Response:
        # A worker killed while it sent a report (a lost rank, a spare stopped at the end):
        # its loss is handled where its exit is seen, and no traceback belongs in the log.
        return Response(status_code=499)


def create_app(orch: Orchestrator, token: str, beat_addr: tuple[str, int] | None = None,
               link: AgentLink | None = None) -> FastAPI:
    app = FastAPI(title="baton", version="1", docs_url=None, redoc_url=None)

    app.add_middleware(_BearerAuth, token=token)
    json_errors(app)

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        return {**orch.status(), "heartbeat_addr": beat_addr}  # the UDP port a firewall must also open

    metrics = JobMetrics(orch)
    orch.listeners.append(metrics.on_event)

    @app.get("/metrics")
    def prometheus() -> Response:
        """Prometheus text format (scrape it with `authorization: {credentials_file: <run dir>/token}`)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/events")
    def events() -> dict[str, Any]:
        return {"events": orch.event_list(), "yoco_ratio": orch.yoco_ratio()}

    @app.post("/v1/migrate", status_code=202)
    def migrate(req: m.MigrateRequest) -> dict[str, Any]:
        return orch.handle(req)

    @app.post("/v1/taint")
    def taint(req: m.TaintRequest) -> dict[str, Any]:
        return orch.handle(req)

    @app.post("/v1/alerts")
    def alerts(req: AlertBatch) -> dict[str, Any]:
        """Alertmanager webhook receiver: an external detector's taints (health/alerts.py)."""
        return orch.handle(req)

    @app.post("/v1/untaint")
    def untaint(req: m.UntaintRequest) -> dict[str, Any]:
        return orch.handle(req)

    @app.post("/v1/workers/{worker_id}/register")
    def register(worker_id: str, req: m.Register) -> dict[str, Any]:
        return {**orch.register(worker_id, req), "heartbeat_addr": beat_addr}

    @app.get("/v1/workers/{worker_id}/commands")
    def commands(worker_id: str, after: int = 0, timeout: float = 10.0) -> dict[str, Any]:
        if after < 0 or not 0 <= timeout <= 60:
            raise RequestError("after must be >= 0 and timeout within 0..60 s")
        return {"commands": orch.commands(worker_id, after, timeout)}

    @app.post("/v1/workers/{worker_id}/reports")
    async def report(worker_id: str, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("invalid request: the body is not JSON", 422) from None
        try:
            rep = m.REPORT.validate_python(body)
        except ValidationError as exc:
            kind = body.get("type") if isinstance(body, dict) else None
            if kind is not None and kind not in _REPORT_TYPES:
                raise RequestError(f"unknown report type {kind!r}", 400) from None
            parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
            raise RequestError("invalid report: " + "; ".join(parts), 422) from None
        result = await anyio.to_thread.run_sync(orch.report, worker_id, rep)
        return JSONResponse(result)

    if link is not None:
        _agent_routes(app, orch, link)
    return app


def _agent_routes(app: FastAPI, orch: Orchestrator, link: AgentLink) -> None:
    """Under `baton serve`: the job's agent fetches scheduler commands and reports back."""

    @app.get("/v1/agent/commands")
    def agent_commands(after: int = 0, timeout: float = 10.0) -> dict[str, Any]:
        if after < 0 or not 0 <= timeout <= 60:
            raise RequestError("after must be >= 0 and timeout within 0..60 s")
        return {"commands": link.commands(after, timeout)}

    @app.post("/v1/agent/reports")
    async def agent_report(request: Request) -> JSONResponse:
        try:
            rep = m.AGENT_REPORT.validate_python(await request.json())
        except (ValueError, ValidationError) as exc:
            raise RequestError(f"invalid agent report: {str(exc)[:500]}", 422) from None
        link.last_seen = time.time()
        return JSONResponse(await anyio.to_thread.run_sync(orch.handle, rep))


class ApiServer:
    """Runs the API in a background thread on a port the OS picks (or the one given), and the
    heartbeat datagram receiver on a UDP port of the same host (told to workers at registration)."""

    def __init__(self, orch: Orchestrator, token: str, host: str = "127.0.0.1", port: int = 0):
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only when the
        # listening socket says it is TCP; without it every reply waits ~40 ms on delayed ACKs.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.orch = orch
        self.beats = BeatReceiver(orch, token, host)
        # httptools, not the pure-Python h11: a request costs the launcher ~1.1 ms of CPU instead
        # of ~1.5 ms (measured on the bench workload, 2 cores).
        config = uvicorn.Config(create_app(orch, token, self.beats.addr), log_level="warning", access_log=False, http="httptools",
                                timeout_keep_alive=75, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="baton-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        import anyio.to_thread

        async def main() -> None:
            # Long-polling workers each hold a thread; the default 40 is too few for big jobs.
            anyio.to_thread.current_default_thread_limiter().total_tokens = 512
            await self.server.serve(sockets=[self.sock])

        import asyncio

        asyncio.run(main())

    def start(self) -> None:
        self.beats.start()
        self.thread.start()
        import time

        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.orch.mail.close()  # long-polls return now instead of at their timeout
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.beats.stop()
