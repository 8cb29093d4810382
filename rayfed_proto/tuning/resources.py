"""What one trial reserves, and the trial config that makes its actors fit exactly in it.

Ray Tune (2.x) starts each trial's function in the first bundle of the trial's placement group
and captures the actors that function creates into the same group. So the group holds one
bundle for the trial driver (the function: scheduler loop and MLflow logging), one for the
server actor and one per client actor, and the trial config gets fixed ``resources.*`` values
equal to those bundles. ``plan_resources`` (the ``auto`` shares) must not be used inside a
trial: it splits the whole cluster's totals, which would ask for more than the group holds and
leave the trial waiting forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from rayfed_proto.config import ConfigError, ConfigIssue, ExperimentConfig
from rayfed_proto.runtime.policies import min_real_slots


@dataclass
class TrialPlan:
    num_actors: int
    clients_per_actor: int
    concurrency: int
    gpu_share: float
    overrides: dict[str, Any]            # dotted config keys -> values, applied to the trial config
    bundles: list[dict[str, float]] = field(default_factory=list)

    def cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)

    def gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)


def _floor(x: float, grain: float = 0.0001) -> float:
    return math.floor(x / grain + 1e-9) * grain


def trial_overrides(cfg: ExperimentConfig, tr, gpus_per_trial: float, check: bool = True,
                    driver_pin: Optional[dict[str, float]] = None) -> TrialPlan:
    """The placement-group bundles and ``resources.*`` settings of one trial of ``cfg``.

    ``tr`` is the sweep's ``trial_resources``; ``gpus_per_trial`` is resolved (a number);
    ``driver_pin`` adds a node resource to the driver bundle (keeps the driver beside a
    loopback MLflow server)."""
    fed = cfg.federation
    n = fed.num_clients
    wanted = n if tr.client_actors == "all" else min(int(tr.client_actors), n)
    clients_per_actor = math.ceil(n / wanted)
    num_actors = math.ceil(n / clients_per_actor)
    share = 0.0
    if gpus_per_trial > 0:
        # every GPU-holding actor (server + clients) gets the same share; a share above 1 must be whole
        share = _floor(gpus_per_trial / (num_actors + 1))
        if share > 1:
            share = float(math.floor(share))
    concurrency = num_actors if fed.concurrency == "auto" else min(int(fed.concurrency), num_actors)
    issues: list[ConfigIssue] = []
    needed = min_real_slots(fed, virtual_clock=False)  # as planned for real slots (a virtual clock's check is the run's)
    if check and needed is not None and needed > concurrency:
        issues.append(ConfigIssue(key="federation.buffer_size", value=fed.buffer_size, allowed=(
            f"at most the trial's concurrency ({concurrency}: min(federation.concurrency, client actors "
            f"{num_actors})); raise trial_resources.client_actors or lower buffer_size")))
    if check and gpus_per_trial > 0 and share <= 0:
        issues.append(ConfigIssue(key="trial_resources.gpus_per_trial", value=gpus_per_trial, allowed=(
            f"enough for {num_actors + 1} actors at Ray's 0.0001 GPU grain")))
    if issues:
        raise ConfigError(issues, "(trial resources)")

    overrides = {
        "resources.address": None, "resources.num_cpus": None, "resources.num_gpus": None,
        "resources.clients_per_actor": clients_per_actor,
        "resources.client_num_cpus": float(tr.client_cpus), "resources.client_num_gpus": share,
        "resources.server_num_cpus": float(tr.server_cpus), "resources.server_num_gpus": share,
        "resources.torch_threads": int(tr.torch_threads),
        "federation.concurrency": concurrency,
    }

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        b = {"CPU": float(cpus)} if cpus > 0 else {}
        if gpus > 0:
            b["GPU"] = float(gpus)
        return b

    driver = bundle(tr.driver_cpus, 0.0)
    driver.update(driver_pin or {})
    bundles = [driver, bundle(tr.server_cpus, share)] + [bundle(tr.client_cpus, share) for _ in range(num_actors)]
    return TrialPlan(num_actors, clients_per_actor, concurrency, share, overrides, bundles)


def resolve_gpus_per_trial(value, cluster_gpus: float, max_concurrent: int) -> float:
    """``auto``: no GPU without GPUs; else the cluster's GPUs shared by the concurrent trials, at most 1."""
    if value != "auto":
        return float(value)
    if cluster_gpus <= 0:
        return 0.0
    return min(1.0, _floor(cluster_gpus / max_concurrent, 0.01))


def placement_group_factory(plan: TrialPlan):
    from ray import tune

    # PACK: keep a trial's actors together when they fit on one node, spill over when not
    return tune.PlacementGroupFactory(plan.bundles, strategy="PACK")


def check_fits_cluster(plan: TrialPlan, nodes: list[dict[str, float]], totals: dict[str, float]) -> list[ConfigIssue]:
    """A trial whose placement group the cluster can never hold would wait forever: refuse it.
    ``nodes`` are the per-node resource totals (``ray.nodes()[i]['Resources']``)."""
    issues = []
    cpus, gpus = plan.cpus(), plan.gpus()
    if cpus > totals.get("CPU", 0.0) + 1e-9:
        issues.append(ConfigIssue(key="trial_resources", value={"CPU": round(cpus, 4)}, allowed=(
            f"a trial's bundles (driver + server + {plan.num_actors} client actors) must fit the cluster's "
            f"{totals.get('CPU', 0):g} CPUs; lower driver_cpus/server_cpus/client_cpus or client_actors")))
    if gpus > totals.get("GPU", 0.0) + 1e-9:
        issues.append(ConfigIssue(key="trial_resources.gpus_per_trial", value=round(gpus, 4),
                                  allowed=f"at most the cluster's {totals.get('GPU', 0):g} GPUs"))
    for i, b in enumerate(plan.bundles):
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for node in nodes):
            pinned = [k for k in b if k.startswith("node:")]
            if i == 0 and pinned:
                issues.append(ConfigIssue(key="trial_resources.driver_cpus", value=b.get("CPU", 0.0), allowed=(
                    f"the trial drivers log to a 127.0.0.1 MLflow server, so they run on its node ({pinned[0]}), "
                    "which lacks these CPUs (a cluster head with CPU 0): use driver_cpus: 0, or an MLflow server "
                    "every node reaches (--tracking-uri http://HOST:PORT)")))
            else:
                issues.append(ConfigIssue(key="trial_resources", value=b, allowed="each bundle must fit on one node of the cluster"))
            break
    return issues
