"""External detectors: a cluster's own monitoring taints slots and nodes through baton's API.

`POST /v1/alerts` takes Alertmanager's webhook body as it is sent (point a receiver's
`webhook_configs` at it, with the job's token as `http_config.authorization`). A firing
alert taints what its labels name, a resolved one untaints it again if that alert's taint
is still the one in place:

    baton_slot / slot                   a slot (n2/1)
    baton_node / node / nodename /      a node (n2); `instance` is read as host[:port]
    hostname / instance

Alerts naming nothing this job runs on are answered "ignored" (Alertmanager retries a
non-2xx answer forever), so one receiver can serve every job.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SLOT_LABELS = ("baton_slot", "slot")
NODE_LABELS = ("baton_node", "node", "nodename", "hostname", "instance")
Label = Annotated[str, Field(max_length=1000)]


class Alert(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    status: Literal["firing", "resolved"]
    labels: Annotated[dict[Label, Label], Field(max_length=200)]
    annotations: Annotated[dict[Label, Annotated[str, Field(max_length=10_000)]], Field(max_length=200)] = {}


class AlertBatch(BaseModel):
    """Alertmanager's webhook payload (version 4); fields baton does not use are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["alerts"] = "alerts"
    alerts: Annotated[list[Alert], Field(max_length=1000)]


def target_of(alert: Alert, slots: set[str], nodes: set[str]) -> str | None:
    """The slot or node an alert names, if this job has it."""
    for key in SLOT_LABELS:
        value = alert.labels.get(key)
        if value in slots:
            return value
    for key in NODE_LABELS:
        value = alert.labels.get(key, "")
        host = value.rsplit(":", 1)[0] if key == "instance" else value
        for name in (host, host.split(".")[0]):  # n2.cluster.local is n2
            if name in nodes:
                return name
    return None


def reason_of(alert: Alert) -> str:
    name = alert.labels.get("alertname", "alert")
    summary = alert.annotations.get("summary", "")
    return f"alert {name}" + (f": {summary}" if summary else "")
