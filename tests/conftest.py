import pytest

from tests.gpt_job import reference_run


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """The nanoGPT-shaped example's failure-free run, shared by every test that compares to it."""
    return reference_run(tmp_path_factory.mktemp("gpt-ref"))


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory):
    """Failure-free runs of baton/examples/train.py, one per (ranks, steps, script args), shared
    by every test that compares with the same one: `train_reference(nproc, steps, args)` is
    every rank's final state."""
    from tests.jobs import Job

    done: dict[tuple, list] = {}

    def get(nproc: int, steps: int, args: list[str]) -> list:
        key = (nproc, steps, tuple(args))
        if key not in done:
            ref = Job(tmp_path_factory.mktemp("train-ref"), nproc=nproc, spares=0, steps=steps, script_args=args)
            try:
                assert ref.wait(timeout=180) == 0, ref.log()
            finally:
                ref.kill()
            done[key] = ref.all_rank_params(nproc)
        return done[key]

    return get


@pytest.fixture(scope="session")
def torchrun_reference(tmp_path_factory):
    """Failure-free torchrun runs of a test script, one per (script text, arguments, ranks,
    environment) in this worker, shared by the tests that compare with the same one:
    `torchrun_reference(script, args, env=...)` is the run's folder. `{d}` in an argument or
    an environment value stands for that folder (exports go to `{d}/export`)."""
    from tests.nocode_runs import torchrun

    done: dict[tuple, object] = {}

    def get(script, args: list[str], nproc: int = 2, env: dict[str, str] | None = None):
        key = (script.read_text(), tuple(args), nproc, tuple(sorted((env or {}).items())))
        if key not in done:
            d = tmp_path_factory.mktemp("torchrun-ref")
            (d / "export").mkdir()
            torchrun(script, [a.format(d=d) for a in args], nproc, d,
                     env={k: v.format(d=d) for k, v in (env or {}).items()})
            done[key] = d
        return done[key]

    return get
