"""A fine-tuning script in the shape that trips a fresh joiner: BatchNorm statistics frozen
from one step on (the switch runs once, inside the step loop), and a non-persistent buffer
(a fixed feature scale, which no state_dict holds), and one made on the first forward
(which a joiner that has not run a step does not hold yet). `--joiner-skips-buffer` makes a joiner
leave the buffer as a model built on the meta device would if the script forgot to compute
it after to_empty(); `--joiner-aborts` makes every joiner die as it sets up or in its first step, as
a crash in native code at one point of the run would."""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import baton


class Net(torch.nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(width, 1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gain" not in self._buffers:  # made on the first forward, as lazily built rotary tables are
            self.register_buffer("gain", torch.tensor([0.9]), persistent=False)
        return self.fc2(self.drop(F.gelu(self.bn(self.fc1(x)) * self.scale))) * self.gain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--freeze-bn-at", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--joiner-skips-buffer", action="store_true")
    p.add_argument("--joiner-aborts", choices=["setup", "step"],
                   help="a joiner aborts (a native crash) as it builds its model, or in its first step")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    job = baton.init()
    if job.joined and args.joiner_aborts == "setup":
        os.abort()  # before it could take its rank over
    torch.manual_seed(0)
    net = Net()
    if job.joined and args.joiner_skips_buffer:
        net.scale.fill_(1.0)
    model = job.wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 16, generator=g)
    data = TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True).sin())
    loader = DataLoader(data, batch_size=8, drop_last=True,
                        sampler=DistributedSampler(data, job.world_size, job.rank, shuffle=True, seed=2))
    job.track(data=loader)

    for step in job.steps(args.steps):
        with step:
            if job.joined and args.joiner_aborts == "step":
                os.abort()  # as a crash in native code would, before any traceback
            if step.index == args.freeze_bn_at:  # fine-tuning: BatchNorm statistics frozen from here on
                net.bn.eval()
            xb, yb = step.batch
            F.mse_loss(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)

    state = {f"model.{k}": v.clone() for k, v in net.state_dict().items()}
    state["rng"] = torch.get_rng_state()
    state["bn_training"] = torch.tensor(net.bn.training)
    torch.save(state, f"{args.out}.rank{job.rank}")
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
