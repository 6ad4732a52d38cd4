"""A small Llama-style decoder trained with FSDP2, in the shape of a TorchTitan job, on baton.

RMSNorm, rotary attention and SwiGLU blocks; each block is sharded with `fully_shard` on
the job's mesh, then the root; AdamW with warm-up and cosine decay (LambdaLR), gradient
clipping, an evaluation every few steps; optionally residual dropout and gradient
accumulation over microbatches (FSDP2 reduce-scatters only the last one's gradients),
TorchTitan's mixed precision (bf16 parameters, fp32 reductions), full activation
checkpointing and per-block torch.compile.
Tokens come from a stream it makes itself (a noisy repeating grammar), so it runs
anywhere on CPU.

    baton run --nproc 4 --spares 1 --redundancy 1 baton/examples/llama.py --steps 40 --out final.pt
    torchrun --nproc_per_node 4 baton/examples/llama.py --plain --steps 40 --out plain.pt

`--plain` is the same script on torchrun (init_process_group + init_device_mesh + a
for-loop); the two write each rank's shards, LR and random stream for a bitwise compare.

With `--redundancy 1` (or more) a lost rank is rebuilt from its buddy's in-memory copy of
its shards; planned moves send the leaver's shards to the joiner.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import baton
from baton.examples import plain_exit


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    vocab_size: int = 96
    seq_len: int = 32
    ffn_multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angle per pair of channels."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) channel pair of x (batch, seq, heads, head_dim) by its position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos[:t], sin[:t]), rotate(k, cos[:t], sin[:t])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), hidden size 2/3 of 4*dim rounded up."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = int(2 * 4 * args.dim / 3)
        hidden = args.ffn_multiple_of * math.ceil(hidden / args.ffn_multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attention(self.attention_norm(x), cos, sin))
        return x + self._drop(self.feed_forward(self.ffn_norm(x)))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Residual dropout (draws from the rank's random stream in training only)."""
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rotary_tables(args.dim // args.n_heads, args.seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_buffers(self) -> None:
        """The rotary tables again, after a build on the meta device (they are not in the
        state dict, so nothing loaded brings them)."""
        self.rope_cos, self.rope_sin = rotary_tables(self.args.dim // self.args.n_heads, self.args.seq_len,
                                                     self.args.rope_theta)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def make_tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    """A token stream with structure to learn: phrases of a small grammar, with noise."""
    g = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g) for _ in range(24)]
    out: list[torch.Tensor] = []
    total = 0
    while total < n:
        phrase = phrases[int(torch.randint(len(phrases), (1,), generator=g))].clone()
        noise = torch.rand(len(phrase), generator=g) < 0.05
        phrase[noise] = torch.randint(vocab, (int(noise.sum()),), generator=g)
        out.append(phrase)
        total += len(phrase)
    return torch.cat(out)[:n]


def save_state(path: str, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """This rank's shards of every parameter and optimizer state (the DCP helpers' sharded
    state dict), the LR and the random stream, for a bitwise comparison."""
    def local(v: torch.Tensor) -> torch.Tensor:  # a shard's local part; a buffer is each rank's own
        return (v.to_local() if hasattr(v, "to_local") else v).clone()

    msd, osd = get_state_dict(model, optimizer)
    state = {f"model.{k}": local(v) for k, v in msd.items()}
    for key, s in osd["state"].items():
        state.update({f"opt.{key}.{k}": local(v) for k, v in s.items()})
    state["lr"] = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    state["rng"] = torch.get_rng_state()
    torch.save(state, f"{path}.rank{rank}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="plain torchrun + FSDP2 (run under torchrun)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per step")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--out", default=None, help="save each rank's sharded state to OUT.rankN")
    p.add_argument("--dim", type=int, default=64, help="model width (the benchmark makes it bigger)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--progress", default=None, help="rank 0 appends `step wall-time` per step to this file")
    p.add_argument("--mixed-precision", action="store_true",
                   help="FSDP2's MixedPrecisionPolicy: bf16 parameters in forward/backward, fp32 gradient reduction")
    p.add_argument("--activation-checkpoint", action="store_true",
                   help="recompute each block's activations in the backward (checkpoint_wrapper, RNG preserved)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (inductor)")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: this many replica groups, each sharding the model over world/replicas ranks")
    args = p.parse_args()

    # ---- the only differences between the torchrun and the baton version: setup ...
    if args.plain:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank, world_size, joined = dist.get_rank(), dist.get_world_size(), False
        if args.replicas > 1:
            mesh = init_device_mesh("cpu", (args.replicas, world_size // args.replicas),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
    else:
        job = baton.init()
        rank, world_size, joined = job.rank, job.world_size, job.joined
        if args.replicas > 1:
            mesh = job.mesh(("replicate", "shard"), (args.replicas, world_size // args.replicas))
        else:
            mesh = job.mesh()

    cfg = ModelArgs(dim=args.dim, n_layers=args.layers, dropout=args.dropout)
    progress = open(args.progress, "a", buffering=1) if args.progress and rank == 0 else None
    tokens = make_tokens(20000, cfg.vocab_size, seed=11)
    train_tokens, val_tokens = tokens[:18000], tokens[18000:]
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    # A rank taking over from a lost one gets its weights from its peers: it builds on the
    # meta device, as TorchTitan does, and allocates only its shards, uninitialised.
    with torch.device("meta" if joined else "cpu"):
        model = Transformer(cfg)
    if args.activation_checkpoint:  # as TorchTitan's full AC: each block recomputed in the backward
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)  # dropout draws again alike
    if args.compile:  # as TorchTitan: each block compiled on its own, after AC and before sharding
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision \
        else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if joined:
        model.to_empty(device="cpu")
        model.init_buffers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def warmup_cosine(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    torch.manual_seed(1000 + rank)  # each rank draws its own batches

    def batch(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(src) - cfg.seq_len - 1, (args.batch_size,))
        x = torch.stack([src[i:i + cfg.seq_len] for i in ix])
        y = torch.stack([src[i + 1:i + 1 + cfg.seq_len] for i in ix])
        return x, y

    def train_step() -> torch.Tensor:
        loss = torch.zeros(())
        for micro in range(args.grad_accum):
            if args.grad_accum > 1:  # accumulate unsharded gradients; reduce-scatter on the last
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            x, y = batch(train_tokens)
            micro_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.grad_accum
            micro_loss.backward()
            loss += micro_loss.detach()
        nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # a DTensor all_reduce of the norm
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            x, y = batch(val_tokens)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        dist.all_reduce(loss)
        model.train()
        if rank == 0:
            print(f"step {step}: val loss {float(loss) / world_size:.4f}", flush=True)

    # ---- ... and the loop.
    if args.plain:
        for step in range(args.steps):
            train_step()
            if (step + 1) % args.eval_every == 0:
                evaluate(step + 1)
            if progress:
                progress.write(f"{step + 1} {time.time():.6f}\n")
        if args.out:
            save_state(args.out, rank, model, optimizer, scheduler)
        plain_exit.leave()

    job.track(model=model, optimizer=optimizer, scheduler=scheduler)
    job.every(args.eval_every)(lambda b: evaluate(b.step))
    for step in job.steps(args.steps):
        with step:
            loss = train_step()
        if not step.failed:
            job.log(loss=loss.item(), lr=scheduler.get_last_lr()[0])
            if progress:
                progress.write(f"{step.index + 1} {time.time():.6f}\n")
    if args.out:
        save_state(args.out, rank, model, optimizer, scheduler)
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
