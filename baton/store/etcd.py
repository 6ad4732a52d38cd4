"""The control plane's state in etcd, through etcd's v3 JSON gateway (plain HTTP, no gRPC
stack to install), and the leader lease that lets only one `baton serve` act.

Keys live under one prefix per job: `<prefix>entities/<kind>/<key>` and
`<prefix>events/<id>`. The store keeps SqliteStore's contract: a write that fails is kept
and retried with the next one, memory stays the truth, `on_error` hears of it once.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from typing import Any, Callable

import httpx

from baton.store.failures import WriteFailures

log = logging.getLogger("baton.store")
_TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    """The range_end that selects every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class EtcdError(RuntimeError):
    pass


class EtcdClient:
    def __init__(self, endpoint: str, timeout: float = 5.0):
        self.endpoint = endpoint.rstrip("/")
        self._http = httpx.Client(base_url=self.endpoint, timeout=timeout)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._http.post(f"/v3/{path}", json=body)
        except httpx.TransportError as exc:
            raise EtcdError(f"etcd at {self.endpoint} unreachable: {exc}") from exc
        data = resp.json() if resp.content else {}
        if resp.status_code >= 400 or "error" in data:
            raise EtcdError(f"etcd {path}: {data.get('error') or data.get('message') or resp.text[:200]}")
        return data

    def range(self, prefix: str) -> list[tuple[str, str]]:
        data = self.call("kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [(_unb64(kv["key"]), _unb64(kv.get("value", ""))) for kv in data.get("kvs", [])]

    def get(self, key: str) -> str | None:
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def put_all(self, items: list[tuple[str, str]]) -> None:
        for i in range(0, len(items), _TXN_OPS):
            ops = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in items[i:i + _TXN_OPS]]
            self.call("kv/txn", {"success": ops})

    def delete(self, key: str) -> None:
        self.call("kv/deleterange", {"key": _b64(key)})

    def close(self) -> None:
        self._http.close()


class EtcdStore(WriteFailures):
    """SqliteStore's interface over etcd keys under `prefix`."""

    def __init__(self, client: EtcdClient, prefix: str, on_error: Callable[[str], None] | None = None):
        self.client = client
        self.prefix = prefix
        self.path = f"{client.endpoint}/{prefix}"  # for messages, like SqliteStore.path
        self.on_error = on_error
        self.error: str | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}
        self.client.range(prefix + "entities/")  # fail now, with etcd's reason, if it is not there

    def _key(self, kind: str, key: str) -> str:
        return f"{self.prefix}entities/{kind}/{key}"

    def put(self, kind: str, key: str, body: dict[str, Any]) -> None:
        self.put_many([(kind, key, body)])

    def put_many(self, rows: list[tuple[str, str, dict[str, Any]]]) -> None:
        with self._lock:
            self._pending.update({self._key(k, key): json.dumps(b) for k, key, b in rows})
            new_error = self._flush()
        self._report(new_error)

    def put_event(self, event_id: int, body: dict[str, Any]) -> None:
        with self._lock:
            self._pending[f"{self.prefix}events/{event_id:012d}"] = json.dumps(body)
            new_error = self._flush()
        self._report(new_error)

    def _flush(self) -> str | None:
        if not self._pending:
            return None
        try:
            self.client.put_all(list(self._pending.items()))
        except EtcdError as exc:
            return self._write_failed(str(exc))
        self._pending.clear()
        self._write_worked()
        return None

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._pending.pop(self._key(kind, key), None)
            try:
                self.client.delete(self._key(kind, key))
            except EtcdError as exc:
                log.warning("state store %s: delete failed (%s)", self.path, exc)

    def all(self, kind: str) -> dict[str, dict[str, Any]]:
        base = f"{self.prefix}entities/{kind}/"
        return {k[len(base):]: json.loads(v) for k, v in self.client.range(base)}

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(v) for _, v in self.client.range(f"{self.prefix}events/")]

    def close(self) -> None:
        with self._lock:
            try:
                self._flush()
            except Exception:  # a last try; nobody is left to tell
                pass


class EtcdLeader:
    """Leadership as an etcd key bound to a lease: whoever created the key leads while it
    keeps the lease alive. A leader that cannot renew in time calls `on_lost` (the server
    stops acting at once: it cannot prove it still leads, and a standby may already)."""

    def __init__(self, client: EtcdClient, key: str, ident: str, ttl_s: int = 5):
        self.client, self.key, self.ident, self.ttl_s = client, key, ident, ttl_s
        self.lease: int | None = None
        self.on_lost: Callable[[str], None] = lambda why: None
        self._stop = threading.Event()

    def try_acquire(self) -> bool:
        lease = int(self.client.call("lease/grant", {"TTL": self.ttl_s})["ID"])
        got = self.client.call("kv/txn", {
            "compare": [{"key": _b64(self.key), "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(self.key), "value": _b64(self.ident), "lease": str(lease)}}],
        }).get("succeeded", False)
        if not got:
            self.client.call("lease/revoke", {"ID": str(lease)})
            return False
        self.lease = lease
        threading.Thread(target=self._keep, name="baton-lease", daemon=True).start()
        return True

    def holder(self) -> str | None:
        try:
            return self.client.get(self.key)
        except EtcdError:
            return None

    def _keep(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.ttl_s / 4):
            try:
                ttl = int(self.client.call("lease/keepalive", {"ID": str(self.lease)}).get("result", {})
                          .get("TTL", 0))
                if ttl <= 0:
                    self.on_lost("the leader lease expired")
                    return
                renewed = time.monotonic()
            except EtcdError as exc:
                if time.monotonic() - renewed > self.ttl_s * 0.75:
                    self.on_lost(f"cannot renew the leader lease: {exc}")
                    return

    def release(self) -> None:
        self._stop.set()
        if self.lease is not None:
            try:
                self.client.call("lease/revoke", {"ID": str(self.lease)})
            except EtcdError:
                pass
