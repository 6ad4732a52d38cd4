"""`baton` command line: run, status, migrate, taint, untaint, events, demo, cost, simulate.

Each subcommand lives in the module that owns its idea; this file only wires
argparse to them, importing lazily so `baton status` never pays for `import torch`.
"""

from __future__ import annotations

import argparse
import sys


def _add_runtime_parsers(sub: argparse._SubParsersAction) -> None:
    from baton import commands

    commands.add_parsers(sub)


def _add_sim_parsers(sub: argparse._SubParsersAction) -> None:
    from baton.sim import cli as sim_cli

    sim_cli.add_parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton",
        description="Keep distributed PyTorch training running through failures.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_runtime_parsers(sub)
    _add_sim_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code = args.func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
