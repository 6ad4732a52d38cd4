"""`baton explain script.py [args]`: what baton will do with a script, without training.

The script runs as torchrun would start it (`--nproc` processes, gloo on loopback, forked from a
zygote as `baton run` forks its workers, see `_zygote`), its own
modules instrumented, up to its first `optimizer.step()`, which never runs: every rank
stops there, before any parameter changes. Rank 0 reads the stack and writes the report
(`analysis.Report`, JSON) for this process, which prints it. The exit code is 0 when the
script can run with no code change, 1 when something is refused or the script failed
before its first step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baton.schedulers import warm
from baton.schedulers.forked import Zygote, start_process
from baton.transparent.mode import MODEL_AWARE, mode_of
from baton.worker.torchrun_env import free_port, torchrun_env

ENV_OUT = "BATON_EXPLAIN_OUT"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="say what baton will do with a script, without training",
                       description="Run a torchrun script up to its first optimizer.step() (which does not run) "
                                   "and print its step loop, the loops around it, what they carry, and what "
                                   "baton refuses and why.")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                   help="ranks to start it with, as torchrun would (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the script may take to reach its first optimizer.step(), default 600")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    if args.nproc < 1:
        raise SystemExit("baton explain: --nproc must be at least 1")
    if not Path(args.script).is_file():
        raise SystemExit(f"baton explain: script not found: {args.script}")
    try:
        model_aware = mode_of(args.script) == MODEL_AWARE
    except SyntaxError:
        model_aware = False  # its run below shows the error with its traceback
    if model_aware:
        console.print(f"{args.script} imports baton: it runs in the model-aware mode (its own `baton.init()`, "
                      "`job.steps()` and boundary functions); `baton explain` describes scripts that do not.")
        return 0
    with tempfile.TemporaryDirectory(prefix="baton-explain-") as tmp:
        out = Path(tmp) / "report.json"
        code = _run_ranks(args, out)
        if not out.exists():
            console.print(f"[bold red]baton explain:[/] {args.script} ended (exit code {code}) before its first "
                          "optimizer.step(); its own output is above")
            return code or 1
        from baton.transparent.analysis import Report

        report = Report.model_validate_json(out.read_text())
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        from baton.transparent.render import render

        render(report, console)
    return 1 if report.refusals else 0


def _run_ranks(args: argparse.Namespace, out: Path) -> int:
    port = free_port()
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    zygote = _zygote(args, base)
    procs: list[Any] = []
    for rank in range(args.nproc):
        env = {**base, **torchrun_env(rank, args.nproc, "127.0.0.1", port, "baton-explain"), ENV_OUT: str(out)}
        argv = [sys.executable, "-m", "baton.transparent.explain", args.script, *args.script_args]
        procs.append(start_process(zygote, argv, env=env, start_new_session=True))  # a session each: killpg
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None] * len(procs)
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            failed = [c for c in codes if c not in (None, 0)]
            if failed or time.monotonic() > deadline:
                if not failed:
                    print(f"baton explain: the script did not reach its first optimizer.step() within "
                          f"{args.timeout:.0f}s (--timeout)", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        if zygote is not None:
            zygote.close()
    return next((c for c in codes if c), 0) or 0


def _zygote(args: argparse.Namespace, env: dict[str, str]) -> Zygote | None:
    """Where the ranks are forked from, as `baton run`'s workers are: the machine's warm
    process (BATON_WARM) or, for several ranks, one zygote that imports torch once for all;
    None for one rank with no warm process (a zygote would import more than the rank does)."""
    if args.nproc == 1 and not os.environ.get(warm.ENV_SWITCH):
        return None
    zygote = Zygote(sys.executable, env)
    zygote.start()
    return zygote


class _Explained(BaseException):
    """Stops the script at its first optimizer.step(): a BaseException, so the script's own
    `except Exception` does not take it for one of its errors."""


def _child(script: str, args: list[str]) -> int:
    """One rank: run the script instrumented; at its first optimizer.step(), report and stop."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from baton.transparent import analysis, ddp_rules, nest
    from baton.transparent.importer import run_script
    from baton.worker.script_files import ScriptModules, script_dir_of

    modules = ScriptModules(script_dir_of(script))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def stop(_opt: torch.optim.Optimizer, *_: object) -> None:
        if rank == 0:
            found = nest.find(sys._getframe(1), modules)
            report = analysis.build(found, script, args, world, explaining=True)
            report.refusals += analysis.ddp_refusals(script)
            if found.call is not None:
                report.refusals += analysis.stray_parameters(found.call.where, [_opt], analysis.models_in_memory())
            Path(os.environ[ENV_OUT]).write_text(report.model_dump_json())
        raise _Explained

    register_optimizer_step_pre_hook(stop)
    ddp_rules.remember_calls()
    try:
        run_script(script, args)
    except _Explained:
        return 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code not in (None, 0) and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return code or 3  # it ended without stepping an optimizer: nothing to explain
    return 3


if __name__ == "__main__":
    from baton.worker.exit import exit_quietly

    try:
        rc = _child(sys.argv[1], sys.argv[2:])
    except BaseException as exc:  # noqa: BLE001 - the script's own error, shown as python would show it
        from baton.transparent.importer import print_script_error

        print_script_error(exc)
        rc = 1
    exit_quietly(rc)  # the script's gloo threads may still hold tensors (see baton/examples/plain_exit.py)
