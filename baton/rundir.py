"""The run directory (`./.baton/` or $BATON_RUN_DIR): how CLI commands find a running job.

It holds `endpoint` (the API URL), `token` (mode 0600), `state.db` (SQLite) and
`events.jsonl`. `baton status` and friends read the first two; `--url`/`--token`
override them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path


def default_dir() -> Path:
    return Path(os.environ.get("BATON_RUN_DIR", ".baton"))


@dataclass
class RunDir:
    path: Path

    @property
    def token_file(self) -> Path:
        return self.path / "token"

    @property
    def endpoint_file(self) -> Path:
        return self.path / "endpoint"

    @property
    def db(self) -> Path:
        return self.path / "state.db"

    def create(self) -> str:
        """Prepare a fresh run directory; returns the new job token."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in (self.db, Path(str(self.db) + "-wal"), Path(str(self.db) + "-shm"), self.endpoint_file):
            stale.unlink(missing_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.chmod(self.token_file, 0o600)
        return token

    def write_endpoint(self, url: str) -> None:
        self.endpoint_file.write_text(url)

    def read(self) -> tuple[str, str]:
        if not self.endpoint_file.exists() or not self.token_file.exists():
            raise FileNotFoundError(
                f"no running job found in {self.path}/ (start one with `baton run`, "
                "or pass --url and --token, or set BATON_RUN_DIR)")
        return self.endpoint_file.read_text().strip(), self.token_file.read_text().strip()
