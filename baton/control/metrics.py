"""What `/metrics` shows Prometheus: the job as the orchestrator sees it, read at scrape time.

Gauges and counters are computed from the orchestrator's own state when Prometheus asks
(nothing on any training path); the downtime histogram is fed as moves resolve. Every
series carries the job id as a label, so one Prometheus can scrape several jobs.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from baton.control.orchestrator import Orchestrator

DOWNTIME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, float("inf"))


class _JobCollector:
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    def collect(self) -> Iterator[Metric]:
        job = self.orch.status()["jobs"][0]
        events = self.orch.event_list()
        jid = job["id"]

        step = GaugeMetricFamily("baton_rank_step", "Steps each rank has completed", labels=["job", "rank"])
        step_time = GaugeMetricFamily("baton_rank_step_time_seconds",
                                      "Each rank's step time (moving average over recent steps)",
                                      labels=["job", "rank"])
        movable = GaugeMetricFamily("baton_rank_movable",
                                    "1 while a rank's state can move bit for bit; 0 once it cannot (status says "
                                    "why): planned moves of it are refused and its loss stops the job",
                                    labels=["job", "rank"])
        for r in job["ranks"]:
            step.add_metric([jid, str(r["rank"])], r["step"])
            if "step_time" in (r.get("metrics") or {}):
                step_time.add_metric([jid, str(r["rank"])], r["metrics"]["step_time"])
            movable.add_metric([jid, str(r["rank"])], 0 if r.get("unmovable") else 1)
        yield step
        yield step_time
        yield movable

        temp = GaugeMetricFamily("baton_gpu_temperature_celsius", "GPU temperature of each rank's slot (NVML)",
                                 labels=["job", "rank", "slot"])
        ecc = GaugeMetricFamily("baton_gpu_ecc_errors", "Volatile ECC error counts of each rank's GPU (NVML)",
                                labels=["job", "rank", "slot", "type"])
        for r in job["ranks"]:
            gpu = r.get("gpu") or {}
            labels = [jid, str(r["rank"]), r["slot"] or ""]
            if "temp_c" in gpu:
                temp.add_metric(labels, gpu["temp_c"])
            for kind in ("uncorrected", "corrected"):
                if f"ecc_{kind}" in gpu:
                    ecc.add_metric([*labels, kind], gpu[f"ecc_{kind}"])
        yield temp
        yield ecc

        by_kind: dict[tuple[str, str], int] = {}
        for e in events:
            key = (e["kind"], e["status"])
            by_kind[key] = by_kind.get(key, 0) + 1
        counter = CounterMetricFamily("baton_events", "Failures and migrations by kind and outcome",
                                      labels=["job", "kind", "status"])
        for (kind, status), n in sorted(by_kind.items()):
            counter.add_metric([jid, kind, status], n)
        yield counter

        lost = CounterMetricFamily("baton_steps_lost", "Steps of completed work lost to failures (rollback)",
                                   labels=["job"])
        lost.add_metric([jid], sum(e.get("steps_lost") or 0 for e in events))
        yield lost

        spares = GaugeMetricFamily("baton_spares", "Warm spares by kind (dedicated, or borrowed from "
                                   "another job)", labels=["job", "kind", "state"])
        counts: dict[tuple[str, str], int] = {}
        for s in job["spares"]:
            key = (s.get("kind", "dedicated"), s["state"])
            counts[key] = counts.get(key, 0) + 1
        for (kind, state), n in sorted(counts.items()):
            spares.add_metric([jid, kind, state], n)
        yield spares

        if any("hot" in s for s in job["spares"]):  # --hot-spares: what each spare's mirror is doing
            hot = GaugeMetricFamily("baton_hot_spares", "Spares by the state of their mirror of the replicated "
                                    "state (--hot-spares): current, following, taking its base, ordinary",
                                    labels=["job", "state"])
            mirrors: dict[str, int] = {}
            for s in job["spares"]:
                if "hot" in s:
                    mirrors[s["hot"]["state"]] = mirrors.get(s["hot"]["state"], 0) + 1
            for state, n in sorted(mirrors.items()):
                hot.add_metric([jid, state], n)
            yield hot

        nodes = GaugeMetricFamily("baton_nodes", "Nodes by state", labels=["job", "state"])
        states: dict[str, int] = {}
        for n in job.get("nodes", []):
            states[n["state"]] = states.get(n["state"], 0) + 1
        for state, n in sorted(states.items()):
            nodes.add_metric([jid, state], n)
        yield nodes

        paths = job.get("data_paths") or {}
        if paths.get("configured"):
            up = GaugeMetricFamily("baton_data_path_up", "1 while a node's data path (--data-paths) is up; a "
                                   "path never reported down is up", labels=["job", "node", "interface"])
            for link in paths.get("links", []):
                up.add_metric([jid, link["node"], link["interface"]], 1 if link["up"] else 0)
            yield up
            used = GaugeMetricFamily("baton_data_path_in_use", "1 for each data path the job's groups run over now",
                                     labels=["job", "interface"])
            for name in paths["configured"]:
                used.add_metric([jid, name], 1 if name in paths.get("in_use", []) else 0)
            yield used

        yield _gauge("baton_generation", "Process-group generation (one more per move)", jid, job["generation"])
        yield _gauge("baton_world_size", "Ranks in the job", jid, job["world_size"])
        yield _gauge("baton_migrating", "1 while a move or recovery is in progress", jid,
                     1 if job.get("operation") else 0)
        if job.get("yoco_ratio") is not None:
            yield _gauge("baton_yoco_ratio", "Failures resolved without rollback / all failures", jid,
                         job["yoco_ratio"])


def _gauge(name: str, doc: str, job: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["job"])
    g.add_metric([job], value)
    return g


class JobMetrics:
    """One registry per orchestrator: its collector, and the downtime histogram that the
    orchestrator's event stream feeds (register `on_event` as a listener)."""

    def __init__(self, orch: Orchestrator):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_JobCollector(orch))  # type: ignore[arg-type]
        self.downtime = Histogram("baton_downtime_seconds", "Training downtime per resolved move, by kind",
                                  labelnames=["job", "kind"], buckets=DOWNTIME_BUCKETS, registry=self.registry)
        self.job_id = orch.config.job_id

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "resolved" and data.get("downtime_s") is not None:
            self.downtime.labels(self.job_id, data.get("kind", "unknown")).observe(float(data["downtime_s"]))
