"""torchrun's own launcher flags on `baton run`, so that a command line written for torchrun
runs as it is: `torchrun --standalone --nproc-per-node 8 train.py` becomes `baton run
--standalone --nproc-per-node 8 train.py`.

Each is taken for what it means to torchrun and mapped onto what baton does instead. Those
that describe torchrun's own rendezvous or restarts are not needed here (baton's launcher
hosts the rendezvous store; a failed rank moves to a spare rather than every rank
restarting): accepted, with one line saying so. Those that baton cannot honour (an elastic
world size, one launcher per node, a module instead of a script) stop the launch with the
reason and the fix, before anything starts.
"""

from __future__ import annotations

import argparse

# torchrun's flags that describe its own rendezvous, restarts and logs, and why baton needs
# none of them (each takes both spellings torchrun does: --max-restarts and --max_restarts)
_NOT_NEEDED = {
    "master_addr": "baton's launcher hosts the rendezvous store; each rank's MASTER_ADDR and MASTER_PORT name it",
    "master_port": "baton's launcher hosts the rendezvous store; each rank's MASTER_ADDR and MASTER_PORT name it",
    "rdzv_backend": "baton's launcher hosts the rendezvous store",
    "rdzv_endpoint": "baton's launcher hosts the rendezvous store",
    "rdzv_id": "baton's launcher hosts the rendezvous store (the ranks' TORCHELASTIC_RUN_ID is --job-id)",
    "rdzv_conf": "baton's launcher hosts the rendezvous store",
    "max_restarts": "baton restarts nothing: a failed rank moves to a spare (--spares), with its state, and a "
                    "script's own error ends the job",
    "monitor_interval": "baton watches its workers itself (--heartbeat-timeout)",
    "start_method": "baton starts its workers itself",
    "role": "every worker runs the one script",
    "log_dir": "the ranks' output goes to baton run's own, each line as the rank wrote it",
    "redirects": "the ranks' output goes to baton run's own, each line as the rank wrote it",
    "tee": "the ranks' output goes to baton run's own, each line as the rank wrote it",
    "local_ranks_filter": "the ranks' output goes to baton run's own, each line as the rank wrote it",
    "local_addr": "baton's launcher picks the addresses (--advertise-addr)",
}


_SHORT = {"redirects": "-r", "tee": "-t"}


def _flags(name: str) -> list[str]:
    dashed = name.replace("_", "-")
    return [f"--{dashed}"] + ([f"--{name}"] if dashed != name else []) + ([_SHORT[name]] if name in _SHORT else [])


def add_to(p: argparse.ArgumentParser) -> None:
    """torchrun's flags that `baton run` does not have under a name of its own."""
    group = p.add_argument_group("torchrun's flags", "taken so that a torchrun command line runs as it is")
    group.add_argument("--standalone", action="store_true",
                       help="torchrun's single-node rendezvous: what baton run does on one machine anyway")
    group.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                       help="torchrun's per-node launcher: baton run starts the whole job from one place")
    for name in _NOT_NEEDED:
        group.add_argument(*_flags(name), dest=f"torchrun_{name}", default=None, metavar="V",
                           help="not needed: " + _NOT_NEEDED[name])
    group.add_argument("-m", "--module", dest="torchrun_module", action="store_true",
                       help="torchrun: run the script as a module (not supported: name the module's file)")
    group.add_argument("--no-python", "--no_python", dest="torchrun_no_python", action="store_true",
                       help="torchrun: run the script as an executable (not supported: baton runs Python scripts)")


def nodes(text: str) -> int:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job; baton's world size never changes."""
    low, _, high = text.partition(":")
    try:
        counts = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes, got {text!r}") from None
    if counts[0] != counts[1]:
        raise argparse.ArgumentTypeError(
            f"{text}: an elastic number of nodes (MIN:MAX) changes the world size as nodes come and go; "
            "baton keeps it fixed and moves a lost node's ranks to spare nodes instead: give one number, "
            "with --spare-nodes for the spares")
    return counts[0]


def review(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """What to refuse (one message) and what to say of the torchrun flags given."""
    if args.torchrun_module:
        return ("-m/--module: baton runs a script's file (it instruments the script's own modules as they "
                "are imported, from the script's directory): give the module's file, `baton run ... "
                "path/to/module.py`, or wrap it in a script that calls its main()", [])
    if args.torchrun_no_python:
        return ("--no-python: baton runs Python training scripts in its own worker processes; it cannot run "
                "another executable in their place", [])
    if args.node_rank not in (None, 0) or (args.node_rank is not None and (args.nodes or 1) > 1):
        return (f"--node-rank {args.node_rank}: torchrun runs one launcher per node; baton run starts the whole "
                "job from one place (on Slurm, once inside the allocation: `baton run --nnodes N ...`) and "
                "places every node's ranks itself. Run it once, without --node-rank", [])
    notes = [f"[baton] {_flags(name)[0]} {getattr(args, f'torchrun_{name}')}: not needed, {why}"
             for name, why in _NOT_NEEDED.items() if getattr(args, f"torchrun_{name}") is not None]
    return None, notes
