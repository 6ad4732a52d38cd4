import os

import pytest

from tests.cpu_by_test import pytest_configure, pytest_unconfigure  # noqa: F401 - BATON_TEST_CPU
from tests.gpt_job import reference_run
from tests.once import once
from tests.warm_process import WarmProcess

# Inductor compiles in the compiling process itself, not in a pool of compile workers that
# each import torch (two more processes per compiling rank, ~2 CPU-s each, on 2 cores that
# could not run them in parallel anyway). Same generated code; set before the warm process
# starts, so every job and torchrun reference inherits it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def warm_process():
    """One `baton warm` per test worker, as a machine that starts many jobs would run it: each
    job's zygote is its fork (BATON_WARM), where each used to import torch for itself, about
    4 CPU-s a job on a 2-core machine. A job it cannot serve exactly starts its own zygote and
    says why in its log. tests/test_warm.py tests the warm process itself. BATON_TEST_WARM=0:
    none (to compare)."""
    if os.environ.get("BATON_TEST_WARM") == "0":
        yield None
        return
    warm = WarmProcess().wait_ready()
    os.environ["BATON_WARM"] = str(warm.socket)
    yield warm
    os.environ.pop("BATON_WARM", None)
    warm.stop()


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """The nanoGPT-shaped example's failure-free run, shared by every test that compares to it."""
    return once(tmp_path_factory, "gpt-reference", reference_run)


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory):
    """Failure-free runs of baton/examples/train.py, one per (ranks, steps, script args), shared
    by every test that compares with the same one: `train_reference(nproc, steps, args)` is
    every rank's final state."""
    from tests.jobs import Job

    def run(nproc: int, steps: int, args: list[str], folder) -> list:
        ref = Job(folder, nproc=nproc, spares=0, steps=steps, script_args=args)
        try:
            assert ref.wait(timeout=180) == 0, ref.log()
        finally:
            ref.kill()
        return ref.all_rank_params(nproc)

    def get(nproc: int, steps: int, args: list[str]) -> list:
        return once(tmp_path_factory, ("train", nproc, steps, tuple(args)), lambda d: run(nproc, steps, args, d))

    return get


@pytest.fixture(scope="session")
def torchrun_reference(tmp_path_factory):
    """Failure-free torchrun runs of a test script, one per (script text, arguments, ranks,
    environment), shared by the tests that compare with the same one:
    `torchrun_reference(script, args, env=...)` is the run's folder. `{d}` in an argument or
    an environment value stands for that folder (exports go to `{d}/export`)."""
    from tests.nocode_runs import torchrun

    def run(script, args: list[str], nproc: int, env: dict[str, str], d):
        (d / "export").mkdir()
        torchrun(script, [a.format(d=d) for a in args], nproc, d, env={k: v.format(d=d) for k, v in env.items()})
        return d

    def get(script, args: list[str], nproc: int = 2, env: dict[str, str] | None = None):
        key = ("torchrun", script.read_text(), tuple(args), nproc, tuple(sorted((env or {}).items())))
        return once(tmp_path_factory, key, lambda d: run(script, args, nproc, env or {}, d))

    return get
