"""A small client for the orchestrator API, used by the CLI and the demo."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ApiClient:
    def __init__(self, url: str, token: str, timeout: float = 10.0):
        self.url = url
        self._http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach the orchestrator at {self.url}: {exc}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = {"error": resp.text}
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, data.get("error", str(data)))
        return data

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def events(self) -> dict[str, Any]:
        return self._call("GET", "/v1/events")

    def migrate(self, rank: int, to: str | None = None, pre_copy: bool | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/migrate", {"rank": rank, **({"to": to} if to else {}),
                                                  **({"pre_copy": pre_copy} if pre_copy is not None else {})})

    def taint(self, slot: str, reason: str) -> dict[str, Any]:
        return self._call("POST", "/v1/taint", {"slot": slot, "reason": reason})

    def untaint(self, slot: str) -> dict[str, Any]:
        return self._call("POST", "/v1/untaint", {"slot": slot})
