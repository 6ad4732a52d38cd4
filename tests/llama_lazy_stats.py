"""The llama example (baton/examples/llama.py) with running statistics that each RMSNorm
registers on its first training forward: a persistent buffer, each rank's own under FSDP2
and HSDP (nothing syncs buffers there), and a key of the model's state dict from then on.

A joiner builds its model afresh and has no such buffer until its own first forward, so it
must receive them, with their values, from its predecessor's state: a fresh model refuses
those keys ("Unexpected key(s) in state_dict"), and statistics started again from zero would
end a run that differs from the failure-free one. tests/test_fsdp_group.py runs this under
torchrun and under baton."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

import baton  # noqa: F401 - model-aware: llama.main() below calls baton.init(), and baton run sees it here

_spec = importlib.util.spec_from_file_location(
    "llama", Path(__file__).resolve().parent.parent / "baton" / "examples" / "llama.py")
llama = sys.modules["llama"] = importlib.util.module_from_spec(_spec)  # (its dataclasses look it up)
_spec.loader.exec_module(llama)
_plain_forward = llama.RMSNorm.forward


def _forward_with_statistics(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.training:
        if "running_mean" not in self._buffers:
            self.register_buffer("running_mean", torch.zeros(x.shape[-1]))
        self.running_mean.mul_(0.9).add_(x.detach().float().mean((0, 1)), alpha=0.1)
    return _plain_forward(self, x)


llama.RMSNorm.forward = _forward_with_statistics

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    llama.main()
