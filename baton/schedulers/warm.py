"""A warm process per machine that forks each `baton run`'s zygote: torch imported once, not once a job.

A job's zygote (`schedulers/zygote.py`) imports torch, torch.distributed, dynamo and baton's
runtime before its first worker can start: about 4-5 CPU-seconds on our 2-core dev machine,
often more than a short job's training. A machine that starts many jobs (a test suite, a
developer trying a script again and again) pays it every time. `baton warm` imports those
modules once and waits; a `baton run` on the same machine with `BATON_WARM=<its socket>` asks
it for its zygote, which is then a fork of the warm process, warm at once, serving the
launcher on the socket the launcher handed over.

The fork becomes what the launcher would have started (`python -m baton.schedulers.zygote`):
the launcher's environment, working directory, standard streams, umask and CPU affinity, in a
session of its own. What python does at start with an environment the warm process did not
see is done again: PYTHONPATH entries the job adds in front go on `sys.path`, and a
`sitecustomize` among them is imported. What cannot be redone is refused, and the launcher
starts its own zygote as before, saying why in one line:

- other values of what python, torch or their libraries read only at start (`STARTUP_ENV`);
- a PYTHONPATH entry (or the working directory) holding a module of the same name as one the
  warm process has imported: a fresh python would have imported that one;
- another python, user, namespace (network, mount, PID ...) or cgroup, as for a launcher in a
  Slurm step or a container: the zygote would be the warm process's child, outside it.

The zygote is tied to its launcher, not to the warm process (which may stop; no job notices):
when the launcher's socket closes, it exits, and its workers die with it (PR_SET_PDEATHSIG).

Messages are JSON lines; the descriptors (the zygote's socket, the launcher's stdin, stdout
and stderr) go with the request (SCM_RIGHTS); only the warm process's own user may connect
(SO_PEERCRED). Nothing is unpickled.
"""

from __future__ import annotations

import errno
import gc
import importlib
import io
import os
import select
import signal
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter

from baton.schedulers import zygote
from baton.worker import orphan

ENV_SWITCH = "BATON_WARM"  # the socket of the warm process a `baton run` asks for its zygote
NAMESPACES = ("net", "mnt", "pid", "user", "ipc", "uts", "cgroup")
REQUEST_TIMEOUT_S = 30.0  # a fork of the warm process takes milliseconds, even on a loaded machine


class Prepare(BaseModel):
    """A launcher's request: fork me a zygote (its socket and my stdio go with it, in that order)."""
    type: Literal["prepare"] = "prepare"
    python: str  # sys.executable: the warm process's must be the same
    env: dict[str, str]  # the zygote's environment
    cwd: str
    umask: int
    affinity: list[int]
    place: dict[str, str]  # namespaces and cgroup (`where_am_i`): the zygote must run where the launcher does


class Forked(BaseModel):
    type: Literal["forked"] = "forked"
    pid: int


Refused = zygote.Refused  # the same answer a zygote gives a request it will not serve

Message = Annotated[Union[Prepare, Forked, Refused], Field(discriminator="type")]
MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


class WarmRefused(RuntimeError):
    """The warm process did not fork a zygote for this launcher (why: the message)."""


def default_socket() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"baton-warm-{os.getuid()}.sock"


def where_am_i() -> dict[str, str]:
    """This process's namespaces and cgroup: a fork of another process runs in that one's."""
    place = {}
    for ns in NAMESPACES:
        try:
            place[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            place[ns] = "?"
    try:
        place["cgroups"] = Path("/proc/self/cgroup").read_text()
    except OSError:
        place["cgroups"] = "?"
    return place


# ------------------------------------------------------------------ the launcher's side

def request_zygote(path: str, python: str, env: dict[str, str], zygote_sock: socket.socket) -> int:
    """Ask the warm process at `path` to fork this launcher's zygote, serving `zygote_sock`; its
    pid. WarmRefused when it cannot (the caller starts its own zygote)."""
    stdio = [_open_or_null(fd) for fd in (0, 1, 2)]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                conn.connect(path)
                req = Prepare(python=python, env=env, cwd=os.getcwd(), umask=_umask(),
                              affinity=sorted(os.sched_getaffinity(0)), place=where_am_i())
                zygote.send(conn, req, fds=[zygote_sock.fileno(), *stdio])
                answer = _read_line(conn)
            except OSError as exc:
                raise WarmRefused(f"it is unreachable at {path}: {exc}") from None
    finally:
        for fd in stdio:
            os.close(fd)
    if isinstance(answer, Forked):
        return answer.pid
    raise WarmRefused(answer.error if isinstance(answer, Refused) else f"it answered {answer!r}"[:300])


def _open_or_null(fd: int) -> int:
    try:
        return os.dup(fd)
    except OSError:  # closed in the launcher: the zygote gets /dev/null there, as python would see nothing
        return os.open(os.devnull, os.O_RDWR)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _read_line(conn: socket.socket) -> Message:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise OSError(errno.ECONNRESET, "it closed the connection without an answer")
        data += chunk
    return MESSAGE.validate_json(data)


# ------------------------------------------------------------------ the warm process

def refusal(req: Prepare, peer_uid: int, here: dict[str, str], started_env: dict[str, str],
            imported: dict[str, set[str]], filled_in: dict[str, str]) -> str | None:
    """Why the warm process cannot fork a zygote that is what `req`'s launcher would have
    started; None when it can. `filled_in`: what the imports added to the environment (torch
    writes its inductor cache directory there when it first reads it); a launcher that
    inherited the same value from a process that imported torch started the same."""
    if peer_uid != os.getuid():
        return f"the request came from uid {peer_uid}; this warm process serves uid {os.getuid()} only"
    if req.python != sys.executable:
        return f"it runs {sys.executable}, the launcher {req.python}"
    if elsewhere := [k for k in sorted(here) if req.place.get(k) != here[k]]:
        return f"the launcher runs in another {', '.join(elsewhere)} (a Slurm step, a container?)"
    as_started = {k: v for k, v in req.env.items() if filled_in.get(k) != v}
    differ = [k for k in zygote.read_at_start(as_started, started_env) if k != "PYTHONPATH"]
    if differ:
        return f"it started with other values of {', '.join(differ)}, read only at start"
    extra = extra_path(started_env.get("PYTHONPATH", ""), req.env.get("PYTHONPATH", ""))
    if extra is None:
        return (f"the job's PYTHONPATH ({req.env.get('PYTHONPATH', '')!r}) does not end with the warm "
                f"process's ({started_env.get('PYTHONPATH', '')!r})")
    for entry in [req.cwd, *extra]:
        if shadowed := _shadowed(entry, imported):
            return f"{entry} holds {', '.join(shadowed[:5])}, imported here from elsewhere"
    if "sitecustomize" in sys.modules and any("sitecustomize" in _top_level_names(e) for e in extra):
        return "the job's PYTHONPATH has a sitecustomize, and this process ran another"
    return None


def extra_path(started: str, job: str) -> list[str] | None:
    """The entries the job's PYTHONPATH puts before the warm process's; None if it does not
    end with those (a fresh python would search another order)."""
    ours = [p for p in started.split(os.pathsep) if p]
    theirs = [p for p in job.split(os.pathsep) if p]
    if len(theirs) < len(ours) or theirs[len(theirs) - len(ours):] != ours:
        return None
    return [os.path.abspath(p) for p in theirs[:len(theirs) - len(ours)]]


def _top_level_names(entry: str) -> set[str]:
    """The top-level names an import would find in directory `entry` (packages, modules,
    extensions), read with one listing."""
    try:
        files = os.listdir(entry)
    except OSError:
        return set()
    return {f.split(".", 1)[0] if f.endswith((".py", ".so", ".pyc")) else f for f in files}


def _shadowed(entry: str, imported: dict[str, set[str]]) -> list[str]:
    """The imported modules a fresh python would have found in `entry` instead of where they
    were found here (`imported`: each top-level name and the folders it came from)."""
    here, names = os.path.realpath(entry), _top_level_names(entry)
    return [name for name, origins in imported.items() if name in names and here not in origins]


def _imported_top_level() -> dict[str, set[str]]:
    """The top-level modules imported from files here, each with the folders it was found in:
    what a PYTHONPATH entry could shadow."""
    out: dict[str, set[str]] = {}
    for name, mod in list(sys.modules.items()):
        if "." in name or name in ("__main__", "sitecustomize"):
            continue
        if paths := list(getattr(mod, "__path__", None) or []):  # a package: the folders holding it
            out[name] = {os.path.realpath(os.path.dirname(p)) for p in paths}
        elif file := getattr(mod, "__file__", None):  # a module: the folder of its file
            out[name] = {os.path.realpath(os.path.dirname(file))}
    return out


def serve(listener: socket.socket, started_env: dict[str, str],
          filled_in: dict[str, str]) -> tuple[Prepare, list[int], int]:
    """Fork a zygote for each acceptable request; return only in such a fork, with the request,
    its descriptors (the zygote's socket, stdin, stdout, stderr) and the launcher's pid.
    `started_env`: the environment the imports saw; `filled_in`: what they added to it."""
    ends = zygote.ChildEnds()
    here, imported = where_am_i(), _imported_top_level()
    while True:
        ready, _, _ = select.select([listener, ends.fd], [], [])
        if ends.fd in ready:
            ends.drain()
        _reap()
        if listener not in ready:
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        with conn:
            conn.settimeout(REQUEST_TIMEOUT_S)  # one slow client must not hold the machine's others
            fds: list[int] = []
            child = False
            try:
                req, fds, uid, launcher = _receive(conn)
                if (why := refusal(req, uid, here, started_env, imported, filled_in)) is not None:
                    zygote.send(conn, Refused(error=why))
                    continue
                pid = os.fork()
                if pid == 0:
                    child = True
                    ends.close_in_child()
                    listener.close()
                    return req, fds, launcher
                zygote.send(conn, Forked(pid=pid))
            except (OSError, ValueError) as exc:
                try:
                    zygote.send(conn, Refused(error=f"bad request: {exc}"[:500]))
                except OSError:
                    pass
            finally:
                if not child:  # the fork keeps them: they become its socket and stdio
                    for fd in fds:
                        os.close(fd)


def _receive(conn: socket.socket) -> tuple[Prepare, list[int], int, int]:
    """The request, its descriptors, and the uid and pid of the process that sent it."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, got, _, _ = socket.recv_fds(conn, 1 << 20, 4)
            fds += got
            if not chunk:
                raise ValueError("the connection closed mid-request")
            data += chunk
        msg = MESSAGE.validate_json(data)
        if not isinstance(msg, Prepare) or len(fds) != 4:
            raise ValueError(f"expected a prepare request with 4 descriptors, got {type(msg).__name__} "
                             f"with {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return msg, fds, uid, pid


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def become_zygote(req: Prepare, fds: list[int], launcher: int, started_pythonpath: str) -> socket.socket:
    """Turn this fork into the zygote the launcher would have started; its socket to the launcher."""
    os.setsid()  # not in the warm process's session: a signal to that one is not for jobs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the warm process's own handlers
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock_fd, *stdio = fds
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.umask(req.umask)
    os.sched_setaffinity(0, req.affinity)
    os.chdir(req.cwd)
    sys.orig_argv = [req.python, "-m", "baton.schedulers.zygote", str(sock_fd)]
    try:  # before the environment changes: it finds the memory to write the title to there
        import setproctitle

        setproctitle.setproctitle(f"{' '.join(sys.orig_argv)} (forked by baton warm for launcher {launcher})")
    except ImportError:  # only what `ps` shows
        pass
    os.environ.clear()
    os.environ.update(req.env)
    sys.argv = [zygote.__file__, str(sock_fd)]
    extra = extra_path(started_pythonpath, req.env.get("PYTHONPATH", "")) or []
    sys.path[0:1] = [req.cwd, *extra]  # as `python -m` puts them: the working directory, then PYTHONPATH's
    tempfile.tempdir = None  # found again from this environment's TMPDIR when next asked
    _fresh_stdio()
    if any("sitecustomize" in _top_level_names(e) for e in extra):
        importlib.import_module("sitecustomize")  # what python's `site` runs at start
    return socket.socket(fileno=sock_fd)


def _fresh_stdio() -> None:
    """sys.stdin/stdout/stderr over the launcher's descriptors, made as python makes them at
    start (line-buffered on a terminal; PYTHONUNBUFFERED writes through)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if old is None:
            continue
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        if fd == 0:
            raw = io.open(fd, "rb", closefd=False)
            new = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors)
        else:
            buffered = io.open(fd, "wb", buffering=-1, closefd=False)
            new = io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                                   line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def main(socket_path: Path) -> int:
    """`baton warm`: import what a zygote imports, then fork one for each launcher that asks.
    It listens once imported: a launcher that finds the socket finds it ready."""
    _refuse_if_served(socket_path)
    orphan.die_with_parent()  # where BATON_PARENT_PID names a parent (a test session), die with it
    # What `baton run` gives every worker (launcher.worker_env) unless told otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started_env = dict(os.environ)
    gc.disable()  # as the zygote: the forks share these pages
    for name in zygote.PRELOADED:
        importlib.import_module(name)
    filled_in = {k: v for k, v in os.environ.items() if k not in started_env}
    gc.freeze()
    listener = _listen(socket_path)

    def stop(signum: int, _frame: object) -> None:
        socket_path.unlink(missing_ok=True)
        os._exit(0)  # the zygotes it forked serve their launchers on: they are not ours to stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"[baton] warm: {', '.join(zygote.PRELOADED)} imported; serving {socket_path} "
          f"(export {ENV_SWITCH}={socket_path})", file=sys.stderr, flush=True)
    req, fds, launcher = serve(listener, started_env, filled_in)
    sock = become_zygote(req, fds, launcher, started_env.get("PYTHONPATH", ""))
    zygote.run(sock)
    return 0


def _refuse_if_served(path: Path) -> None:
    """SystemExit if another warm process serves `path`; a socket file left by a dead one goes."""
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # left by one that died
            else:
                raise SystemExit(f"baton warm: a warm process already serves {path}")


def _listen(path: Path) -> socket.socket:
    """A listening socket at `path` only this user can reach."""
    _refuse_if_served(path)  # again: one may have started while this one imported
    path.parent.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(mask)
    listener.listen(64)
    return listener
