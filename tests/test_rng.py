"""The random-stream capture: in-place reads agree with getstate(), and nothing escapes it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from baton.worker import rng


def _draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist(),
            np.random.standard_normal())


@pytest.fixture(params=["in place", "getstate"])
def reader(request, monkeypatch):
    """Both ways of reading Python's and numpy's generators; the second is the fallback for
    builds whose layout the probe does not recognise."""
    if request.param == "getstate":
        monkeypatch.setattr(rng, "_PY_AT", None)
        monkeypatch.setattr(rng, "_NP_AT", None)
    else:
        assert rng._PY_AT is not None and rng._NP_AT is not None, "probe failed on this build"
    return request.param


def test_restore_replays_every_stream_including_cached_normals(reader):
    random.gauss(0, 1)  # leaves random's gauss_next set
    np.random.standard_normal()  # and numpy's cached second normal
    saved = rng.capture()
    first = _draws()
    rng.restore(saved)
    assert _draws() == first
    assert not rng.describe_difference(rng.capture(), rng.capture())


def test_both_readers_give_the_same_value(monkeypatch):
    np.random.standard_normal()
    random.gauss(0, 1)
    in_place = rng.capture()
    monkeypatch.setattr(rng, "_PY_AT", None)
    monkeypatch.setattr(rng, "_NP_AT", None)
    assert rng.equal(in_place, rng.capture())


@pytest.mark.parametrize("draw, name", [
    (lambda: torch.rand(1), "torch"),
    (lambda: random.random(), "random"),
    (lambda: np.random.rand(), "numpy"),
])
def test_any_draw_is_named(reader, draw, name):
    before = rng.capture()
    draw()
    assert rng.describe_difference(rng.capture(), before) == [name]


def test_a_normal_served_from_numpys_cache_is_seen(reader):
    """The draw that changes no generator word, only numpy's has_gauss flag."""
    np.random.seed(3)
    np.random.standard_normal()  # draws two, returns one, caches the other
    before = rng.capture()
    np.random.standard_normal()  # served from the cache
    assert rng.describe_difference(rng.capture(), before) == ["numpy"]
    random.seed(3)
    random.gauss(0, 1)
    before = rng.capture()
    random.gauss(0, 1)  # random's own cached second value
    assert rng.describe_difference(rng.capture(), before) == ["random"]


def test_tracked_generators_are_captured_and_restored():
    gens = {"g": torch.Generator().manual_seed(1), "r": random.Random(2), "n": np.random.default_rng(3)}
    saved = rng.capture(gens)
    first = (torch.rand(2, generator=gens["g"]).tolist(), gens["r"].random(), gens["n"].random())
    assert sorted(rng.describe_difference(rng.capture(gens), saved)) == ["g", "n", "r"]
    rng.restore(saved, gens)
    assert (torch.rand(2, generator=gens["g"]).tolist(), gens["r"].random(), gens["n"].random()) == first
