"""Runtime subcommands (placeholder)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register run/status/migrate/taint/untaint/events/demo."""
