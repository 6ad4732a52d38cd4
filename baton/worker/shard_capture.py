"""The DCP state-dict helpers' answer, without asking them at every step boundary.

A redundant FSDP2 rank snapshots its shards at every boundary. What the helpers return
for an FSDP2 model and its optimizer is, key by key, the live shards themselves: each
model entry a DTensor over the parameter's own local tensor, each optimizer entry the
very tensor in `optimizer.state`, and param_groups the optimizer's with parameters named
by their FQN. Finding that again costs ~5 ms of Python per boundary for a 4-block model.

So the first answer is learned: for a model, which live tensor each key is; for an
optimizer, each parameter's FQN. Later boundaries rebuild the same answer from the live
objects, as long as the objects are the ones learned (a fingerprint of parameter and
tensor identities, checked every time). An answer learned is used only if, rebuilt at
once, it equals the helpers' own, entry for entry and tensor for tensor; and every
REVALIDATE_EVERY boundaries the helpers are asked again and compared. Anything the
rebuild cannot reproduce (a state-dict hook, extra state, a copy the helpers made) makes
that object go through the helpers every time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from baton.transfer import codec
from baton.worker import registrations
from baton.worker.dtensors import is_dtensor

log = logging.getLogger("baton.worker")

REVALIDATE_EVERY = 50


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if is_dtensor(t) else t  # noqa: SLF001 - to_local() without autograd


def same(a: Any, b: Any) -> bool:
    """Equal answers: the same keys in the same order, tensors over the same memory (same
    dtype, shape and strides), other values equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or type(a) is not type(b):
            return False
        if is_dtensor(a) and (a.placements != b.placements or a.device_mesh != b.device_mesh
                                       or a.shape != b.shape):
            return False
        la, lb = _local(a), _local(b)
        return (la.data_ptr() == lb.data_ptr() and la.dtype == lb.dtype and la.shape == lb.shape
                and la.stride() == lb.stride())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Learned:
    def __init__(self, fingerprint: tuple, rebuild: Callable[[], Any],
                 encode: Callable[[], codec.Encoded] | None):
        self.fingerprint, self.rebuild, self.encode, self.uses = fingerprint, rebuild, encode, 0


class Learning:
    """What `learn` makes of the helpers' answer: how to rebuild it, and (optionally) how to
    encode it without walking it (codec.Encoded, checked against the codec's own)."""

    def __init__(self, rebuild: Callable[[], Any], encode: Callable[[], codec.Encoded] | None = None):
        self.rebuild, self.encode = rebuild, encode


def same_encoding(a: codec.Encoded, b: codec.Encoded) -> bool:
    return a.skeleton == b.skeleton and same(a.tensors, b.tensors)


class ShardCapture:
    """One tracked object's state dict through the helpers (`ask`), learned once it can be."""

    def __init__(self, name: str, ask: Callable[[], Any], fingerprint: Callable[[], tuple],
                 learn: Callable[[Any], Learning | None]):
        self.name, self._ask, self._fingerprint, self._learn = name, ask, fingerprint, learn
        self._learned: _Learned | None = None
        self.disabled = False
        self.rebuilt = 0  # answers rebuilt without the helpers (tests read it)

    def __call__(self) -> Any:
        return self._get(encoded=False)

    def live(self) -> Any | None:
        """The learned answer, whose tensors are the live shards themselves (a load may copy
        into them), or None where nothing learned holds now (the helpers' answer may be copies)."""
        self()  # learns at the first call, and re-learns after a change
        learned = self._learned
        if learned is None or self.disabled or learned.fingerprint != self._fingerprint():
            return None
        return learned.rebuild()

    def encoded(self) -> codec.Encoded:
        """The answer, encoded (the snapshot's form): without walking it where learned."""
        return self._get(encoded=True)

    def _get(self, encoded: bool) -> Any:
        fp = None if self.disabled else self._fingerprint()
        learned = self._learned
        if learned is not None and learned.fingerprint == fp and learned.uses % REVALIDATE_EVERY:
            learned.uses += 1
            self.rebuilt += 1
            if not encoded:
                return learned.rebuild()
            return learned.encode() if learned.encode is not None else codec.encoded(learned.rebuild())
        answer = self._ask()
        if fp is not None:
            self._check_or_learn(fp, answer)
        return codec.encoded(answer) if encoded else answer

    def _check_or_learn(self, fp: tuple, answer: Any) -> None:
        learned = self._learned
        if learned is not None and learned.fingerprint == fp:
            if self._matches(learned, answer):
                learned.uses += 1  # revalidated
                return
            log.warning("%s: the learned state dict no longer matches the DCP helpers' answer; asking them "
                        "at every boundary from now on", self.name)
            self.disabled, self._learned = True, None
            return
        learning = self._learn(answer)
        self._learned = None
        if learning is not None:
            candidate = _Learned(fp, learning.rebuild, learning.encode)
            if self._matches(candidate, answer):
                candidate.uses = 1
                self._learned = candidate

    @staticmethod
    def _matches(learned: _Learned, answer: Any) -> bool:
        """The learned answer is the helpers', entry for entry over the same memory, and so is
        its encoding (skeleton and tensors) where it encodes itself."""
        if not same(learned.rebuild(), answer):
            return False
        if learned.encode is not None and not same_encoding(learned.encode(), codec.encoded(answer)):
            learned.encode = None  # rebuild, then encode by walking: still right, only slower
        return True


def _places(model: torch.nn.Module) -> list[tuple[dict, str]]:
    """Where each of the model's parameters and buffers is registered."""
    out = []
    for module in model.modules():
        out.extend((module._parameters, n) for n in module._parameters)  # noqa: SLF001
        out.extend((module._buffers, n) for n in module._buffers)  # noqa: SLF001
    return out


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor an encode makes of a live shard, when that needs no copy (else None)."""
    t = _local(t)
    if t.requires_grad:  # a parameter's (optimizer state never is: detach costs ~1 us a tensor)
        t = t.detach()
    return t if t.is_cpu and t.is_contiguous() else None


def for_model(name: str, model: torch.nn.Module, ask: Callable[[], Any],
              to_local: Callable[[Any], Any]) -> ShardCapture:
    """`ask`: the helpers' answer with DTensors made local by `to_local` (shards.py's form)."""
    found: list = [-1, []]  # the registration count when the places were found, and the places

    def fingerprint() -> tuple:
        now = registrations.count()
        if found[0] != now:
            found[:] = [now, _places(model)]
        live = [d.get(n) for d, n in found[1]]
        return (found[0], tuple(id(t) for t in live), tuple(id(t._local_tensor) for t in live  # noqa: SLF001
                                                               if is_dtensor(t)))

    def learn(answer: Any) -> Learning | None:
        live = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        if not isinstance(answer, dict) or set(answer) - set(live):
            return None  # entries that are not parameters or buffers (extra state, hooks)
        keys = list(answer)
        sources = [live[k] for k in keys]

        def rebuild() -> dict[str, Any]:
            return to_local({k: t.detach() if not is_dtensor(t) else t for k, t in zip(keys, sources)})

        skeleton = codec.Dumped(codec.encoded(rebuild()).skeleton)

        def encode() -> codec.Encoded:
            tensors = [_plain(t) for t in sources]
            if any(t is None for t in tensors):
                return codec.encoded(rebuild())
            return codec.Encoded(skeleton, tensors)

        return Learning(rebuild, encode)

    return ShardCapture(name, ask, fingerprint, learn)


def for_optimizer(name: str, optimizer: torch.optim.Optimizer, ask: Callable[[], Any],
                  to_local: Callable[[Any], Any]) -> ShardCapture:
    def fingerprint() -> tuple:
        return tuple((id(p), tuple(optimizer.state[p]) if p in optimizer.state else None)
                     for group in optimizer.param_groups for p in group["params"]) + \
            tuple(tuple(g) for g in optimizer.param_groups)

    def learn(answer: Any) -> Learning | None:
        try:
            groups = answer["param_groups"]
            fqns = [list(g["params"]) for g in groups]
            if len(groups) != len(optimizer.param_groups) or list(answer) != ["state", "param_groups"] or any(
                    len(f) != len(g["params"]) for f, g in zip(fqns, optimizer.param_groups)):
                return None
            by_fqn = {fqn: p for f, g in zip(fqns, optimizer.param_groups) for fqn, p in zip(f, g["params"])}
            order = list(answer["state"])
            params = [by_fqn[fqn] for fqn in order]
        except (KeyError, TypeError):
            return None

        def param_groups() -> list[dict[str, Any]]:
            return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(f)}
                    for g, f in zip(optimizer.param_groups, fqns)]

        def rebuild() -> dict[str, Any]:
            state = {fqn: dict(optimizer.state[p]) for fqn, p in zip(order, params)}
            return to_local({"state": state, "param_groups": param_groups()})

        # The state's skeleton is fixed while the fingerprint (each parameter's state keys) is;
        # param_groups (the LR changes every step) are encoded at every boundary.
        state_skeleton = codec.Dumped(codec.encoded(rebuild()["state"]).skeleton)
        slots = [(p, list(optimizer.state[p])) for p in params]

        def encode() -> codec.Encoded:
            tensors = []
            state = optimizer.state
            for p, keys in slots:
                st = state[p]
                for k in keys:
                    v = st[k]
                    t = _plain(v) if isinstance(v, torch.Tensor) else None
                    if t is None:  # a value the skeleton cannot hold: walk it
                        return codec.encoded(rebuild())
                    tensors.append(t)
            groups = codec.encode_into(to_local(param_groups()), tensors)
            return codec.Encoded({"state": state_skeleton, "param_groups": groups}, tensors)

        return Learning(rebuild, encode)

    return ShardCapture(name, ask, fingerprint, learn)
