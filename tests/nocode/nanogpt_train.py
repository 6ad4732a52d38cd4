"""A plain torchrun script in the shape of karpathy/nanoGPT's train.py (CPU + gloo, tiny).

Shape: config as module-level globals overridden by `--key=value` (or `--key value`); all code
at module level (no main()), DDP from the torchrun env, seed 1337 + rank; a tiny GPT (causal
attention, dropout, weight tying); uint16 np.memmap data (written once into --data_dir) read by
`get_batch(split)` with torch.randint offsets; `init_from = 'scratch' | 'resume'` (ckpt.pt:
model, optimizer, iter_num, best_val_loss); GradScaler (only for float16, so off) + bf16
autocast `ctx`; AdamW with hand-set warm-up + cosine `get_lr(it)`; `estimate_loss()` under
no_grad; rank 0 evaluates every eval_interval and writes ckpt.pt; `X, Y = get_batch('train')`
prefetched before the loop and right after each forward; gradient accumulation toggling
`model.require_backward_grad_sync` by hand; clipping; t0/t1/dt, local_iter_num, running_mfu;
a module-level `while True:` loop. Extra: `--export DIR` saves DIR/rank{RANK}.pt at the end.
"""

import ast
import logging
import math
import os
import pickle
import random
import sys
import time
from collections import namedtuple
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
out_dir = 'out'
data_dir = ''  # default: a folder 'nanogpt_data' next to out_dir
export = ''  # if set, each rank saves its final state to export/rank{RANK}.pt
eval_interval = 10
log_interval = 5
eval_iters = 4
always_save_checkpoint = True
init_from = 'scratch'  # 'scratch' or 'resume'
gradient_accumulation_steps = 4  # over all ranks: 2 per rank with 2 ranks
batch_size, block_size = 8, 32
n_layer, n_head, n_embd, dropout, bias = 2, 2, 32, 0.1, False  # model
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 3e-3, 30, 1e-1, 0.9, 0.95, 1.0
decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 5, 30, 3e-4
backend, device = 'gloo', 'cpu'
dtype = 'bfloat16'  # 'float32', 'bfloat16' or 'float16' (the latter enables the GradScaler)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
_argv = sys.argv[1:]
while _argv:  # tiny exec-free configurator: --key=value or --key value
    _arg = _argv.pop(0)
    assert _arg.startswith('--'), f"unexpected argument {_arg}"
    _key, _eq, _val = _arg[2:].partition('=')
    _key, _val = _key.replace('-', '_'), (_val if _eq else _argv.pop(0))
    assert _key in config_keys, f"unknown config key {_key}"
    try:
        _parsed = ast.literal_eval(_val)
    except (ValueError, SyntaxError):
        _parsed = _val
    if isinstance(globals()[_key], float) and isinstance(_parsed, int):
        _parsed = float(_parsed)
    assert type(_parsed) is type(globals()[_key]), f"type mismatch for {_key}"
    globals()[_key] = _parsed
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------

ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, ddp_local_rank, ddp_world_size, master_process, seed_offset = 0, 0, 1, True, 0
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
random.seed(1337 + seed_offset)  # not in the original: keeps the exported
np.random.seed(1337 + seed_offset)  # python/numpy RNG states reproducible
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# the "dataset" (prepare.py's job): random 4-token words from a 32-word lexicon, as uint16
# files; written once by each node's local rank 0 (meta.pkl last), each file moved into place
data_dir = data_dir or os.path.join(os.path.dirname(os.path.abspath(out_dir)), 'nanogpt_data')
if ddp_local_rank == 0 and not os.path.exists(os.path.join(data_dir, 'meta.pkl')):
    os.makedirs(data_dir, exist_ok=True)
    _rng = np.random.default_rng(0)
    _toks = _rng.integers(0, 64, (32, 4))[_rng.integers(0, 32, 6000)].ravel().astype(np.uint16)
    for _name, _blob in (('train.bin', _toks[:21_000].tobytes()), ('val.bin', _toks[21_000:].tobytes()),
                         ('meta.pkl', pickle.dumps({'vocab_size': 64}))):
        with open(os.path.join(data_dir, f'{_name}.{os.getpid()}'), 'wb') as f:
            f.write(_blob)
        os.replace(os.path.join(data_dir, f'{_name}.{os.getpid()}'), os.path.join(data_dir, _name))
if ddp:
    dist.barrier()

def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)

iter_num = 0
best_val_loss = 1e9
with open(os.path.join(data_dir, 'meta.pkl'), 'rb') as f:
    meta_vocab_size = pickle.load(f)['vocab_size']

GPTConfig = namedtuple('GPTConfig', 'n_layer n_head n_embd block_size bias vocab_size dropout')

class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.p = c.n_head, c.dropout
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias), nn.Dropout(c.dropout))
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas) -> torch.optim.AdamW:
        groups = [{'params': [p for p in self.parameters() if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in self.parameters() if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float = 50e9) -> float:
        c = self.config  # ~6 flops per parameter per token, plus attention
        per_token = 6 * sum(p.numel() for p in self.parameters()) + 12 * c.n_layer * c.n_embd * c.block_size
        return per_token * c.block_size * fwdbwd_per_iter / dt / peak_flops

model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                  bias=bias, vocab_size=meta_vocab_size, dropout=dropout)
if init_from == 'scratch':
    if master_process:
        print("Initializing a new model from scratch")
    model = GPT(GPTConfig(**model_args))
elif init_from == 'resume':
    if master_process:
        print(f"Resuming training from {out_dir}")
    checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location=device)
    for k in ['n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size']:
        model_args[k] = checkpoint['model_args'][k]
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(checkpoint['model'])
    iter_num = checkpoint['iter_num']
    best_val_loss = checkpoint['best_val_loss']
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if init_from == 'resume':
    optimizer.load_state_dict(checkpoint['optimizer'])
checkpoint = None
if ddp:
    model = DDP(model)

@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out

def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)

X, Y = get_batch('train')  # the first batch, prefetched
t0 = time.time()
local_iter_num = 0
raw_model = model.module if ddp else model
running_mfu = -1.0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses['val']
            if iter_num > 0:
                checkpoint = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                              'model_args': model_args, 'iter_num': iter_num,
                              'best_val_loss': best_val_loss, 'config': config}
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch('train')  # prefetch the next batch right after the forward
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5:
            mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%")
    iter_num += 1
    local_iter_num += 1

    if iter_num > max_iters:
        break

if export:  # running_mfu and t0 are wall-clock dependent, so they stay out
    os.makedirs(export, exist_ok=True)
    torch.save({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                'scaler': scaler.state_dict(), 'torch_rng': torch.get_rng_state(),
                'python_rng': random.getstate(), 'numpy_rng': np.random.get_state(),
                'iter_num': iter_num, 'local_iter_num': local_iter_num,
                'best_val_loss': best_val_loss, 'lr': lr, 'X': X, 'Y': Y, 'last_loss': loss.detach()},
               os.path.join(export, f'rank{ddp_rank}.pt'))

if ddp:
    destroy_process_group()

def _leave() -> None:
    # torch 2.13's gloo can abort during interpreter teardown: tear down by hand, skip it.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)

_leave()
