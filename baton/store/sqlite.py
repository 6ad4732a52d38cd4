"""SQLite persistence for the orchestrator: one row per entity, written on every transition.

A restarted orchestrator reads the same rows back; the ledger (events) is
append-mostly and is what `baton events` shows after the job ended.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

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


class SqliteStore:
    """Thread-safe key/JSON store over one SQLite file (WAL, synchronous=NORMAL)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def put(self, kind: str, key: str, body: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO entities(kind, key, body) VALUES (?, ?, ?)",
                (kind, key, json.dumps(body)),
            )

    def put_many(self, rows: list[tuple[str, str, dict[str, Any]]]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO entities(kind, key, body) VALUES (?, ?, ?)",
                [(k, key, json.dumps(b)) for k, key, b in rows],
            )
            self._db.execute("COMMIT")

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM entities WHERE kind=? AND key=?", (kind, key))

    def all(self, kind: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT key, body FROM entities WHERE kind=?", (kind,)).fetchall()
        return {k: json.loads(b) for k, b in rows}

    def put_event(self, event_id: int, body: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO events(id, body) VALUES (?, ?)", (event_id, json.dumps(body))
            )

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM events ORDER BY id").fetchall()
        return [json.loads(b) for (b,) in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
