"""The Tune trial: one whole federated run (its own server and client actors) per trial.

Each evaluation of the run is reported to Tune (so ASHA can stop a bad trial early) and logged
by the run's own tracker as a child run of the sweep's parent run. Everything a trial needs
travels in :class:`TrialContext` (plain data, pickled with the function), never in the
param_space, so a restored sweep re-registers the trainable with a fresh context (a new
MLflow server port) without touching the trials' sampled values.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import ExperimentConfig, build_config, set_dotted
from rayfed_proto.tuning.resources import TrialPlan, placement_group_factory, trial_overrides
from rayfed_proto.tuning.spec import TrialResources


@dataclass
class TrialContext:
    sweep_name: str
    base_raw: dict[str, Any]
    space_keys: list[str]
    trial_resources: dict[str, Any]
    gpus_per_trial: float
    metric: str
    tracking_uri: Optional[str]           # None: tracking disabled in the base
    parent_run_id: Optional[str]
    output_dir: str                       # absolute: trials run inside their own Tune folders
    driver_pin: dict[str, float] = field(default_factory=dict)


def absolute_paths(raw: dict[str, Any], cwd: Path) -> None:
    """Relative paths of a run config, made absolute against ``cwd``: Tune runs each trial with
    its trial folder as working directory."""
    data = raw.get("data")
    if isinstance(data, dict):
        for key in ("root", "path"):
            v = data.get(key)
            if isinstance(v, str) and v and "://" not in v and not Path(v).expanduser().is_absolute():
                data[key] = str((cwd / Path(v).expanduser()).resolve())


def trial_config(ctx: TrialContext, values: dict[str, Any], run_name: Optional[str] = None) -> tuple[ExperimentConfig, TrialPlan]:
    """The trial's validated config and its placement plan, from the sampled ``values``."""
    raw = copy.deepcopy(ctx.base_raw)
    for k in ctx.space_keys:
        set_dotted(raw, k, values[k])
    plan = trial_overrides(build_config(raw), TrialResources(**ctx.trial_resources), ctx.gpus_per_trial,
                           check=True, driver_pin=ctx.driver_pin)
    for k, v in plan.overrides.items():
        set_dotted(raw, k, v)
    set_dotted(raw, "tracking.output_dir", ctx.output_dir)
    if ctx.tracking_uri is not None:
        set_dotted(raw, "tracking.tracking_uri", ctx.tracking_uri)
        set_dotted(raw, "tracking.parent_run_id", ctx.parent_run_id)
    set_dotted(raw, "tracking.run_name", run_name)
    return build_config(raw, source="(trial)"), plan


def trial_resources_fn(ctx: TrialContext):
    """For ``tune.with_resources``: the placement group of the trial with this config (keys
    like num_clients may be swept, so each trial can differ)."""

    def resources(config: dict[str, Any]):
        _, plan = trial_config(ctx, config)
        return placement_group_factory(plan)

    return resources


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def make_trainable(ctx: TrialContext):
    def rayfed_trial(config: dict[str, Any]) -> None:
        from ray import tune

        from rayfed_proto.runtime.driver import run_experiment

        run_name = f"{ctx.sweep_name}-{tune.get_context().get_trial_id()}"
        cfg, _ = trial_config(ctx, config, run_name=run_name)
        run_ids: list[str] = []

        def on_eval(version: int, metrics: dict[str, Any]) -> None:
            report: dict[str, Any] = {**_numeric(metrics), "version": version}
            if cfg.tracking.enabled:
                import mlflow

                run = mlflow.active_run()
                if run is not None and not run_ids:
                    run_ids.append(run.info.run_id)
                report["mlflow_run_id"] = run_ids[0] if run_ids else None
            if ctx.metric not in metrics:  # proto_acc has no value before the first bank (version 0)
                return
            if version >= cfg.federation.rounds:
                # The last evaluation is reported once the run has ended: a scheduler stops a
                # trial at its last report (ASHA at max_t), which would cut the run before its
                # final artifacts and leave it FAILED.
                final.append(report)
                return
            tune.report(report)  # raises SystemExit when the scheduler stops this trial

        final: list[dict[str, Any]] = []
        try:
            run_experiment(cfg, progress=False, echo=lambda s: None, on_eval=on_eval)
        except SystemExit:
            # Stopped by the scheduler (ASHA) or an interrupted sweep: run_experiment ended the
            # run as FAILED (and released its actors); it was stopped, not broken.
            if run_ids:
                from mlflow.tracking import MlflowClient

                client = MlflowClient(cfg.tracking.tracking_uri)
                client.set_tag(run_ids[0], "rayfed_proto.stopped", "by the Tune scheduler or an interrupted sweep")
                client.set_terminated(run_ids[0], status="KILLED")
            raise
        for report in final:
            tune.report(report)

    return rayfed_trial
