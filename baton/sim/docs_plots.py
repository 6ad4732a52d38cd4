"""Regenerate the plots embedded in docs/economics.md.

    python -m baton.sim.docs_plots [OUTPUT_DIR]     # default: docs/img

One PNG per shipped scenario (progress of trial 0 versus wall-clock time).
"""

from __future__ import annotations

import sys
from pathlib import Path

from baton.sim.engine import simulate
from baton.sim.plot import plot_progress
from baton.sim.scenario import load_scenario, shipped_scenarios


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0] if args else "docs/img")
    for name in shipped_scenarios():
        result = simulate(load_scenario(name))
        path = plot_progress(result, out_dir / f"sim-{name}.png")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
