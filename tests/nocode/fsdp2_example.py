"""A plain torchrun script in the shape of pytorch/examples' distributed/FSDP2/example.py and
its checkpoint.py (CPU + gloo, tiny).

Shape features kept from the original:
- `main(args)` reads LOCAL_RANK/RANK/WORLD_SIZE from the env at its top, joins the process
  group, builds a 1-d `init_device_mesh("cpu", (world_size,))`, seeds torch;
- a tiny Transformer built on the meta device, `fully_shard` on every block then on the root
  (optional `--mixed-precision`: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)),
  `inspect_model` / `inspect_mixed_precision` checks, optional explicit forward/backward
  prefetching; `to_empty` + `reset_parameters` when there is no checkpoint;
- a `Checkpointer` over --checkpoint-dir/<format>/<number>/ that finds the last checkpoint,
  loads model then optimizer from it, and saves at the end, through the DCP state-dict
  helpers: `--checkpoint-format full` (default; rank 0 torch.save of full state dicts, loaded
  with broadcast_from_rank0) or `sharded` (torch.distributed.checkpoint save/load of
  sharded state dicts);
- a loop of random token batches drawn with torch.randint, clip_grad_norm_, Adam(W).
Extra: `--export DIR` gathers the full model/optimizer state dicts (a collective, every rank)
and saves each rank's final state to DIR/rank{RANK}.pt.
"""

import argparse
import logging
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 128
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.1


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.p = a.n_heads, a.dropout_p
        self.attention_norm, self.ffn_norm = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.wqkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.w1, self.w2 = nn.Linear(a.dim, 4 * a.dim), nn.Linear(4 * a.dim, a.dim)
        self.resid_dropout = nn.Dropout(a.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        h = x + self.resid_dropout(self.wo(y.transpose(1, 2).reshape(b, t, d)))
        return h + self.resid_dropout(self.w2(F.gelu(self.w1(self.ffn_norm(h)))))

    def reset_parameters(self) -> None:
        for m in (self.attention_norm, self.ffn_norm, self.wqkv, self.wo, self.w1, self.w2):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.pos_embeddings = nn.Embedding(a.max_seq_len, a.dim)
        self.dropout = nn.Dropout(a.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layers))
        self.norm = nn.LayerNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1)))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self) -> None:
        for m in (self.tok_embeddings, self.pos_embeddings, self.norm, self.output):
            m.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


def inspect_model(model: FSDPModule) -> None:
    assert isinstance(model, Transformer) and isinstance(model, FSDPModule)
    if dist.get_rank() == 0:
        print(model)
    for param in model.parameters():
        assert param.placements == (Shard(0),) and param.dtype == torch.float32


def inspect_mixed_precision(model: FSDPModule) -> None:
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()


class Checkpointer:
    def __init__(self, folder: str, fmt: str):
        self.folder, self.fmt = os.path.join(folder, fmt), fmt
        names = [int(n) for n in os.listdir(self.folder) if n.isdigit()] if os.path.isdir(self.folder) else []
        self.last_training_time = max(names) if names else None

    def _path(self, name: str = "") -> str:
        return os.path.join(self.folder, str(self.last_training_time), name)

    def _load_rank0(self, name: str) -> dict:  # only rank 0 reads; the others get a broadcast
        if dist.get_rank() != 0:
            return {}
        return torch.load(self._path(name), mmap=True, weights_only=True, map_location="cpu")

    def load_model(self, model: FSDPModule) -> None:
        if self.fmt == "sharded":
            model.to_empty(device="cpu")  # DCP loads in place, so materialize the meta model first
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, checkpoint_id=self._path())
            set_model_state_dict(model, sd["model"])
            return
        full_sd = self._load_rank0("model_state_dict.pt")
        # loads straight into the meta-device model, as the original does
        set_model_state_dict(model, full_sd,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def load_optim(self, model: FSDPModule, opt: torch.optim.Optimizer) -> None:
        if self.fmt == "sharded":
            sd = {"optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=self._path())
            set_optimizer_state_dict(model, opt, sd["optim"])
            return
        full_sd = self._load_rank0("optim_state_dict.pt")
        set_optimizer_state_dict(model, opt, full_sd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def save(self, model: FSDPModule, optim: torch.optim.Optimizer) -> None:
        stamp = torch.tensor([int(time.time() * 1000)])
        dist.broadcast(stamp, 0)  # one folder name for all ranks
        folder = os.path.join(self.folder, str(int(stamp)))
        if self.fmt == "sharded":
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
                     checkpoint_id=folder)
            return
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=opts)
        optim_sd = get_optimizer_state_dict(model, optim, options=opts)
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(model_sd, os.path.join(folder, "model_state_dict.pt"))
            torch.save(optim_sd, os.path.join(folder, "optim_state_dict.pt"))


def set_modules_to_prefetch(model: Transformer, num: int) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + num])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - num):i][::-1])


def main(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    print(f"Running on rank {rank} (local {local_rank}) on device {device}")
    dist.init_process_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    vocab_size, batch_size, seq_len = 128, 8, 16
    model_args = ModelArgs(vocab_size=vocab_size, max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(model_args)
    fsdp_kwargs: dict = {"mesh": mesh}
    if args.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    inspect_model(model)
    if args.explicit_prefetching:
        set_modules_to_prefetch(model, 2)

    checkpointer = Checkpointer(args.checkpoint_dir, args.checkpoint_format)
    if checkpointer.last_training_time is None:
        model.to_empty(device=device)
        model.reset_parameters()
    else:
        checkpointer.load_model(model)
    if args.mixed_precision:
        inspect_mixed_precision(model)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if checkpointer.last_training_time is not None:
        checkpointer.load_optim(model, optim)

    torch.manual_seed(args.seed + 1 + rank)  # each rank draws its own batches
    for it in range(args.iterations):
        if args.explicit_prefetching:
            model.unshard()
        start = torch.randint(0, vocab_size, (batch_size, 1))  # counting sequences: learnable
        x = (start + torch.arange(seq_len + 1)) % vocab_size
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if rank == 0 and (it % 5 == 0 or it == args.iterations - 1):
            print(f"iter {it}: loss {loss.item():.4f}")

    checkpointer.save(model, optim)
    if args.export:  # full state dicts are collectives: every rank calls them
        # cpu_offload=True would leave ranks other than 0 with empty dicts; tensors are on CPU anyway
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        state = {"model": get_model_state_dict(model, options=opts),
                 "optimizer": get_optimizer_state_dict(model, optim, options=opts),
                 "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                 "iterations": args.iterations, "last_loss": loss.detach()}
        os.makedirs(args.export, exist_ok=True)
        torch.save(state, os.path.join(args.export, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _leave() -> None:
    # torch 2.13's gloo can abort during interpreter teardown: tear down by hand, skip it.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example (CPU)")
    parser.add_argument("--explicit-prefetching", action="store_true", default=False)
    parser.add_argument("--mixed-precision", action="store_true", default=False)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--checkpoint-format", choices=["full", "sharded"], default="full")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export", default="", help="save each rank's final state into this folder")
    main(parser.parse_args())
    _leave()
