"""The joiner's early fetch: one fetch per Form, handed to the step loop only for that very
Form, with the fetch's own error; nothing started once the step loop has taken over.
(The fetch itself, over real sockets during a real script's setup: test_fsdp_group.)"""

from __future__ import annotations

import threading

import pytest

from baton.control import messages as m
from baton.transfer import FetchStats, TransferError
from baton.worker.prefetch import Prefetch


def _form(generation: int, port: int = 9000) -> m.Form:
    return m.Form(generation=generation, pos=(5, 0), fetch_from=[("127.0.0.1", port)], snapshot=True)


def test_a_form_offered_twice_is_fetched_once_and_taken_by_that_form_only():
    calls: list[int] = []
    release = threading.Event()

    def fetch(form: m.Form):
        calls.append(form.generation)
        release.wait(5)
        return {"pos": [5, 0]}, FetchStats(bytes=10, seconds=0.01)

    pre = Prefetch(fetch)
    pre.offer(_form(3))
    pre.offer(_form(3))  # the poll thread and the queue scan may both show it
    release.set()
    assert pre.take(_form(3, port=9001)) is None  # same generation, other sources: fetched afresh
    assert calls == [3]

    pre.offer(_form(4))
    state, stats = pre.take(_form(4))
    assert state == {"pos": [5, 0]} and stats.bytes == 10
    assert calls == [3, 4]


def test_the_fetchs_error_reaches_the_step_loop():
    def fetch(form: m.Form):
        raise TransferError("source refused: no snapshot of step 5")

    pre = Prefetch(fetch)
    pre.offer(_form(2))
    with pytest.raises(TransferError, match="no snapshot of step 5"):
        pre.take(_form(2))


def test_nothing_starts_after_close_or_without_sources():
    calls: list[int] = []
    pre = Prefetch(lambda form: calls.append(form.generation))  # type: ignore[func-returns-value]
    pre.offer(m.Form(generation=1, pos=(0, 0)))  # a survivor's Form: nothing to fetch
    pre.offer(m.Form(generation=1, pos=(0, 0), fetch_from=[("127.0.0.1", 9000)]))  # DDP: in the step loop
    pre.close()
    pre.offer(_form(2))
    assert pre.take(_form(2)) is None and calls == []
