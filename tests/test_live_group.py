"""The live group's formation, in one process: a gloo connect that cannot complete is given up."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from baton.worker.group import CollectiveFailure, connect_gloo


def test_a_formation_superseded_while_gloo_connects_is_given_up_at_once():
    """gloo's constructor waits for a peer that never comes (here: one that never announces
    itself; on a cluster: one whose link went down, its SYNs dropped, which blocks in the
    kernel for minutes). The orchestrator's next plan supersedes the formation: the rank
    stops waiting within milliseconds, while gloo's own wait runs out on its thread."""
    superseded = threading.Event()
    threading.Timer(0.3, superseded.set).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveFailure, match="superseded while gloo was connecting"):
        connect_gloo(dist.HashStore(), 0, 2, 30.0, (), 7, superseded.is_set)
    assert time.monotonic() - t0 < 5.0


def test_a_formation_is_given_up_once_gloos_timeout_has_passed():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):  # gloo's own timeout, or ours just after it
        connect_gloo(dist.HashStore(), 0, 2, 0.5, (), 8, lambda: False)
    assert time.monotonic() - t0 < 0.5 + 2.0 + 2.0
