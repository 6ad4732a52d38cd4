"""The run directory (`./.baton/` or $BATON_RUN_DIR): how CLI commands find a running job.

It holds `endpoint` (the API URL), `token` (mode 0600), `state.db` (SQLite) and
`events.jsonl`. `baton status` and friends read the first two; `--url`/`--token`
override them. A running job holds `lock`, so a second job cannot share the directory;
a new job moves the previous one's ledger to `history/<time>/`, never deleting it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


class RunDirError(RuntimeError):
    """The run directory cannot be used (in use by another job, not writable, not a directory)."""


def default_dir() -> Path:
    return Path(os.environ.get("BATON_RUN_DIR", ".baton"))


@dataclass
class RunDir:
    path: Path
    _lock: IO[str] | None = field(default=None, repr=False, compare=False)

    @property
    def token_file(self) -> Path:
        return self.path / "token"

    @property
    def endpoint_file(self) -> Path:
        return self.path / "endpoint"

    @property
    def db(self) -> Path:
        return self.path / "state.db"

    @property
    def history(self) -> Path:
        return self.path / "history"

    def create(self) -> str:
        """Lock the directory for this job, keep the previous job's ledger under history/,
        and write a new job token (returned)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._take_lock()
            self._archive_previous()
            self.endpoint_file.unlink(missing_ok=True)
        except OSError as exc:
            raise RunDirError(f"run directory {self.path} is unusable: {exc.strerror or exc}") from None
        token = secrets.token_urlsafe(32)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.chmod(self.token_file, 0o600)
        return token

    def _take_lock(self) -> None:
        f = open(self.path / "lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RunDirError(f"run directory {self.path} is in use by a running job (pid {holder}); "
                              "stop that job or pass another --run-dir") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock = f  # held (open) for as long as this process runs the job

    def _archive_previous(self) -> None:
        old = [p for p in (self.db, Path(str(self.db) + "-wal"), Path(str(self.db) + "-shm"),
                           self.path / "events.jsonl") if p.exists()]
        if not old:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.db.stat().st_mtime if self.db.exists()
                                                                else time.time()))
        dest = self.history / stamp
        n = 1
        while dest.exists():
            dest = self.history / f"{stamp}-{n}"
            n += 1
        dest.mkdir(parents=True)
        for p in old:
            shutil.move(str(p), dest / p.name)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def write_endpoint(self, url: str) -> None:
        """Atomically: a reader (`baton status`, a test) never sees it half written, empty."""
        tmp = self.endpoint_file.with_name(f".{self.endpoint_file.name}.tmp")
        tmp.write_text(url)
        os.replace(tmp, self.endpoint_file)

    def read(self) -> tuple[str, str]:
        if not self.endpoint_file.exists() or not self.token_file.exists():
            raise FileNotFoundError(
                f"no running job found in {self.path}/ (start one with `baton run`, "
                "or pass --url and --token, or set BATON_RUN_DIR)")
        return self.endpoint_file.read_text().strip(), self.token_file.read_text().strip()
