"""A joiner's setup leaves out the random initialisation its rank's state overwrites.

A spare that takes a rank over runs the script's setup, and its model's constructors fill
every parameter with random numbers (`reset_parameters`, `init.normal_`): ~5 ms for each
1M parameters on our CPUs (a 1B model: seconds), inside a kill's downtime, for values the
rank's arriving state then replaces. A model-aware script says so itself (`job.joined`:
build on the meta device); here the script is unchanged, so baton decides op by op, below
autograd (a dispatch mode on the script's thread), and never changes a value anyone sees:

- An in-place random fill with the default CPU generator (`uniform_`, `normal_`, ...), the
  in-place scalar ops after it on the same memory (`trunc_normal_`'s `erfinv_`, `mul_`;
  `zeros_`, `ones_`), and a copy of that memory to another device or dtype (a model built
  on the CPU, then `model.to(device)` or `.half()`: the copy's memory is allocated, not
  filled), are recorded instead of run. Memory copied over whole (a resume block's
  `load_state_dict`) needs none of them: only their draws still run, into scratch memory,
  when the stream is next needed.
- Anything that reads that memory (an out-of-place op, a forward, a copy, `.tolist()`,
  `torch.save`, `repr`, a process forked or started), another draw from the default
  generator, `torch.manual_seed` or `torch.get_rng_state()` and their kin, or a tensor
  subclass (FSDP2's DTensor) runs everything recorded first, in order, on the generator as it was (a clone of it, where
  its state changed meanwhile): what the script reads is what it would have read.
- At the step loop (`finish`), where the state is about to arrive: what only the arriving
  state's tensors hold (every model's `state_dict()`, loaded whole), or nothing holds any
  more, is dropped; anything else recorded is run. The default generator is then behind
  where the draws would have left it; the rank's own streams replace it before the script
  runs on, and the setup's fingerprint (setup_check) takes the stream it would have had
  from a replay of the draws alone into scratch memory, on a low-priority thread
  (`StreamReplay`), checked before this process's first record names it.

Only the script's thread is watched (baton's own threads never see the mode). Not noticed
(the README's limits say so): memory read from another thread of the script's, or through a
raw pointer taken before; a seed set on `torch.default_generator` itself, not through
`torch.manual_seed`, to the state it had (that one the fingerprint's stream check catches:
the job stops).
"""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

log = logging.getLogger("baton.worker")

_SEEDED = torch.Tag.nondeterministic_seeded
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_storage_of = torch.Tensor.untyped_storage  # the original: the patched one would run the recorded ops
# Ops that make an alias or read only sizes: the memory they see is read later, if at all.
_METADATA = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.new_empty_strided.default}
_TO_COPY = torch.ops.aten._to_copy.default  # what `.to(device)`, `.cuda()`, `.half()` run
_COPY = torch.ops.aten.copy_.default
_TO_COPY_ARGS = {"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}
_INHERITED = object()  # a patched name the class only inherited: deleted again, not set
# What reads a tensor's memory without the dispatcher seeing it: each runs the recorded ops first.
_READERS = ("tolist", "numpy", "__array__", "data_ptr", "untyped_storage", "storage", "_typed_storage",
            "__dlpack__", "__reduce_ex__", "__repr__")


def _key(t: torch.Tensor) -> int:
    return _storage_of(t).data_ptr()


_TRAITS: dict[Any, tuple[bool, bool, bool]] = {}


def _traits(func: Any) -> tuple[bool, bool, bool]:
    """Whether `func` draws random numbers, writes its first argument alone in place, and
    only aliases or reads sizes (once per op: the schema is slow to read)."""
    traits = _TRAITS.get(func)
    if traits is None:
        args = func._schema.arguments
        in_place = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write and \
            not any(a.alias_info is not None and a.alias_info.is_write for a in args[1:])
        traits = _TRAITS[func] = (_SEEDED in func.tags, in_place, func.is_view or func in _METADATA)
    return traits


class _Entry:
    __slots__ = ("func", "args", "kwargs", "key", "seeded", "dead")

    def __init__(self, func: Any, args: tuple, kwargs: dict, key: int, seeded: bool):
        self.func, self.args, self.kwargs, self.key, self.seeded = func, args, kwargs, key, seeded
        self.dead = False  # its memory was written whole since: a draw still draws, into scratch memory

    def run(self, kwargs: dict) -> None:
        if not self.dead:
            self.func(*self.args, **kwargs)
        elif self.seeded:  # (the stream must move on as it would have)
            self.func(_scratch_like(self.args[0]), *self.args[1:], **kwargs)


def _scratch_like(t: torch.Tensor) -> torch.Tensor:
    """Memory of `t`'s layout (so a draw into it takes as many numbers as into `t`)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


class DeferredInit(TorchDispatchMode):
    """The mode (see the module's docstring). `install()` on the script's thread before its
    setup runs; `finish(...)` there at its step loop."""

    def __init__(self) -> None:
        super().__init__()
        self.owner = threading.get_ident()
        self.entries: list[_Entry] = []
        self.pending: set[int] = set()
        self.copies_of: dict[int, list[_Entry]] = {}  # key -> the recorded copies that read its memory
        self.start_state: torch.Tensor | None = None  # the default generator's, at the first recorded draw
        self.replaying = False
        self.ran = 0  # ops run late (read before the step loop), for the log
        self.left_out_bytes = 0  # the memory whose random fill `finish` dropped
        self.off = False  # finished, but not the innermost mode then: it only passes ops on
        self.finished = False
        self.disarm: Callable[[], None] = lambda: None  # `arm`'s patch, where no module was made
        self._originals: dict[tuple[Any, str], Any] = {}

    # ------------------------------------------------------------------ the dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.replaying or self.off:
            return func(*args, **kwargs)
        if any(t not in _PLAIN for t in types):  # a subclass's own dispatch reads its inner tensors unseen
            self.run_recorded()
            return func(*args, **kwargs)
        seeded, in_place, passes = _traits(func)
        if in_place and (seeded or self.pending) and self._recordable(args, kwargs, seeded):
            target = args[0]
            if seeded:
                state = torch.default_generator.get_state()
                if self.start_state is not None and not torch.equal(state, self.start_state):
                    self.run_recorded()  # seeded again since the recorded draws: they take the old stream
                if self.start_state is None:
                    self.start_state = state
            key = _key(target)
            # an alias of its memory, not the tensor: `param.data = ...` later gives the tensor other memory
            alias = torch.ops.aten.alias.default(target)
            self.entries.append(_Entry(func, (alias, *args[1:]), kwargs, key, seeded))
            self.pending.add(key)
            return target
        if func is _TO_COPY and self.pending and type(args[0]) in _PLAIN and _key(args[0]) in self.pending:
            moved = self._copy_later(args[0], kwargs)
            if moved is not None:
                return moved
        if func is _COPY and self.pending and type(args[0]) in _PLAIN and _key(args[0]) in self.pending \
                and _spans_storage(args[0]):
            self._written_whole(_key(args[0]), args[1])  # a resume block's load_state_dict, say
            return func(*args, **kwargs)
        if (seeded and self._default_generator(args, kwargs)) or (
                self.pending and not passes
                and any(isinstance(t, torch.Tensor) and _key(t) in self.pending for t in tree_leaves((args, kwargs)))):
            self.run_recorded()  # a draw after the recorded ones, or a read of their memory: theirs first
        return func(*args, **kwargs)

    def _recordable(self, args: tuple, kwargs: dict, seeded: bool) -> bool:
        target = args[0]
        if type(target) not in _PLAIN or target.device.type != "cpu" or target.layout is not torch.strided \
                or target.numel() == 0:
            return False
        if seeded:
            if kwargs.get("generator") is not None:
                return False
        elif _key(target) not in self.pending:
            return False  # a scalar op on memory not recorded: it costs nothing to run
        return not any(isinstance(x, (torch.Tensor, torch.Generator)) for x in tree_leaves((args[1:], kwargs)))

    def _written_whole(self, key: int, src: Any) -> None:
        """Memory with recorded ops is copied over whole: they are dead (their draws still
        count for the stream), unless a recorded copy still reads it, or `src` is recorded."""
        reads = any(not e.dead for e in self.copies_of.get(key, ()))
        if reads or (isinstance(src, torch.Tensor) and _key(src) in self.pending):
            self.run_recorded()
            return
        for e in self.entries:
            if e.key == key:
                e.dead = True
        self.pending.discard(key)

    def _copy_later(self, src: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """`src.to(device or dtype)` of recorded memory (`model.to(device)`, `.half()`): the
        copy's memory, its copy recorded after the ops it copies (None where it cannot be)."""
        if not set(kwargs) <= _TO_COPY_ARGS or kwargs.get("layout", torch.strided) is not torch.strided:
            return None
        device = torch.device(kwargs.get("device") or src.device)
        if device.type not in ("cpu", "cuda"):
            return None  # (meta memory has no address to key it by)
        out = torch.empty_like(src, dtype=kwargs.get("dtype") or src.dtype, device=device,
                               memory_format=kwargs.get("memory_format") or torch.preserve_format,
                               pin_memory=bool(kwargs.get("pin_memory")))
        key = _key(out)
        copy = _Entry(_COPY, (torch.ops.aten.alias.default(out), torch.ops.aten.alias.default(src)), {}, key, False)
        self.entries.append(copy)
        self.copies_of.setdefault(_key(src), []).append(copy)
        self.pending.add(key)
        return out

    @staticmethod
    def _default_generator(args: tuple, kwargs: dict) -> bool:
        gens = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Generator)]
        return not gens or any(g is torch.default_generator for g in gens)

    # ------------------------------------------------------------------ running what was recorded
    def run_recorded(self) -> None:
        """Run the recorded ops in order (all of them), on the default generator where the
        script left it alone since the first recorded draw, else on a clone of it as it was."""
        if not self.entries:
            return
        entries, start = self._take()
        self.replaying = True
        try:  # below autograd, as they were recorded there (no second bump of a version counter)
            clone = None
            if start is not None and not torch.equal(torch.default_generator.get_state(), start):
                clone = torch.Generator().set_state(start)  # seeded again since: the draws' stream, apart
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for e in entries:
                    e.run({**e.kwargs, "generator": clone} if e.seeded and clone is not None else e.kwargs)
            self.ran += len(entries)
        finally:
            self.replaying = False

    def _take(self) -> tuple[list[_Entry], torch.Tensor | None]:
        """The records and the generator's state at their first draw, no longer recorded."""
        taken = self.entries, self.start_state
        self.entries, self.pending, self.copies_of, self.start_state = [], set(), {}, None
        return taken

    def _unreachable(self) -> set[int]:
        """The recorded memory nothing but the records holds any more (a tensor the script gave
        other memory, `param.data = ...`, `Module.to`, or dropped): no one can read it."""
        held: dict[int, tuple[torch.Tensor, int]] = {}  # key -> (one alias of it, how many the records hold)
        for e in self.entries:
            for t in e.args:
                if isinstance(t, torch.Tensor):
                    key = _key(t)
                    held[key] = (t, held[key][1] + 1 if key in held else 1)
        out = set()
        for key, (alias, count) in held.items():
            storage = _storage_of(alias)
            if torch._C._storage_Use_Count(storage._cdata) == count + 1:  # the records' aliases, and `storage`
                out.add(key)
        return out

    def _reads(self, t: Any) -> None:
        if self.entries and threading.get_ident() == self.owner and isinstance(t, torch.Tensor) \
                and _key(t) in self.pending:
            self.run_recorded()

    def _any(self) -> None:
        if self.entries and threading.get_ident() == self.owner:
            self.run_recorded()

    # ------------------------------------------------------------------ in and out
    def install(self) -> DeferredInit:
        _ACTIVE[0] = self
        self._patch(multiprocessing.process.BaseProcess, "start", _first(self, multiprocessing.process.BaseProcess.start))
        for name in _READERS:
            original = getattr(torch.Tensor, name)
            self._patch(torch.Tensor, name, _reading(self, original))
        for module in (torch, torch.random):  # a seed set again reads as the state it had: seen here
            for name in ("get_rng_state", "set_rng_state", "manual_seed", "seed"):
                self._patch(module, name, _first(self, getattr(module, name)))
        self._patch(torch, "save", _first(self, torch.save))
        self.__enter__()
        return self

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._originals[(owner, name)] = owner.__dict__.get(name, _INHERITED)
        setattr(owner, name, replacement)

    def _uninstall(self) -> None:
        if _python_dispatch._get_current_dispatch_mode() is self:
            self.__exit__(None, None, None)
        else:  # the script's own mode above it (it entered one and never left): pass ops on from now
            self.off = True
        for (owner, name), original in self._originals.items():
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()

    def finish(self, overwritten: Iterable[torch.Tensor]) -> StreamReplay | None:
        """The setup reached the step loop: stop watching. The recorded ops whose memory only
        `overwritten` (what the arriving state is loaded into, whole) holds are dropped, where
        every one is; else all run now. With draws dropped, the replay that gives the stream
        the setup would have left (None where none were, or the generator was seeded since)."""
        self.finished = True
        self.disarm()
        if _ACTIVE[0] is self:
            _ACTIVE[0] = None
        if self._originals:
            self._uninstall()
        if not self.entries:
            return None
        whole = {_key(t) for t in overwritten if _spans_storage(t)} | self._unreachable()
        if any(e.key not in whole and not e.dead for e in self.entries):
            n = len(self.entries)
            t0 = time.perf_counter()
            self.run_recorded()
            log.info("deferred initialisation: %d ops run at the step loop (%.3fs): not all of their memory "
                     "receives the rank's state", n, time.perf_counter() - t0)
            return None
        entries, start = self._take()
        filled = {e.key: e.args[0] for e in entries if e.seeded}
        self.left_out_bytes = sum(_storage_of(t).nbytes() for t in filled.values())
        log.info("deferred initialisation: %d ops on %.1f MB left out (the rank's state overwrites their memory), "
                 "%d run earlier where the setup read their memory", len(entries), self.left_out_bytes / 1e6, self.ran)
        if start is None or not torch.equal(torch.default_generator.get_state(), start):
            return None  # no draws, or a seed since: the generator is as the script left it
        return StreamReplay(start, [e for e in entries if e.seeded])


_ACTIVE: list[DeferredInit | None] = [None]  # the installed mode, for the hook below


def _before_fork() -> None:
    """A process forked from the script's thread (a DataLoader's workers started in the setup)
    gets memory as it is: what was recorded runs first. (A spawned one pickles what it takes:
    `BaseProcess.start` is patched the same way.)"""
    mode = _ACTIVE[0]
    if mode is not None:
        mode._any()


os.register_at_fork(before=_before_fork)


def _spans_storage(t: torch.Tensor) -> bool:
    """Writing `t` whole writes every byte of its memory."""
    if type(t) not in _PLAIN or t.device.type not in ("cpu", "cuda") or t.numel() == 0:
        return False
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.numel() * t.element_size() == _storage_of(t).nbytes()


def _reading(mode: DeferredInit, original: Callable[..., Any]) -> Callable[..., Any]:
    def reading(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode._reads(self)
        return original(self, *args, **kwargs)

    reading.__name__ = getattr(original, "__name__", "reading")
    reading.__doc__ = getattr(original, "__doc__", None)
    return reading


def _first(mode: DeferredInit, original: Callable[..., Any]) -> Callable[..., Any]:
    def first(*args: Any, **kwargs: Any) -> Any:
        mode._any()
        return original(*args, **kwargs)

    first.__name__ = getattr(original, "__name__", "first")
    first.__doc__ = getattr(original, "__doc__", None)
    return first


_MODULE_INIT = torch.nn.Module.__init__
OFF = "BATON_DEFERRED_INIT"  # =0: a joiner's setup runs every op (a side by side measure, a way out)


def arm() -> DeferredInit:
    """A joiner's mode, installed by the script's thread at its first module's construction
    (the ops of a setup before its model, a dataset built op by op, run at full speed)."""
    mode = DeferredInit()
    if os.environ.get(OFF, "1") == "0":
        mode.finished = True  # never installed: finish() has nothing to do
        return mode
    original = _MODULE_INIT

    def first_module(module: Any, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() == mode.owner and torch.nn.Module.__init__ is first_module:
            torch.nn.Module.__init__ = original  # type: ignore[method-assign]
            if not mode.finished:
                mode.install()
        original(module, *args, **kwargs)

    torch.nn.Module.__init__ = first_module  # type: ignore[method-assign]
    mode.disarm = lambda: setattr(torch.nn.Module, "__init__", original) \
        if torch.nn.Module.__init__ is first_module else None
    return mode


def warm_up() -> None:
    """Pay the mode's first use (its ops' traits, the replay thread) while a spare waits;
    no stream of the script's is drawn from."""
    mode = DeferredInit().install()
    x = torch.empty(16)
    x.uniform_()
    replay = mode.finish([x])
    if replay is not None:
        replay.result()


class StreamReplay:
    """The default generator's state had the dropped draws run: they run again, into scratch
    memory of their shapes, on a clone of the generator, on a thread at the lowest priority
    (it takes what CPU the move leaves idle). `result()` waits for it."""

    def __init__(self, start: torch.Tensor, draws: list[_Entry]):
        self._future: Future[torch.Tensor] = Future()
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(start, draws), name="baton-stream-replay",
                                        daemon=True)
        self._thread.start()

    def _run(self, start: torch.Tensor, draws: list[_Entry]) -> None:
        t0 = time.perf_counter()
        try:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
            gen = torch.Generator().set_state(start)
            scratch: dict[torch.dtype, torch.Tensor] = {}  # one buffer a dtype, of the largest draw's extent
            for e in draws:  # (dead ones too: the stream moved on past them)
                t = e.args[0]
                extent = 1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride()))
                if scratch.get(t.dtype) is None or scratch[t.dtype].numel() < extent:
                    scratch[t.dtype] = torch.empty(extent, dtype=t.dtype)
                into = scratch[t.dtype].as_strided(t.size(), t.stride())  # its layout: the same draws
                e.func(into, *e.args[1:], **{**e.kwargs, "generator": gen})
            self.seconds = time.perf_counter() - t0
            self._future.set_result(gen.get_state())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._future.set_exception(exc)

    def result(self) -> torch.Tensor:
        state = self._future.result()
        self._thread.join()  # its end too: an interpreter leaving while it still ran aborted (SIGABRT)
        return state
