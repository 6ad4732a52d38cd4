"""Parameters of the three recovery strategies the simulator compares.

Each dataclass holds only what its strategy needs; defaults are the published
cost-model assumptions where one exists (10 + 5 + 5 min restart, ~3 min
unplanned migration) and stated assumptions otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.sim.model import daly_interval


@dataclass(frozen=True)
class CheckpointPolicy:
    """Periodic checkpoints, used by checkpoint-restart and as everyone's fallback."""

    save_min: float = 1.0  # blocking save cost
    interval_h: float | None = None  # hours of work between checkpoints; None = Daly optimum

    def interval_for(self, mttf_h: float) -> float:
        if self.interval_h is not None:
            return self.interval_h
        return daly_interval(self.save_min / 60.0, mttf_h)


@dataclass(frozen=True)
class CheckpointRestart:
    """Every failure stops all ranks: detect, replace the node, load the checkpoint, restart."""

    detection_min: float = 0.0
    node_replacement_min: float = 10.0
    restore_min: float = 5.0
    startup_min: float = 5.0

    @property
    def restart_h(self) -> float:
        return (self.detection_min + self.node_replacement_min + self.restore_min + self.startup_min) / 60.0


@dataclass(frozen=True)
class ReplicaGroupDrop:
    """TorchFT-style: a failure drops its whole replica group until a replacement heals it.

    Throughput falls by 1/groups per dropped group; the in-flight step is
    discarded; every step pays a quorum/cross-replica overhead. Failures that
    hit every replica (software bugs) still restart the job from a checkpoint.
    """

    groups: int = 8
    step_overhead: float = 0.15  # fraction of step time
    heal_min: float = 15.0  # replacement node + join + weight transfer from a healthy group
    failover_pause_s: float = 10.0  # survivors notice the loss and re-form the quorum


@dataclass(frozen=True)
class LiveMigration:
    """baton: the failed rank moves to a spare at a step boundary; the world size never changes.

    A migration takes a spare; the failed node returns to the pool after
    `spare_replenish_h`. With the pool empty the job waits for a spare.
    Failures migration cannot save fall back to checkpoint-restart.
    """

    step_overhead: float = 0.005  # design budget: <= 1% of step time
    planned_downtime_min: float = 0.5  # pre-emptive: state handed over from the live rank
    unplanned_downtime_min: float = 3.0  # rank dead: detect, rebuild state from replicas
    path_failover_s: float = 5.0
    spare_pool: int = 2  # spares, each replacing one failed unit
    spare_gpus: int = 8  # GPUs held idle per spare (a node)
    spare_replenish_h: float = 4.0  # repair or re-provision before a used spare is back


STRATEGY_NAMES = ("checkpoint_restart", "replica_group_drop", "live_migration")
STRATEGY_LABELS = {
    "checkpoint_restart": "checkpoint-restart",
    "replica_group_drop": "replica-group drop (TorchFT-style)",
    "live_migration": "live migration (baton)",
}
