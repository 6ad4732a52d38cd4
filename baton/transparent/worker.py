"""A worker of a script with no code change: `python -m baton.transparent.worker script.py args`.

`baton run` starts every worker of such a script this way. The process first does what
`baton.init()` does for a model-aware script (registers, warms up, and as a spare waits
there until it is given a rank), so a warm spare costs nothing more here. Holding its
rank, it sets the environment torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID ...),
answers the script's torch.distributed calls with the live group (`intercept`), and runs
the script as `__main__`, its own modules instrumented (`importer`), the step loop's heads
handed to the runtime (`controller`). The process exits with the script's exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if not argv:
        print("usage: python -m baton.transparent.worker script.py [args...]", file=sys.stderr)
        sys.exit(2)
    script, args = argv[0], argv[1:]
    from baton.transparent import ahead, deferred_init, intercept
    from baton.transparent.controller import StepLoopController
    from baton.transparent.importer import print_script_error, run_script
    from baton.transparent.script_runtime import ScriptRuntime
    from baton.worker import job as job_mod
    from baton.worker.exit import exit_quietly
    from baton.worker.script_files import ScriptModules, script_dir_of

    modules = ScriptModules(script_dir_of(script))
    ahead.prepare(Path(script), modules)  # a spare: before it waits, not in a move's downtime
    deferred_init.warm_up()
    rt = job_mod.join(ScriptRuntime, script)  # which sets torchrun's environment
    assert isinstance(rt, ScriptRuntime)
    controller = StepLoopController(rt, modules, script, args)
    intercept.install(rt, job_mod.Job(rt), rt.finish_script)
    controller.attach()
    code = 0
    try:
        run_script(script, args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the script's own error: its traceback, the job told
        job_mod.report_script_error(rt.ctl, exc)
        print_script_error(exc)
        exit_quietly(1)
    if code == 0:
        rt.finish_script()
    exit_quietly(code)


if __name__ == "__main__":
    main(sys.argv[1:])
