"""A torchrun command line under `baton run` as it is: torchrun's launcher flags are taken
(`--standalone`, `--nnodes=1`, `--max-restarts`, the rendezvous flags), each that baton
does not need said so in one line, and those it cannot honour (an elastic number of nodes,
one launcher per node, a module, another executable) refused with the reason before
anything starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} summed {int(t)}", flush=True)
dist.destroy_process_group()
"""


def _baton_run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.run([sys.executable, "-m", "baton.cli", "run", *flags, "--run-dir", str(tmp_path / "run"),
                           str(script)], capture_output=True, text=True, timeout=170, cwd=tmp_path)


def test_a_torchrun_command_line_runs_as_it_is(tmp_path):
    done = _baton_run(tmp_path, "--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
                      "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400", "--rdzv-id=456", "--master_port",
                      "29501", "--spares", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank ")) == \
        ["rank 0 of 2 summed 2", "rank 1 of 2 summed 2"], done.stdout
    for note in ("--max-restarts 3: not needed, baton restarts nothing: a failed rank moves to a spare",
                 "--rdzv-endpoint localhost:29400: not needed", "--master-port 29501: not needed"):
        assert note in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("flags, said", [
    (["--nnodes", "1:4"], "an elastic number of nodes (MIN:MAX) changes the world size"),
    (["--nnodes", "2", "--node-rank", "1"], "--node-rank 1: torchrun runs one launcher per node"),
    (["-m"], "-m/--module: baton runs a script's file"),
    (["--no-python"], "--no-python: baton runs Python training scripts"),
], ids=["elastic", "node-rank", "module", "no-python"])
def test_a_torchrun_flag_baton_cannot_honour_is_refused_before_anything_starts(tmp_path, flags, said):
    done = _baton_run(tmp_path, "--nproc-per-node", "2", *flags)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists() and "started" not in done.stderr
