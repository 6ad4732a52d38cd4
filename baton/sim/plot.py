"""PNG of training progress versus wall-clock time, one line per strategy.

Shows trial 0 of a simulation (every strategy saw the same failures), with a
marker at each failure: the saw-teeth of checkpoint-restart against the near
straight line of live migration are the whole argument in one picture.
"""

from __future__ import annotations

from pathlib import Path

from baton.sim.engine import SimulationResult
from baton.sim.strategies import STRATEGY_LABELS

_COLORS = {"checkpoint_restart": "#c0392b", "replica_group_drop": "#2980b9", "live_migration": "#27ae60"}


def plot_progress(result: SimulationResult, path: str | Path) -> Path:
    """Write the progress plot of trial 0 to `path` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scn = result.scenario
    work = scn.job.work_h
    unit, scale = ("min", 60.0) if work < 24 else ("h", 1.0)
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for name, run in result.runs.items():
        color = _COLORS.get(name, None)
        t = [x * scale for x in run.trace_t]
        p = [100.0 * y / work for y in run.trace_p]
        end = run.completion_h[0]
        label = STRATEGY_LABELS.get(name, name)
        label += f" ({end * scale:,.0f} {unit})" if end != float("inf") else " (did not finish)"
        ax.plot(t, p, color=color, lw=1.6, label=label)
        ax.plot(
            [x * scale for x in run.marks_t],
            [100.0 * y / work for y in run.marks_p],
            "x",
            color=color,
            ms=5,
            mew=1.2,
        )
    ax.axhline(100.0, color="#888", lw=0.8, ls=":")
    ax.set_xlabel(f"wall-clock time ({unit})")
    ax.set_ylabel("progress (% of the job's work)")
    ax.set_ylim(0, 105)
    ax.set_xlim(left=0)
    ax.set_title(f"{scn.name}: {scn.job.gpus:,} GPUs, trial 0 (x = failure)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
