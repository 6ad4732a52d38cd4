"""`baton cost` and `baton simulate`: argparse wiring and human-readable output.

Imports stay light (no torch, numpy only when simulating) so the CLI starts fast.
Bad input is reported as one line naming the field, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from baton.sim.model import CostInputs, CostReport, InputError, compute_cost

EXIT_BAD_INPUT = 2


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the `cost` and `simulate` subcommands."""
    _add_cost_parser(sub)
    _add_simulate_parser(sub)


# --------------------------------------------------------------------------- cost


def _add_cost_parser(sub: argparse._SubParsersAction) -> None:
    d = CostInputs()
    p = sub.add_parser(
        "cost",
        help="closed-form cost of failures: checkpoint-restart vs live migration",
        description=(
            "What failures cost a job of N GPUs per day, month and year under checkpoint-restart "
            "and under live migration, and the Young/Daly optimal checkpoint interval."
        ),
    )
    p.add_argument("--gpus", type=int, default=d.gpus, help="GPUs in the job (default %(default)s)")
    p.add_argument("--gpu-hour-usd", type=float, default=d.gpu_hour_usd, help="price of one GPU-hour (default %(default)s)")
    p.add_argument(
        "--mttf-h",
        type=float,
        default=None,
        help="job mean time to failure in hours (default: power law through 7.9 h @ 1,024 and 1.8 h @ 16,384 GPUs)",
    )
    p.add_argument("--checkpoint-interval-h", type=float, default=d.checkpoint_interval_h, help="hours between checkpoints (default %(default)s)")
    p.add_argument("--checkpoint-save-min", type=float, default=d.checkpoint_save_min, help="blocking save cost per checkpoint, minutes (default %(default)s)")
    p.add_argument("--node-replacement-min", type=float, default=d.node_replacement_min, help="minutes to get a replacement node (default %(default)s)")
    p.add_argument("--restore-min", type=float, default=d.restore_min, help="minutes to load the checkpoint (default %(default)s)")
    p.add_argument("--startup-min", type=float, default=d.startup_min, help="minutes to restart the job (default %(default)s)")
    p.add_argument("--migration-min", type=float, default=d.migration_min, help="downtime per live migration, minutes (default %(default)s)")
    p.add_argument(
        "--yoco-ratio",
        type=float,
        default=d.yoco_ratio,
        help="share of failures resolved by migration; the rest fall back to checkpoint-restart (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=run_cost)


_COST_FLAGS = {
    "gpus": "--gpus",
    "gpu_hour_usd": "--gpu-hour-usd",
    "mttf_h": "--mttf-h",
    "checkpoint_interval_h": "--checkpoint-interval-h",
    "checkpoint_save_min": "--checkpoint-save-min",
    "node_replacement_min": "--node-replacement-min",
    "restore_min": "--restore-min",
    "startup_min": "--startup-min",
    "migration_min": "--migration-min",
    "yoco_ratio": "--yoco-ratio",
}


def _bad_input(command: str, err: InputError, flags: dict[str, str] | None = None) -> int:
    name = (flags or {}).get(err.field, err.field)
    print(f"baton {command}: error: {name} {err.message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_cost(args: argparse.Namespace) -> int:
    inputs = CostInputs(**{k: getattr(args, k) for k in _COST_FLAGS})
    try:
        report = compute_cost(inputs)
    except InputError as err:
        return _bad_input("cost", err, _COST_FLAGS)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_cost(report))
    return 0


def _usd(x: float) -> str:
    return f"${x:,.0f}"


def format_cost(r: CostReport) -> str:
    """Readable table of a CostReport."""
    i = r.inputs
    restart = i.node_replacement_min + i.restore_min + i.startup_min
    lines = [
        f"Job: {i.gpus:,} GPUs at ${i.gpu_hour_usd:g}/GPU-hour, MTTF {r.mttf.hours:.2f} h ({r.mttf.source})",
        f"Checkpoint every {i.checkpoint_interval_h:g} h (save {i.checkpoint_save_min:g} min); "
        f"restart = {i.node_replacement_min:g} replace + {i.restore_min:g} restore + {i.startup_min:g} startup = {restart:g} min",
        f"Live migration: {i.migration_min:g} min per failure, YOCO ratio {i.yoco_ratio:g}",
        "",
    ]
    rows = [
        ("failures per day", lambda s: f"{s.failures_per_day:.2f}"),
        ("lost per failure", lambda s: f"{s.lost_hours_per_failure * 60:.1f} min"),
        ("lost per day", lambda s: f"{s.lost_hours_per_day:.2f} h ({s.lost_hours_per_day * 60:.0f} min)"),
        ("waste fraction", lambda s: f"{s.waste_fraction:.1%}"),
        ("lost GPU-hours / month", lambda s: f"{s.lost_gpu_hours_per_month:,.0f}"),
        ("lost $ / month", lambda s: _usd(s.lost_usd_per_month)),
        ("lost $ / year", lambda s: _usd(s.lost_usd_per_year)),
    ]
    w0 = max(len(name) for name, _ in rows)
    cols = [("checkpoint-restart", r.checkpoint_restart), ("live migration", r.live_migration)]
    cells = [[fmt(s) for _, s in cols] for _, fmt in rows]
    widths = [max(len(cols[j][0]), *(len(c[j]) for c in cells)) for j in range(len(cols))]
    lines.append("  ".join([" " * w0] + [cols[j][0].rjust(widths[j]) for j in range(len(cols))]))
    for (name, _), c in zip(rows, cells):
        lines.append("  ".join([name.ljust(w0)] + [c[j].rjust(widths[j]) for j in range(len(cols))]))
    saved = r.checkpoint_restart.lost_usd_per_month - r.live_migration.lost_usd_per_month
    lines += [
        "",
        f"Live migration saves {_usd(saved)} per month ({_usd(saved * 12)} per year).",
    ]
    if r.optimal_interval_h > 0:
        lines.append(
            f"Optimal checkpoint interval for a {i.checkpoint_save_min:g}-min save: {r.optimal_interval_h * 60:.1f} min (Daly), "
            f"{r.young_interval_h * 60:.1f} min (Young); waste at optimum {r.optimal_waste_fraction:.1%}."
        )
    for note in r.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ----------------------------------------------------------------------- simulate


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="Monte Carlo of a training run under checkpoint-restart, replica-group drop and live migration",
        description=(
            "Simulate one job doing a fixed amount of work while failures arrive, under each recovery "
            "strategy, over many trials. SCENARIO is a shipped scenario name or a path to a TOML file."
        ),
    )
    p.add_argument("scenario", nargs="?", default="1024-gpus", help="shipped scenario name or .toml path (default %(default)s)")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios and exit")
    p.add_argument("--trials", type=int, default=None, help="number of Monte Carlo trials (default: the scenario's)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario key, e.g. --set job.gpus=2048 --set live_migration.spare_pool=4",
    )
    p.add_argument("--plot", metavar="PNG", default=None, help="write the progress-vs-time plot of trial 0 to this PNG")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from baton.sim import scenario as scenario_mod

    if args.list:
        for name in scenario_mod.shipped_scenarios():
            raw = scenario_mod.load_raw(name)[1]
            print(f"{name:16s} {raw.get('description', '')}")
        return 0
    try:
        if args.trials is not None and args.trials < 1:
            raise InputError("--trials", f"must be >= 1, got {args.trials}")
        if args.seed is not None and args.seed < 0:
            raise InputError("--seed", f"must be >= 0, got {args.seed}")
        scn = scenario_mod.load_scenario(args.scenario, args.set)
    except InputError as err:
        return _bad_input("simulate", err)

    from baton.sim.engine import simulate, summarize

    result = simulate(scn, trials=args.trials, seed=args.seed)
    summary = summarize(result)
    plot_path = None
    if args.plot:
        from baton.sim.plot import plot_progress

        plot_path = str(plot_progress(result, args.plot))
    if args.json:
        print(json.dumps(simulation_dict(result, summary, plot_path), indent=2))
    else:
        print(format_simulation(result, summary, plot_path))
    return 0


def simulation_dict(result, summary: dict, plot_path: str | None) -> dict:
    scn = result.scenario
    return {
        "scenario": scn.name,
        "description": scn.description,
        "trials": int(next(iter(result.runs.values())).completion_h.shape[0]),
        "gpus": scn.job.gpus,
        "work_hours": scn.job.work_h,
        "mttf_hours": scn.arrivals.mean_gap_h,
        "mttf_source": scn.mttf_source,
        "failure_distribution": scn.arrivals.distribution,
        "elapsed_s": result.elapsed_s,
        "strategies": summary,
        "published_min": scn.published_min,
        "plot": plot_path,
    }


def format_simulation(result, summary: dict, plot_path: str | None) -> str:
    """Readable per-strategy table of a simulation."""
    from baton.sim.engine import MAX_SLOWDOWN
    from baton.sim.strategies import STRATEGY_LABELS

    scn = result.scenario
    job = scn.job
    minutes = job.work_h < 24
    unit, scale = ("min", 60.0) if minutes else ("h", 1.0)
    trials = next(iter(result.runs.values())).completion_h.shape[0]
    arr = scn.arrivals
    if arr.distribution == "uniform":
        fail = f"a failure every {arr.uniform_min_h * 3600:,.0f}-{arr.uniform_max_h * 3600:,.0f} s"
    else:
        fail = f"{arr.distribution} failures, MTTF {arr.mttf_h:.2f} h ({scn.mttf_source})"
    lines = [
        f"Scenario {scn.name}: {job.gpus:,} GPUs, {job.work_h * scale:,.1f} {unit} of work, {fail}",
        f"checkpoint save {scn.checkpoint.save_min:g} min; {trials} trials in {result.elapsed_s:.2f} s",
        "",
    ]
    names = list(summary)
    rows = [
        (f"completion p50 ({unit})", lambda s: f"{s['completion_h']['p50'] * scale:,.1f}"),
        (f"completion p95 ({unit})", lambda s: f"{s['completion_h']['p95'] * scale:,.1f}"),
        ("goodput p50", lambda s: f"{s['goodput']['p50']:.1%}"),
        ("goodput p5 (worst 5%)", lambda s: f"{s['goodput']['p5']:.1%}"),
        ("failures (mean)", lambda s: f"{s['failures']['mean']:,.1f}"),
        ("YOCO ratio", lambda s: f"{s['yoco_ratio']:.1%}"),
        ("GPU-hours wasted p50", lambda s: f"{s['wasted_gpu_hours']['p50']:,.0f}"),
        ("spare GPU-hours p50", lambda s: f"{s['spare_gpu_hours']['p50']:,.0f}"),
        ("$ wasted p50 (incl. spares)", lambda s: f"${s['wasted_usd']['p50']:,.0f}"),
        ("$ wasted p95", lambda s: f"${s['wasted_usd']['p95']:,.0f}"),
        ("waiting for spares (mean h)", lambda s: f"{s['spare_wait_h']['mean']:,.2f}"),
        ("unfinished trials", lambda s: f"{s['unfinished_trials']}"),
        ("checkpoint interval (min)", lambda s: f"{s['checkpoint_interval_h'] * 60:,.1f}"),
    ]
    if scn.published_min:
        rows.append(("published (min)", lambda s, n=None: ""))
    headers = [STRATEGY_LABELS.get(n, n) for n in names]
    def cell(fmt, st: dict) -> str:
        try:
            return fmt(st)
        except TypeError:  # a statistic is None: no trial finished
            return "n/a"

    cells = [[cell(fmt, summary[n]) for n in names] for _, fmt in rows]
    if scn.published_min:
        cells[-1] = [
            f"{scn.published_min[n]:,.0f} ({(summary[n]['completion_h']['p50'] * 60 / scn.published_min[n] - 1):+.0%})"
            if n in scn.published_min and summary[n]["completion_h"]
            else "-"
            for n in names
        ]
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(headers[j]), *(len(c[j]) for c in cells)) for j in range(len(names))]
    lines.append("  ".join([" " * w0] + [headers[j].rjust(widths[j]) for j in range(len(names))]))
    for (label, _), c in zip(rows, cells):
        lines.append("  ".join([label.ljust(w0)] + [c[j].rjust(widths[j]) for j in range(len(names))]))
    stuck = [STRATEGY_LABELS.get(n, n) for n in names if summary[n]["unfinished_trials"]]
    if stuck:
        lines.append(
            f"note: some trials did not finish within {MAX_SLOWDOWN:g}x the failure-free time under: {', '.join(stuck)} "
            "(failures arrive faster than the strategy recovers); statistics cover finished trials only."
        )
    if scn.mttf_source == "extrapolated":
        lines.append("note: MTTF is extrapolated beyond the measured points (1,024 and 16,384 GPUs).")
    if plot_path:
        lines.append(f"plot: {plot_path}")
    return "\n".join(lines)
