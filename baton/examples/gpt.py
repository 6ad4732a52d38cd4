"""A character-level GPT trained the way nanoGPT-style scripts do it, on baton.

Iteration-based (no epochs): every micro-batch is drawn with `torch.randint` inside the
step, gradients accumulate over micro-batches with `no_sync()` on all but the last, the
learning rate follows warm-up + cosine decay set by hand each step, the loss runs under
bf16 autocast with gradient clipping, and every `eval_interval` steps an evaluation
(random batches too, a metric `all_reduce`) updates rank 0's best validation loss and
writes its checkpoint. A resume block loads that checkpoint on a fresh start. The model
has dropout, weight tying and a causal-mask buffer. The text is generated here.

    baton run --nproc 3 --spares 1 baton/examples/gpt.py --max-iters 60 --out final.pt
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import baton


@dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizer(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def make_text(n: int, vocab: int, seed: int) -> torch.Tensor:
    """A token stream with structure to learn: a random first-order Markov chain."""
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=1)
    out = torch.empty(n, dtype=torch.long)
    out[0] = 0
    for i in range(1, n):
        out[i] = torch.multinomial(table[out[i - 1]], 1, generator=g)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-iters", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--eval-interval", type=int, default=15)
    p.add_argument("--eval-iters", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-iters", type=int, default=5)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests)")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="extra seconds per evaluation (tests)")
    p.add_argument("--eval-hold", default=None, help="each evaluation waits while this file exists (tests)")
    p.add_argument("--end-sleep", type=float, default=0.0, help="seconds after the loop, before saving (tests)")
    p.add_argument("--out-dir", default=None, help="rank 0 writes ckpt.pt here when val loss improves")
    p.add_argument("--resume", action="store_true", help="start from out-dir/ckpt.pt if it exists")
    p.add_argument("--out", default=None, help="save each rank's final state to OUT.rankN")
    args = p.parse_args()

    job = baton.init()
    torch.manual_seed(1337 + job.rank)  # per-rank seed: dropout and batches differ across ranks
    cfg = GPTConfig()
    data = make_text(4000, cfg.vocab_size, seed=7)
    train_data, val_data = data[:3600], data[3600:]

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        src = train_data if split == "train" else val_data
        ix = torch.randint(len(src) - cfg.block_size - 1, (args.batch_size,))
        x = torch.stack([src[i:i + cfg.block_size] for i in ix])
        y = torch.stack([src[i + 1:i + 1 + cfg.block_size] for i in ix])
        return x, y

    model = GPT(cfg)  # rank 0's initial weights reach every rank through DDP's broadcast
    ddp = job.wrap(model)
    optimizer = model.configure_optimizer(weight_decay=0.1, lr=args.lr)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    best = job.local(val_loss=1e9)  # rank 0's best; only rank 0 writes checkpoints
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt") if args.out_dir else None

    start_iter = 0
    if args.resume and ckpt_path and os.path.exists(ckpt_path) and not job.joined:
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_iter, best.val_loss = ckpt["iter_num"], ckpt["best_val_loss"]

    def get_lr(it: int) -> float:
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)

    @job.every(args.eval_interval)
    def evaluate(b) -> None:
        model.eval()
        losses = torch.zeros(2)
        with torch.no_grad():
            for i, split in enumerate(("train", "val")):
                for _ in range(args.eval_iters):
                    x, y = get_batch(split)
                    with ctx:
                        _, loss = ddp(x, y)
                    losses[i] += loss.float() / args.eval_iters
        if args.eval_sleep:
            time.sleep(args.eval_sleep)
        while args.eval_hold and os.path.exists(args.eval_hold):
            time.sleep(0.05)
        dist.all_reduce(losses)
        losses /= job.world_size
        model.train()
        if job.rank == 0:
            print(f"step {b.step}: train loss {losses[0]:.4f}, val loss {losses[1]:.4f}", flush=True)
            if losses[1] < best.val_loss:
                best.val_loss = float(losses[1])
                if ckpt_path:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": b.step, "best_val_loss": best.val_loss}, ckpt_path)

    for step in job.steps(args.max_iters, start=start_iter):
        with step:
            lr = get_lr(step.index)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(args.grad_accum):
                last = micro == args.grad_accum - 1
                x, y = get_batch("train")
                with ctx, (ddp.no_sync() if not last else contextlib.nullcontext()):
                    _, loss = ddp(x, y)
                    (loss / args.grad_accum).backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if not step.failed:
            job.log(loss=loss.item(), lr=lr)

    if args.end_sleep:
        time.sleep(args.end_sleep)
    if args.out:
        state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
        for i, s in optimizer.state_dict()["state"].items():
            state.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
        state["lr"] = torch.tensor(optimizer.param_groups[0]["lr"])
        state["best"] = torch.tensor(best.val_loss)
        state["rng"] = torch.get_rng_state()
        torch.save(state, f"{args.out}.rank{job.rank}")
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
