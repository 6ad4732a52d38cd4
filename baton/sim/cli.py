"""CLI for `baton cost` and `baton simulate` (placeholder until issue 3 lands)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the `cost` and `simulate` subcommands."""
