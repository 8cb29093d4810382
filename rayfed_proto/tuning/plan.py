"""A sweep's plan: what its trials reserve, worked out once before Tune starts (issue 37).

:func:`plan_sweep` reads the cluster's capacity once (an autoscaling cluster counts the nodes it
can add, issue 13), resolves ``gpus_per_trial`` against it into the trials' :class:`TrialContext`
and builds the placement of the trials at the corners of the search space. Whoever needs any of
it reads the :class:`SweepPlan`: the cluster check, the autoscaler request made before
``Tuner.fit`` and its narrowing as trials finish (``tuning/requests.py``), Tune's trainable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rayfed_proto.config import ConfigError, ConfigIssue
from rayfed_proto.runtime.autoscale import Capacity, capacity, request_if_short
from rayfed_proto.tuning.resources import TrialPlan, check_fits_cluster, resolve_gpus_per_trial
from rayfed_proto.tuning.spec import SweepSpec, corner_values
from rayfed_proto.tuning.trainable import TrialContext, trial_config


@dataclass(frozen=True)
class SweepPlan:
    """Built once per ``run_sweep`` by :func:`plan_sweep`; read, never recomputed, by the rest."""

    spec: SweepSpec
    capacity: Capacity                     # the cluster, with the nodes an autoscaler can add
    ctx: TrialContext                      # what every trial needs; gpus_per_trial resolved against capacity
    corner_plans: tuple[TrialPlan, ...]    # the trials at corner_values(spec.space), in that order

    @property
    def trial_bundles(self) -> list[dict[str, float]]:
        """One trial's placement-group bundles: the first corner of the search space stands for all."""
        return self.corner_plans[0].bundles

    @property
    def concurrent(self) -> int:
        """Trials that run at once: ``max_concurrent_trials``, at most the sweep's trials, at least 1."""
        return max(1, min(self.spec.file.max_concurrent_trials, self.spec.num_trials))


def plan_sweep(spec: SweepSpec, base_raw: dict, *, tracking_uri: Optional[str], parent_run_id: Optional[str],
               output_dir: str, driver_pin: dict[str, float], experiment_name: str,
               store_uri: Optional[str] = None) -> SweepPlan:
    """The plan of ``spec``'s trials (``base_raw``: the base with absolute paths; the keywords:
    the :class:`TrialContext` fields the sweep's place and MLflow server decide)."""
    cap = capacity(spec.base_config.resources)
    tr = spec.file.trial_resources
    ctx = TrialContext(sweep_name=spec.name, base_raw=base_raw, space_keys=list(spec.space),
                       trial_resources=tr.model_dump(),
                       gpus_per_trial=resolve_gpus_per_trial(tr.gpus_per_trial, cap.gpus, spec.file.max_concurrent_trials),
                       metric=spec.file.metric, tracking_uri=tracking_uri, parent_run_id=parent_run_id,
                       output_dir=output_dir, driver_pin=driver_pin, experiment_name=experiment_name,
                       store_uri=store_uri or tracking_uri, source=spec.source)
    corners = tuple(trial_config(ctx, values)[1] for values in corner_values(spec.space))
    return SweepPlan(spec, cap, ctx, corners)


def check_cluster(plan: SweepPlan) -> None:
    """Refuse a sweep with a corner trial whose placement group the cluster can never hold (it
    would wait forever): every problem of every corner, each once, in one ConfigError."""
    nodes, totals = plan.capacity.nodes, plan.capacity.totals()
    issues: list[ConfigIssue] = []
    for trial in plan.corner_plans:
        issues.extend(i for i in check_fits_cluster(trial, nodes, totals) if str(i) not in {str(j) for j in issues})
    if issues:
        raise ConfigError(issues, f"{plan.spec.source} (against the cluster)")


def request_for_trials(plan: SweepPlan) -> bool:
    """Ask an autoscaling cluster for the placement groups of ``plan.concurrent`` trials when it
    lacks them; True when asked. Tune's pending trial groups are a demand the autoscaler serves
    too; this asks at once, for all (narrowed as trials finish: tuning/requests.py)."""
    return request_if_short(plan.trial_bundles * plan.concurrent)
