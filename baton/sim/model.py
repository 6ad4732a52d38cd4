"""Closed-form cost of failures: what checkpoint-restart and live migration lose.

This is the spreadsheet buyers use, written down once and tested: failures
arrive every MTTF hours; under checkpoint-restart each one costs half a
checkpoint interval of recomputed work plus the restart time, under live
migration it costs the migration downtime (or, for the share migration cannot
save, the checkpoint-restart cost). Blocking checkpoint saves cost their
duration every interval under both.

Formulas (all times in hours, M = MTTF, tau = checkpoint interval, delta =
blocking save cost, R = node replacement + restore + startup):

    waste(tau)      = delta / (tau + delta) + (tau / 2 + R) / M
    tau_young       = sqrt(2 delta M)
    tau_daly        = sqrt(2 delta M) - delta      (minimises waste(tau))
    waste(tau_daly) = sqrt(2 delta / M) - delta / (2 M) + R / M
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOURS_PER_DAY = 24.0
HOURS_PER_MONTH = 730.0  # 8,760 h / 12: the month the published figures use
MONTHS_PER_YEAR = 12

# Measured MTTF points (Meta, "Revisiting Reliability in Large-Scale ML Research
# Clusters"): a power law through them gives MTTF for any job size.
MTTF_POINTS: tuple[tuple[int, float], tuple[int, float]] = ((1024, 7.9), (16384, 1.8))


class InputError(ValueError):
    """Bad user input; `field` names the flag or scenario key at fault."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True)
class MttfEstimate:
    hours: float
    source: str  # "given", "measured", "interpolated", "extrapolated"

    @property
    def extrapolated(self) -> bool:
        return self.source == "extrapolated"


def mttf_exponent() -> float:
    """alpha in MTTF(N) = MTTF(1024) * (N / 1024) ** -alpha (about 0.533)."""
    (n1, m1), (n2, m2) = MTTF_POINTS
    return math.log(m1 / m2) / math.log(n2 / n1)


def mttf_for_gpus(gpus: int) -> MttfEstimate:
    """Job MTTF from the power law through the two measured points."""
    if gpus <= 0:
        raise InputError("gpus", f"must be a positive integer, got {gpus}")
    (n1, m1), (n2, _m2) = MTTF_POINTS
    hours = m1 * (gpus / n1) ** (-mttf_exponent())
    if gpus in (n1, n2):
        source = "measured"
    elif n1 < gpus < n2:
        source = "interpolated"
    else:
        source = "extrapolated"
    return MttfEstimate(hours=hours, source=source)


def young_interval(save_h: float, mttf_h: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * save_h * mttf_h)


def daly_interval(save_h: float, mttf_h: float) -> float:
    """Daly (2006) first order: tau = sqrt(2 delta M) - delta; exact optimum of waste().

    For delta >= 2M checkpointing cannot pay for itself; we return M, as Daly does.
    """
    if save_h >= 2.0 * mttf_h:
        return mttf_h
    return math.sqrt(2.0 * save_h * mttf_h) - save_h


def waste_fraction(interval_h: float, save_h: float, restart_h: float, mttf_h: float) -> float:
    """Share of wall-clock lost to saves, recomputation and restarts."""
    save_share = save_h / (interval_h + save_h) if interval_h + save_h > 0 else 0.0
    return save_share + (interval_h / 2.0 + restart_h) / mttf_h


@dataclass(frozen=True)
class CostInputs:
    """Inputs of `baton cost`; defaults are the published 1,024-GPU assumptions."""

    gpus: int = 1024
    gpu_hour_usd: float = 3.0
    mttf_h: float | None = None
    checkpoint_interval_h: float = 1.5
    checkpoint_save_min: float = 0.0
    node_replacement_min: float = 10.0
    restore_min: float = 5.0
    startup_min: float = 5.0
    migration_min: float = 3.0
    yoco_ratio: float = 1.0

    def validate(self) -> None:
        """Raise InputError naming the first bad field."""
        if not isinstance(self.gpus, int) or self.gpus <= 0:
            raise InputError("gpus", f"must be a positive integer, got {self.gpus}")
        positive = {"gpu_hour_usd": self.gpu_hour_usd, "checkpoint_interval_h": self.checkpoint_interval_h}
        if self.mttf_h is not None:
            positive["mttf_h"] = self.mttf_h
        for name, value in positive.items():
            if not math.isfinite(value) or value <= 0:
                raise InputError(name, f"must be > 0, got {value}")
        non_negative = {
            "checkpoint_save_min": self.checkpoint_save_min,
            "node_replacement_min": self.node_replacement_min,
            "restore_min": self.restore_min,
            "startup_min": self.startup_min,
            "migration_min": self.migration_min,
        }
        for name, value in non_negative.items():
            if not math.isfinite(value) or value < 0:
                raise InputError(name, f"must be >= 0, got {value}")
        if not 0.0 <= self.yoco_ratio <= 1.0:
            raise InputError("yoco_ratio", f"must be between 0 and 1, got {self.yoco_ratio}")


@dataclass(frozen=True)
class StrategyCost:
    """What one recovery strategy loses, per failure and per period."""

    lost_hours_per_failure: float
    failures_per_day: float
    lost_hours_per_day: float
    lost_gpu_hours_per_month: float
    lost_usd_per_month: float
    lost_usd_per_year: float
    waste_fraction: float


@dataclass(frozen=True)
class CostReport:
    inputs: CostInputs
    mttf: MttfEstimate
    checkpoint_restart: StrategyCost
    live_migration: StrategyCost
    optimal_interval_h: float  # Daly; 0 when saves are free
    young_interval_h: float
    optimal_waste_fraction: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        def strat(s: StrategyCost) -> dict:
            return {
                "failures_per_day": s.failures_per_day,
                "lost_hours_per_failure": s.lost_hours_per_failure,
                "lost_hours_per_day": s.lost_hours_per_day,
                "lost_gpu_hours_per_month": s.lost_gpu_hours_per_month,
                "lost_usd_per_month": s.lost_usd_per_month,
                "lost_usd_per_year": s.lost_usd_per_year,
                "waste_fraction": s.waste_fraction,
            }

        i = self.inputs
        return {
            "inputs": {
                "gpus": i.gpus,
                "gpu_hour_usd": i.gpu_hour_usd,
                "mttf_h": self.mttf.hours,
                "mttf_source": self.mttf.source,
                "mttf_extrapolated": self.mttf.extrapolated,
                "checkpoint_interval_h": i.checkpoint_interval_h,
                "checkpoint_save_min": i.checkpoint_save_min,
                "node_replacement_min": i.node_replacement_min,
                "restore_min": i.restore_min,
                "startup_min": i.startup_min,
                "migration_min": i.migration_min,
                "yoco_ratio": i.yoco_ratio,
                "hours_per_month": HOURS_PER_MONTH,
            },
            "checkpoint_restart": strat(self.checkpoint_restart),
            "live_migration": strat(self.live_migration),
            "optimal_checkpoint": {
                "daly_interval_h": self.optimal_interval_h,
                "young_interval_h": self.young_interval_h,
                "waste_fraction": self.optimal_waste_fraction,
            },
            "notes": list(self.notes),
        }


def _strategy_cost(per_failure_h: float, save_share: float, mttf_h: float, gpus: int, usd: float) -> StrategyCost:
    failures_per_day = HOURS_PER_DAY / mttf_h
    waste = save_share + per_failure_h / mttf_h
    lost_per_day = waste * HOURS_PER_DAY
    gpu_hours_month = waste * HOURS_PER_MONTH * gpus
    return StrategyCost(
        lost_hours_per_failure=per_failure_h,
        failures_per_day=failures_per_day,
        lost_hours_per_day=lost_per_day,
        lost_gpu_hours_per_month=gpu_hours_month,
        lost_usd_per_month=gpu_hours_month * usd,
        lost_usd_per_year=gpu_hours_month * usd * MONTHS_PER_YEAR,
        waste_fraction=waste,
    )


def compute_cost(inputs: CostInputs) -> CostReport:
    """Evaluate the closed-form model for one set of inputs."""
    inputs.validate()
    mttf = MttfEstimate(inputs.mttf_h, "given") if inputs.mttf_h is not None else mttf_for_gpus(inputs.gpus)
    m = mttf.hours
    tau = inputs.checkpoint_interval_h
    save_h = inputs.checkpoint_save_min / 60.0
    restart_h = (inputs.node_replacement_min + inputs.restore_min + inputs.startup_min) / 60.0
    save_share = save_h / (tau + save_h)

    cr_per_failure = tau / 2.0 + restart_h
    lm_per_failure = inputs.yoco_ratio * inputs.migration_min / 60.0 + (1.0 - inputs.yoco_ratio) * cr_per_failure
    cr = _strategy_cost(cr_per_failure, save_share, m, inputs.gpus, inputs.gpu_hour_usd)
    lm = _strategy_cost(lm_per_failure, save_share, m, inputs.gpus, inputs.gpu_hour_usd)

    notes: list[str] = []
    if mttf.extrapolated:
        (n1, _), (n2, _) = MTTF_POINTS
        notes.append(
            f"MTTF {m:.2f} h is extrapolated from the power law through the measured points "
            f"({n1:,} and {n2:,} GPUs); pass --mttf-h to use your own."
        )
    if save_h == 0.0:
        notes.append("checkpoint saves are free (--checkpoint-save-min 0): the optimal interval is 0, checkpoint every step.")
        opt, young = 0.0, 0.0
    else:
        opt, young = daly_interval(save_h, m), young_interval(save_h, m)
        if save_h >= 2.0 * m:
            notes.append("save cost exceeds 2x MTTF: checkpointing cannot pay for itself; interval set to MTTF.")
    opt_waste = waste_fraction(opt, save_h, restart_h, m)
    if cr.waste_fraction >= 1.0:
        notes.append(
            "checkpoint-restart loses more time than it runs (waste >= 100%): failures arrive faster than it "
            "recovers, the job makes no progress and this first-order model no longer applies; see `baton simulate`."
        )
    return CostReport(
        inputs=inputs,
        mttf=mttf,
        checkpoint_restart=cr,
        live_migration=lm,
        optimal_interval_h=opt,
        young_interval_h=young,
        optimal_waste_fraction=opt_waste,
        notes=notes,
    )
