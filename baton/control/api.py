"""HTTP API over the orchestrator (FastAPI). Every route needs the job's bearer token.

Errors are always JSON `{"error": "..."}` with a 4xx status; a refused request
changes nothing.
"""

from __future__ import annotations

import hmac
import socket
import threading
from typing import Any

import anyio.to_thread
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pydantic import ValidationError

from baton.control import messages as m
from baton.control.orchestrator import Orchestrator, RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MigrateRequest(_Strict):
    rank: int = Field(ge=0)


class TaintRequest(_Strict):
    slot: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=200)


class UntaintRequest(_Strict):
    slot: str = Field(min_length=1, max_length=200)


_REPORT_TYPES = {"heartbeat", "ready", "unit_done", "pause_ack", "paused", "recover", "formed", "verified",
                 "finished", "user_error", "left"}


def create_app(orch: Orchestrator, token: str) -> FastAPI:
    app = FastAPI(title="baton", version="1", docs_url=None, redoc_url=None)

    def auth(request: Request) -> None:
        """Checked by the middleware below for every request, before any body is read."""

    @app.middleware("http")
    async def _authenticate_first(request: Request, call_next):  # noqa: ANN001, ANN202
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "missing or wrong token (send 'Authorization: Bearer <token>')"},
                                status_code=401)
        return await call_next(request)

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

    guard = [Depends(auth)]

    @app.get("/v1/status", dependencies=guard)
    def status() -> dict[str, Any]:
        return orch.status()

    @app.get("/v1/events", dependencies=guard)
    def events() -> dict[str, Any]:
        return {"events": orch.event_list(), "yoco_ratio": orch.yoco_ratio()}

    @app.post("/v1/migrate", dependencies=guard, status_code=202)
    def migrate(req: MigrateRequest) -> dict[str, Any]:
        return orch.request_migration(req.rank)

    @app.post("/v1/taint", dependencies=guard)
    def taint(req: TaintRequest) -> dict[str, Any]:
        return orch.taint(req.slot, req.reason)

    @app.post("/v1/untaint", dependencies=guard)
    def untaint(req: UntaintRequest) -> dict[str, Any]:
        return orch.untaint(req.slot)

    @app.post("/v1/workers/{worker_id}/register", dependencies=guard)
    def register(worker_id: str, req: m.Register) -> dict[str, Any]:
        return orch.register(worker_id, req.pid, list(req.transfer_addr))

    @app.get("/v1/workers/{worker_id}/commands", dependencies=guard)
    def commands(worker_id: str, after: int = 0, timeout: float = 10.0) -> dict[str, Any]:
        if after < 0 or not 0 <= timeout <= 60:
            raise RequestError("after must be >= 0 and timeout within 0..60 s")
        return {"commands": orch.commands(worker_id, after, timeout)}

    @app.post("/v1/workers/{worker_id}/reports", dependencies=guard)
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

    return app


class ApiServer:
    """Runs the API in a background thread on a port the OS picks (or the one given)."""

    def __init__(self, orch: Orchestrator, token: str, host: str = "127.0.0.1", port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.orch = orch
        config = uvicorn.Config(create_app(orch, token), log_level="warning", access_log=False,
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
        self.thread.start()
        import time

        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.orch.mail.close()  # long-polls return now instead of at their timeout
        self.server.should_exit = True
        self.thread.join(timeout=5)
