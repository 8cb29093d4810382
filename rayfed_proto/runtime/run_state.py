"""The plain data of one run: what the driver's steps share (:class:`RunState`) and what a run
returns (:class:`RunResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rayfed_proto.config import ExperimentConfig

if TYPE_CHECKING:
    from rayfed_proto.data.partition import Partition
    from rayfed_proto.runtime.checkpoint import Checkpoint, CheckpointStore
    from rayfed_proto.runtime.fleet import ActorFleet
    from rayfed_proto.runtime.policies import FederationPolicy
    from rayfed_proto.runtime.resources import ResourcePlan
    from rayfed_proto.runtime.scheduler import Scheduler
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


@dataclass
class RunState:
    """What the steps of one run share (filled in step by step)."""

    cfg: ExperimentConfig
    echo: Callable[[str], None]
    progress: bool
    started_unix: float = 0.0  # when the run started (startup_s)
    out: Optional[Path] = None
    store: Optional[CheckpointStore] = None
    ckpt: Optional[Checkpoint] = None  # the checkpoint a resume continues from
    partition: Optional[Partition] = None
    shape: tuple[int, int, int] = (0, 0, 0)  # classes, channels, image size
    class_names: list[str] = field(default_factory=list)
    plan: Optional[ResourcePlan] = None
    fleet: Optional[ActorFleet] = None
    groups: list[list[int]] = field(default_factory=list)  # the clients of each worker
    tracker: Optional[MlflowTracker] = None  # or a NullTracker (tracking disabled)
    run_log: Optional[RunLogging] = None
    run_id: Optional[str] = None
    driver_state: dict[str, Any] = field(default_factory=dict)  # the checkpoint's scheduler state and history
    history: list[dict[str, Any]] = field(default_factory=list)
    start_version: int = 0
    bar: Any = None  # the tqdm progress bar, when shown
    scheduler: Optional[Scheduler] = None
    policy: Optional[FederationPolicy] = None  # the federation mode as one object (runtime.policies)
