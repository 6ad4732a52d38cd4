"""Every kind of move, in unmodified torchrun scripts under `baton run` (tests/nocode/: the
shapes of nanoGPT's train.py, the DDP tutorial's Trainer, imagenet's main.py, the FSDP2
example, and a trainer accumulating fp16 micro-batches under GradScaler with BatchNorm, a
OneCycle schedule, validation and a resume block). In one run of each: a planned move of rank 1, then a taint of rank 0's slot (a
pre-emptive move), then a real kill -9 or SIGSTOP landing inside a step (rank 0 in two of
them; nanoGPT's inside its gradient accumulation; FSDP2's rebuilt from a buddy's copy),
each taken wherever the script stands (mid-epoch, at an epoch's end, after an evaluation).
Every rank ends bit for bit equal to the same file under torchrun, the files it wrote too,
and the ledger holds the three moves, resolved with no step lost. `baton status` says the
job runs with no code change and where its step loop is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import Job
from tests.nocode_runs import INJECT, NOCODE, compare, differences

STEPS, CAP = 72, 56  # every shape runs 72 optimizer steps; its ranks stop at step 56 until the test lets go
SHAPES = {
    # script, its arguments ({d}: the run's folder), the files it writes (compared with
    # torchrun's; read back: nanoGPT's holds the folder it was written to), the loss:
    # "rank:signal". The jobs are leashed (Job(leash=...)): however slow the machine, the three
    # moves land before CAP, and the loss after it, with steps to go.
    "nanogpt": ("nanogpt_train.py", ["--out_dir={d}/out", f"--max_iters={STEPS}", "--eval_interval=18"],
                ["out/ckpt.pt"], "1:SIGSTOP"),
    "trainer": ("trainer_ddp.py", ["9", "4", "--snapshot-path", "{d}/snapshot.pt"], ["snapshot.pt"], "1:SIGKILL"),  # 8 steps an epoch
    "imagenet": ("imagenet_main.py", ["--epochs", "9", "--out-dir", "{d}/out"],  # 8 steps an epoch
                 ["out/checkpoint.pth.tar", "out/model_best.pth.tar"], "0:SIGKILL"),
    "accumulating": ("accumulating_amp.py", ["--epochs", "9", "--checkpoint", "{d}/ckpt.pt"], ["ckpt.pt"],  # 8 steps an epoch
                     "1:SIGKILL"),
    "fsdp2": ("fsdp2_example.py", ["--iterations", str(STEPS), "--checkpoint-dir", "{d}/ck"], [], "0:SIGKILL"),  # DCP folders: by time
}


def _cli(job: Job, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args, "--run-dir", str(job.run_dir)],
                          capture_output=True, text=True, timeout=60, cwd=job.dir)


def _torchrun_then_job(tmp_path: Path, torchrun_reference: Any, name: str, args: list[str], env: dict[str, str],
                       leash: int = 0, cap: int = CAP) -> tuple[Path, Path, Job]:
    """`name` with `args` ({d}: the run's folder) run under torchrun for the reference (the
    session's run of the same file and arguments where a test already made one), then
    started under `baton run` with two spares and `env` (tests/inject on its path), each
    exporting its ranks' state: the two folders, and the job (`leash`: its ranks run at most
    that many steps past what the test last saw, never past `cap` until it lets go)."""
    ref = torchrun_reference(NOCODE / name, [*args, "--export", "{d}/export"])
    run = tmp_path / "baton"
    job = Job(tmp_path, nproc=2, spares=2, script=NOCODE / name, out_arg=False, name="baton",
              script_args=[a.format(d=run) for a in args] + ["--export", str(run / "export")],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_SIGNAL_MARK": str(tmp_path / "fired"), **env},
              leash=leash, leash_cap=cap if leash else None)
    return ref, run, job


def _resolved(job: Job, count: int) -> dict[str, Any]:
    return job.wait_until(lambda st: st["operation"] is None and len(
        [e for e in job.events() if e["status"] == "resolved"]) >= count, timeout=120, what=f"{count} resolved move(s)")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_planned_move_a_taint_and_a_lost_rank_end_bitwise_equal_to_torchrun(tmp_path, torchrun_reference, shape):
    name, args, files, loss = SHAPES[shape]
    go = tmp_path / "go"
    victim, signal_name = loss.split(":")
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args,  # two spares: the taint's is warm
                                       {"BATON_TEST_SIGNAL_MID_STEP": f"{victim}:go:{signal_name}",
                                        "BATON_TEST_SIGNAL_GO": str(go)}, leash=4)
    try:
        st = job.wait_step(8, timeout=120)
        assert st["mode"] == "no-code" and st["step_loop"].startswith(f"{NOCODE / name}:")
        assert f"mode: no code change, step loop at {st['step_loop']}" in _cli(job, "status").stdout
        planned_taint_then_loss(job, go)
        assert job.wait(timeout=170) == 0, job.log()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    compare(ref, run)
    for f in files:
        written = [_relative(torch.load(d / f, weights_only=False), d) for d in (ref, run)]
        assert differences(*written) == [], f
    events = job.events()
    assert [(e["kind"], e["rank"], e["status"], e["steps_lost"]) for e in events] == [
        ("planned", 1, "resolved", 0), ("pre-emptive", 0, "resolved", 0),
        ("unplanned", int(victim), "resolved", 0)], events
    # where each move's pause went, in the ledger: the joiner's walk to its place (the state
    # arriving meanwhile), its load, form and check, the boundary, the rest
    for e in events:
        assert {"walk_and_fetch", "load", "form", "verify", "rest"} <= set(e["phases"] or {}), e
    # and the joiner's script setup where training waited for it: a rebuild's (its Form came with
    # its assignment), never a planned move's (the ranks pause once the joiner's setup is done)
    assert [("setup" in e["phases"]) for e in events] == [False, False, True], events
    assert list(events[2]["phases"])[:2] == ["collect", "setup"], events[2]
    # each joiner's setup left its model's random initialisation out (deferred_init), where a
    # resume block loaded a checkpoint over it too (the Trainer's snapshot, the accumulating
    # script's); but nanoGPT's setup draws its first batch from the default generator after
    # building the model (the draws before it must run to give that batch), and FSDP2's
    # example builds on the meta device and initialises DTensors, whose ops run as they come
    left_out = [e["joiner_setup_left_out_mb"] for e in events]
    none = shape in ("nanogpt", "fsdp2")
    assert left_out == [None] * 3 if none else all(mb and mb > 0 for mb in left_out), left_out
    # the survivor was in the victim's step (that step runs again) or, where the kill landed as
    # it stood at a head or in a region without collectives, not; the states above are the check
    assert events[2]["steps_rerun"] in (0, 1), events[2]


def planned_taint_then_loss(job: Job, go: Path) -> None:
    """A planned move of rank 1 through the CLI, then a taint of rank 0's slot, each resolved,
    then `go` made: the loss the job was started with (BATON_TEST_SIGNAL_GO) lands in the
    victim's next step, after its forward."""
    moved = _cli(job, "migrate", "--rank", "1")
    assert moved.returncode == 0, moved.stderr
    st = _resolved(job, 1)
    slot = next(r["slot"] for r in st["ranks"] if r["rank"] == 0)
    tainted = _cli(job, "taint", slot, "--reason", "ecc")
    assert tainted.returncode == 0, tainted.stderr
    _resolved(job, 2)
    go.touch()


def _relative(obj: Any, folder: Path) -> Any:
    if isinstance(obj, str):
        return obj.replace(str(folder), "<run>")
    if isinstance(obj, dict):
        return {k: _relative(v, folder) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_relative(v, folder) for v in obj)
    return obj


@pytest.mark.parametrize("asked_for", ["rest", "own"])
def test_a_leaver_lost_while_its_successor_walks_to_its_place_is_rebuilt_bit_for_bit(
        tmp_path, torchrun_reference, asked_for):
    """A planned move's successor fetches its predecessor's own record first and walks the
    script to the rank's place while the rest of the state arrives. The leaver dies -9 as
    that rest is asked for ("rest"), or before it served the own record ("own": the
    successor cannot walk). The successor leaves the rank to another spare, the move fails
    over to a rebuild from the survivors' copies, and every rank still ends equal to
    torchrun's run."""
    name, args, _, _ = SHAPES["trainer"]
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args,
                                       {"BATON_TEST_LEAVER_DIES_SERVING": "1" if asked_for == "rest" else "own"},
                                       leash=4)
    try:
        job.wait_step(8, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        _resolved(job, 1)
        assert job.wait(timeout=170) == 0, job.log()
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), log[-3000:]
    # either way the successor leaves (it walked, or could not: the next plan may name another place)
    assert "rank 1: a joiner's state could not be fetched" in log and "leaves the rank to another spare" in log, log
    assert [(e["kind"], e["status"], e["rank"]) for e in events][-1] == ("unplanned", "resolved", 1), events
    assert events[0]["kind"] == "planned" and events[0]["status"] == "failed", events
    compare(ref, run)


BUDGET = ("step_budget.py", ["--steps", str(STEPS)])  # `while done < steps:` around the loader's passes
# a step of the epoch's middle: GradScaler's skipped steps (its first scales overflow) make
# the accumulating shape's first epochs shorter than 8 steps, and its step 19 begins an epoch
HELD_MID_EPOCH = {"accumulating": 21}


@pytest.mark.parametrize("shape, reachable", [("trainer", True), ("trainer", False), ("budget", True),
                                             ("accumulating", True)])
def test_a_planned_moves_joiner_walks_ahead_while_the_ranks_train_on(tmp_path, torchrun_reference, shape,
                                                                    reachable):
    """A planned move's joiner walks, inside its setup, to where its rank stood a moment ago
    (its buddies' record: the loader drawn to there), and the pause walks only the steps
    since. The ranks are held at step 19 (iteration 3 of the trainer's 8-step epoch; steps to
    spare forced down to 2) until the move has its target, then let go. Where the rank's
    place turns out to be past where the joiner can walk (forced once: as if the ranks had
    gone on past the loop's end), the joiner leaves the rank to another spare and the move
    runs again, its new joiner walking in the pause (a fast epoch must not use up the spares:
    seen in CI before that rule). In a step budget's shape the loop around the step loop
    holds the step counter the step loop assigns: it changes with every step and is not
    a reason to leave (seen in bench/nocode.py: every walk-ahead there left its rank). The
    accumulating shape walks ahead through GradScaler, BatchNorm and two micro-batches a
    step, after its resume block read its checkpoint. Either way every rank ends equal to
    torchrun's run."""
    name, args = BUDGET if shape == "budget" else SHAPES[shape][:2]
    env = {"BATON_TEST_AHEAD_MARGIN": "2"}
    if not reachable:
        env["BATON_TEST_AHEAD_UNREACHABLE"] = str(tmp_path / "unreachable-once")
    held = HELD_MID_EPOCH.get(shape, 19)
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args, env, leash=1, cap=held)
    try:
        job.wait_step(held, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        job.wait_until(lambda st: (st.get("operation") or {}).get("target_step") is not None, timeout=120,
                       what="the move's target", pull=False)
        job.let_go()
        _resolved(job, 1)
        assert job.wait(timeout=170) == 0, job.log()
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
    ready = [line for line in log.splitlines() if "joiners-ready" in line]
    assert ready and "walked_ahead=" in ready[0], ready
    if reachable:
        assert [(e["kind"], e["status"], e["rank"]) for e in events] == [("planned", "resolved", 1)], events
        assert "leaves the rank to another spare" not in log, log[-3000:]
    else:
        assert "cannot walk on to the rank's place from there: BATON_TEST_AHEAD_UNREACHABLE" in log, log[-3000:]
        assert events[0]["kind"] == "planned" and events[0]["status"] == "failed", events
        assert events[-1]["kind"] == "planned" and events[-1]["status"] == "resolved", events
        assert len(ready) == 2 and "walked_ahead=" not in ready[1], ready  # its successor walked in the pause
    compare(ref, run)


def test_a_planned_moves_ranks_pause_only_once_its_joiner_is_through_its_setup(tmp_path, torchrun_reference):
    """A joiner whose script takes seconds to set up (building a large model): the ranks
    train on meanwhile and pause only once it stands at its step loop's outermost loop
    (SetupDone), as a model-aware joiner's prepare. Its setup is in the ledger, not in the
    move's downtime (which had been at least the setup: the ranks paused at once). The memory
    its state arrived in, mapped while it waited, goes back to the kernel once its parameters
    copied from it (it had held that second copy for good)."""
    name, args = "trainer_ddp.py", ["30", "4", "--hidden", "16384", "--snapshot-path", "{d}/snapshot.pt"]
    # 240 steps; the ranks hold at step 200 at the latest (a cap they reached in the setup
    # would hold them short of the target)
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args,
                                       {"BATON_TEST_SLOW_JOINER_SETUP": "2", "BATON_LOG": "INFO"}, leash=4, cap=200)
    try:
        st = job.wait_step(8, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        step_asked = max(r["step"] for r in st["ranks"])
        _resolved(job, 1)
        assert job.wait(timeout=170) == 0, job.log()
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
    freed = re.search(r"received into memory mapped ahead; ([0-9.]+) MB of it the load copied from given back", log)
    assert freed is not None and float(freed[1]) >= 1.0, log[-3000:]  # the 1.25 MiB weight's pages at least
    [planned] = events
    assert (planned["kind"], planned["status"], planned["steps_lost"]) == ("planned", "resolved", 0), planned
    assert planned["joiner_setup_s"] >= 2, planned
    ready = re.search(r"\[baton\] joiners-ready op=\d+ joiners=\['w\d+'\] setup_s=([0-9.]+)", log)
    assert ready is not None and float(ready[1]) >= 2, log[-3000:]  # the wait before the pause, as it ends
    assert planned["downtime_s"] < planned["joiner_setup_s"], planned
    assert planned["step"] > step_asked, planned  # the ranks trained on while it set up
    compare(ref, run)


def test_a_joiner_loaded_wrong_is_caught_by_the_deferred_state_check_before_its_first_commit(tmp_path):
    """A no-code move's state check digests the large tensors on a thread while the script's
    next step runs, and compares before that step's optimizer step. A joiner whose load
    changed one ulp of its 20x16384 weight (1.25 MiB: digested on that thread) stops the job
    there: a divergence at the move's step, exit non-zero, no step after it committed."""
    job = Job(tmp_path, nproc=2, spares=1, script=NOCODE / "trainer_ddp.py", out_arg=False, name="baton",
              script_args=["30", "4", "--hidden", "16384", "--snapshot-path", str(tmp_path / "snapshot.pt")],
              env={"PYTHONPATH": str(INJECT), "BATON_TEST_CORRUPT_JOINER": "1", "BATON_LOG": "INFO"},
              leash=4, leash_cap=200)
    try:
        job.wait_step(8, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        code = job.wait(timeout=170)
        log, events = job.log(tail=None), job.events()
    finally:
        job.kill()
    assert "injected: joiner of rank 1 corrupted one value of a (16384, 20) parameter" in log, log[-3000:]
    assert code != 0 and "state check failed" in log, log[-3000:]
    assert re.search(r"\[w2\] baton.worker: state check of generation 1 at \(\d+, 0\): [1-9]\d* large tensors "
                     "digested beside the next step", log), log[-3000:]  # the weight's pass left the pause
    planned, divergence = events[0], events[-1]
    assert planned["kind"] == "planned" and divergence["kind"] == "divergence", events
    assert divergence["status"] == "failed" and divergence["step"] == planned["step"], events
    assert "joiner" in divergence["note"] or ".weight" in divergence["note"], divergence
    assert "training finished" not in log, log[-3000:]


def test_a_joiner_lost_before_its_state_check_is_compared_is_replaced_bit_for_bit(tmp_path, torchrun_reference):
    """A move's state check digests the joiner's large tensors beside its first step and is
    compared at that step's optimizer step (verify_state's `defer`). The joiner is killed -9
    before that step's backward: the survivor, blocked in the step's gradient all-reduce,
    drops the check it can never compare (its collective would wait for the dead rank), and
    the rank's next successor is rebuilt from the survivor's replicas and the dead joiner's
    own record of the head it joined at, where its own state check then passes. Every rank
    ends equal to torchrun's run."""
    name, args = "trainer_ddp.py", ["9", "4", "--hidden", "16384", "--snapshot-path", "{d}/snapshot.pt"]
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args,
                                       {"BATON_TEST_SIGNAL_MID_STEP": "1:joined+0:SIGKILL", "BATON_LOG": "INFO"},
                                       leash=4)
    try:
        job.wait_step(8, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        assert job.wait(timeout=170) == 0, job.log()
        events, log = job.events(), job.log(tail=None)
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), log[-3000:]
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == \
        [("planned", "resolved", 1), ("unplanned", "resolved", 1)], events
    moved_at = events[0]["step"]
    assert events[1]["step"] == moved_at, events  # the joiner's first step, abandoned everywhere
    assert re.search(rf"state check of generation 1 at \({moved_at}, 0\): [1-9]\d* large tensors digested beside "
                     "the next step", log), log[-3000:]
    assert re.search(rf"state check of generation 1 at \({moved_at}, 0\), deferred: dropped uncompared", log), \
        log[-3000:]
    compare(ref, run)


def test_a_rank_lost_again_after_its_move_draws_what_its_predecessor_drew(tmp_path, torchrun_reference):
    """Rank 0 moves (planned) to a new process, which walks the script to the rank's place;
    that process is killed -9 two steps later, in the same epoch. Its successor is rebuilt
    from the walked process's own record, whose epoch head must hold the random streams
    there: the iterator the epoch head makes draws its DataLoader workers' seed from them,
    and the workers' random crops follow. (That record once left them out: the rebuilt rank
    took other crops for the rest of the epoch, and the job ended 0 with other weights.)"""
    args = ["--epochs", "3", "-b", "1", "--out-dir", "{d}/out"]  # 128 steps an epoch
    # leashed, held before step 250: however busy the machine, the move and the loss land early in
    # the second epoch (unleashed under CI load, the move came at step 254 and the loss in the third)
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, "imagenet_main.py", args,
                                       {"BATON_TEST_SIGNAL_MID_STEP": "0:joined+2:SIGKILL"}, leash=4, cap=250)
    try:
        job.wait_spare()
        # early in the second epoch (steps 128-255): in the first, a fresh process's streams
        # at the epoch head equal its predecessor's anyway (the same seeded setup)
        job.wait_step(130, timeout=120)
        job.client.migrate(0)
        _resolved(job, 2)
        assert job.wait(timeout=170) == 0, job.log()
        events = job.events()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == \
        [("planned", "resolved", 0), ("unplanned", "resolved", 0)], events
    moved_at, lost_at = events[0]["step"], events[1]["step"]
    assert lost_at // 128 == moved_at // 128, f"the loss (step {lost_at}) landed past the move's epoch ({moved_at})"
    compare(ref, run)


@pytest.mark.parametrize("shape", ["trainer", "accumulating"])
def test_a_rank_lost_in_the_step_its_buddy_was_replaced_at_is_rebuilt_bit_for_bit(tmp_path, torchrun_reference, shape):
    """Rank 1 moves (planned); rank 0, its buddy, is killed -9 in the very next step, before
    its backward. Its record of that head is the first it sends the new process, on a new
    connection (opened slowly here, as over a busy network): had it not reached that buddy
    before the step went on, the rank's place would be held by no live process and the job
    could only stop. It is rebuilt from there, and every rank ends equal to torchrun's. The
    joiner's first step fails with it and runs again from the state it joined with: in the
    accumulating shape, after its first micro-batch added its loss in place to the sum the
    loop carries (a joined state bound as the script's own tensor ran that step again from
    the sum: exit 0 with another history)."""
    name, args, _, _ = SHAPES[shape]
    ref, run, job = _torchrun_then_job(tmp_path, torchrun_reference, name, args,
                                       {"BATON_TEST_SIGNAL_MID_STEP": "0:rebuddied:SIGKILL",
                                        "BATON_TEST_SLOW_NEW_BUDDY": "1.5"}, leash=4)
    try:
        job.wait_spare()
        job.wait_step(8, timeout=120)
        moved = _cli(job, "migrate", "--rank", "1")
        assert moved.returncode == 0, moved.stderr
        _resolved(job, 2)
        assert job.wait(timeout=170) == 0, job.log()
        events = job.events()
    finally:
        job.kill()
    assert (tmp_path / "fired").exists(), job.log()
    assert [(e["kind"], e["status"], e["rank"]) for e in events] == \
        [("planned", "resolved", 1), ("unplanned", "resolved", 0)], events
    assert events[1]["step"] == events[0]["step"], events  # lost in the step the move ended at
    compare(ref, run)
