"""Heartbeats as signed UDP datagrams: the one message every worker sends all the time.

An HTTP heartbeat cost the launcher ~1.1 ms of CPU and the sending rank ~0.7 ms (FastAPI,
uvicorn, httpx), four times per heartbeat timeout per rank: most of baton's steady-state
cost outside the training thread. A datagram costs tens of microseconds at both ends.
Losing one is harmless (several are sent per timeout and each carries the latest values),
and everything else (reports that change state, commands) stays on HTTP.

A datagram is `MAGIC | HMAC-SHA256(token, MAGIC | body) | body`, the body a `BeatEnvelope`
as JSON. The receiver checks the MAC before parsing anything, so a datagram without the
job's token costs one hash; a replayed one is dropped by its sequence number.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from pydantic import ValidationError

from baton.control import messages as m
from baton.control.errors import RequestError

if TYPE_CHECKING:  # workers import this module for BeatSender; they never load the orchestrator
    from baton.control.orchestrator import Orchestrator

log = logging.getLogger("baton.beats")

MAGIC = b"BHB1"
_MAC_LEN = hashlib.sha256().digest_size
MAX_DATAGRAM = 16 << 10  # a heartbeat with 64 metrics is ~6 KB


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.digest(key, MAGIC + body, "sha256")


def seal(key: bytes, envelope: m.BeatEnvelope) -> bytes:
    body = envelope.model_dump_json().encode()
    return MAGIC + _mac(key, body) + body


def open_sealed(key: bytes, datagram: bytes) -> m.BeatEnvelope:
    """The envelope a datagram carries; ValueError if it is not one signed with `key`."""
    head = len(MAGIC) + _MAC_LEN
    if len(datagram) <= head or datagram[:len(MAGIC)] != MAGIC:
        raise ValueError("not a heartbeat datagram")
    body = datagram[head:]
    if not hmac.compare_digest(datagram[len(MAGIC):head], _mac(key, body)):
        raise ValueError("bad signature (wrong token?)")
    try:
        return m.BeatEnvelope.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(f"malformed heartbeat: {exc.errors()[0].get('msg')}") from None


class BeatReceiver:
    """Reads heartbeat datagrams on a UDP port beside the API and hands them to the orchestrator."""

    def __init__(self, orch: "Orchestrator", token: str, host: str = "127.0.0.1"):
        self.orch = orch
        self.key = token.encode()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.addr: tuple[str, int] = self.sock.getsockname()[:2]
        self._last_seq: dict[str, int] = {}
        self._refused = 0
        self._last_warning = 0.0
        self._stopped = False
        self.thread = threading.Thread(target=self._serve, name="baton-beats", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopped = True
        try:  # wake the blocked recvfrom
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as waker:
                waker.sendto(b"", self.addr)
        except OSError:
            pass
        self.thread.join(timeout=2)
        self.sock.close()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                datagram, sender = self.sock.recvfrom(MAX_DATAGRAM)
            except OSError:
                return
            if self._stopped:
                return
            try:
                self.handle(datagram)
            except (ValueError, RequestError) as exc:
                self._refuse(sender, exc)
            except Exception:  # noqa: BLE001 - a bug here must not silence every worker's heartbeat
                log.exception("a heartbeat from %s:%s could not be handled", *sender[:2])

    def handle(self, datagram: bytes) -> None:
        env = open_sealed(self.key, datagram)
        if env.seq <= self._last_seq.get(env.worker_id, -1):
            raise ValueError(f"stale or replayed heartbeat from {env.worker_id} (seq {env.seq})")
        self.orch.report(env.worker_id, env.beat)
        self._last_seq[env.worker_id] = env.seq

    def _refuse(self, sender: tuple[str, int], exc: Exception) -> None:
        """Dropped, and said in the log at most every 10 s (a flood must not flood the log)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("dropped a heartbeat datagram from %s:%s: %s (%d dropped so far)",
                        sender[0], sender[1], exc, self._refused)


class BeatSender:
    """A worker's end: one connected UDP socket, one datagram per beat."""

    def __init__(self, token: str, worker_id: str, addr: tuple[str, int]):
        self.key = token.encode()
        self.worker_id = worker_id
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(tuple(addr))
        # Increasing across this worker's life; the receiver drops anything not newer.
        self._seq = 0

    def send(self, beat: m.Heartbeat) -> None:
        """Raises OSError where the datagram cannot be sent (the caller falls back to HTTP)."""
        self._seq += 1
        self.sock.send(seal(self.key, m.BeatEnvelope(worker_id=self.worker_id, seq=self._seq, beat=beat)))

    def close(self) -> None:
        self.sock.close()
