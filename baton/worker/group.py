"""The job's live process group: one stable object whose gloo backend is swapped per generation.

`LiveGroup` is registered as torch.distributed's default group, so
`dist.all_reduce(t)`, `dist.get_rank()` and `group=job.group` all keep working
across migrations: survivors keep the same Python object while the gloo group
underneath is rebuilt under a new store prefix with the joiner in the departed
rank's place. Every collective issued through it is watched: a failure is
recorded so the step loop can tell a lost peer from a bug in user code.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from baton import selfcost
from baton.address import node_address
from baton.store.rendezvous import RendezvousClient, StoreUnreachable


@functools.cache
def _gloo_device(interface: str = "") -> dist.ProcessGroupGloo.Device:
    """This process's gloo transport device on `interface` (a data path), or its default
    one, shared by all its groups.

    Each device runs a network loop thread that wakes up every few milliseconds even
    when idle (~2.5 ms of CPU a second here); a device per group would add one such thread
    per generation formed, for the life of the process. A data path's device outlives its
    link going down: when the link is back, the same device serves it again.
    """
    interface = interface or os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    addr = node_address()
    if addr != "127.0.0.1":  # across machines: the address the others can reach, not the hostname's
        return dist.ProcessGroupGloo.create_device(hostname=addr)
    return dist.ProcessGroupGloo.create_default_device()


def gloo_backend(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 paths: tuple[str, ...] = ()) -> dist.ProcessGroupGloo:
    """A gloo group over `paths` (the interfaces of the data paths every rank can use now,
    the same on every rank: gloo pairs its ranks' devices by position and runs each
    collective over one of them in turn), or over the default device."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [_gloo_device(p) for p in paths] or [_gloo_device()]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def connect_gloo(store: dist.Store, rank: int, world_size: int, timeout_s: float, paths: tuple[str, ...],
                 generation: int, superseded: Callable[[], bool]) -> dist.ProcessGroupGloo:
    """`gloo_backend`, given up when the formation is superseded or runs past gloo's timeout.

    gloo's constructor connects to every peer, and a connect to a peer whose data path went
    down after the plan was made (its SYNs dropped, no refusal) blocks in the kernel far past
    gloo's own timeout (minutes): a live rank stuck there cannot take the orchestrator's next
    plan, and is lost as hung. So the constructor (which releases the GIL) runs on a helper
    thread; the caller gives up on it and goes on, and the thread ends when the connect fails.
    """
    built: dict[str, Any] = {}
    done = threading.Event()

    def build() -> None:
        try:
            built["group"] = gloo_backend(store, rank, world_size, timeout_s, paths)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, if it still waits
            built["error"] = exc
        finally:
            done.set()

    threading.Thread(target=build, name=f"baton-gloo-connect-gen{generation}", daemon=True).start()
    deadline = time.monotonic() + timeout_s + 2.0  # gloo's own timeout, and a moment to say so
    while not done.wait(0.005):
        if superseded():
            raise CollectiveFailure(f"formation of generation {generation} superseded while gloo was connecting")
        if time.monotonic() > deadline:
            raise CollectiveFailure(f"generation {generation} did not form: gloo's connect to its peers did not "
                                    f"complete in {timeout_s:g}s (a peer unreachable over {list(paths) or 'its path'})")
    if "error" in built:
        raise built["error"]
    return built["group"]


@functools.cache
def solo_group() -> dist.ProcessGroup:
    """A world-of-one group for DDP's own bookkeeping collectives (they become local no-ops).
    One per process, shared by every DDP that needs one."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = gloo_backend(store, 0, 1, 60.0)
    # gloo takes CUDA tensors too: a model on the GPU has DDP call this group with them
    # (its bucket rebuild), and a group knows a backend only for the devices registered here
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


class _Done(dist.Work):
    def __init__(self, result: list[torch.Tensor]):
        super().__init__()
        self._fut: torch.futures.Future = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout=None) -> bool:  # type: ignore[override]  # noqa: ANN001
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _FailureNotingWork(dist.Work):
    """A collective's work (one or several, waited on as one) whose failure marks the live
    group failed when it is waited on.

    gloo's works for FSDP2's flat-shard collectives carry no future to watch, so without
    this a dead peer would surface in the script as a bare RuntimeError (a script bug)
    instead of a lost generation the runtime recovers from.
    """

    def __init__(self, inner: dist.Work | list[dist.Work], on_failure: Callable[[BaseException], None]):
        super().__init__()
        self._inner = inner if isinstance(inner, list) else [inner]
        self._on_failure = on_failure

    def wait(self, timeout=None) -> bool:  # type: ignore[override]  # noqa: ANN001
        try:
            return all([w.wait() if timeout is None else w.wait(timeout) for w in self._inner])
        except Exception as exc:
            self._on_failure(exc)
            raise

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._inner)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._inner)

    def exception(self):  # noqa: ANN201
        return next((e for e in (w.exception() for w in self._inner) if e is not None), None)

    def get_future(self) -> torch.futures.Future:
        if len(self._inner) == 1:
            return self._inner[0].get_future()
        return torch.futures.collect_all([w.get_future() for w in self._inner])


class IdleGroup(dist.ProcessGroup):
    """A world of one with no transport behind it: every collective is complete when issued.

    For the warm-up's DistributedDataParallel only. A gloo group would start the process's
    gloo network loop, which wakes 100 times a second: ~3 ms of CPU per second, measured,
    in a spare that may wait for hours. A rank gets its gloo device when its group forms."""

    def __init__(self) -> None:
        super().__init__(0, 1)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "baton-idle"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allreduce(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        return _Done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]  # noqa: ANN001
        for out, inp in zip(output_tensors, input_tensors):
            out[0].copy_(inp)
        return _Done([o[0] for o in output_tensors])

    def _allgather_base(self, output, input, opts=None):  # type: ignore[override]  # noqa: ANN001,A002
        output.copy_(input)
        return _Done([output])

    def barrier(self, opts=None):  # type: ignore[override]  # noqa: ANN001
        return _Done([])


class CollectiveFailure(RuntimeError):
    """A collective on the live group failed: a peer died, hung or the group was torn down."""


class LiveGroup(dist.ProcessGroup):
    """The world group (`members` None), or one of its live sub-groups (`subgroup`): a device
    mesh dimension of HSDP, say. A sub-group has its own gloo backend per generation, formed
    with the world's, and shares the world's failure state: a failure on any of them fails
    the generation, and breaking the transport breaks all of them."""

    def __init__(self, rank: int, world_size: int, members: list[int] | None = None,
                 parent: "LiveGroup | None" = None, name: str = ""):
        super().__init__(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.members = list(members) if members is not None else list(range(world_size))
        self._parent = parent
        self._name = name  # a script's own group (dist.new_group), named alike on each of its members
        self._children: list[LiveGroup] = []
        self._new_groups: dict[tuple[int, ...], int] = {}  # the script's groups made so far, by members
        self._inner: dist.ProcessGroup | None = None
        # Backends of past generations are never destroyed: ~ProcessGroupGloo joins its
        # threads with the GIL held and can deadlock against a callback waiting for the GIL.
        # Each one holds a few blocked worker threads and closed sockets (its network loop is
        # the process's shared one), a bounded cost per migration that burns no CPU.
        self._retired: list[dist.ProcessGroup] = []
        self._transport_fds: dict[int, str] = {}  # descriptor -> "socket:[inode]" when formed
        self.known_local_ports: set[int] = set()  # e.g. this worker's transfer server
        self.known_remote_ports: set[int] = set()  # e.g. the orchestrator API and the store
        self.generation = -1
        self.paths: tuple[str, ...] = ()  # the data paths of the current generation (none: the default device)
        self._store: RendezvousClient | None = None
        self._op_timeout_s = 60.0
        self.failed = threading.Event()  # set when any collective of this generation failed
        self.issued_at = 0.0  # when the latest collective was issued (a failed one: where this rank blocked)
        self.last_error: str = ""
        # Called with the op name and the group it runs on before every collective the script
        # issues (not baton's own): the step loop uses it to capture this rank's bundle and
        # enforce where collectives go. It may return another group to run the call on (a
        # joiner's startup barrier: its own).
        self._guard: Callable[[str, LiveGroup], dist.ProcessGroup | None] | None = None
        self._internal = threading.local()
        if parent is not None:
            self.failed, self._internal = parent.failed, parent._internal

    @property
    def root(self) -> "LiveGroup":
        return self._parent.root if self._parent is not None else self

    @property
    def guard(self) -> Callable[[str, "LiveGroup"], dist.ProcessGroup | None] | None:
        return self.root._guard

    @guard.setter
    def guard(self, fn: Callable[[str, "LiveGroup"], dist.ProcessGroup | None] | None) -> None:
        self.root._guard = fn

    @property
    def whole(self) -> bool:
        """Whether every rank of the job is a member (a collective's result is then the same
        on every rank, where it is on every member)."""
        return len(self.members) == self.root._world

    def subgroup(self, members: list[int]) -> "LiveGroup":
        """The live group of these world ranks (this rank among them), registered with
        torch.distributed like `dist.new_group` would, but with no collective: every rank
        creates its sub-groups locally, and each generation forms them with the world. The
        same members give the same object."""
        assert self._parent is None, "sub-groups are made from the world group"
        members = sorted(int(r) for r in members)
        if self._rank not in members or len(set(members)) != len(members) or \
                not all(0 <= r < self._world for r in members):
            raise ValueError(f"a sub-group of rank {self._rank} must hold it and only ranks of "
                             f"0..{self._world - 1} once: {members}")
        if members == self.members:
            return self
        for child in self._children:
            if child.members == members and not child._name:
                return child
        child = self._child(members)
        world_store = dist.distributed_c10d._world.pg_map[self][1]
        dist.distributed_c10d._register_pg_in_world(
            child, _BACKEND_NAME, world_store, f"baton:{child.tag}", f"cpu:{_BACKEND_NAME}",
            rank_mapping={r: i for i, r in enumerate(members)})
        return child

    def new_group(self, ranks: list[int] | None, timeout: Any = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None) -> "LiveGroup | None":
        """`dist.new_group(ranks)` (and `new_subgroups`) in a script: torch 2.13 hands the call to
        the default group, registers what it returns, and returns NON_GROUP_MEMBER for None. A
        live sub-group of its own, as torch's is a communicator of its own, even for members
        another group has too. Its members make the groups they share in the same order
        (torch's rule), a joiner's setup too, so the members and how many groups of them came
        before name it alike on each, whatever the ranks outside it did meanwhile."""
        assert self._parent is None, "sub-groups are made from the world group"
        members = sorted(int(r) for r in (ranks if ranks is not None else range(self._world)))
        if self._rank not in members:
            return None
        nth = self._new_groups[tuple(members)] = self._new_groups.get(tuple(members), 0) + 1
        return self._child(members, name=f"new{'-'.join(map(str, members))}.{nth}")

    def _child(self, members: list[int], name: str = "") -> "LiveGroup":
        child = LiveGroup(members.index(self._rank), len(members), members=members, parent=self, name=name)
        self._children.append(child)
        if self._inner is not None and self._store is not None:  # created mid-generation
            before = _socket_fds()
            child._form_backend(self._store, self.generation, self._op_timeout_s, self.paths)
            self._transport_fds.update(self._new_transport_sockets(before))
        return child

    @property
    def tag(self) -> str:
        return self._name or "-".join(map(str, self.members))

    def _form_backend(self, store: RendezvousClient, generation: int, op_timeout_s: float,
                      paths: tuple[str, ...] = ()) -> None:
        prefixed = dist.PrefixStore(f"baton/gen{generation}/sub/{self.tag}/", store.store)
        backend = gloo_backend(prefixed, self._rank, self._world, op_timeout_s, paths)
        self.drop()
        self._inner = backend
        self.generation = generation

    def internal(self) -> "_Internal":
        """Collectives issued inside `with group.internal():` are baton's own (no guard)."""
        return _Internal(self._internal)

    # ---------------------------------------------------------------- generation swap
    def form(self, store: RendezvousClient, generation: int, op_timeout_s: float,
             formation_timeout_s: float = 120.0, superseded: Callable[[], bool] = lambda: False,
             paths: tuple[str, ...] = ()) -> None:
        """Join generation `generation` over the data paths `paths` (the orchestrator's
        choice: those every node can use now); returns once every rank has joined.

        Members first meet at a store barrier that is polled, so a formation can be
        abandoned when the orchestrator supersedes it (another failure), and only then
        build the gloo group, which by then connects in milliseconds. A member whose store
        connection broke (the store restarted, empty) announces itself again on the new one.
        """
        prefix = f"baton/gen{generation}/"
        mine = f"{prefix}ready/{self._rank}"
        keys = [f"{prefix}ready/{r}" for r in range(self._world)]
        deadline = time.monotonic() + formation_timeout_s
        announced_on: list[dist.Store] = []

        def all_ready(s: dist.Store) -> bool:
            if not announced_on or announced_on[0] is not s:
                s.set(mine, b"1")
                announced_on[:] = [s]
            return s.check(keys)

        try:
            while not store.call(all_ready, deadline, give_up=superseded):
                if superseded():
                    raise CollectiveFailure(f"formation of generation {generation} superseded")
                if time.monotonic() > deadline:
                    raise CollectiveFailure(f"generation {generation} did not form in {formation_timeout_s:.0f}s")
                time.sleep(0.002)
        except StoreUnreachable as exc:
            raise CollectiveFailure(f"generation {generation} did not form: {exc}") from None
        prefixed = dist.PrefixStore(prefix, store.store)
        before = _socket_fds()
        try:
            backend = connect_gloo(prefixed, self._rank, self._world, op_timeout_s, paths, generation, superseded)
        except CollectiveFailure:  # superseded, or gloo's connect outlived its timeout
            raise
        except RuntimeError as exc:  # gloo could not connect (a data path gone meanwhile): the plan failed
            raise CollectiveFailure(f"generation {generation} did not form: {exc}") from None
        self.drop()
        self._inner = backend
        self.paths = paths
        for child in self._children:  # every member holds the same sub-groups (the same script)
            child._form_backend(store, generation, op_timeout_s, paths)
        self._transport_fds = self._new_transport_sockets(before)
        self._store, self._op_timeout_s = store, op_timeout_s
        self.generation = generation
        self.failed.clear()
        self.last_error = ""

    def break_transport(self) -> None:
        """Make every collective blocked on this generation fail now, here and at the peers.

        gloo cannot cancel an operation in flight (abort() and shutdown() leave it waiting
        until its timeout), and in a ring a survivor may wait on a live neighbour for the
        full timeout after another rank died. Shutting down the generation's sockets
        (not closing them: gloo still owns the descriptors) turns that wait into an
        immediate "connection closed" on every rank of the ring.

        gloo closes a pair whose peer died, and the process may reuse its descriptor number
        at once (a DataLoader worker's shared-memory handoff does): only a descriptor that
        is still the socket it was when formed is shut down.
        """
        shut_down_sockets(self._transport_fds)
        self._transport_fds = {}

    def _new_transport_sockets(self, before: dict[int, str]) -> dict[int, str]:
        after = _socket_fds()
        return {fd: link for fd, link in after.items()
                if before.get(fd) != link and not self._is_known_socket(fd)}

    def _is_known_socket(self, fd: int) -> bool:
        """Sockets that are not gloo's: the control plane's, the store's, state transfers'."""
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    return True
                local_port = sock.getsockname()[1]
                try:
                    remote_port = sock.getpeername()[1]
                except OSError:
                    return True  # a listening socket
        except OSError:
            return True
        return local_port in self.known_local_ports or remote_port in self.known_remote_ports

    def drop(self) -> None:
        """Retire the current generation's backends (after a failure or before re-forming)."""
        if self._inner is not None:
            self._retired.append(self._inner)
        self._inner = None
        for child in self._children:
            child.drop()

    def note_failure(self, exc: BaseException | str) -> None:
        if self._parent is not None:
            self.root.note_failure(exc)
            return
        self.last_error = str(exc)[:500]
        first = not self.failed.is_set()
        self.failed.set()
        if first:
            self.break_transport()

    # ---------------------------------------------------------------- ProcessGroup API
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "baton"

    def getGroupName(self) -> str:  # noqa: N802 (torch's name)
        """The name torch.distributed registered this group under: a DeviceMesh built on it
        resolves its dimension's group by this name, so FSDP2 and DTensor collectives reach
        this live group and follow its generations."""
        return dist.distributed_c10d._world.pg_names.get(self, "")

    @property
    def group_name(self) -> str:
        return self.getGroupName()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def _backend(self, op: str = "") -> dist.ProcessGroup:
        self.root.issued_at = time.time()
        if op and self.guard is not None and not getattr(self._internal, "depth", 0):
            substitute = self.guard(op, self)
            if substitute is not None:
                return substitute
        if self._inner is None or self.failed.is_set():
            err = CollectiveFailure(f"baton live group has no healthy generation ({self.root.last_error})")
            self.failed.set()
            raise err
        return self._inner

    def _watch(self, work: dist.Work) -> dist.Work:
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's works for some collectives (reduce_scatter of lists) carry none
            return _FailureNotingWork(work, self.note_failure)
        future.add_done_callback(self._check)
        return work

    @selfcost.counted
    def _check(self, f: torch.futures.Future) -> None:
        try:
            f.value()
        except Exception as exc:  # noqa: BLE001 - any error here means the group is broken
            self.note_failure(exc)

    def reduce_gradients(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """DDP's bucket all-reduce (baton's own: no guard), resolving to the bucket itself.
        One Python callback per bucket, where a watched collective plus `then` would take two."""
        backend = self._backend()
        with selfcost.outside():  # the all-reduce DDP itself would issue: not baton's cost
            fut = backend.allreduce([tensor], dist.AllreduceOptions()).get_future()
        return fut.then(self._reduced)

    @selfcost.counted
    def _reduced(self, f: torch.futures.Future) -> torch.Tensor:
        try:
            return f.value()[0]
        except Exception as exc:  # noqa: BLE001 - any error here means the group is broken
            self.note_failure(exc)
            raise

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._watch(self._backend("allreduce").allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._watch(self._backend("allreduce_coalesced").allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._watch(self._backend("broadcast").broadcast(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._watch(self._backend("allgather").allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output, input, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._watch(self._backend("allgather_base")._allgather_base(output, input, opts))

    # FSDP2 (torch 2.13) gathers and reduce-scatters flat shards through the two single forms;
    # DTensor's redistributions (`full_tensor()`, full state dicts) go through the functional
    # collectives, which call the coalesced forms, one gloo collective per tensor here.
    def all_gather_single(self, output, input, opts=None):  # type: ignore[override]  # noqa: A002
        return self._per_tensor("all_gather_single", "_allgather_base", [output], [input],
                                opts if opts is not None else _c10d.AllgatherOptions())

    def reduce_scatter_single(self, output, input, opts=None):  # type: ignore[override]  # noqa: A002
        return self._per_tensor("reduce_scatter_single", "_reduce_scatter_base", [output], [input],
                                opts if opts is not None else dist.ReduceScatterOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):  # type: ignore[override]
        return self._per_tensor("allgather_into_tensor_coalesced", "_allgather_base", outputs, inputs,
                                opts if opts is not None else _c10d.AllgatherOptions())

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):  # type: ignore[override]
        return self._per_tensor("reduce_scatter_tensor_coalesced", "_reduce_scatter_base", outputs, inputs,
                                opts if opts is not None else dist.ReduceScatterOptions())

    def _per_tensor(self, op: str, method: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                    opts: Any) -> dist.Work:
        """One backend collective per (output, input) pair, waited on as one. gloo's works for
        these carry no future: a failure is noted when the work is waited on."""
        backend = self._backend(op)
        works = [getattr(backend, method)(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return _FailureNotingWork(works, self.note_failure)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._watch(self._backend("reduce_scatter").reduce_scatter(output_tensors, input_tensors, opts))

    def gather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.GatherOptions()
        return self._watch(self._backend("gather").gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._watch(self._backend("scatter").scatter(output_tensors, input_tensors, opts))

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._watch(self._backend("reduce").reduce(tensors, opts))

    def alltoall(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._watch(self._backend("alltoall").alltoall(output_tensors, input_tensors, opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._watch(self._backend("alltoall_base").alltoall_base(output, input, output_split_sizes,
                                                         input_split_sizes, opts))

    def barrier(self, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._watch(self._backend("barrier").barrier(opts))

    def send(self, tensors, dst, tag=0):  # type: ignore[override]
        return self._watch(self._backend("send").send(tensors, dst, tag))

    def recv(self, tensors, src, tag=0):  # type: ignore[override]
        return self._watch(self._backend("recv").recv(tensors, src, tag))


_BACKEND_NAME = "baton"


class _Internal:
    def __init__(self, local: threading.local):
        self._local = local

    def __enter__(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self._local.depth -= 1


def shut_down_sockets(fds: dict[int, str]) -> None:
    """Shut down each descriptor that is still the socket named beside it; leave the rest."""
    for fd, link in fds.items():
        try:
            held = os.dup(fd)  # pins whatever the number is now, so the check below stays true
        except OSError:
            continue
        if _fd_link(held) != link:
            os.close(held)  # closed by gloo; the number is now someone else's
            continue
        sock = socket.socket(fileno=held)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def _fd_link(fd: int) -> str:
    """What descriptor `fd` is now ("socket:[4711]"), "" if it is closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _socket_fds() -> dict[int, str]:
    """The process's socket descriptors, each with its "socket:[inode]" identity."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}  # not Linux: collectives still fail at their timeout
    fds = {}
    for name in names:
        link = _fd_link(int(name))
        if link.startswith("socket:"):
            fds[int(name)] = link
    return fds


def install_as_world(live: LiveGroup, store: dist.Store) -> None:
    """Make `live` torch.distributed's default group, so plain dist.* calls use it."""
    if _BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(_BACKEND_NAME, _create_live, devices=["cpu"])
    _PENDING[0] = live
    dist.init_process_group(_BACKEND_NAME, store=dist.PrefixStore("baton/world/", store),
                            rank=live.rank(), world_size=live.size())
    _PENDING[0] = None


_PENDING: list[LiveGroup | None] = [None]


def _create_live(store, rank, size, timeout):  # noqa: ANN001 - torch's plugin signature
    live = _PENDING[0]
    assert live is not None, "the baton backend is created by baton.init() only"
    return live
