"""Turn the config's resource settings and the cluster's totals into per-actor requests.

Ray actors hold their logical CPUs/GPUs for their whole life, so with one actor per client the
shares must be fractional for every actor to be placed at once (20 clients on 2 CPUs get 0.075
CPU each). ``auto`` splits what the cluster declares; explicit values are checked against it
so that an impossible request fails before any actor starts, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rayfed_proto.config import ConfigError, ConfigIssue, ExperimentConfig
from rayfed_proto.runtime.policies import min_real_slots


@dataclass
class ResourcePlan:
    num_actors: int
    clients_per_actor: int
    client_num_cpus: float
    client_num_gpus: float
    server_num_cpus: float
    server_num_gpus: float
    torch_threads: int
    concurrency: int

    def as_dict(self) -> dict:
        return asdict(self)


def _floor(x: float, grain: float = 0.0001) -> float:
    return math.floor(x / grain) * grain


def useful_slots(cluster_cpus: float) -> int:
    """Worker actors that can train at once: one per whole CPU (each worker drives its model with
    one or more torch threads; with GPUs too, a worker process needs a CPU to feed its share)."""
    return max(1, int(cluster_cpus + 1e-9))


def clients_per_actor(cfg: ExperimentConfig, cluster_cpus: float) -> int:
    """``resources.clients_per_actor``, with ``auto`` resolved: the clients spread over as many
    worker actors as there are useful slots."""
    per = cfg.resources.clients_per_actor
    if per != "auto":
        return int(per)
    return math.ceil(cfg.federation.num_clients / min(useful_slots(cluster_cpus), cfg.federation.num_clients))


def plan_resources(cfg: ExperimentConfig, cluster_cpus: float, cluster_gpus: float) -> ResourcePlan:
    res, fed = cfg.resources, cfg.federation
    per_actor = clients_per_actor(cfg, cluster_cpus)
    num_actors = (min(useful_slots(cluster_cpus), fed.num_clients) if res.clients_per_actor == "auto"
                  else math.ceil(fed.num_clients / per_actor))

    server_cpus = min(1.0, cluster_cpus / 4) if res.server_num_cpus == "auto" else float(res.server_num_cpus)
    client_cpus = _floor((cluster_cpus - server_cpus) / num_actors) if res.client_num_cpus == "auto" else float(res.client_num_cpus)

    if cluster_gpus > 0:
        # The server gets the same share as a client actor (it trains generators/anchors there).
        # A fractional share must fit on ONE GPU (Ray never splits a request across GPUs), so the
        # share is 1 / (actors per GPU), not total / actors: 5 actors on 2 GPUs get 1/3, not 0.4.
        whole_gpus = max(1, int(cluster_gpus))
        share = _floor(1.0 / math.ceil((num_actors + 1) / whole_gpus), 0.01)
    else:
        share = 0.0
    server_gpus = share if res.server_num_gpus == "auto" else float(res.server_num_gpus)
    client_gpus = share if res.client_num_gpus == "auto" else float(res.client_num_gpus)

    issues = []
    if server_cpus + num_actors * client_cpus > cluster_cpus + 1e-6:
        issues.append(ConfigIssue(
            key="resources.client_num_cpus", value=res.client_num_cpus,
            allowed=f"{num_actors} client actors x {client_cpus:g} CPU + server {server_cpus:g} CPU = "
            f"{server_cpus + num_actors * client_cpus:g} > the cluster's {cluster_cpus:g} CPUs; lower it, use 'auto', "
            f"or raise resources.clients_per_actor"))
    if not gpu_requests_fit([server_gpus] + [client_gpus] * num_actors, cluster_gpus):
        issues.append(ConfigIssue(
            key="resources.client_num_gpus", value=res.client_num_gpus,
            allowed=f"{num_actors} client actors x {client_gpus:g} GPU + server {server_gpus:g} GPU = "
            f"{server_gpus + num_actors * client_gpus:g} do not fit the cluster's {cluster_gpus:g} GPUs (a fractional "
            f"share must fit on one GPU: at most {int(1 / client_gpus) if 0 < client_gpus < 1 else 1} per GPU); lower it or use 'auto'"))
    if client_cpus <= 0 and res.client_num_cpus == "auto":
        issues.append(ConfigIssue(key="resources.client_num_cpus", value=res.client_num_cpus,
                                  allowed=f"the cluster's {cluster_cpus:g} CPUs leave nothing for {num_actors} client actors "
                                  "(an autoscaling cluster without workers yet: set resources.cluster_cpus to the CPUs its "
                                  "workers will bring, or run on its head, where ray up's autoscaling config names them)"))
    concurrency = min(num_actors, max(1, int(cluster_cpus))) if fed.concurrency == "auto" else min(fed.concurrency, num_actors)
    needed = min_real_slots(fed, virtual_clock=getattr(cfg, "system", None) is not None)
    if needed is not None and needed > concurrency:
        issues.append(ConfigIssue(
            key="federation.buffer_size", value=fed.buffer_size,
            allowed=f"at most the concurrency this cluster gives ({concurrency}: min(client actors {num_actors}, "
            f"{'CPUs ' + format(cluster_cpus, 'g') if fed.concurrency == 'auto' else 'federation.concurrency'}))"))
    if issues:
        raise ConfigError(issues, "(resources)")

    if res.torch_threads != "auto":
        threads = int(res.torch_threads)
    elif client_cpus >= 1:
        threads = int(client_cpus)
    else:
        threads = max(1, int(cluster_cpus // max(concurrency, 1)))
    return ResourcePlan(num_actors, per_actor, client_cpus, client_gpus, server_cpus, server_gpus, threads, concurrency)


def gpu_requests_fit(requests: list[float], cluster_gpus: float) -> bool:
    """Whether Ray can place these GPU requests at once: whole requests take whole GPUs, and
    each fractional one must fit on a single GPU (first-fit decreasing, in Ray's 1e-4 units)."""
    units = 10_000
    free = [units] * int(math.floor(cluster_gpus + 1e-9))
    for r in sorted((round(x * units) for x in requests if x > 0), reverse=True):
        if r >= units:
            whole = -(-r // units)
            idle = [i for i, f in enumerate(free) if f == units]
            if len(idle) < whole:
                return False
            for i in idle[:whole]:
                free[i] = 0
        else:
            slot = next((i for i, f in enumerate(free) if f >= r), None)
            if slot is None:
                return False
            free[slot] -= r
    return True


def assign_clients(num_clients: int, clients_per_actor: int, work: list[float] | None = None,
                   num_actors: int | None = None) -> list[list[int]]:
    """Client ids hosted by each actor (sorted within an actor).

    Without ``work``: consecutive blocks. With ``work`` (each client's cost, e.g. its training
    samples): longest-processing-time-first over ``num_actors`` (default
    ceil(num_clients / clients_per_actor)) actors,
    each holding at most ``clients_per_actor`` clients, so that a synchronous round's actors finish
    at about the same time instead of one idling while a heavier one finishes (ties by client id:
    deterministic)."""
    num_actors = num_actors or math.ceil(num_clients / clients_per_actor)
    if work is None or num_actors == 1:
        return [list(range(i, min(i + clients_per_actor, num_clients))) for i in range(0, num_clients, clients_per_actor)]
    load = [0.0] * num_actors
    groups: list[list[int]] = [[] for _ in range(num_actors)]
    for c in sorted(range(num_clients), key=lambda c: (-work[c], c)):
        a = min((a for a in range(num_actors) if len(groups[a]) < clients_per_actor), key=lambda a: (load[a], len(groups[a]), a))
        groups[a].append(c)
        load[a] += work[c]
    return [sorted(g) for g in groups]
