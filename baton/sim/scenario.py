"""Scenario files: a full, validated set of simulator parameters in TOML.

A scenario is either the name of one shipped in baton/sim/scenarios/ or a path
to a .toml file. Every key is checked: an unknown key, a wrong type or an
out-of-range value raises InputError naming the key (`job.gpus`,
`checkpoint.interval_hours`, ...), so typos never silently fall back to defaults.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from baton.sim.failures import CLASS_TABLES, DISTRIBUTIONS, ArrivalProcess, FailureClass, Mechanism
from baton.sim.model import InputError, mttf_for_gpus
from baton.sim.strategies import (
    STRATEGY_NAMES,
    CheckpointPolicy,
    CheckpointRestart,
    LiveMigration,
    ReplicaGroupDrop,
)


@dataclass(frozen=True)
class JobSpec:
    gpus: int
    work_h: float  # failure-free compute time at full speed, no checkpoint saves
    step_s: float  # one optimizer step: the unit an unplanned failure discards
    gpu_hour_usd: float = 3.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    job: JobSpec
    arrivals: ArrivalProcess
    mttf_source: str
    classes: tuple[FailureClass, ...]
    checkpoint: CheckpointPolicy
    checkpoint_restart: CheckpointRestart
    replica_group_drop: ReplicaGroupDrop
    live_migration: LiveMigration
    strategies: tuple[str, ...] = STRATEGY_NAMES
    trials: int = 200
    seed: int = 0
    published_min: dict[str, float] = field(default_factory=dict)


def _scenario_dir():
    return resources.files("baton.sim") / "scenarios"


def shipped_scenarios() -> list[str]:
    return sorted(p.name[:-5] for p in _scenario_dir().iterdir() if p.name.endswith(".toml"))


def load_raw(ref: str) -> tuple[str, dict]:
    """Read a shipped scenario by name, or a TOML file by path."""
    candidate = _scenario_dir() / f"{ref}.toml"
    if "/" not in ref and not ref.endswith(".toml") and candidate.is_file():
        text = candidate.read_text()
        name = ref
    else:
        path = Path(ref)
        if not path.is_file():
            known = ", ".join(shipped_scenarios())
            raise InputError("scenario", f"no shipped scenario or file named {ref!r} (shipped: {known})")
        text = path.read_text()
        name = path.stem
    try:
        return name, tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError("scenario", f"{ref}: invalid TOML: {err}") from None


def apply_override(raw: dict, assignment: str) -> None:
    """Apply `section.key=value` (value parsed as TOML, else taken as a string)."""
    if "=" not in assignment:
        raise InputError("--set", f"expected KEY=VALUE, got {assignment!r}")
    key, text = assignment.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InputError(key, f"{part!r} is not a table")
        node = child
    node[parts[-1]] = value


# ------------------------------------------------------------------ validation


class _Table:
    """Typed reads from one TOML table, remembering which keys were used."""

    def __init__(self, raw: Any, prefix: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise InputError(prefix, "must be a table")
        self.raw = raw
        self.prefix = prefix
        self.used: set[str] = set()

    def _key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return name in self.raw

    def number(self, name: str, default: float | None = None, *, minimum: float = 0.0, strict: bool = False) -> float | None:
        self.used.add(name)
        if name not in self.raw:
            return default
        value = self.raw[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(self._key(name), f"must be a number, got {value!r}")
        if strict and value <= minimum:
            raise InputError(self._key(name), f"must be > {minimum:g}, got {value}")
        if not strict and value < minimum:
            raise InputError(self._key(name), f"must be >= {minimum:g}, got {value}")
        return float(value)

    def integer(self, name: str, default: int | None = None, *, minimum: int = 0) -> int | None:
        self.used.add(name)
        if name not in self.raw:
            return default
        value = self.raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(self._key(name), f"must be an integer, got {value!r}")
        if value < minimum:
            raise InputError(self._key(name), f"must be >= {minimum}, got {value}")
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        self.used.add(name)
        if name not in self.raw:
            return default
        value = self.raw[name]
        if not isinstance(value, str):
            raise InputError(self._key(name), f"must be a string, got {value!r}")
        return value

    def sub(self, name: str) -> "_Table":
        self.used.add(name)
        return _Table(self.raw.get(name), self._key(name))

    def done(self) -> None:
        for key in self.raw:
            if key not in self.used:
                raise InputError(self._key(key), "unknown key")


def _classes(t: _Table) -> tuple[FailureClass, ...]:
    t.used.add("classes")
    spec = t.raw.get("classes", "llama3-405b")
    if isinstance(spec, str):
        if spec not in CLASS_TABLES:
            raise InputError(t._key("classes"), f"unknown class table {spec!r} (known: {', '.join(CLASS_TABLES)})")
        return CLASS_TABLES[spec]
    if not isinstance(spec, list) or not spec:
        raise InputError(t._key("classes"), "must be a table name or a non-empty list of classes")
    out = []
    for i, item in enumerate(spec):
        c = _Table(item, f"{t._key('classes')}[{i}]")
        name = c.string("name") or f"class {i}"
        share = c.number("share", minimum=0.0, strict=True)
        if share is None:
            raise InputError(c._key("share"), "is required")
        mech = c.string("mechanism", "migration")
        try:
            mechanism = Mechanism(mech)
        except ValueError:
            known = ", ".join(m.value for m in Mechanism)
            raise InputError(c._key("mechanism"), f"unknown mechanism {mech!r} (known: {known})") from None
        warning = c.number("warning_share", 0.0)
        if warning > 1.0:
            raise InputError(c._key("warning_share"), f"must be between 0 and 1, got {warning}")
        c.done()
        out.append(FailureClass(name, share, mechanism, warning))
    return tuple(out)


def _dataclass_from(table: _Table, cls, integer_fields: tuple[str, ...] = (), positive: tuple[str, ...] = ()):
    kwargs = {}
    for f in fields(cls):
        if f.name in integer_fields:
            value = table.integer(f.name, None, minimum=1 if f.name in positive else 0)
        else:
            value = table.number(f.name, None, strict=f.name in positive)
        if value is not None:
            kwargs[f.name] = value
    table.done()
    return cls(**kwargs)


def parse_scenario(name: str, raw: dict) -> Scenario:
    """Validate a raw TOML dict into a Scenario."""
    top = _Table(raw, "")
    description = top.string("description", "") or ""
    top.string("name")
    trials = top.integer("trials", 200, minimum=1)
    seed = top.integer("seed", 0)

    job_t = top.sub("job")
    gpus = job_t.integer("gpus", minimum=1)
    if gpus is None:
        raise InputError("job.gpus", "is required")
    step_s = job_t.number("step_seconds", 10.0, strict=True)
    if job_t.has("steps") and job_t.has("work_hours"):
        raise InputError("job.steps", "give either job.steps or job.work_hours, not both")
    steps = job_t.integer("steps", None, minimum=1)
    work_h = job_t.number("work_hours", None, strict=True)
    if steps is not None:
        work_h = steps * step_s / 3600.0
    if work_h is None:
        raise InputError("job.work_hours", "is required (or job.steps)")
    usd = job_t.number("gpu_hour_usd", 3.0)
    job_t.done()
    job = JobSpec(gpus=gpus, work_h=work_h, step_s=step_s, gpu_hour_usd=usd)

    f_t = top.sub("failures")
    dist = f_t.string("distribution", "exponential")
    if dist not in DISTRIBUTIONS:
        raise InputError("failures.distribution", f"unknown distribution {dist!r} (known: {', '.join(DISTRIBUTIONS)})")
    mttf = f_t.number("mttf_hours", None, strict=True)
    source = "given"
    if mttf is None:
        est = mttf_for_gpus(gpus)
        mttf, source = est.hours, est.source
    shape = f_t.number("weibull_shape", 1.0, strict=True)
    umin = f_t.number("uniform_min_s", None, strict=True)
    umax = f_t.number("uniform_max_s", None, strict=True)
    if dist == "uniform":
        if umin is None or umax is None:
            raise InputError("failures.uniform_min_s", "uniform_min_s and uniform_max_s are required for a uniform distribution")
        if umax < umin:
            raise InputError("failures.uniform_max_s", f"must be >= uniform_min_s ({umin:g}), got {umax:g}")
        source = "given"
    classes = _classes(f_t)
    f_t.done()
    arrivals = ArrivalProcess(
        distribution=dist,
        mttf_h=mttf if dist != "uniform" else (umin + umax) / 7200.0,
        weibull_shape=shape,
        uniform_min_h=(umin or 0.0) / 3600.0,
        uniform_max_h=(umax or 0.0) / 3600.0,
    )

    c_t = top.sub("checkpoint")
    save_s = c_t.number("save_seconds", 60.0)
    if c_t.has("interval_steps") and c_t.has("interval_hours"):
        raise InputError("checkpoint.interval_steps", "give either interval_steps or interval_hours, not both")
    interval_steps = c_t.integer("interval_steps", None, minimum=0)
    interval_h = c_t.number("interval_hours", None, strict=True)
    if interval_steps is not None:
        if interval_steps == 0:
            raise InputError("checkpoint.interval_steps", "must be > 0, got 0")
        interval_h = interval_steps * step_s / 3600.0
    c_t.done()
    if interval_h is None and save_s == 0:
        raise InputError("checkpoint.interval_hours", "is required when checkpoint.save_seconds is 0 (the Daly optimum would be 0)")
    checkpoint = CheckpointPolicy(save_min=save_s / 60.0, interval_h=interval_h)

    cr = _dataclass_from(top.sub("checkpoint_restart"), CheckpointRestart)
    ft = _dataclass_from(top.sub("replica_group_drop"), ReplicaGroupDrop, integer_fields=("groups",), positive=("groups",))
    lm = _dataclass_from(top.sub("live_migration"), LiveMigration, integer_fields=("spare_pool", "spare_gpus"))

    pub_t = top.sub("published")
    published = {}
    for s in STRATEGY_NAMES:
        v = pub_t.number(f"{s}_min", None)
        if v is not None:
            published[s] = v
    pub_t.done()
    top.done()
    return Scenario(
        name=name,
        description=description,
        job=job,
        arrivals=arrivals,
        mttf_source=source,
        classes=classes,
        checkpoint=checkpoint,
        checkpoint_restart=cr,
        replica_group_drop=ft,
        live_migration=lm,
        trials=trials,
        seed=seed,
        published_min=published,
    )


def load_scenario(ref: str, overrides: list[str] | None = None) -> Scenario:
    name, raw = load_raw(ref)
    for assignment in overrides or []:
        apply_override(raw, assignment)
    return parse_scenario(name, raw)
