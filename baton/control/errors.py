"""The one error a request can get from the orchestrator (its own module so every protocol
mixin can raise it)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the orchestrator refuses; `status` is the HTTP status to answer with."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
