"""`/metrics` in Prometheus format, read the way Prometheus reads it, from a real job with a
planned move: steps, step times, movable ranks, events by kind, the downtime histogram, spares, YOCO."""

from __future__ import annotations

import httpx

from tests.jobs import Job


def test_metrics_show_steps_events_downtime_and_spares(tmp_path):
    job = Job(tmp_path, nproc=2, spares=1, steps=100000, script_args=["--step-sleep", "0.05"])
    try:
        job.wait_step(3)
        assert httpx.get(job.client.url + "/metrics").status_code == 401  # the job's token, as every route
        before = job.metrics()
        assert before[("baton_rank_step", (("rank", "0"),))] >= 3
        assert before[("baton_rank_step_time_seconds", (("rank", "1"),))] > 0
        assert before[("baton_rank_movable", (("rank", "0"),))] == 1
        assert before[("baton_spares", (("kind", "dedicated"), ("state", "spare")))] == 1
        assert not any(k[0] == "baton_events_total" for k in before)
        job.client.migrate(0)
        job.wait_until(lambda st: st["operation"] is None and st["spares"] and
                       any(e["status"] == "resolved" for e in job.events()), what="the move resolved")
        after = job.metrics()
        assert after[("baton_events_total", (("kind", "planned"), ("status", "resolved")))] == 1
        assert after[("baton_downtime_seconds_count", (("kind", "planned"),))] == 1
        assert 0 < after[("baton_downtime_seconds_sum", (("kind", "planned"),))] < 60
        assert after[("baton_steps_lost_total", ())] == 0
        assert after[("baton_yoco_ratio", ())] == 1.0
        assert after[("baton_generation", ())] == before[("baton_generation", ())] + 1
        assert after[("baton_nodes", (("state", "healthy"),))] == 1
    finally:
        job.kill()
