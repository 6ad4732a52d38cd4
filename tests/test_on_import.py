"""A module patched when the script first imports it (baton/transparent/on_import.py), and
the modules a job's zygote preloads: everything a DDP rank's setup imports, torch._dynamo
(with FSDP2 and DTensor) included, so no worker pays for them again."""

from __future__ import annotations

import subprocess
import sys

from baton.schedulers.zygote import PRELOADED
from baton.transparent import on_import


def test_a_module_is_patched_right_after_its_first_import_and_at_once_if_already_there(tmp_path, monkeypatch):
    pkg = tmp_path / "late_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("def f():\n    return 'own'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def patch(module):
        seen.append(module.__name__)
        module.f = lambda: "patched"

    on_import.after_import("late_pkg.mod", patch)
    assert seen == [] and "late_pkg.mod" not in sys.modules
    from late_pkg.mod import f  # the script's own import: it reads the patched name

    assert f() == "patched" and seen == ["late_pkg.mod"]
    assert not any(isinstance(x, on_import._PatchOnImport) for x in sys.meta_path)  # once only
    on_import.after_import("late_pkg.mod", lambda m: seen.append("again"))  # already imported: now
    assert seen == ["late_pkg.mod", "again"]
    for name in ("late_pkg.mod", "late_pkg"):
        sys.modules.pop(name, None)


def test_a_ddp_workers_setup_imports_nothing_heavy_the_zygote_did_not_and_fully_shard_is_batons():
    """After the zygote's preloads, a DDP construction, a backward and an AdamW step (what a
    DDP rank's setup and a warm spare's warm-up run) import no module of torch._dynamo, sympy
    or FSDP2: the zygote paid for them once per job. A script that then imports FSDP2's
    `fully_shard` gets the patched one (applied at once: the module is already there)."""
    code = ("import sys\n"
            f"for m in {list(PRELOADED)!r}:\n    __import__(m)\n"
            "before = set(sys.modules)\n"
            "import torch\n"
            "from torch.nn.parallel import DistributedDataParallel\n"
            "from baton.worker.group import IdleGroup\n"
            "ddp = DistributedDataParallel(torch.nn.Linear(4, 1), process_group=IdleGroup(), init_sync=False)\n"
            "opt = torch.optim.AdamW(ddp.parameters())\n"
            "ddp(torch.zeros(2, 4)).sum().backward()\n"
            "opt.step()\n"
            "late = sorted(m for m in set(sys.modules) - before\n"
            "              if m.startswith(('torch._dynamo', 'sympy', 'torch.distributed.fsdp', 'torch.distributed.tensor')))\n"
            "assert not late, late\n"
            "from baton.transparent import on_import\n"
            "marker = lambda *a, **k: 'baton'\n"
            "on_import.after_import('torch.distributed.fsdp', lambda m: setattr(m, 'fully_shard', marker))\n"
            "from torch.distributed.fsdp import fully_shard\n"
            "from baton.worker.dtensors import is_dtensor\n"
            "assert fully_shard is marker and not is_dtensor(torch.zeros(1))\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
