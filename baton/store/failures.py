"""How a state store lives through writes that fail (disk full, a damaged file, etcd away):
memory stays the truth, the rows are kept and written with the next write that works, and
`on_error` hears of each new kind of failure once. Shared by the SQLite and etcd stores."""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("baton.store")


class WriteFailures:
    path: Any  # where the store writes, for messages
    on_error: Callable[[str], None] | None
    error: str | None  # the last write error, None once writes work again

    def _write_failed(self, text: str) -> str | None:
        """A write failed: the text when it is a new kind of failure (to report), else None."""
        if text == self.error:
            return None
        self.error = text
        log.warning("state store %s: write failed (%s); continuing from memory", self.path, text)
        return text

    def _write_worked(self) -> None:
        if self.error is not None:
            log.warning("state store %s: writes work again", self.path)
            self.error = None

    def _report(self, new_error: str | None) -> None:
        """Outside the lock: whoever hears of the error may write again at once."""
        if new_error is not None and self.on_error is not None:
            self.on_error(new_error)
