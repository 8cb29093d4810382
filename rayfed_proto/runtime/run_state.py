"""The plain data the driver's steps hand each other, each made by one step: where the run lives
(:class:`RunFolder`, by the preparation), what it read (:class:`RunData`), its working parts once
Ray is up (:class:`Federation`), who listens (:class:`Listeners`, the caller's), and what a run
returns (:class:`RunResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rayfed_proto.data.base import ArrayDataset
    from rayfed_proto.data.partition import Partition
    from rayfed_proto.runtime.checkpoint import Checkpoint, CheckpointStore
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.policies import FederationPolicy
    from rayfed_proto.runtime.resources import ResourcePlan
    from rayfed_proto.tracking.mlflow_tracker import MlflowTracker
    from rayfed_proto.tracking.run_logging import RunLogging


@dataclass
class RunResult:
    run_id: Optional[str]
    tracking_uri: Optional[str]
    output_dir: Path
    final_version: int
    history: list[dict[str, Any]] = field(default_factory=list)
    resource_plan: dict[str, Any] = field(default_factory=dict)
    placements: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""
    client_updates: dict[int, int] = field(default_factory=dict)  # client -> local updates dispatched to it


@dataclass(frozen=True)
class RunFolder:
    """Where a run lives: its output folder (locked), its checkpoint store and, when resuming, the
    checkpoint it continues from (:mod:`rayfed_proto.runtime.preparation`)."""

    out: Path
    store: CheckpointStore
    ckpt: Optional[Checkpoint] = None

    @property
    def resumed(self) -> bool:
        return self.ckpt is not None


@dataclass(frozen=True)
class RunData:
    """What the driver read before Ray starts: the dataset (only the driver reads it; the actors
    map it from the object store), the clients' partition and their system profiles (None:
    wall-clock mode)."""

    dataset: ArrayDataset
    partition: Partition
    system: Any = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """Classes, channels, image size."""
        return self.dataset.num_classes, self.dataset.channels, self.dataset.image_size


@dataclass(frozen=True)
class Federation:
    """A run's working parts once Ray is up: the tracker, the resource plan, the worker actors
    (the fleet) and the clients each one holds, the federation policy (the mode as one object),
    the run's MLflow logging with its evaluation history (restored when resuming) and the
    checkpoint's scheduler state ({} for a new run)."""

    tracker: MlflowTracker  # or a NullTracker (tracking disabled)
    plan: ResourcePlan
    fleet: ActorFleet
    groups: list[list[int]]  # the clients of each worker
    policy: FederationPolicy
    run_log: RunLogging
    shape: tuple[int, int, int]  # classes, channels, image size
    class_names: list[str]
    scheduler_state: dict[str, Any] = field(default_factory=dict)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per evaluation: the run's metrics at its version."""
        return self.run_log.history


@dataclass(frozen=True)
class Listeners:
    """What the caller of ``run_experiment`` listens with: ``echo`` for the run's lines, a progress
    bar or not, ``on_eval(version, metrics)`` after each evaluation (Tune) and ``on_version(version)``
    as soon as the driver learns of a new version."""

    echo: Callable[[str], None] = print
    progress: bool = True
    on_eval: Optional[Callable[[int, dict[str, Any]], None]] = None
    on_version: Optional[Callable[[int], None]] = None
