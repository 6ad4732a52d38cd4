"""bench/report.py turns a results dict into docs/benchmarks.md and its plots (a fake result, no benchmark run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import report  # noqa: E402


def _mr(median: float, lo: float, hi: float, n: int = 3) -> dict:
    return {"median": median, "min": lo, "max": hi, "n": n}


def _result() -> dict:
    return {
        "schema": 1, "preset": "quick", "date": "2026-11-21 12:00:00",
        "commands": ["make bench", "python bench/run.py --preset quick"], "duration_s": 600.0,
        "machine": {"cpus": 2, "memory_gib": 7.8, "platform": "Linux-test-x86_64", "python": "3.11.7",
                    "torch": "2.13.0+cpu", "torchft": None, "cpu_model": "Test CPU 9000"},
        "overhead": {"nproc": 3, "steps": 60, "warmup": 10, "runs": 3, "sizes": [
            {"params": 2166785, "step_s": {"ddp": _mr(0.057, 0.052, 0.062), "baton": _mr(0.058, 0.051, 0.066)},
             "ratio_vs_ddp": {"baton": _mr(1.04, 0.90, 1.20)}}]},
        "failures": {"nproc": 3, "params": 2166785, "steps": 200, "step_sleep": 0.0, "kill_at": [100], "kill_rank": 1,
                     "runs": 3, "save_s": 0.05, "step_s": 0.06, "mtbf_s": 6.0, "young_daly_k": 12, "other_k": 40,
                     "contenders": [
                         {"key": "ddp", "name": "plain DDP, no kills", "failures": 0, "total_s": _mr(20.0, 19.0, 21.0),
                          "train_s": _mr(15.0, 14.5, 15.5), "lost_per_failure_s": None, "stall_s": None,
                          "steps_recomputed": None, "samples_dropped_frac": None, "params_match": None,
                          "reference": "-", "notes": ""},
                         {"key": "ckpt-k12", "name": "checkpoint-restart, K=12 (Young/Daly)", "failures": 1,
                          "total_s": _mr(26.0, 25.0, 27.5), "train_s": _mr(20.1, 19.6, 21.0),
                          "lost_per_failure_s": _mr(5.1, 4.6, 6.3), "stall_s": _mr(4.7, 4.5, 5.0),
                          "steps_recomputed": _mr(5, 5, 5), "samples_dropped_frac": None, "params_match": True,
                          "reference": "its own failure-free run", "notes": ""},
                         {"key": "baton", "name": "baton (warm spare)", "failures": 1, "total_s": _mr(21.0, 20.0, 22.0),
                          "train_s": _mr(15.4, 15.0, 15.9), "lost_per_failure_s": _mr(0.4, 0.2, 0.6),
                          "stall_s": _mr(0.3, 0.25, 0.34), "steps_recomputed": _mr(1, 1, 1),
                          "samples_dropped_frac": None, "params_match": None, "reference": "-", "notes": ""}]},
        "downtime": {"nproc": 2, "spares": 1, "moves": 3, "sizes": [
            {"state_bytes": 10**7, "params": 833333, "planned_s": _mr(0.07, 0.06, 0.08),
             "unplanned_s": _mr(0.17, 0.15, 0.18), "unplanned_ledger_s": _mr(0.14, 0.13, 0.15),
             "transfer_s": _mr(0.012, 0.011, 0.013), "raw_tcp_s": _mr(0.011, 0.010, 0.012),
             "raw_shm_s": _mr(0.004, 0.003, 0.005), "planned_over_tcp": 6.4, "unplanned_over_tcp": 15.5},
            {"state_bytes": 10**9, "params": 83333333, "planned_s": _mr(0.99, 0.92, 1.07),
             "unplanned_s": _mr(0.97, 0.95, 1.11), "unplanned_ledger_s": _mr(0.85, 0.78, 0.87),
             "transfer_s": _mr(0.81, 0.75, 0.87), "raw_tcp_s": _mr(0.69, 0.59, 0.76),
             "raw_shm_s": _mr(0.29, 0.23, 0.30), "planned_over_tcp": 1.43, "unplanned_over_tcp": 1.41}],
            "fit": {"planned": {"slope": 1.35, "intercept_s": 0.06}, "unplanned": None}},
        "gpu": {"skipped": "no CUDA device in this test"},
    }


def test_page_and_plots(tmp_path):
    results = tmp_path / "bench" / "results" / "bench-20261121-120000.json"
    results.parent.mkdir(parents=True)
    result = _result()
    results.write_text(json.dumps(result))

    page = report.write_report(result, results, tmp_path)

    assert page == tmp_path / "docs" / "benchmarks.md"
    text = page.read_text()
    assert "bench/results/bench-20261121-120000.json" in text and "do not edit by hand" in text
    assert "2026-11-21 12:00:00" in text
    for fact in ("Test CPU 9000", "7.8 GiB", "Linux-test-x86_64", "3.11.7", "2.13.0+cpu", "not installed"):
        assert fact in text, fact
    assert "make bench" in text and "python bench/run.py --preset quick" in text
    assert "no CUDA device in this test" in text  # a skipped section says why
    assert "1% goal is not demonstrated" in text  # 1.04x with range 0.90-1.20
    assert "## Caveats" in text and "## How to reproduce" in text
    for name in ("bench-overhead.png", "bench-failures.png", "bench-downtime.png"):
        png = tmp_path / "docs" / "img" / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"img/{name}" in text

    rows = report.headline_rows(result)
    assert 4 <= len(rows) <= 6
    assert all(isinstance(label, str) and isinstance(value, str) for label, value in rows)


def test_missing_sections_still_give_a_page(tmp_path):
    stale = tmp_path / "docs" / "img" / "bench-overhead.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    result = {"schema": 1, "date": "2026-11-21 12:00:00", "overhead": {"skipped": "asked to skip"}}

    text = report.write_report(result, tmp_path / "r.json", tmp_path).read_text()

    assert "asked to skip" in text
    assert "absent from the results file" in text
    assert not stale.exists()  # a plot from an earlier results file is not left next to the new page


def test_readme_headline_table_is_replaced_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.README_BEGIN}\nstale row\n{report.README_END}\nafter\n")
    assert report.update_readme(_result(), tmp_path / "r.json", tmp_path)
    text = readme.read_text()
    assert "stale row" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| what | result |" in text and "docs/benchmarks.md" in text
    assert text.count("baton / plain DDP") == 1
    (tmp_path / "README.md").write_text("no markers\n")
    assert not report.update_readme(_result(), tmp_path / "r.json", tmp_path)
