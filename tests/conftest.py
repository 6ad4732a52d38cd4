import pytest

from tests.gpt_job import reference_run


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """The nanoGPT-shaped example's failure-free run, shared by every test that compares to it."""
    return reference_run(tmp_path_factory.mktemp("gpt-ref"))
