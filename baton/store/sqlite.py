"""SQLite persistence for the orchestrator: one row per entity, written on every transition.

A restarted orchestrator reads the same rows back; the ledger (events) is
append-mostly and is what `baton events` shows after the job ended.

A write that fails (disk full, a corrupted or vanished file) never takes the job down:
memory stays the truth, the failure is reported through `on_error` once per kind of
error, and the rows that did not land are written again with the next write that works.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable

from baton.store.failures import WriteFailures

log = logging.getLogger("baton.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entities (
    kind TEXT NOT NULL,
    key  TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (kind, key)
);
CREATE TABLE IF NOT EXISTS events (
    id   INTEGER PRIMARY KEY,
    body TEXT NOT NULL
);
"""


class SqliteStore(WriteFailures):
    """Thread-safe key/JSON store over one SQLite file (WAL, synchronous=NORMAL)."""

    def __init__(self, path: str | Path, on_error: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.on_error = on_error
        self.error: str | None = None  # the last write error, None once writes work again
        self._lock = threading.Lock()
        self._pending_events: dict[int, str] = {}
        self._pending_rows: dict[tuple[str, str], str] = {}
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def put(self, kind: str, key: str, body: dict[str, Any]) -> None:
        self.put_many([(kind, key, body)])

    def put_many(self, rows: list[tuple[str, str, dict[str, Any]]]) -> None:
        with self._lock:
            self._pending_rows.update({(k, key): json.dumps(b) for k, key, b in rows})
            new_error = self._flush()
        self._report(new_error)

    def _flush(self) -> str | None:
        """Write whatever has not landed yet, in one transaction; keep it on failure.
        Returns the error text when it is a new kind of failure."""
        if not self._pending_rows and not self._pending_events:
            return None
        try:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO entities(kind, key, body) VALUES (?, ?, ?)",
                                 [(k, key, b) for (k, key), b in self._pending_rows.items()])
            self._db.executemany("INSERT OR REPLACE INTO events(id, body) VALUES (?, ?)",
                                 list(self._pending_events.items()))
            self._db.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            return self._write_failed(f"{type(exc).__name__}: {exc}")
        self._pending_rows.clear()
        self._pending_events.clear()
        self._write_worked()
        return None

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._pending_rows.pop((kind, key), None)
            try:
                self._db.execute("DELETE FROM entities WHERE kind=? AND key=?", (kind, key))
            except (sqlite3.Error, OSError) as exc:
                log.warning("state store %s: delete failed (%s)", self.path, exc)

    def all(self, kind: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT key, body FROM entities WHERE kind=?", (kind,)).fetchall()
        return {k: json.loads(b) for k, b in rows}

    def put_event(self, event_id: int, body: dict[str, Any]) -> None:
        with self._lock:
            self._pending_events[event_id] = json.dumps(body)
            new_error = self._flush()
        self._report(new_error)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM events ORDER BY id").fetchall()
        return [json.loads(b) for (b,) in rows]

    def close(self) -> None:
        with self._lock:
            self._flush()  # a last try; nobody is left to tell
            self._db.close()
