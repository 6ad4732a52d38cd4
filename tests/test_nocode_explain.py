"""`baton explain` on unmodified torchrun scripts in the shapes people run (tests/nocode/):
the step loop found from the stack wherever it lives (module level, a function called per
epoch, a Trainer's method), the loops around it, what they carry, the regions after the
inner loop; and each refusal (generator data, an IterableDataset without state, a value
that cannot be carried, a step loop inside an installed package) named with its file,
line, reason and fix, before anything trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NOCODE = Path(__file__).resolve().parent / "nocode"


def _explain(tmp_path: Path, script: Path, *args: str, nproc: int = 1,
             env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    out = subprocess.run([sys.executable, "-m", "baton.cli", "explain", "--json", "--nproc", str(nproc), str(script),
                          *args], capture_output=True, text=True, timeout=170, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    start = out.stdout.find("{\n")
    report = json.loads(out.stdout[start:]) if start >= 0 else {}
    return out.returncode, report, out.stdout + out.stderr


def _line(script: Path, text: str) -> int:
    """The line of `script` whose code starts with `text` (tests name loops by their source)."""
    for number, line in enumerate(script.read_text().splitlines(), 1):
        if line.strip().startswith(text):
            return number
    raise AssertionError(f"{text!r} not in {script}")


def _carried(report: dict) -> dict[tuple[str, str], str]:
    return {(c["loop"].rsplit(":", 1)[1], c["name"]): c["kind"] for c in report["carried"]}


def test_nanogpt_shape_module_level_while_true(tmp_path):
    script = NOCODE / "nanogpt_train.py"
    code, report, log = _explain(tmp_path, script, f"--out_dir={tmp_path / 'out'}", nproc=2)
    assert code == 0, log
    step = _line(script, "while True:")
    assert [(lp["where"], lp["step"]) for lp in report["loops"]] == [(f"{script}:{step}", True)]
    assert report["loops"][0]["scope"] == "<module>"
    carried = _carried(report)
    for name in ("iter_num", "local_iter_num", "running_mfu", "t0", "lr"):
        assert carried[(str(step), name)] == "value", name
    assert carried[(str(step), "best_val_loss")] == "tensor"
    assert carried[(str(step), "X")] == carried[(str(step), "Y")] == "tensor"  # the prefetched batch
    assert report["refusals"] == []


def test_ddp_tutorial_shape_trainer_methods(tmp_path):
    script = NOCODE / "trainer_ddp.py"
    code, report, log = _explain(tmp_path, script, "--snapshot-path", str(tmp_path / "snap.pt"), nproc=2)
    assert code == 0, log
    outer, inner = _line(script, "for epoch in range(self.epochs_run"), _line(script, "for source, targets in")
    assert [(lp["where"], lp["scope"], lp["step"]) for lp in report["loops"]] == [
        (f"{script}:{outer}", "Trainer.train", False), (f"{script}:{inner}", "Trainer._run_epoch", True)]
    assert "DistributedSampler" in report["loops"][1]["iterates"]
    carried = _carried(report)
    assert carried[(str(outer), "self")] == "object"  # self.epochs_run and the others, attribute by attribute
    after = [r for r in report["regions"] if r["when"] == "after"]
    assert after and any("_save_snapshot" in s for s in after[0]["statements"])
    assert report["refusals"] == []


def test_imagenet_shape_train_and_validate_per_epoch(tmp_path):
    script = NOCODE / "imagenet_main.py"
    code, report, log = _explain(tmp_path, script, "--out-dir", str(tmp_path / "out"), nproc=2)
    assert code == 0, log
    outer, inner = _line(script, "for epoch in range(args.start_epoch"), _line(script, "for i, (images, target) in enumerate(train_loader)")
    assert [(lp["scope"], lp["step"]) for lp in report["loops"]] == [("main_worker", False), ("train", True)]
    assert report["loops"][1]["where"] == f"{script}:{inner}"
    assert "DataLoader over SyntheticImages" in report["loops"][1]["iterates"]
    carried = _carried(report)
    assert carried[(str(outer), "best_acc1")] == "value"  # a global, assigned in main_worker's loop
    for meter in ("batch_time", "losses", "top1", "progress"):
        assert carried[(str(inner), meter)] == "object"
    regions = {r["when"]: r["statements"] for r in report["regions"]}
    assert regions["before"] == ["train_sampler.set_epoch(epoch)"]
    assert regions["after"][0].startswith("acc1 = validate(") and any("save_checkpoint" in s for s in regions["after"])
    assert report["refusals"] == []


def test_fsdp2_example_shape(tmp_path):
    script = NOCODE / "fsdp2_example.py"
    code, report, log = _explain(tmp_path, script, "--checkpoint-dir", str(tmp_path / "ck"), nproc=2)
    assert code == 0, log
    assert [(lp["scope"], lp["iterates"], lp["step"]) for lp in report["loops"]] == [("main", "range(0, 10)", True)]
    assert report["refusals"] == []


def _refused(tmp_path: Path, source: str, *, env: dict[str, str] | None = None) -> tuple[dict, str, Path]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    code, report, log = _explain(tmp_path, script, env=env)
    assert code == 1, log
    assert "STEPPED" not in log  # stopped before the first optimizer.step(): nothing trained
    assert len(report["refusals"]) == 1, report["refusals"]
    return report["refusals"][0], log, script


SETUP = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step(x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    print("STEPPED")
"""


def test_refused_batches_from_a_generator(tmp_path):
    refusal, _, script = _refused(tmp_path, SETUP + """
def batches():
    while True:
        yield torch.randn(8, 4), torch.randn(8, 1)
for x, y in batches():
    step(x, y)
""")
    assert refusal["where"] == f"{script}:{_line(script, 'for x, y in batches()')}"
    assert "Python generator" in refusal["what"] and "DataLoader" in refusal["fix"] and "baton.init()" in refusal["fix"]


def test_refused_an_iterable_dataset_without_state(tmp_path):
    refusal, _, script = _refused(tmp_path, SETUP + """
class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            yield torch.randn(4), torch.randn(1)
for x, y in torch.utils.data.DataLoader(Stream(), batch_size=8):
    step(x, y)
""")
    assert refusal["where"].endswith(f":{_line(script, 'for x, y in torch.utils.data.DataLoader')}")
    assert "IterableDataset without state" in refusal["what"] and "state_dict()" in refusal["fix"]


def test_the_setup_state_that_moves_with_the_rank_is_listed(tmp_path):
    """An EMA module outside DDP and the generator a sampler shuffles with are neither loop
    variables nor tracked by an interception: explain lists them as carried, by kind; the
    model DDP holds (here also as `raw`) and a stateless loss module are not listed."""
    script = tmp_path / "ema.py"
    script.write_text(textwrap.dedent(SETUP + """
import copy
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
raw = model.module
ema = copy.deepcopy(raw)
criterion = torch.nn.MSELoss()
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(0)))
for epoch in range(2):
    for x, y in loader:
        step(x, y)
        ema.weight.data.lerp_(raw.weight.data, 0.1)
"""))
    code, report, log = _explain(tmp_path, script)
    assert code == 0, log
    kinds = {c["name"]: (c["kind"], c["detail"]) for c in report["carried"] if c["kind"] in ("module", "generator")}
    assert kinds == {"ema": ("module", "Linear"), "loader.sampler.generator": ("generator", "Generator")}, kinds


def test_refused_batches_drawn_with_next_from_a_dataloader_iterator(tmp_path):
    """TorchTitan's shape: `batch = next(data_iterator)` in a while loop. The iterator's position
    cannot be handed over, and a re-run iteration would draw another batch."""
    refusal, _, script = _refused(tmp_path, SETUP + """
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)),
                                     batch_size=8)
data_iterator = iter(loader)
n = 0
while n < 20:
    try:
        x, y = next(data_iterator)
    except StopIteration:
        data_iterator = iter(loader)
        x, y = next(data_iterator)
    step(x, y)
    n += 1
""")
    assert refusal["where"] == f"{script}:{_line(script, 'while n < 20')}"
    assert "DataLoader's iterator" in refusal["what"] and "for x, y in loader" in refusal["fix"]


def test_refused_a_loader_with_persistent_workers_iterated_each_epoch(tmp_path):
    """Persistent workers keep their random streams from one epoch to the next, where a
    successor's could not be brought (seen: augmentations drawn in the workers differed after
    a loss in a later epoch, exit 0)."""
    refusal, _, script = _refused(tmp_path, SETUP + """
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=1, persistent_workers=True)
for epoch in range(3):
    for x, y in loader:
        step(x, y)
""")
    assert refusal["where"] == f"{script}:{_line(script, 'for x, y in loader')}"
    assert "persistent_workers=True" in refusal["what"] and "persistent_workers=False" in refusal["fix"]
    assert "--no-migration" in refusal["fix"]


@pytest.mark.parametrize("register, what", [
    ("model.register_comm_hook(powerSGD.PowerSGDState(process_group=None), powerSGD.powerSGD_hook)",
     "register_comm_hook"),
    ("model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)", "_register_builtin_comm_hook"),
])
def test_refused_a_comm_hook_that_cannot_move(tmp_path, register, what):
    """What `baton run` refuses at registration is reported before it runs, at the line of the call."""
    refusal, _, script = _refused(tmp_path, SETUP + f"""
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
{register}
for _ in range(3):
    step(torch.randn(8, 4), torch.randn(8, 1))
""")
    assert refusal["where"] == f"{script}:{_line(script, 'model.')}" and refusal["what"].endswith(what), refusal
    assert "--no-migration" in refusal["fix"], refusal


@pytest.mark.parametrize("use, value, what", [
    ("print(i, file=log)", "log = open(os.devnull, 'a')", "TextIOWrapper"),
    ("scale(torch.ones(1))", "scale = lambda t: t * 2", "<lambda>"),
])
def test_refused_a_value_the_loop_carries_that_cannot_move(tmp_path, use, value, what):
    """Carried: the next iteration uses what this one made (one it never reads is not carried)."""
    refusal, _, script = _refused(tmp_path, SETUP + f"""
for i in range(10):
    if i:
        {use}
    {value}
    step(torch.randn(8, 4), torch.randn(8, 1))
""")
    assert refusal["where"] == f"{script}:{_line(script, 'for i in range(10)')}"
    assert what in refusal["what"] and "create it before the loop" in refusal["fix"]


def test_refused_a_step_loop_inside_an_installed_package(tmp_path):
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "minitrainer.py").write_text(textwrap.dedent("""
        class Trainer:
            def __init__(self, step):
                self.step = step
            def fit(self, epochs):
                for _ in range(epochs):
                    self.step(*self.batch())
            def batch(self):
                import torch
                return torch.randn(8, 4), torch.randn(8, 1)
    """))
    refusal, _, _ = _refused(tmp_path, SETUP + "import minitrainer\nminitrainer.Trainer(step).fit(3)\n",
                             env={"PYTHONPATH": str(lib)})
    assert refusal["where"] == f"{lib / 'minitrainer.py'}:6"
    assert "installed package" in refusal["what"] and "--no-migration" in refusal["fix"]


def test_a_model_aware_script_is_left_to_its_own_mode(tmp_path):
    code, _, log = _explain(tmp_path, Path(__file__).resolve().parents[1] / "baton" / "examples" / "train.py")
    assert code == 0 and "model-aware" in log


def test_refused_a_parameter_the_optimizer_trains_outside_the_model(tmp_path):
    """Rank-local state the optimizer changes that no replica shares (see test_nocode_run)."""
    refusal, _, script = _refused(tmp_path, SETUP.replace(
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "temperature = torch.nn.Parameter(torch.ones(3))\n"
        "opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)") + """
for _ in range(3):
    step(torch.randn(8, 4) * temperature.sum(), torch.randn(8, 1))
""")
    assert refusal["where"] == f"{script}:{_line(script, 'opt.step()')}", refusal
    assert "parameter of shape [3]" in refusal["what"] and "--no-migration" in refusal["fix"], refusal
