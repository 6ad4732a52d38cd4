"""Turn one benchmark results file into the public page docs/benchmarks.md and its plots.

    python bench/report.py                                  # the newest bench/results/bench-*.json
    python bench/report.py bench/results/bench-<ts>.json    # a given results file
    python bench/report.py RESULTS --repo /tmp/somewhere    # write <repo>/docs/... elsewhere

The harness (bench/run.py) calls `write_report(result, results_path, repo)` at the end of
`make bench`; `headline_lines(result)` gives the README's tables (`update_readme` writes them,
and the sentence on what moving large state costs, between the README's markers).

Every figure on the page is printed as median (min-max) with n; comparisons are ratios
taken within the same results file. Verdicts are derived from the numbers (a ratio whose
range straddles the goal is reported as "not demonstrated"), and the caveats are derived
from the machine, the preset and what is missing or skipped in the file.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGE = Path("docs") / "benchmarks.md"
IMG_DIR = Path("docs") / "img"
IMAGES = {"overhead": "bench-overhead.png", "failures": "bench-failures.png", "downtime": "bench-downtime.png"}
OVERHEAD_GOAL = 1.01  # baton / plain DDP steady-state step time
DOWNTIME_SLOPE_GOAL = 1.5  # downtime vs raw TCP copy of the same bytes, fit slope
DASH = "–"  # en dash for ranges
NONE = "—"  # em dash for "no value"
LABELS = {"ddp": "plain DDP", "ddp-again": "plain DDP again (A/A)", "baton": "baton", "baton-verify": "baton + check",
          "baton-hot": "baton --hot-spares", "torchft": "TorchFT"}
COLORS = {"ddp": "#7f8c8d", "baton": "#27ae60", "baton-verify": "#1e8449", "baton-hot": "#f39c12", "torchft": "#2980b9",
          "ckpt": "#c0392b"}
OVERHEAD_ORDER = ("ddp", "ddp-again", "baton", "baton-verify", "baton-hot", "torchft")
SECTIONS = (("overhead", "1. Steady-state overhead"), ("failures", "2. Failures: time lost per failure"),
            ("downtime", "3. Migration downtime vs state size"), ("gpu", "4. GPU state capture"))


# ----------------------------------------------------------------------------- small helpers
def _section(result: dict, name: str) -> tuple[dict | None, str | None]:
    """(data, None) for a measured section, else (None, why it is not there)."""
    sec = result.get(name)
    if sec is None:
        return None, "absent from the results file"
    if not isinstance(sec, dict):
        return None, f"unreadable in the results file ({type(sec).__name__})"
    if "skipped" in sec:
        return None, f"skipped: {sec['skipped']}"
    return sec, None


def _schema(result: dict) -> int:
    v = result.get("schema", 1)
    return v if isinstance(v, int) else 1


def _is_mr(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("median"), (int, float))


def _decimals(x: float) -> int:
    """Decimals for about three significant digits (never scientific notation)."""
    a = abs(x)
    if a == 0 or a >= 100:
        return 0
    return max(0, 2 - int(math.floor(math.log10(a))))


def _num(x: float, dec: int | None = None) -> str:
    return f"{x:,.{_decimals(x) if dec is None else dec}f}"


def _time_unit(values: list[float]) -> tuple[str, float]:
    """'ms' when every value is under a second, else 's' (one unit per column)."""
    vals = [abs(v) for v in values if v is not None]
    return ("ms", 1e3) if vals and max(vals) < 1.0 else ("s", 1.0)


def _mr(mr: Any, unit: str = "", scale: float = 1.0, with_n: bool = False, rng: bool = True) -> str:
    """'57.1 ms (52.0–61.9)' for a median/min/max/n dict; NONE when absent."""
    if not _is_mr(mr):
        return NONE
    med = mr["median"] * scale
    vals = [mr.get(k) for k in ("median", "min", "max") if isinstance(mr.get(k), (int, float))]
    dec = 0 if all(float(v * scale).is_integer() for v in vals) else _decimals(med)
    sp = " " if unit and unit not in ("×", "%") else ""
    out = f"{_num(med, dec)}{sp}{unit}"
    if rng and isinstance(mr.get("min"), (int, float)) and isinstance(mr.get("max"), (int, float)):
        out += f" ({_num(mr['min'] * scale, dec)}{DASH}{_num(mr['max'] * scale, dec)})"
    if with_n and mr.get("n") is not None:
        out += f", n={mr['n']}"
    return out


def _mr_time(mr: Any, unit_scale: tuple[str, float], with_n: bool = False) -> str:
    return _mr(mr, unit_scale[0], unit_scale[1], with_n)


def _spread(mr: Any, with_n: bool = False, scale: float = 1.0, unit: str = "×") -> str:
    """'1.07× (0.97–1.11)' for a ratio's median/min/max (scale 100, unit '%': a fraction's)."""
    if not _is_mr(mr):
        return NONE
    out = f"{scale * mr['median']:.2f}{unit}"
    if isinstance(mr.get("min"), (int, float)) and isinstance(mr.get("max"), (int, float)):
        out += f" ({scale * mr['min']:.2f}{DASH}{scale * mr['max']:.2f})"
    if with_n and mr.get("n") is not None:
        out += f", n={mr['n']}"
    return out


def _ratio(mr: Any, with_n: bool = False) -> str:
    return _spread(mr, with_n)


def _pct(mr: Any, with_n: bool = False) -> str:
    """'3.41% (3.02–3.95)' for a fraction's median/min/max."""
    return _spread(mr, with_n, 100.0, "%")


def _secs(x: float | None) -> str:
    """One duration, in ms under a second."""
    if x is None:
        return NONE
    unit, scale = _time_unit([x])
    return f"{_num(x * scale)} {unit}"


def _secs_pair(a: float | None, b: float | None) -> str:
    """'4.84 s / 0.34 s': two durations in the unit of the larger one."""
    if a is None or b is None:
        return f"{_secs(a)} / {_secs(b)}"
    unit, scale = _time_unit([a, b])
    return f"{_num(a * scale)} {unit} / {_num(b * scale)} {unit}"


def _bytes(b: float | None) -> str:
    if b is None:
        return NONE
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.4g} {unit}"
    return f"{b:.0f} B"


def _params(p: int | None) -> str:
    if p is None:
        return "?"
    if p >= 1e9:
        return f"{p / 1e9:.1f}B"
    if p >= 1e5:
        return f"{p / 1e6:.1f}M"
    return f"{p / 1e3:.0f}k"


def _med(mr: Any) -> float | None:
    return mr["median"] if _is_mr(mr) else None


def _n_note(mrs: list[Any]) -> tuple[str, bool]:
    """('n = 5 runs per figure', False) when every n agrees, else ('', True): print n per cell."""
    ns = {m.get("n") for m in mrs if _is_mr(m)}
    if len(ns) == 1:
        n = ns.pop()
        return (f"n = {n}" if n is not None else ""), False
    return "", bool(ns)


def _min_n(obj: Any) -> int | None:
    """Smallest n of any median/min/max/n figure inside obj."""
    found: list[int] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if _is_mr(o) and isinstance(o.get("n"), int):
                found.append(o["n"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return min(found) if found else None


def _overlap(a: Any, b: Any) -> bool:
    """Whether the min–max ranges of two figures overlap."""
    if not (_is_mr(a) and _is_mr(b)):
        return False
    lo_a, hi_a = a.get("min", a["median"]), a.get("max", a["median"])
    lo_b, hi_b = b.get("min", b["median"]), b.get("max", b["median"])
    return lo_a <= hi_b and lo_b <= hi_a


def _rel(path: Path, start: Path) -> str:
    """path relative to start, with forward slashes; absolute when on another drive/tree."""
    try:
        return Path(os.path.relpath(path, start)).as_posix()
    except ValueError:
        return path.as_posix()


def _display_path(results_path: Path, repo: Path) -> str:
    try:
        return results_path.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        return results_path.as_posix()


def _contender_color(key: str) -> str:
    return COLORS["ckpt"] if key.startswith("ckpt") else COLORS.get(key, "#8e44ad")


def _failure_contenders(sec: dict) -> list[dict]:
    return [c for c in sec.get("contenders") or [] if isinstance(c, dict)]


def _find(contenders: list[dict], key: str) -> dict | None:
    return next((c for c in contenders if c.get("key") == key), None)


def _short_name(c: dict) -> str:
    key = c.get("key", "")
    if key.startswith("ckpt-k"):
        return f"checkpoint-restart K={key[len('ckpt-k'):]}"
    return LABELS.get(key, c.get("name") or key)


def _reference_ddp(contenders: list[dict]) -> dict | None:
    """Plain DDP run without kills: the failure-free reference of the failures section."""
    c = _find(contenders, "ddp")
    return c if c is not None and not c.get("failures") else None


# ----------------------------------------------------------------------------- verdicts
_MORE = {"step time": "slower than plain DDP", "CPU-seconds per step": "more CPU per step than plain DDP"}


def _own_verdict(s: dict) -> str | None:
    """baton's own CPU per step, as it counted it, against plain DDP's whole tree and the 1% goal."""
    frac = (s.get("own_cpu_vs_ddp") or {}).get("baton")
    ms = (s.get("own_cpu_s_per_step") or {}).get("baton")
    if not _is_mr(frac) or not _is_mr(ms):
        return None
    split = (s.get("own_cpu_split_s_per_step") or {}).get("baton") or {}
    parts = ", ".join(f"{name} {_mr(v, 'ms', 1e3, rng=False)}" for name, v in split.items() if _is_mr(v))
    hi = frac.get("max", frac["median"])
    lo = frac.get("min", frac["median"])
    verdict = ("within the 1% goal in every round" if hi <= OVERHEAD_GOAL - 1 else
               "above the 1% goal in every round: the goal is missed at this size" if lo > OVERHEAD_GOAL - 1 else
               "around the 1% goal: within it in some rounds only")
    return (f"baton's own CPU, counted by baton as it ran (`job.cpu_use()`: its entry points on the training "
            f"thread and its threads in every rank, plus the launcher and the spare): {_mr(ms, 'ms', 1e3)} per "
            f"step ({parts}), which is {_pct(frac, with_n=True)} of plain DDP's whole-tree CPU per step in the "
            f"same round: {verdict}. This count does not see work baton makes torch do outside its entry "
            "points; the whole-tree ratio above does, within its noise.")


def _overhead_verdict(who: str, r: Any, what: str = "step time", aa: Any = None) -> str:
    """One sentence on a contender/plain DDP ratio against the 1% goal, from its range; `aa`, plain
    DDP against itself in the same rounds, says how wide the noise alone is."""
    if not _is_mr(r):
        return f"{who}: no {what} ratio in the results."
    if _is_mr(aa):
        out = _overhead_verdict(who, r, what) + \
            f" For scale, plain DDP against itself (A/A) in the same rounds: {_ratio(aa, with_n=True)}"
        if aa.get("min", aa["median"]) <= r["median"] <= aa.get("max", aa["median"]):
            return out + f"; {who}'s median lies inside that range, so its difference from plain DDP is not " \
                "distinguishable from the difference between two identical runs."
        if r["median"] > aa.get("max", aa["median"]):
            return out + f"; {who}'s median lies above that range: more than two identical runs differ."
        return out + f"; {who}'s median lies below that range (the baseline runs were the slow ones)."
    med, lo, hi = r["median"], r.get("min", r["median"]), r.get("max", r["median"])
    more = _MORE.get(what, f"more {what} than plain DDP")
    head = f"{who} / plain DDP, {what} = {_ratio(r, with_n=True)}: "
    if hi <= OVERHEAD_GOAL:
        return head + "within the 1% goal in every round."
    if lo > OVERHEAD_GOAL:
        return head + f"{more} by more than 1% in every round; the 1% goal is missed at this size."
    if lo >= 1.0:
        return head + (f"never below plain DDP, median overhead {100 * (med - 1):.1f}%; "
                       f"the 1% goal is not demonstrated at this noise level.")
    out = head + ("the spread between rounds is wider than the 1% being tested, so the 1% goal is not "
                  "demonstrated at this noise level; neither is an overhead.")
    if med < 1.0:
        out += " A median below 1.00 is noise: baton runs the same DDP plus a control plane."
    return out


def _plain_ratio_sentence(who: str, r: Any, what: str = "step time", versus: str = "plain DDP") -> str:
    if not _is_mr(r):
        return f"{who}: no {what} ratio in the results."
    lo, hi = r.get("min", r["median"]), r.get("max", r["median"])
    out = f"{who} / {versus}, {what} = {_ratio(r, with_n=True)}"
    if lo > 1.0:
        out += f": above {versus} in every round."
    elif hi < 1.0:
        out += f": below {versus} in every round."
    else:
        out += ": the range includes 1.00."
    return out


def _label(key: str, ov: dict | None = None) -> str:
    """A contender's name; baton-verify says its N."""
    if key == "baton-verify" and ov and ov.get("verify_every"):
        return f"baton --verify-every {ov['verify_every']}"
    return LABELS.get(key, key)


def _overhead_keys(sizes: list[dict], field: str = "step_s") -> list[str]:
    keys = [k for k in OVERHEAD_ORDER if any(k in (s.get(field) or {}) for s in sizes)]
    return keys + sorted({k for s in sizes for k in (s.get(field) or {})} - set(keys))


# ----------------------------------------------------------------------------- headline
def headline_overhead(result: dict) -> list[str]:
    """The README's steady-state table: one column per model size (every size measured), one row
    per ratio; empty when the section is missing."""
    ov, _ = _section(result, "overhead")
    if not ov:
        return []
    sizes = [s for s in ov.get("sizes") or [] if isinstance(s, dict)]
    verify = _label("baton-verify", ov)
    rows = [("step time (median), baton / plain DDP", "ratio_vs_ddp", "baton"),
            ("CPU-seconds per step, whole process tree, baton / plain DDP", "cpu_ratio_vs_ddp", "baton"),
            ("baton's own CPU per step, counted by baton itself, as a share of plain DDP's", "own_cpu_vs_ddp",
             "baton"),
            ("step time (median), plain DDP again / plain DDP (A/A: the noise floor)", "ratio_vs_ddp", "ddp-again"),
            ("CPU-seconds per step, plain DDP again / plain DDP (A/A: the noise floor)", "cpu_ratio_vs_ddp",
             "ddp-again"),
            (f"CPU-seconds per step, `{verify}` / baton", "verify_vs_baton", "cpu_s_per_step"),
            (f"wall time per step (mean, includes the checks), `{verify}` / baton", "verify_vs_baton",
             "mean_step_s"),
            ("step time (median), `--hot-spares` / baton", "hot_vs_baton", "step_s"),
            ("CPU-seconds per step, whole process tree, `--hot-spares` / baton", "hot_vs_baton", "cpu_s_per_step"),
            ("step time (median), TorchFT / plain DDP", "ratio_vs_ddp", "torchft"),
            ("CPU-seconds per step, whole process tree, TorchFT / plain DDP", "cpu_ratio_vs_ddp", "torchft")]
    # a fraction (baton's own CPU as a share) reads as a percentage, every other row as a ratio
    cells = [(label, _pct if field == "own_cpu_vs_ddp" else _ratio, [(s.get(field) or {}).get(key) for s in sizes])
             for label, field, key in rows]
    cells = [(label, fmt, mrs) for label, fmt, mrs in cells if any(_is_mr(m) for m in mrs)]
    if not cells:
        return []
    note, per_cell = _n_note([m for _, _, mrs in cells for m in mrs])
    nproc = ov.get("nproc")
    head = "steady state" + (f", {nproc} ranks" if nproc else "") + ": median (min–max) over " + \
        (f"{note.removeprefix('n = ')} rounds" if note else "rounds")
    out = [f"| {head} | " + " | ".join(f"{_params(s.get('params'))} params" for s in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    out += [f"| {label} | " + " | ".join(fmt(m, per_cell) for m in mrs) + " |" for label, fmt, mrs in cells]
    return out


def headline_rows(result: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the README's second table: failures, downtime, GPU (fewer when
    sections are missing). The steady-state figures are in headline_overhead's table."""
    cands: list[tuple[int, str, str]] = []  # (order on the page, label, value)

    fa, _ = _section(result, "failures")
    if fa:
        cs = _failure_contenders(fa)
        bat = _find(cs, "baton")
        ck = _find(cs, f"ckpt-k{fa.get('young_daly_k')}")
        if bat and _is_mr(bat.get("lost_per_failure_s")):
            b = bat["lost_per_failure_s"]
            n = f", n={b['n']}" if b.get("n") is not None else ""
            if ck and _is_mr(ck.get("lost_per_failure_s")):
                c = ck["lost_per_failure_s"]
                cands.append((20, f"time lost per failure: {_short_name(ck)} / baton",
                              f"{_secs_pair(c['median'], b['median'])} (medians{n})"))
            else:
                cands.append((20, "time lost per failure, baton", _mr(b, "s", with_n=True)))

    dt, _ = _section(result, "downtime")
    if dt:
        sizes = [s for s in dt.get("sizes") or [] if isinstance(s, dict) and s.get("state_bytes")]
        if sizes:
            big = max(sizes, key=lambda s: s["state_bytes"])
            size = _bytes(big["state_bytes"])
            p, u, t = _med(big.get("planned_s")), _med(big.get("unplanned_s")), _med(big.get("raw_tcp_s"))
            if p is not None:
                val = f"{_secs_pair(p, t)} = {p / t:.1f}×" if t else _secs(p)
                cands.append((30, f"planned move of {size}: downtime / raw TCP copy", val))
            if _is_mr(big.get("pre_copied_s")):
                small = min(sizes, key=lambda s: s["state_bytes"])
                val = _mr_time(big["pre_copied_s"], _time_unit([_med(big["pre_copied_s"])]))
                if small is not big and _is_mr(small.get("pre_copied_s")):
                    val += f" ({_secs(_med(small['pre_copied_s']))} at {_bytes(small['state_bytes'])})"
                cands.append((29, f"pre-copied planned move of {size} (`--pre-copy`): training paused", val))
            if u is not None:
                val = _mr_time(big.get("unplanned_s"), _time_unit([u]))
                if t:
                    val += f", {u / t:.1f}× raw TCP"
                cands.append((31, f"unplanned recovery of {size}: kill -9 → all ranks running", val))
            if _is_mr(big.get("hot_unplanned_s")):
                hu = _med(big["hot_unplanned_s"])
                val = _mr_time(big["hot_unplanned_s"], _time_unit([hu]))
                setup = _med(((big.get("hot") or {}).get("phases") or {}).get("joiner_setup"))
                if setup is not None:
                    val += f", of which the new rank's script setup {_secs(setup)}"
                cands.append((32, f"unplanned recovery of {size} onto a hot spare (`--hot-spares`)", val))

    gpu, _ = _section(result, "gpu")
    if gpu and _is_mr(gpu.get("capture_gbs")):
        val = _mr(gpu["capture_gbs"], "GB/s")
        frac = _gpu_capture_frac(gpu)
        if frac is not None:
            val += f", {100 * frac:.0f}% of raw D2H"
        cands.append((40, f"GPU state capture ({gpu.get('device', '?')})", val))
    return [(label, value) for _, label, value in sorted(cands)]


def headline_lines(result: dict) -> list[str]:
    """The README's and the page summary's tables: steady state, then everything else."""
    out = headline_overhead(result)
    rows = headline_rows(result)
    if rows:
        out += ([""] if out else []) + ["| what | result |", "|---|---|"]
        out += [f"| {label} | {value} |" for label, value in rows]
    return out


def move_cost_sentence(result: dict) -> str | None:
    """The README's 'Limits' sentence on what moving large state costs, from the downtime section."""
    dt, _ = _section(result, "downtime")
    sizes = [s for s in (dt or {}).get("sizes") or [] if isinstance(s, dict) and s.get("state_bytes")]
    if not sizes:
        return None
    big = max(sizes, key=lambda s: s["state_bytes"])
    p, u, t = _med(big.get("planned_s")), _med(big.get("unplanned_s")), _med(big.get("raw_tcp_s"))
    if not t or (p is None and u is None):
        return None
    parts = ([f"a planned move took {p / t:.1f}×"] if p is not None else []) + \
        ([f"an unplanned recovery {u / t:.1f}×"] if u is not None else [])
    where = _phases_text(big.get("phases") or {})
    text = (f"Moving large state costs several raw copies of it: at {_bytes(big['state_bytes'])} "
            f"{' and '.join(parts)} a raw loopback TCP copy of the same bytes (medians, measured "
            f"{result.get('date', '?')}{'; ' + where if where else ''}); see "
            "[docs/benchmarks.md](docs/benchmarks.md).")
    pre = pre_copy_sentence(big)
    return f"{pre} {text}" if pre else text


def pre_copy_sentence(size: dict) -> str | None:
    """What a pre-copied planned move paused, and what it did beside training, at one size."""
    pc, bg = _med(size.get("pre_copied_s")), size.get("pre_copy") or {}
    fell = [str(x) for x in bg.get("fallbacks") or []]
    fell_text = (f" {len(fell)} move(s) asked to pre-copy took the whole state instead ({fell[0]})."
                 if fell else "")
    if pc is None or not _is_mr(bg.get("base_s")):
        return (f"At {_bytes(size.get('state_bytes'))} no move pre-copied:{fell_text}" if fell else None)
    leaver = ""
    if _is_mr(bg.get("leaver_base_s")) and _is_mr(bg.get("leaver_capture_s_per_step")):
        leaver = (f"; feeding it cost the leaver's steps {_secs(_med(bg['leaver_base_s']))} once (its copy of the "
                  f"state) and {_secs(_med(bg['leaver_capture_s_per_step']))} per step (the gradients it serves)")
    return (f"A pre-copied planned move (`--pre-copy`): at {_bytes(size['state_bytes'])} training paused "
            f"{_secs(pc)} (median), while the joiner's copy of the replicated state took "
            f"{_secs(_med(bg['base_s']))} beside training and it then followed "
            f"{_med(bg.get('steps_followed')) or 0:.0f} of the leaver's optimizer steps{leaver}.{fell_text}")


def hot_overhead_sentence(size: dict) -> str | None:
    """What keeping a spare hot cost in steady state, against baton's default mode, at one model size."""
    hb, hot = size.get("hot_vs_baton") or {}, size.get("hot") or {}
    if not any(_is_mr(v) for v in hb.values()):
        return None
    parts = [f"{name} {_ratio(hb.get(m), with_n=True)}" for m, name in
             (("step_s", "step time (median)"), ("cpu_s_per_step", "CPU-seconds per step of the whole tree"))
             if _is_mr(hb.get(m))]
    text = "`--hot-spares` / baton within each round: " + ", ".join(parts)
    bps, replay = _med(hot.get("bytes_per_step")), _med(hot.get("replay_s"))
    if bps is not None:
        text += (f"; the feeding rank sent the spare {_bytes(bps)} per optimizer step (its gradients and the "
                 "small state)")
    if replay is not None:
        text += f", which the spare replayed in {_secs(replay)} a step"
    late = [x for x in hot.get("kept_pace_before_window") or [] if x is False]
    if late:
        text += f" ({len(late)} run(s) began the window before the spare kept pace)"
    notes = hot.get("notes") or []
    return text + (f". Runs without a hot spare: {'; '.join(notes)}." if notes else ".")


def hot_sentence(size: dict) -> str | None:
    """An unplanned recovery onto a hot spare, at one state size."""
    hot = size.get("hot") or {}
    u, led = _med(hot.get("unplanned_s")), _med(hot.get("unplanned_ledger_s"))
    fell = [str(x) for x in hot.get("fallbacks") or []]
    fell_text = f" {len(fell)} recovery(ies) took the whole state instead ({fell[0]})." if fell else ""
    if u is None:
        return (f"With `--hot-spares` at {_bytes(size.get('state_bytes'))} no recovery used the mirror:{fell_text}"
                if fell else None)
    setup = _med((hot.get("phases") or {}).get("joiner_setup"))
    rest = _med(hot.get("ledger_minus_setup_s"))
    moved = _med(hot.get("bytes_moved"))
    hp = _med(hot.get("planned_s"))
    planned = (f"a planned move to the hot spare paused training {_secs(hp)} (its mirror held the replicated "
               "state; the pause moved the leaver's own and the small state), and " if hp is not None else "")
    text = (f"With `--hot-spares` (the spare mirrors the replicated state every step): at "
            f"{_bytes(size['state_bytes'])} {planned}an unplanned recovery took {_secs(u)} from `kill -9` to every rank "
            f"running (median; ledger, from detection: {_secs(led)}")
    if setup is not None and rest is not None:
        text += f", of which the new rank's script setup {_secs(setup)} and the rest {_secs(rest)}"
    text += ")"
    if moved is not None:
        text += f", moving {_bytes(moved)} instead of the whole state"
    bps, replay = _med(hot.get("bytes_per_step")), _med(hot.get("replay_s"))
    if bps is not None and replay is not None:
        text += f"; the feed sent {_bytes(bps)} per step, replayed in {_secs(replay)}"
    return text + "." + fell_text


def _phases_text(phases: dict) -> str:
    """Where the moves' downtime went, from the ledger's phases: 'planned: fetch 0.48 s, ...'."""
    out, after = [], []
    for kind, per in phases.items():
        shown = [f"{k.replace('_', ' ')} {_secs(_med(v))}" for k, v in per.items()
                 if _med(v) is not None and k != "check_after_resume"
                 # results from before the ledger had `setup`: the bench's own figure stands in
                 and (k != "joiner_setup" or (kind == "unplanned" and "setup" not in per))]
        if shown:
            out.append(f"{kind.replace('_', '-')}: {', '.join(shown)}")
        if _med(per.get("check_after_resume")) is not None:
            after.append(f"{kind.replace('_', '-')} {_secs(_med(per['check_after_resume']))}")
    text = ("where the time went (ledger phases; an unplanned recovery's collect: the survivors' reports "
            "until the plan went out, its setup: the joiner's script setup after the failure): "
            + "; ".join(out)) if out else ""
    if after:  # the state check's pass over the large tensors runs beside the next step, outside the pause
        text += ("; " if text else "") + "the first step after a move then waited for the state check: " + \
            ", ".join(after)
    return text


# ----------------------------------------------------------------------------- page sections
def _header(result: dict, results_path: Path, repo: Path, page_dir: Path) -> list[str]:
    shown = _display_path(results_path, repo)
    link = _rel(results_path.resolve(), page_dir.resolve())
    m = result.get("machine") or {}
    dur = result.get("duration_s")
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by bench/report.py from {shown}. Do not edit by hand. -->",
        f"*Generated by `bench/report.py` from [`{shown}`]({link}) — do not edit by hand; "
        f"rerun `make bench` or `python bench/report.py {shown}`.*",
        "",
        f"Measured **{result.get('date', 'date unknown')}**, preset `{result.get('preset', '?')}`"
        + (f", {dur / 60:.1f} min for the whole harness." if isinstance(dur, (int, float)) else "."),
        "",
        "| machine | |",
        "|---|---|",
        f"| CPUs | {m.get('cpus', '?')}" + (f" ({m['cpu_model']})" if m.get("cpu_model") else "") + " |",
        f"| memory | {m['memory_gib']:.1f} GiB |" if isinstance(m.get("memory_gib"), (int, float))
        else "| memory | ? |",
        f"| platform | `{m.get('platform', '?')}` |",
        f"| Python | {m.get('python', '?')} |",
        f"| torch | {m.get('torch', '?')} |",
        f"| torchft | {m.get('torchft') or 'not installed'} |",
        "",
        "Commands, exactly as run:",
        "",
        "```bash",
        *(result.get("commands") or ([result["command"]] if result.get("command") else ["(not recorded)"])),
        "```",
        "",
        "How to read the figures: every figure is the **median**, with the **min–max** over the runs in "
        "brackets and **n** the number of runs behind it; min–max is the observed range, not a "
        "confidence interval. Every comparison is a ratio between figures measured in this same "
        "results file: step-time ratios are taken per round (the contenders of a round run back to "
        "back) and then summarised; other ratios are ratios of the medians. Nothing here is compared "
        "with another run or another machine.",
        "",
    ]
    return lines


def _summary(result: dict) -> list[str]:
    lines = headline_lines(result)
    if not lines:
        return []
    return ["## Summary", "", *lines, "", "Details, definitions and the losing cases are in the sections below.", ""]


def _reproduce() -> list[str]:
    return [
        "## How to reproduce",
        "",
        "```bash",
        "make bench                     # quick preset; writes bench/results/bench-<timestamp>.json and this page",
        "python bench/run.py --full     # full preset: more runs and sizes",
        "python bench/run.py --preset tiny   # smoke test of the harness (minutes); results to a temp dir, "
        "this page untouched",
        "python bench/report.py [bench/results/bench-<timestamp>.json]   # regenerate this page only",
        "```",
        "",
        "The TorchFT contender runs from its own virtualenv (`bench/peers/setup.sh`); without it the "
        "TorchFT rows are missing and the caveats below say so. The GPU section needs a CUDA device.",
        "",
    ]


def _spares(n: int | None) -> str:
    return "no spare" if not n else f"{n} warm spare" + ("s" if n != 1 else "")


def _kills(n: int | None) -> str:
    return f"{n if n is not None else '?'} kill" + ("" if n == 1 else "s")


def _buddies(nproc: Any) -> str:
    n = min(2, nproc - 1) if isinstance(nproc, int) else 2
    return {0: "no buddy rank", 1: "one buddy rank"}.get(n, "two buddy ranks")


def _overhead_table(sizes: list[dict], ov: dict, field: str, ratio_field: str, what: str) -> list[str]:
    """One table: `field` per contender and each contender's ratio to plain DDP, per model size."""
    keys = _overhead_keys(sizes, field)
    keys = [k for k in keys if any(_is_mr((s.get(field) or {}).get(k)) for s in sizes)]
    if not keys:
        return []
    rkeys = [k for k in keys if k != "ddp" and any(_is_mr((s.get(ratio_field) or {}).get(k)) for s in sizes)]
    mrs = [m for s in sizes for m in [*(s.get(field) or {}).values(), *(s.get(ratio_field) or {}).values()]]
    note, per_cell = _n_note(mrs)
    unit = _time_unit([_med(m) for s in sizes for m in (s.get(field) or {}).values() if _is_mr(m)])
    out = [f"{what}, per launcher, and ratio to plain DDP{f' ({note} per figure)' if note else ''}:", "",
           "| params | " + " | ".join(_label(k, ov) for k in keys) + " | "
           + " | ".join(f"{_label(k, ov)} / plain DDP" for k in rkeys) + " |",
           "|---:|" + "---:|" * (len(keys) + len(rkeys))]
    for s in sizes:
        st, rt = s.get(field) or {}, s.get(ratio_field) or {}
        out.append(f"| {_params(s.get('params'))} | " + " | ".join(_mr_time(st.get(k), unit, per_cell) for k in keys)
                   + " | " + " | ".join(_ratio(rt.get(k), per_cell) for k in rkeys) + " |")
    return out + [""]


def _overhead_md(sec: dict, img: str | None) -> list[str]:
    sizes = [s for s in sec.get("sizes") or [] if isinstance(s, dict)]
    nproc, steps, warmup, runs = sec.get("nproc"), sec.get("steps"), sec.get("warmup"), sec.get("runs")
    n_verify = sec.get("verify_every")
    has_cpu = any(_is_mr(m) for s in sizes for m in (s.get("cpu_s_per_step") or {}).values())
    has_mean = any(_is_mr(m) for s in sizes for m in (s.get("mean_step_s") or {}).values())
    window = f"steps {warmup}–{steps}" if isinstance(warmup, int) and isinstance(steps, int) else "after warm-up"
    out = [
        "**What is measured.** The same model, synthetic data and world size "
        f"({nproc} ranks, one process each, gloo over loopback) trained for {steps} steps under each "
        "launcher: plain `DistributedDataParallel` under `torchrun` (the baseline), the same plain DDP a "
        "second time (an A/A comparison: its ratio to the baseline is how far two identical runs differ "
        "on this machine, the noise any other ratio must be read against), baton "
        f"(`baton run`, `job.wrap` + `job.steps`, {_spares(sec.get('baton_spares', 0))} waiting, its per-step "
        "work as in any run: the step-boundary check, the capture of each rank's random streams at the "
        f"step's first gradient bucket and its push to {_buddies(nproc)}, which hold back their last bucket "
        "until it has arrived)"
        + (f", baton with `--verify-every {n_verify}` (the same, plus a replica-agreement check — every "
           f"rank digests its replicated state and the ranks compare digests — at every {n_verify}th step "
           "boundary)" if n_verify else "")
        + " and TorchFT (its DDP wrapper, replica groups of one rank, lighthouse). Every figure covers the "
        f"same window of each run, {window}: from rank 0 reporting step {warmup} done to rank 0 reporting the "
        "last one, so warm-up and start-up are left out. **step time** is the median gap between rank "
        "0's step reports in the window; being a median, it leaves out work done only every few steps."
        + (" **wall time per step (mean)** is the window's wall time / its steps, which includes that work."
           if has_mean else "")
        + (" **CPU-seconds per step** is the CPU time (user + system, every thread) of the run's whole "
           "process tree in the window / its steps: every rank (read by the rank itself, `getrusage`, at "
           "its own edges of the window) plus every other process — the launcher (`baton run` with its "
           "orchestrator and API, or `torchrun`'s agent), baton's warm spare, TorchFT's lighthouse and "
           "agents, anything they started — read from `/proc` by the harness as rank 0 reports each edge. "
           "It charges every contender for everything it runs, and unlike wall time it does not count "
           "the time a process waits for a core on an oversubscribed machine."
           if has_cpu else "")
        + f" Each cell is the median over {runs} runs with min–max. The contenders run in rounds, back to "
        "back, and each ratio is taken within one round, so a slow period of the machine affects both "
        "sides of it; the ratio columns are the median (min–max) over rounds, not the ratio of the "
        "medians.",
        "",
    ]
    if not sizes:
        return out + ["No model sizes in the results.", ""]
    out += _overhead_table(sizes, sec, "step_s", "ratio_vs_ddp", "Step time (median)")
    out += _overhead_table(sizes, sec, "cpu_s_per_step", "cpu_ratio_vs_ddp",
                           "CPU-seconds per step of the whole process tree, in ms of CPU time")
    out += _overhead_table(sizes, sec, "mean_step_s", "mean_ratio_vs_ddp", "Wall time per step (mean over the window)")
    bullets: list[str] = []
    for s in sizes:
        rt, ct = s.get("ratio_vs_ddp") or {}, s.get("cpu_ratio_vs_ddp") or {}
        label = f"{_params(s.get('params'))} params"
        bullets.append(f"{label}: " + _overhead_verdict("baton", rt.get("baton"), aa=rt.get("ddp-again")))
        if "baton" in ct:
            bullets.append(f"{label}: " + _overhead_verdict("baton", ct.get("baton"), "CPU-seconds per step",
                                                            aa=ct.get("ddp-again")))
        own = _own_verdict(s)
        if own:
            bullets.append(f"{label}: {own}")
        vb = s.get("verify_vs_baton") or {}
        if any(_is_mr(v) for v in vb.values()):
            who = _label("baton-verify", sec)
            parts = [f"{name} {_ratio(vb.get(m), with_n=True)}" for m, name in
                     (("cpu_s_per_step", "CPU-seconds per step"), ("mean_step_s", "wall time per step (mean)"),
                      ("step_s", "step time (median)")) if _is_mr(vb.get(m))]
            bullets.append(f"{label}: the periodic check, `{who}` / baton within each round: " + ", ".join(parts)
                           + ". The median step time leaves the checked boundaries out; the other two include them.")
        hot = hot_overhead_sentence(s)
        if hot:
            bullets.append(f"{label}: {hot}")
        for k in ("torchft", *[k for k in rt if k not in ("baton", "baton-verify", "baton-hot", "torchft",
                                                            "ddp-again")]):
            if k in rt:
                bullets.append(f"{label}: " + _plain_ratio_sentence(_label(k, sec), rt.get(k)))
            if k in ct:
                bullets.append(f"{label}: " + _plain_ratio_sentence(_label(k, sec), ct.get(k), "CPU-seconds per step"))
        others = s.get("cpu_others_s_per_step") or {}
        total = s.get("cpu_s_per_step") or {}
        shares = [f"{_label(k, sec)} {1e3 * _med(others[k]):.2f} ms ({100 * _med(others[k]) / _med(total[k]):.1f}%)"
                  for k in _overhead_keys([s], "cpu_others_s_per_step")
                  if _is_mr(others.get(k)) and _is_mr(total.get(k)) and _med(total[k])]
        if shares:
            bullets.append(f"{label}: CPU per step outside the ranks (launcher, agents, spare, lighthouse), median: "
                           + ", ".join(shares) + ".")
    checks = [s.get("cpu_check") for s in sizes if isinstance(s.get("cpu_check"), dict)]
    if checks:
        agree = [c["ranks_proc_over_self"] for c in checks if _is_mr(c.get("ranks_proc_over_self"))]
        lag = max((c["max_harness_lag_s"] for c in checks if isinstance(c.get("max_harness_lag_s"), (int, float))),
                  default=None)
        bits = []
        if agree:
            lo = min(a.get("min", a["median"]) for a in agree)
            hi = max(a.get("max", a["median"]) for a in agree)
            bits.append(f"the ranks' CPU read from `/proc` by the harness is {lo:.2f}–{hi:.2f}× what they read "
                        "themselves (the harness reads a few ms late, in 10 ms ticks)")
        if lag is not None:
            bits.append(f"the harness read the other processes at most {_secs(lag)} after rank 0's report")
        fallbacks = sum(c.get("tick_fallbacks") or 0 for c in checks)
        exited = sum(c.get("processes_exited_in_window") or 0 for c in checks)
        bits.append(f"{exited} process{'es' if exited != 1 else ''} exited inside a window, and "
                    f"{fallbacks} process{'es were' if fallbacks != 1 else ' was'} read in clock ticks because "
                    "threads came and went between the harness's reads")
        notes = sorted({n for c in checks for n in c.get("notes") or []})
        if notes:
            bits.append("runs without a CPU figure: " + "; ".join(notes))
        bullets.append("Checks on the CPU figure: " + "; ".join(bits) + ".")
    out += [f"- {b}" for b in bullets] + [""]
    if img:
        what = "step time and CPU-seconds per step" if has_cpu else "step time"
        out += [f"![steady-state {what} per launcher and model size](img/{img})", ""]
    return out


def _failures_md(sec: dict, img: str | None, legacy_stall: bool = False) -> list[str]:
    """legacy_stall: a results file from before schema 2, whose baton stall counted the absorbed
    (failed) attempt at the interrupted step as progress; that figure is not shown."""
    cs = _failure_contenders(sec)
    hidden_stall = None
    if legacy_stall:
        cs = [{**c, "stall_s": None} if c.get("key") == "baton" else c for c in cs]
        hidden_stall = next((c.get("stall_s") for c in _failure_contenders(sec) if c.get("key") == "baton"), None)
    kill_at = sec.get("kill_at") or []
    ykey = f"ckpt-k{sec.get('young_daly_k')}"
    save_s, mtbf_s, step_s = sec.get("save_s"), sec.get("mtbf_s"), sec.get("step_s")
    young = ""
    if all(isinstance(x, (int, float)) and x > 0 for x in (save_s, mtbf_s, step_s)):
        tau = math.sqrt(2 * save_s * mtbf_s)
        young = (f" (Young: √(2 · {_secs(save_s)} · {_secs(mtbf_s)}) = {_secs(tau)} = "
                 f"{tau / step_s:.1f} steps of {_secs(step_s)})")
    sleep = sec.get("step_sleep")
    out = [
        f"**What is measured.** One job — {sec.get('nproc')} ranks, {_params(sec.get('params'))} params, "
        f"{sec.get('steps')} steps" + (f", each step padded with {_secs(sleep)} of sleep" if sleep else "")
        + f" — run to completion under each contender while rank {sec.get('kill_rank')} is killed with "
        f"`kill -9` at step{'s' if len(kill_at) != 1 else ''} {', '.join(str(k) for k in kill_at) or '?'}, "
        f"{sec.get('runs')} rounds. Plain DDP under `torchrun` has no recovery, so it runs without kills "
        "and is the failure-free reference. Checkpoint-restart is `torchrun --max-restarts` with "
        "`torch.save` every K steps, resuming from the last checkpoint: "
        f"K = {sec.get('young_daly_k')} is the Young/Daly interval for the measured save cost "
        f"δ = {_secs(save_s)}, the mean time between this schedule's kills M = {_secs(mtbf_s)} and the "
        f"measured step time{young}; K = {sec.get('other_k')} is shown for comparison. "
        "**total** is the wall time of the whole job including process start-up; **train** is first "
        "step to last step; **lost per failure** is (train − plain DDP's failure-free train in the same "
        "round) / kills, so it also contains the contender's steady-state overhead over the whole job; "
        "**stall** is kill → surviving rank 0 completes a step beyond the last one it had reported before "
        "the kill (an attempt at a step that failed and was absorbed, to be run again, does not count); "
        "**params equal** "
        "says whether the final parameters are bitwise equal to the same contender's own run without "
        "kills.",
        "",
    ]
    if not cs:
        return out + ["No contenders in the results.", ""]
    cols = [("total_s", "total job time"), ("train_s", "train time"), ("lost_per_failure_s", "lost per failure"),
            ("stall_s", "stall after kill"), ("steps_recomputed", "steps recomputed"),
            ("samples_dropped_frac", "batches dropped")]
    cols = [(k, h) for k, h in cols if any(_is_mr(c.get(k)) for c in cs)]
    note, per_cell = _n_note([c.get(k) for c in cs for k, _ in cols])
    units = {k: _time_unit([_med(c.get(k)) for c in cs]) for k, _ in cols if k.endswith("_s")}
    out += [f"Per contender{f' ({note} per figure)' if note else ''}:", "",
            "| contender | kills per run | " + " | ".join(h for _, h in cols) + " | params equal |",
            "|---|---:|" + "---:|" * len(cols) + "---|"]
    for c in cs:
        cells = []
        for k, _ in cols:
            v = c.get(k)
            if k in units:
                cells.append(_mr_time(v, units[k], per_cell))
            elif k == "samples_dropped_frac":
                cells.append(_mr(v, "%", 100.0, per_cell))
            else:
                cells.append(_mr(v, "", 1.0, per_cell))
        pm = c.get("params_match")
        pm_s = NONE if pm is None else ("yes" if pm else "**no**")
        out.append(f"| {c.get('name') or c.get('key')} | {c.get('failures', '?')} | " + " | ".join(cells)
                   + f" | {pm_s} |")
    out.append("")

    # comparisons, from the data
    bullets: list[str] = []
    ref = _reference_ddp(cs)
    bat = _find(cs, "baton")
    b_lost = bat.get("lost_per_failure_s") if bat else None
    for c in cs:
        if c is bat or not c.get("failures"):
            continue
        c_lost = c.get("lost_per_failure_s")
        if not (_is_mr(c_lost) and _is_mr(b_lost)):
            continue
        cm, bm = c_lost["median"], b_lost["median"]
        s = (f"Time lost per failure, {_short_name(c)} vs baton: {_mr(c_lost, 's')} vs {_mr(b_lost, 's')}")
        if bm >= cm:
            s += f": baton lost as much or more time per failure than {_short_name(c)} here."
        elif bm > 0:
            s += f": {_short_name(c)} lost {cm / bm:.1f}× as much as baton (ratio of medians)."
        else:
            s += f": baton's median is {_secs(bm)}, at or below the failure-free reference, i.e. within noise."
        if _overlap(c_lost, b_lost):
            s += " The ranges overlap, so this difference is not established by these runs."
        bullets.append(s)
    for c in cs:
        if not c.get("failures") or not _is_mr(c.get("lost_per_failure_s")):
            continue
        lf = c["lost_per_failure_s"]
        if lf.get("min", lf["median"]) < 0:
            bullets.append(f"{_short_name(c)}: some rounds lost a negative amount of time per failure "
                           f"(min {_secs(lf['min'])}): the kills cost less than the run-to-run noise of "
                           "the failure-free reference.")
    if ref and _is_mr(ref.get("total_s")):
        r = ref["total_s"]
        for c in cs:
            if c is ref or not _is_mr(c.get("total_s")):
                continue
            t = c["total_s"]
            bullets.append(f"Whole job, {_short_name(c)} with {_kills(c.get('failures'))}: {_mr(t, 's')}, "
                           f"{t['median'] / r['median']:.2f}× the {_mr(r, 's')} of plain DDP without kills.")
    for c in cs:
        d = c.get("samples_dropped_frac")
        if _is_mr(d) and d["median"] > 0:
            bullets.append(f"{_short_name(c)} did not commit {_mr(d, '%', 100.0)} of its batches: it ran the "
                           "same number of steps on fewer samples, so its times are not a like-for-like "
                           "comparison with contenders that drop nothing.")
    for c in cs:
        if c.get("params_match") is False:
            bullets.append(f"{_short_name(c)}: final parameters are **not** bitwise equal to "
                           f"{c.get('reference') or 'its failure-free run'}.")
    matched = [_short_name(c) for c in cs if c.get("params_match") is True]
    if matched:
        bullets.append("Final parameters bitwise equal to the contender's own failure-free run: "
                       + ", ".join(matched) + ".")
    if _find(cs, ykey) is None and sec.get("young_daly_k") is not None:
        bullets.append(f"No checkpoint-restart result at the Young/Daly K = {sec.get('young_daly_k')}.")
    if bat is None:
        bullets.append("**baton has no result in this section.**")
    if _is_mr(hidden_stall):
        bullets.append(f"baton's stall is not shown: this results file predates schema 2, and its figure "
                       f"({_mr(hidden_stall, 's')}) counted baton's absorbed, failed attempt at the interrupted "
                       "step as progress, so it timed the failure being absorbed, not training moving on. "
                       "Time lost per failure is unaffected.")
    out += [f"- {b}" for b in bullets] + ([""] if bullets else [])

    notes = [(c.get("name") or c.get("key"), c.get("reference"), c.get("notes")) for c in cs]
    notes = [(n, r, t) for n, r, t in notes if t or (r and r not in ("-", NONE))]
    if notes:
        out += ["Notes per contender:", ""]
        for n, r, t in notes:
            bits = [t] if t else []
            if r and r not in ("-", NONE):
                bits.append(f"parameters compared with {r}")
            out.append(f"- {n}: " + "; ".join(bits) + ".")
        out.append("")
    if img:
        out += [f"![total job time per contender](img/{img})", ""]
    return out


def _fit_sentence(kind: str, fit: Any) -> str:
    if not isinstance(fit, dict) or not isinstance(fit.get("slope"), (int, float)):
        return f"{kind}: no fit (needs two or more sizes)."
    slope, c = fit["slope"], fit.get("intercept_s") or 0.0
    s = f"{kind} downtime ≈ **{slope:.2f}** × raw TCP copy time {'+' if c >= 0 else '−'} {_secs(abs(c))}: "
    if slope <= DOWNTIME_SLOPE_GOAL:
        s += f"slope under the {DOWNTIME_SLOPE_GOAL}× aim."
    else:
        s += (f"slope **above** the {DOWNTIME_SLOPE_GOAL}× aim: a move costs more than "
              f"{DOWNTIME_SLOPE_GOAL} raw copies of its state.")
    if c < 0:
        s += " (A negative constant is a fitting artefact of a few points, not a negative cost.)"
    return s


def _downtime_md(sec: dict, img: str | None) -> list[str]:
    sizes = sorted((s for s in sec.get("sizes") or [] if isinstance(s, dict)), key=lambda s: s.get("state_bytes") or 0)
    out = [
        f"**What is measured.** A baton job of {sec.get('nproc')} ranks and {sec.get('spares')} warm spare"
        f"{'s' if sec.get('spares') != 1 else ''}, whose state (fp32 model + AdamW moments) is grown "
        f"step by step in size; at each size the harness makes {sec.get('moves')} planned moves "
        "(`baton migrate`) and as many unplanned recoveries (`kill -9` of a rank). **planned** is the "
        "ledger's downtime: first rank paused → every rank in the next process-group generation; "
        "**unplanned** is `kill -9` → every rank in the next generation (the ledger's own figure, "
        "from failure detection, beside it); **transfer** is the joiner's state fetch inside a planned "
        "move. **raw TCP / raw shm** copy the same number of bytes between two plain processes over "
        "loopback TCP / shared memory in the same run, right after the job: the floor for moving that "
        "state over that medium. The fit is a least-squares line through the medians, downtime = "
        f"slope × raw TCP copy time + constant; the aim is a slope under {DOWNTIME_SLOPE_GOAL} with a small constant.",
        "",
    ]
    if not sizes:
        return out + ["No state sizes in the results.", ""]
    keys = [("planned_s", "planned"), ("pre_copied_s", "pre-copied (pause)"), ("unplanned_s", "unplanned"),
            ("unplanned_ledger_s", "unplanned (ledger)"), ("hot_planned_s", "planned, hot spare"),
            ("hot_unplanned_s", "unplanned, hot spare"),
            ("transfer_s", "transfer"), ("raw_tcp_s", "raw TCP"), ("raw_shm_s", "raw shm")]
    keys = [(k, h) for k, h in keys if any(_is_mr(s.get(k)) for s in sizes)]
    note, per_cell = _n_note([s.get(k) for s in sizes for k, _ in keys])
    units = {k: _time_unit([_med(s.get(k)) for s in sizes]) for k, _ in keys}
    out += [f"Downtime and raw copies per state size{f' ({note} per figure)' if note else ''}; the last two "
            "columns are ratios of medians:", "",
            "| state | params | " + " | ".join(h for _, h in keys) + " | planned / TCP | unplanned / TCP |",
            "|---:|---:|" + "---:|" * (len(keys) + 2)]
    for s in sizes:
        pt, ut = s.get("planned_over_tcp"), s.get("unplanned_over_tcp")
        out.append(f"| {_bytes(s.get('state_bytes'))} | {_params(s.get('params'))} | "
                   + " | ".join(_mr_time(s.get(k), units[k], per_cell) for k, _ in keys)
                   + f" | {f'{pt:.2f}×' if isinstance(pt, (int, float)) else NONE}"
                   + f" | {f'{ut:.2f}×' if isinstance(ut, (int, float)) else NONE} |")
    out.append("")
    fit = sec.get("fit") or {}
    bullets = [_fit_sentence("Planned", fit.get("planned")), _fit_sentence("Unplanned", fit.get("unplanned"))]
    bullets += [b for b in map(pre_copy_sentence, sizes) if b]  # the pause that does not grow with the state
    bullets += [b for b in map(hot_sentence, sizes) if b]  # recoveries that move only the rank's own state
    big = sizes[-1]
    t, shm = _med(big.get("raw_tcp_s")), _med(big.get("raw_shm_s"))
    if t and shm:
        bullets.append(f"At {_bytes(big.get('state_bytes'))} a raw shared-memory copy takes {_secs(shm)} against "
                       f"{_secs(t)} over TCP ({t / shm:.1f}× faster); the ratios and the fit above are "
                       "against TCP.")
    small = sizes[0]
    if len(sizes) > 1 and isinstance(small.get("planned_over_tcp"), (int, float)) and small["planned_over_tcp"] > 3:
        bullets.append(f"At the smallest size ({_bytes(small.get('state_bytes'))}) planned downtime is "
                       f"{small['planned_over_tcp']:.1f}× the raw copy: the fixed cost of a move dominates "
                       "small states.")
    out += [f"- {b}" for b in bullets] + [""]
    if img:
        out += [f"![migration downtime vs state size](img/{img})", ""]
    return out


def _gpu_md(sec: dict) -> list[str]:
    out = [
        "**What is measured.** Copying a rank's state from GPU memory to host memory, as a move "
        "must before it can send it: **raw D2H** is a plain device-to-host copy of the same bytes; "
        "**capture** is baton's capture of the state; **stream** is capture overlapped with "
        "sending it on.",
        "",
        f"Device: {sec.get('device', '?')}, state {_bytes(sec.get('state_bytes'))}.",
        "",
        "| raw D2H | capture | capture | capture / raw (harness) | stream | stream |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {_mr(sec.get('d2h_raw_gbs'), 'GB/s', with_n=True)} | "
        f"{_mr_time(sec.get('capture_s'), _time_unit([_med(sec.get('capture_s'))]), True)} | "
        f"{_mr(sec.get('capture_gbs'), 'GB/s')} | "
        + (f"{sec['capture_over_raw']:.2f}×" if isinstance(sec.get("capture_over_raw"), (int, float)) else NONE)
        + f" | {_mr_time(sec.get('stream_s'), _time_unit([_med(sec.get('stream_s'))]), True)} | "
        f"{_mr(sec.get('stream_gbs'), 'GB/s')} |",
        "",
    ]
    frac = _gpu_capture_frac(sec)
    if frac is not None:
        out += [f"Capture runs at {100 * frac:.0f}% of the raw device-to-host bandwidth (ratio of medians)"
                + (": slower than a plain copy." if frac < 1 else "."), ""]
    return out


def _gpu_capture_frac(sec: dict) -> float | None:
    """capture GB/s over raw D2H GB/s, both medians of this run."""
    cap, raw = _med(sec.get("capture_gbs")), _med(sec.get("d2h_raw_gbs"))
    return cap / raw if cap is not None and raw else None


def _caveats(result: dict, missing: dict[str, str]) -> list[str]:
    m = result.get("machine") or {}
    cav: list[str] = []
    torch_v = str(m.get("torch") or "")
    gpu, _ = _section(result, "gpu")
    if gpu:
        cav.append(f"Sections 1–3 ran on CPU with gloo; only section 4 used a GPU ({gpu.get('device', '?')}). "
                   "NCCL is not measured.")
    else:
        cav.append(f"CPU only (torch {torch_v or '?'}): training runs on CPU with gloo. Nothing here measures "
                   "NCCL, GPU memory or a real interconnect.")
    cpus = m.get("cpus")
    nprocs = [s.get("nproc") for s in (_section(result, k)[0] for k in ("overhead", "failures", "downtime"))
              if s and isinstance(s.get("nproc"), int)]
    if isinstance(cpus, int) and nprocs and cpus <= max(nprocs) + 1:
        cav.append(f"{cpus} CPU core{'s' if cpus != 1 else ''} for up to {max(nprocs)} ranks plus launcher and "
                   "control plane (baton's orchestrator and heartbeats, torchrun's agent, TorchFT's "
                   "lighthouse): the machine is oversubscribed, so step times include scheduling contention "
                   "and the control plane's CPU time is charged to its contender. Other load on the machine "
                   "during the run is not controlled.")
    cav.append("Single host: collectives are gloo over loopback and state moves over loopback TCP. Across "
               "hosts the absolute times grow with the network; the ratio to a raw copy over the same "
               "medium is the figure that compares.")
    n = _min_n({k: result.get(k) for k in ("overhead", "failures", "downtime", "gpu")})
    if n is not None and n < 5:
        cav.append(f"Some figures rest on n = {n} runs: their min–max is the range of {n} values.")
    if result.get("preset") == "quick":
        cav.append("Quick preset: fewer runs and sizes than `python bench/run.py --full`.")
    if result.get("preset") == "tiny":
        cav.append("**Tiny preset: a smoke test of the harness. One small model, one round, a few steps: "
                   "its figures mean nothing.**")
    ov, _ = _section(result, "overhead")
    if ov:
        sizes = [s for s in ov.get("sizes") or [] if isinstance(s, dict)]
        no_ft = [s for s in sizes if "torchft" not in (s.get("step_s") or {})]
        if sizes and no_ft:
            which = "any size" if len(no_ft) == len(sizes) else ", ".join(_params(s.get("params")) for s in no_ft)
            cav.append(f"TorchFT has no steady-state figure at {which} (it runs from the peers virtualenv, "
                       "`bench/peers/setup.sh`; " + ("torchft is not installed on this machine)."
                                                     if not m.get("torchft") else "see the harness output)."))
        lows = [_params(s.get("params")) for s in sizes
                if _is_mr((s.get("ratio_vs_ddp") or {}).get("baton")) and s["ratio_vs_ddp"]["baton"].get("min", 1) < 1]
        if lows:
            cav.append(f"baton / plain DDP step time dips below 1.00 in some rounds ({', '.join(lows)} params). "
                       "baton runs the same DDP plus a control plane, so those rounds measure noise; read the "
                       "range, not the median.")
        has_cpu = any(_is_mr(v) for s in sizes for v in (s.get("cpu_s_per_step") or {}).values())
        if sizes and not has_cpu:
            cav.append("This results file has no CPU-seconds per step (the harness measures them since "
                       "schema 2): the steady-state comparison rests on wall time alone.")
        elif has_cpu:
            cav.append("CPU-seconds per step do not count waiting for a core, but they are not free of noise: "
                       "other load on a shared machine contends for caches and memory bandwidth and stretches "
                       "the same work, and a rank that waits in a collective may spin. A CPU ratio's range is "
                       "its noise, as for step time.")
        if sizes and not any("baton-verify" in (s.get("step_s") or {}) for s in sizes):
            cav.append("The cost of `baton run --verify-every N` (the periodic replica-agreement check) is not "
                       "in this results file.")
    fa, _ = _section(result, "failures")
    if fa:
        cav.append("Failures are `kill -9` of a local process, and the warm spare is on the same host. "
                   "Checkpoint-restart restarts processes on the same host with no node replacement, "
                   f"scheduling or image pull and saves to local disk (δ = {_secs(fa.get('save_s'))}): in a "
                   "cluster its loss per failure would grow by those times, and baton's by the state "
                   "transfer over a real network.")
        if fa.get("step_sleep"):
            cav.append(f"In section 2 each step sleeps {_secs(fa['step_sleep'])} to stand in for compute, so "
                       "that the job is long enough for its kills; absolute job times reflect that padding.")
        cs = _failure_contenders(fa)
        if not any(c.get("key") == "torchft" for c in cs):
            cav.append("TorchFT has no result in the failures section.")
        nulls = [_short_name(c) for c in cs if c.get("failures") and c.get("params_match") is None]
        if nulls:
            cav.append("Bitwise parameter equality was not checked for: " + ", ".join(nulls) + ".")
    for name, title in SECTIONS:
        if name in missing:
            cav.append(f"Section {title.split('. ', 1)[0]} ({title.split('. ', 1)[1]}) is {missing[name]}.")
    if "plots" in missing:
        cav.append(f"Plots were not drawn: {missing['plots']}.")
    return ["## Caveats", ""] + [f"- {c}" for c in cav] + [""]


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _err(mrs: list[Any], scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    meds, lo, hi = [], [], []
    for m in mrs:
        med = m["median"] * scale
        meds.append(med)
        lo.append(max(0.0, med - m.get("min", m["median"]) * scale))
        hi.append(max(0.0, m.get("max", m["median"]) * scale - med))
    return meds, [lo, hi]


def plot_overhead(sec: dict, path: Path) -> Path | None:
    """One column per model size; a row for step time and, when measured, one for CPU per step."""
    sizes = [s for s in sec.get("sizes") or []
             if isinstance(s, dict) and any(_is_mr(v) for v in (s.get("step_s") or {}).values())]
    if not sizes:
        return None
    rows = [("step_s", "ratio_vs_ddp", "step time, median (ms)")]
    if any(_is_mr(v) for s in sizes for v in (s.get("cpu_s_per_step") or {}).values()):
        rows.append(("cpu_s_per_step", "cpu_ratio_vs_ddp", "CPU-seconds per step,\nwhole process tree (ms)"))
    plt = _plt()
    fig, axes = plt.subplots(len(rows), len(sizes), figsize=(3.6 * len(sizes) + 1.2, 3.6 * len(rows)), dpi=110,
                             squeeze=False)
    for r_i, (field, ratio_field, ylabel) in enumerate(rows):
        for ax, s in zip(axes[r_i], sizes):
            st, rt = s.get(field) or {}, s.get(ratio_field) or {}
            keys = [k for k in _overhead_keys([s], field) if _is_mr(st.get(k))]
            if not keys:
                ax.set_axis_off()
                continue
            meds, yerr = _err([st[k] for k in keys], 1e3)
            xs = range(len(keys))
            ax.bar(xs, meds, yerr=yerr, capsize=4, color=[_contender_color(k) for k in keys], width=0.65)
            top = max(m + e for m, e in zip(meds, yerr[1]))
            for x, k, med, e in zip(xs, keys, meds, yerr[1]):
                r = rt.get(k)
                if _is_mr(r):
                    ax.text(x, med + e + 0.03 * top, f"{r['median']:.2f}×\n({r.get('min', r['median']):.2f}"
                            f"{DASH}{r.get('max', r['median']):.2f})", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(list(xs), [LABELS.get(k, k).replace(" + ", "\n+ ") for k in keys], fontsize=8)
            ax.set_ylim(0, top * 1.35)
            if r_i == 0:
                ax.set_title(f"{_params(s.get('params'))} params", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        axes[r_i][0].set_ylabel(ylabel)
    check = f"; baton + check = --verify-every {sec['verify_every']}" if sec.get("verify_every") else ""
    fig.suptitle(f"Steady state, {sec.get('nproc')} ranks: median, min–max bars, ratio to plain DDP{check}",
                 fontsize=10)
    return _save(fig, plt, path)


def plot_failures(sec: dict, path: Path) -> Path | None:
    cs = [c for c in _failure_contenders(sec) if _is_mr(c.get("total_s"))]
    if not cs:
        return None
    plt = _plt()
    ref = _reference_ddp(cs)
    cs = [c for c in cs if c is not ref] or cs
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(cs) + 1.6), dpi=110)
    meds, xerr = _err([c["total_s"] for c in cs])
    ys = list(range(len(cs)))[::-1]
    ax.barh(ys, meds, xerr=xerr, capsize=4, color=[_contender_color(c.get("key", "")) for c in cs], height=0.6)
    right = max(m + e for m, e in zip(meds, xerr[1]))
    for y, med, e in zip(ys, meds, xerr[1]):
        ax.text(med + e + 0.01 * right, y, f"{med:.1f} s", va="center", fontsize=8)
    labels = [f"{c.get('name') or c.get('key')}\n{_kills(c.get('failures'))}" for c in cs]
    ax.set_yticks(ys, labels, fontsize=8)
    if ref:
        r = ref["total_s"]["median"]
        ax.axvline(r, color="#333", ls="--", lw=1)
        ax.text(r, len(cs) - 0.45, f" plain DDP, no kills: {r:.1f} s", fontsize=8, va="bottom")
        right = max(right, r)
    ax.set_xlim(0, right * 1.18)
    ax.set_ylim(-0.6, len(cs) - 0.1)
    ax.set_xlabel("total job time (s), median with min–max")
    ax.set_title(f"Whole job with kill -9 of rank {sec.get('kill_rank')} at steps "
                 f"{', '.join(str(k) for k in sec.get('kill_at') or [])} ({sec.get('runs')} rounds)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, plt, path)


def plot_downtime(sec: dict, path: Path) -> Path | None:
    sizes = sorted((s for s in sec.get("sizes") or [] if isinstance(s, dict) and (s.get("state_bytes") or 0) > 0),
                   key=lambda s: s["state_bytes"])
    series = [("planned_s", "planned move", COLORS["baton"], "o"),
              ("unplanned_s", "unplanned (kill -9)", "#e67e22", "s"),
              ("raw_tcp_s", "raw TCP copy", "#34495e", "^"),
              ("raw_shm_s", "raw shm copy", "#95a5a6", "v")]
    if not any(_is_mr(s.get(k)) for s in sizes for k, *_ in series):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=110)
    for key, label, color, marker in series:
        pts = [s for s in sizes if _is_mr(s.get(key)) and s[key]["median"] > 0]
        if not pts:
            continue
        meds, yerr = _err([s[key] for s in pts])
        yerr[0] = [min(lo, m * 0.999) for lo, m in zip(yerr[0], meds)]  # keep the log axis positive
        ax.errorbar([s["state_bytes"] for s in pts], meds, yerr=yerr, label=label, color=color, marker=marker,
                    ms=5, capsize=3, lw=1.4)
    fit = sec.get("fit") or {}
    for kind, color in (("planned", COLORS["baton"]), ("unplanned", "#e67e22")):
        f = fit.get(kind)
        if not (isinstance(f, dict) and isinstance(f.get("slope"), (int, float))):
            continue
        pts = [(s["state_bytes"], f["slope"] * s["raw_tcp_s"]["median"] + (f.get("intercept_s") or 0.0))
               for s in sizes if _is_mr(s.get("raw_tcp_s"))]
        pts = [(x, y) for x, y in pts if y > 0]
        if pts:
            ax.plot(*zip(*pts), ls="--", color=color, lw=1, alpha=0.8,
                    label=f"fit {kind}: {f['slope']:.2f} × TCP + {_secs(f.get('intercept_s') or 0.0)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([s["state_bytes"] for s in sizes], [_bytes(s["state_bytes"]) for s in sizes])
    ax.minorticks_off()
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s"))
    ax.set_xlabel("state size (model + AdamW moments)")
    ax.set_ylabel("downtime or copy time (median, min–max)")
    ax.set_title(f"Downtime vs state size, {sec.get('nproc')} ranks + {sec.get('spares')} warm spare", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("fit"))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="upper left")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the page
def write_report(result: dict, results_path: Path, repo: Path) -> Path:
    """Write <repo>/docs/benchmarks.md and <repo>/docs/img/bench-*.png from one results dict; return the page."""
    repo, results_path = Path(repo), Path(results_path)
    page = repo / PAGE
    img_dir = repo / IMG_DIR
    page.parent.mkdir(parents=True, exist_ok=True)
    img_dir.mkdir(parents=True, exist_ok=True)

    missing: dict[str, str] = {}
    secs: dict[str, dict] = {}
    for name, _ in SECTIONS:
        sec, why = _section(result, name)
        if sec is None:
            missing[name] = why or "absent"
        else:
            secs[name] = sec

    images: dict[str, str] = {}
    plotters = {"overhead": plot_overhead, "failures": plot_failures, "downtime": plot_downtime}
    if importlib.util.find_spec("matplotlib") is None:
        missing["plots"] = "matplotlib is not installed"
    for name, fn in plotters.items():
        target = img_dir / IMAGES[name]
        drawn = None
        if name in secs and "plots" not in missing:
            drawn = fn(secs[name], target)
        if drawn is not None:
            images[name] = IMAGES[name]
        elif target.exists():
            target.unlink()  # a figure from an earlier results file must not sit next to this page

    lines = _header(result, results_path, repo, page.parent)
    lines += _summary(result)
    lines += _reproduce()
    for name, title in SECTIONS:
        lines += [f"## {title}", ""]
        if name not in secs:
            why = missing[name]
            lines += [f"**Skipped** by the harness: {why[len('skipped: '):]}." if why.startswith("skipped: ")
                      else f"Not measured: this section is {why}.", ""]
            continue
        if name == "overhead":
            lines += _overhead_md(secs[name], images.get(name))
        elif name == "failures":
            lines += _failures_md(secs[name], images.get(name), legacy_stall=_schema(result) < 2)
        elif name == "downtime":
            lines += _downtime_md(secs[name], images.get(name))
        else:
            lines += _gpu_md(secs[name])
    lines += _torchft_stable_md(repo)
    lines += _caveats(result, missing)
    page.write_text("\n".join(lines).rstrip() + "\n")
    return page


def _torchft_stable_md(repo: Path) -> list[str]:
    """The newest bench/peers/torchft_stable_check.py result: why the harness pins a nightly."""
    import json

    found = sorted((repo / "bench" / "results").glob("torchft-stable-check-*.json"))
    if not found:
        return []
    check = json.loads(found[-1].read_text())
    lines = ["## Why TorchFT is pinned to a nightly", "",
             f"From [`{found[-1].name}`](../bench/results/{found[-1].name}), {check['date']}, "
             f"`{check['command']}`: {check['setup']}.", "",
             "| version | survivors finished the job | Gloo error seen by survivors | died on TorchFT's comm-hook assertion |",
             "|---|---|---|---|"]
    for version in dict.fromkeys(r["version"] for r in check["runs"]):
        runs = [r for r in check["runs"] if r["version"] == version]
        n = len(runs)
        lines.append(f"| {version} | {sum(r['survivors_finished'] for r in runs)}/{n} "
                     f"| {sum(r['gloo_error_seen'] for r in runs)}/{n} | {sum(r['comm_hook_assertion'] for r in runs)}/{n} |")
    lines += ["", "When the kill lands during a gradient allreduce, the survivors' Gloo allreduce fails "
              "(\"Connection reset by peer\"). torchft 0.2.0's DDP comm hook ignores the failed `work.wait()` and "
              "then fails `assert fut._fut` (torchft/ddp.py), so `backward()` raises and every surviving replica "
              "exits; with torchrun restarts all replicas start over from step 0. When the kill lands between "
              "allreduces, 0.2.0 survives. The nightly rejects that step (`should_commit=false`), continues on the "
              "remaining replicas and heals the restarted one back in.", ""]
    return lines


README_BEGIN = "<!-- bench:headline (generated by bench/report.py) -->"
README_END = "<!-- /bench:headline -->"
README_MOVE_BEGIN = "<!-- bench:move-cost (generated by bench/report.py) -->"
README_MOVE_END = "<!-- /bench:move-cost -->"


def _replace_between(text: str, begin: str, end: str, body: str, inline: bool = False) -> str | None:
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    sep = "" if inline else "\n"
    return head + begin + sep + body + sep + end + tail


def update_readme(result: dict, results_path: Path, repo: Path) -> bool:
    """Rewrite the headline tables between the README's bench markers (and the sentence on what
    moving large state costs, between its own markers, where the README has them); False if
    the README has no headline markers."""
    readme = Path(repo) / "README.md"
    if not readme.exists():
        return False
    text = readme.read_text()
    machine = result.get("machine") or {}
    rows = [f"Measured {result.get('date', '?')} on {machine.get('cpus', '?')} CPU cores "
            f"({machine.get('cpu_model') or 'unknown CPU'}), torch {machine.get('torch', '?')}, "
            f"`{(result.get('commands') or ['make bench'])[0]}` ({result.get('preset', '?')} preset); medians over "
            "interleaved runs, min–max in brackets. Every figure, how it was measured and where baton loses: "
            "[docs/benchmarks.md](docs/benchmarks.md).", "", *headline_lines(result)]
    new = _replace_between(text, README_BEGIN, README_END, "\n".join(rows))
    if new is None:
        return False
    sentence = move_cost_sentence(result)
    if sentence is not None:
        new = _replace_between(new, README_MOVE_BEGIN, README_MOVE_END, sentence, inline=True) or new
    readme.write_text(new)
    return True


def newest_results(repo: Path = REPO) -> Path | None:
    found = sorted((repo / "bench" / "results").glob("bench-*.json"), key=lambda p: (p.name, p.stat().st_mtime))
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, help="results JSON (default: newest bench/results/bench-*.json)")
    p.add_argument("--repo", type=Path, default=REPO, help="write <repo>/docs/benchmarks.md (default: this repo)")
    a = p.parse_args(argv)
    path = a.results or newest_results(REPO)
    if path is None:
        print(f"report.py: no bench/results/bench-*.json under {REPO}; run `make bench` first", file=sys.stderr)
        return 2
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"report.py: cannot read {path}: {e}", file=sys.stderr)
        return 2
    out = write_report(result, Path(path), a.repo)
    print(f"wrote {out}" + (" and the README's headline tables" if update_readme(result, Path(path), a.repo) else ""))
    for line in headline_lines(result):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
