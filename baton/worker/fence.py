"""A successor's setup changes no file the job already wrote.

A process that takes a rank over runs the script from its first line, as its predecessor
did long ago: a setup that opens its log with mode "w", saves an initial checkpoint where
the loop saves its latest one, writes a config through a temporary file and os.replace, or
clears an output folder, would undo what the job wrote since. From its assignment until it
holds its rank's place, the script's writes to paths that training changed (modified since
the job's step loop began, by the orchestrator's clock) go nowhere:

- open(path, "w"/"a"/"wb"/"ab"/...) of such a file opens the null device instead. A handle
  still open when the fence lifts is pointed at the file then, appending: a log the setup
  opened gets the successor's lines after its predecessor's.
- torch.save to such a path, os.remove/unlink and shutil.rmtree of one, os.mkdir of an
  existing folder (so that makedirs after a skipped rmtree goes on), os.replace/rename onto
  such a path (its source, the script's temporary file, is removed instead) are skipped.

What the predecessor's setup wrote and training never touched (a pid file, a config, a
per-rank log of the setup) is written again, as torchrun's restart would; paths that do not
exist yet are written as usual. A successor's setup writes after the loop began, so each says
which files it wrote (their modification times once it holds its place), and the next
successor's fence writes those again while they are still as that setup left them: the third
process of a rank rewrites its pid file too. Without the job's start time, every existing path is kept. Only
calls made from the script's own files are fenced (a library's cache is not the job's
output), and not modes that also read ("r+", "w+"), nor os.open. A successor that re-runs
code its predecessor had run with the others (the region after the step loop, the step it
was lost after) does so past the fence, writing what its predecessor wrote.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import shutil
import sys
import weakref
from typing import Any, Callable

import torch

log = logging.getLogger("baton.worker")

_WRITES = frozenset("wa")


class Fence:
    def __init__(self, own: Callable[[str], bool], since: float | None, setup_files: dict[str, float]):
        self._own = own
        self._since = since
        self._setup_files = setup_files  # earlier successors' setups' files: {path: mtime they left}
        self.written: set[str] = set()  # what this setup wrote through (absolute paths)
        self._own_cache: dict[str, bool] = {}
        self._diverted: list[tuple[weakref.ref, str]] = []
        self.skipped: list[str] = []  # what was not done, for the log
        self._originals: dict[tuple[Any, str], Any] = {}
        self.active = True  # a name the script imported itself (`from os import replace`) outlives the patch

    # ------------------------------------------------------------------ on and off
    def install(self) -> None:
        self._patch(builtins, "open", self._open)
        self._patch(io, "open", self._open)
        self._patch(torch, "save", self._save)
        for name in ("remove", "unlink"):
            self._patch(os, name, self._remove_with(name))
        self._patch(os, "mkdir", self._mkdir)
        for name in ("replace", "rename"):
            self._patch(os, name, self._replace_with(name))
        self._patch(shutil, "rmtree", self._rmtree)

    def lift(self) -> dict[str, float]:
        """The successor holds its rank's place: writes go through again, and the handles
        the setup opened on existing files append to them from here on. The files its setup
        wrote, with their modification times now."""
        self.active = False
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        for ref, path in self._diverted:
            handle = ref()
            if handle is None or handle.closed:
                continue
            handle.flush()  # what the setup wrote before: to the null device, as its predecessor wrote it
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.dup2(fd, handle.fileno())
            finally:
                os.close(fd)
        if self.skipped:
            log.info("before taking its rank's place, the script's setup left alone what the job had written: %s",
                     "; ".join(self.skipped[:20]))
        self._diverted.clear()
        written = {}
        for path in sorted(self.written)[:256]:
            try:
                written[path] = os.stat(path).st_mtime
            except OSError:
                continue
        return written

    def _patch(self, module: Any, name: str, replacement: Any) -> None:
        self._originals[(module, name)] = getattr(module, name)
        setattr(module, name, replacement)

    def _original(self, module: Any, name: str) -> Any:
        return self._originals[(module, name)]

    # ------------------------------------------------------------------ who is asking
    def _from_script(self) -> bool:
        if not self.active:
            return False
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            own = self._own_cache.get(name)
            if own is None:
                own = self._own_cache[name] = self._own(name)
            if own:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def _kept(self, path: str) -> bool:
        """Whether `path` holds what training wrote (so the setup must leave it alone)."""
        try:
            changed = os.stat(path).st_mtime
        except OSError:
            return False
        if self._setup_files.get(os.path.abspath(path)) == changed:
            return False  # as an earlier successor's setup left it: not training's
        return self._since is None or changed > self._since

    def _wrote(self, path: str | None) -> None:
        if path is not None and self.active and self._from_script():
            self.written.add(os.path.abspath(path))

    @staticmethod
    def _path(file: Any) -> str | None:
        return os.fsdecode(os.fspath(file)) if isinstance(file, (str, bytes, os.PathLike)) else None

    # ------------------------------------------------------------------ the fenced calls
    def _open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        original = self._original(builtins, "open")
        path = self._path(file)
        if path is None or "+" in mode or not (_WRITES & set(mode)) or not os.path.isfile(path) \
                or not self._kept(path) or not self._from_script():
            if path is not None and _WRITES & set(mode):
                self._wrote(path)
            return original(file, mode, *args, **kwargs)
        handle = original(os.devnull, mode, *args, **kwargs)
        self._diverted.append((weakref.ref(handle), os.path.abspath(path)))
        self.skipped.append(f"open({path!r}, {mode!r})")
        return handle

    def _save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        path = self._path(f)
        if path is not None and self._kept(path) and self._from_script():
            self.skipped.append(f"torch.save to {path!r}")
            return
        self._original(torch, "save")(obj, f, *args, **kwargs)
        self._wrote(path)

    def _remove_with(self, name: str) -> Callable[..., None]:
        def remove(path: Any, *args: Any, **kwargs: Any) -> None:
            if self._kept(os.fspath(path)) and self._from_script():
                self.skipped.append(f"os.{name}({os.fsdecode(os.fspath(path))!r})")
                return
            self._original(os, name)(path, *args, **kwargs)
        return remove

    def _mkdir(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.isdir(os.fspath(path)) and self._kept(os.fspath(path)) and self._from_script():
            return
        self._original(os, "mkdir")(path, *args, **kwargs)

    def _replace_with(self, name: str) -> Callable[..., None]:
        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if self._kept(os.fspath(dst)) and self._from_script():
                self.skipped.append(f"os.{name} onto {os.fsdecode(os.fspath(dst))!r}")
                self._original(os, "remove")(src)
                return
            self._original(os, name)(src, dst, *args, **kwargs)
            self._wrote(os.fsdecode(os.fspath(dst)))
        return replace

    def _rmtree(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if self._kept(os.fspath(path)) and self._from_script():
            self.skipped.append(f"shutil.rmtree({os.fsdecode(os.fspath(path))!r})")
            return
        self._original(shutil, "rmtree")(path, *args, **kwargs)


_FENCE: list[Fence | None] = [None]


def raise_for(own: Callable[[str], bool], since: float | None, setup_files: dict[str, float] | None = None) -> None:
    """A successor starts its script: fence it (see the module's docstring); `since`: when
    the job's step loop began; `setup_files`: what earlier successors' setups wrote."""
    if _FENCE[0] is None:
        fence = _FENCE[0] = Fence(own, since, dict(setup_files or {}))
        fence.install()


def lift() -> dict[str, float]:
    """The successor holds its rank's place (idempotent): the files its setup wrote."""
    fence, _FENCE[0] = _FENCE[0], None
    return fence.lift() if fence is not None else {}
