"""One warm process per job that forks the local workers, so none imports torch again.

A worker's imports (torch, torch.distributed, baton's runtime) cost about 3 CPU-seconds on
our 2-core dev machine: more than a small job's training, and most of the time a spare or a
replacement takes to start. On one machine, `baton run` starts this process once (it forks
the rendezvous store too): it imports those modules,
then forks each worker on the launcher's request, and the child becomes `python script.py
args` (or `python -m module args`): its argv, environment, working directory, session,
process title (what `ps` shows) and a fresh `__main__`. The worker is the zygote's child;
the zygote reaps it and reports its exit status at once, and the worker dies with the
zygote (PR_SET_PDEATHSIG, set before anything else runs), as it dies with the launcher.

Forking is safe because the zygote runs no torch op and starts no thread: the child is a
copy of one idle thread, as a DataLoader worker's fork is. What differs from a fresh
`python`: the modules imported here are already imported in the worker (their import-time
reads of the environment saw the job's environment, which lacks only the worker's own
BATON_* keys: `baton._worker_process_started` redoes what depends on those), and every
worker shares the zygote's string hash seed (`random` and numpy's global generator are
seeded from the OS again in each: `_seed_from_the_os`).

Run as `python -m baton.schedulers.zygote FD` by `Zygote` only, or forked ready-imported by the
machine's `baton warm` (`warm`), which then turns into the same. Messages are JSON lines on
the socket FD; nothing is unpickled.
"""

from __future__ import annotations

import builtins
import gc
import io
import os
import select
import signal
import socket
import sys
import types
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter

from baton.worker import orphan

# torch._dynamo: DistributedDataParallel's constructor imports it (and with it sympy, FSDP2,
# DTensor and inductor's config): ~2 CPU-s that every DDP rank, every warm spare (its warm-up
# builds a DDP) and every FSDP2 rank paid again. Here a job pays it once.
PRELOADED = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "numpy", "baton.worker.job",
             "baton.transparent.worker")
# Read when python, torch or their libraries start: a worker that needs other values than its
# zygote started with is started as its own process (`forked`); a job whose zygote would need
# other values than the machine's warm process started with starts its own (`warm`).
STARTUP_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "MALLOC_", "TORCH_",
               "TORCHDYNAMO_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "CUDA_", "LANG", "LC_")
# Of those, the ones read only when called (init_process_group's), never at import.
READ_WHEN_CALLED = frozenset({"TORCH_DIST_INIT_BARRIER"})


def read_at_start(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The variables read only at start whose values differ between environments `a` and `b`."""
    return sorted(k for k in set(a) | set(b)
                  if k.startswith(STARTUP_ENV) and k not in READ_WHEN_CALLED and a.get(k) != b.get(k))


class Spawn(BaseModel):
    type: Literal["spawn"] = "spawn"
    argv: list[str]  # [python, script, args...] or [python, -m, module, args...]
    env: dict[str, str]
    cwd: str
    new_session: bool = False
    stdout: bool = False  # the process's stdout is the descriptor sent with the request (SCM_RIGHTS)


class Ready(BaseModel):
    type: Literal["ready"] = "ready"
    pid: int


class Started(BaseModel):
    type: Literal["started"] = "started"
    pid: int


class Refused(BaseModel):
    type: Literal["refused"] = "refused"
    error: str


class Exited(BaseModel):
    type: Literal["exited"] = "exited"
    pid: int
    code: int  # as subprocess reports it: the exit status, or -N for signal N
    cpu_s: float = 0.0  # the CPU-seconds it used (user + system)


Message = Annotated[Union[Spawn, Ready, Started, Refused, Exited], Field(discriminator="type")]
MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


def can_fork(argv: list[str]) -> bool:
    """The command lines a zygote can become: `python script args` or `python -m module args`."""
    if len(argv) < 2:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and not argv[2].startswith("-")
    return not argv[1].startswith("-")


def send(sock: socket.socket, msg: BaseModel, fds: list[int] | None = None) -> None:
    data = msg.model_dump_json().encode() + b"\n"
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


class Lines:
    """JSON lines read from a socket, one message at a time, and the descriptors sent with them."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fds: list[int] = []  # received, in order, not yet taken
        self._buf = b""

    def read(self) -> list[Message] | None:
        """The messages one recv completes; None once the other side has closed."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        self.fds += fds
        if not data:
            return None
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [MESSAGE.validate_json(line) for line in lines if line]


# ------------------------------------------------------------------ the zygote process

class ChildEnds:
    """A pipe each SIGCHLD writes a byte to (`signal.set_wakeup_fd`): a fork server's select on
    `fd` wakes when a child ends, as it does on a request."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def close_in_child(self) -> None:
        """In a fork: SIGCHLD back to its default, the pipe closed (after the wake-up fd is off it)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.fd)
        os.close(self._write)


def serve(sock: socket.socket) -> Spawn:
    """Fork a worker for each request and report each one's end; return only in a child."""
    ends = ChildEnds()
    lines = Lines(sock)
    send(sock, Ready(pid=os.getpid()))
    while True:
        ready, _, _ = select.select([sock, ends.fd], [], [])
        if ends.fd in ready:
            ends.drain()
        _reap(sock)
        if sock not in ready:
            continue
        msgs = lines.read()
        if msgs is None:  # the launcher is done with us (or gone): the workers go with us
            os._exit(0)  # nothing to finalize: this process only imported and forked
        for req in msgs:
            stdout = lines.fds.pop(0) if isinstance(req, Spawn) and req.stdout and lines.fds else None
            if not isinstance(req, Spawn) or not can_fork(req.argv) or req.stdout and stdout is None:
                send(sock, Refused(error=f"not a command a zygote forks: {req!r}"[:500]))
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            zygote_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                # first of all: die with this zygote (not the BATON_PARENT_PID it holds yet), and
                # at once if the zygote died before the request could be made
                if orphan.ask_to_die_with_parent() and os.getppid() != zygote_pid:
                    os._exit(1)
                gc.enable()
                ends.close_in_child()
                for fd in lines.fds:
                    os.close(fd)
                sock.close()
                if stdout is not None:
                    os.dup2(stdout, 1)
                    os.close(stdout)
                return req
            if stdout is not None:
                os.close(stdout)
            send(sock, Started(pid=pid))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, Exited(pid=pid, code=os.waitstatus_to_exitcode(status), cpu_s=usage.ru_utime + usage.ru_stime))


def _seed_from_the_os() -> None:
    """A fresh python seeds `random`'s generator (and numpy its global one) from the OS when it
    imports them; a fork holds its parent's. Without this, every worker of a job, and under
    `baton warm` every job of the machine, drew the same "random" port or run name. torch's
    default generator starts from a fixed seed in every process: nothing to do there."""
    if (rnd := sys.modules.get("random")) is not None:
        rnd.seed()
    if (nprandom := sys.modules.get("numpy.random")) is not None:
        nprandom.seed()


def become(req: Spawn) -> None:
    """Turn this fresh child into `python script args` / `python -m module args`."""
    if req.new_session:
        os.setsid()
    os.chdir(req.cwd)
    try:  # before the environment changes: it finds the memory to write the title to there
        import setproctitle

        setproctitle.setproctitle(" ".join(req.argv))
    except ImportError:  # only what `ps` shows
        pass
    os.environ.clear()
    os.environ.update(req.env)
    if "BATON_PARENT_PID" in os.environ:  # the worker dies with its parent, which is this zygote
        os.environ["BATON_PARENT_PID"] = str(os.getppid())
    _seed_from_the_os()
    import baton

    baton._worker_process_started()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if req.argv[1] == "-m":
        import runpy

        sys.argv = [req.argv[2], *req.argv[3:]]
        sys.path[0] = req.cwd
        sys.modules.pop(req.argv[2], None)  # imported here to be warm: run afresh, as `python -m` does
        runpy._run_module_as_main(req.argv[2])  # what `python -m` itself calls
        return
    script = os.path.abspath(req.argv[1])
    sys.argv = req.argv[1:]
    sys.path[0] = os.path.dirname(script)
    main.__file__ = req.argv[1]
    main.__cached__ = None
    with io.open_code(script) as f:
        code = compile(f.read(), req.argv[1], "exec", dont_inherit=True)
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - printed as python prints it: from the script's frame
        assert exc.__traceback__ is not None
        exc.with_traceback(exc.__traceback__.tb_next)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    orphan.die_with_parent()
    import importlib

    gc.disable()  # as the gc docs advise for a fork server: the children share these pages
    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()  # a child's collections leave the imported objects (and their pages) alone
    run(sock)


def run(sock: socket.socket) -> None:
    """Serve the launcher on `sock`, with the modules imported; return only as a worker, once
    its script has run."""
    req = serve(sock)
    del sock
    become(req)


if __name__ == "__main__":
    main()
