"""Turn the config's resource settings and the cluster's nodes into per-actor requests.

Ray actors hold their logical CPUs/GPUs for their whole life, so with one actor per client the
shares must be fractional for every actor to be placed at once (20 clients on 2 CPUs get 0.075
CPU each). A run's actors are one placement group, and Ray places each bundle on ONE node, so
``auto`` shares are planned per node: the server and the client actors are laid out over the
nodes the cluster has (or will have: see :mod:`rayfed_proto.runtime.autoscale`) the way Ray's
PACK strategy places them (the server first, then as many client bundles as fit on each node),
and the client share is the largest one for which every client actor finds a node whichever
node the server lands on. Explicit values are checked the same way, so that an impossible
request fails in seconds, naming the key and the per-node arithmetic, instead of waiting
``resources.placement_timeout_s`` for a placement that can never happen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from rayfed_proto.config import ConfigError, ConfigIssue, ExperimentConfig
from rayfed_proto.runtime.policies import min_real_slots

UNIT = 10_000  # Ray's resource grain: 1e-4 of a CPU or GPU


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
    return math.floor(x / grain + 1e-9) * grain


def _units(x: float) -> int:
    return int(round(float(x) * UNIT))


def _num(units: int) -> float:
    return round(units / UNIT, 4)


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


# ----------------------------------------------------------------------------- nodes and bundles


@dataclass(frozen=True)
class NodeShape:
    """A node's CPUs and whole GPUs, in Ray's units (1e-4)."""

    cpu: int
    gpus: int

    @classmethod
    def of(cls, node: dict[str, float]) -> NodeShape:
        return cls(_units(node.get("CPU", 0.0)), int(math.floor(float(node.get("GPU", 0.0)) + 1e-9)))

    def describe(self) -> str:
        return f"{_num(self.cpu):g} CPU" + (f", {self.gpus} GPU" if self.gpus else "")


def _take(shape: NodeShape, cpu: int, gpu: int) -> Optional[tuple[int, list[int]]]:
    """The node's free CPU units and per-GPU free units once a bundle of ``cpu``/``gpu`` units is
    on it, or None when the bundle does not fit (a fractional GPU share must fit on one GPU,
    a share of one GPU or more takes whole idle GPUs)."""
    if cpu > shape.cpu:
        return None
    free = [UNIT] * shape.gpus
    if 0 < gpu < UNIT:
        slot = next((i for i, f in enumerate(free) if f >= gpu), None)
        if slot is None:
            return None
        free[slot] -= gpu
    elif gpu >= UNIT:
        whole = -(-gpu // UNIT)
        if whole > len(free):
            return None
        free = free[whole:]
    return shape.cpu - cpu, free


def _count(cpu_free: int, gpu_free: list[int], cpu: int, gpu: int, limit: int) -> int:
    """How many bundles of ``cpu``/``gpu`` units fit in what a node has free (at most ``limit``)."""
    n = limit
    if cpu > 0:
        n = min(n, cpu_free // cpu)
    if 0 < gpu < UNIT:
        n = min(n, sum(f // gpu for f in gpu_free))
    elif gpu >= UNIT:
        n = min(n, sum(1 for f in gpu_free if f >= UNIT) // (-(-gpu // UNIT)))
    return n


@dataclass
class Layout:
    """How many client bundles fit on each node with the server on ``server_node`` (the node
    where the fewest fit in all: Ray's PACK may put the server on any node that holds it)."""

    shapes: list[NodeShape]
    server_node: int
    counts: list[int]

    @property
    def fitting(self) -> int:
        return sum(self.counts)


def layout(shapes: Sequence[NodeShape], server: tuple[int, int], client: tuple[int, int], n: int) -> Optional[Layout]:
    """The worst-case layout of the server bundle plus ``n`` client bundles (units) over
    ``shapes``; None when the server fits on no node."""
    worst: Optional[Layout] = None
    tried: set[NodeShape] = set()
    for i, shape in enumerate(shapes):
        if shape in tried:  # the same shape gives the same layout
            continue
        tried.add(shape)
        rest = _take(shape, *server)
        if rest is None:
            continue
        counts = []
        for j, other in enumerate(shapes):
            cpu_free, gpu_free = rest if j == i else (other.cpu, [UNIT] * other.gpus)
            counts.append(_count(cpu_free, gpu_free, *client, n))
        if worst is None or sum(counts) < worst.fitting:
            worst = Layout(list(shapes), i, counts)
    return worst


def _fits(shapes, server, client, n) -> bool:
    lay = layout(shapes, server, client, n)
    return lay is not None and lay.fitting >= n


def largest_client_cpu(shapes: Sequence[NodeShape], server: tuple[int, int], client_gpu: int, n: int) -> int:
    """The largest client CPU share (units) for which ``n`` client bundles and the server fit
    (0 when none does): the candidates are each node's free CPUs divided by 1..n."""
    frees = {s.cpu for s in shapes} | {s.cpu - server[0] for s in shapes if s.cpu >= server[0]}
    candidates = sorted({f // k for f in frees if f > 0 for k in range(1, n + 1) if f // k > 0}, reverse=True)
    lo, hi = 0, len(candidates)  # fitting is monotone: a smaller share never fits fewer bundles
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(shapes, server, (candidates[mid], client_gpu), n):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo] if lo < len(candidates) else 0


def auto_gpu_share(shapes: Sequence[NodeShape], server_cpu: int, client_cpu: int, n: int) -> float:
    """The GPU share that lets every actor a node can hold by its CPUs (at most all ``n + 1``)
    share that node's GPUs: 1 / (actors per GPU), to 0.01, on the most crowded GPU node. A
    fractional share must fit on one GPU (Ray never splits a request across GPUs), so 5 actors on
    2 GPUs get 1/3, not 0.4."""
    share = 1.0
    for s in {s for s in shapes if s.gpus > 0}:
        by_cpu = s.cpu // client_cpu if client_cpu > 0 else n
        if s.cpu >= server_cpu:
            by_cpu = max(by_cpu, 1 + ((s.cpu - server_cpu) // client_cpu if client_cpu > 0 else n))
        actors = max(1, min(n + 1, by_cpu))
        share = min(share, _floor(1.0 / math.ceil(actors / s.gpus), 0.01))
    return share


def describe_layout(lay: Layout, server: tuple[int, int], client: tuple[int, int], n: int) -> str:
    """The per-node arithmetic: which node holds the server, how many client bundles fit on
    each node and what they add up to, identical nodes grouped."""
    def bundle(cpu: int, gpu: int) -> str:
        return f"({_num(cpu):g} CPU, {_num(gpu):g} GPU)" if gpu else f"{_num(cpu):g} CPU"

    groups: dict[tuple[NodeShape, bool, int], int] = {}
    for j, (shape, k) in enumerate(zip(lay.shapes, lay.counts, strict=True)):
        key = (shape, j == lay.server_node, k)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (shape, has_server, k), many in groups.items():
        used = (server[0] if has_server else 0) + k * client[0]
        what = (f"server {bundle(*server)} + " if has_server else "") + f"{k} x {bundle(*client)}"
        gpus = (server[1] if has_server else 0) + k * client[1]
        each = " each" if many > 1 else ""
        parts.append(f"{many} node{'s' if many > 1 else ''} of {shape.describe()}: {what} = {_num(used):g} CPU"
                     + (f", {_num(gpus):g} GPU" if gpus else "") + each)
    return (f"{'; '.join(parts)}: {lay.fitting if lay.fitting < n else n} of {n} client actors fit "
            "(each bundle must fit on one node; Ray places the server first, then as many client bundles as fit on each node)")


# ----------------------------------------------------------------------------- the plan


def plan_resources(cfg: ExperimentConfig, cluster_cpus: float, cluster_gpus: float,
                   nodes: Optional[Sequence[dict[str, float]]] = None) -> ResourcePlan:
    """The per-actor shares of ``cfg`` on a cluster of ``nodes`` (each node's resources, e.g.
    ``{"CPU": 8, "GPU": 1}``: the nodes it has and those its autoscaler can add), or, without
    ``nodes``, on one node of ``cluster_cpus``/``cluster_gpus`` (a local instance)."""
    res, fed = cfg.resources, cfg.federation
    given = nodes if nodes is not None else [{"CPU": cluster_cpus, "GPU": cluster_gpus}]
    shapes = [s for s in (NodeShape.of(n) for n in given) if s.cpu > 0 or s.gpus > 0]
    gpu_nodes = [s for s in shapes if s.gpus > 0]
    clients_use_gpu = bool(gpu_nodes) if res.client_num_gpus == "auto" else res.client_num_gpus > 0
    pool = gpu_nodes if clients_use_gpu and gpu_nodes else shapes  # the nodes that can hold a client actor
    pool_cpus = sum(s.cpu for s in pool) / UNIT

    per_actor = clients_per_actor(cfg, pool_cpus)
    num_actors = (min(useful_slots(pool_cpus), fed.num_clients) if res.clients_per_actor == "auto"
                  else math.ceil(fed.num_clients / per_actor))

    biggest = max((s.cpu for s in pool), default=0) / UNIT
    server_cpus = _floor(min(1.0, pool_cpus / 4, biggest)) if res.server_num_cpus == "auto" else float(res.server_num_cpus)
    fixed_server_gpus = float(res.server_num_gpus) if res.server_num_gpus != "auto" else 0.0
    fixed_client_gpus = float(res.client_num_gpus) if res.client_num_gpus != "auto" else 0.0
    if res.client_num_cpus != "auto":
        client_cpu_u = _units(float(res.client_num_cpus))
    elif pool_cpus > 0:  # the largest share for which all bundles fit (an auto GPU share follows from it)
        client_cpu_u = (largest_client_cpu(pool, (_units(server_cpus), _units(fixed_server_gpus)), _units(fixed_client_gpus),
                                           num_actors)
                        # explicit GPU shares that fit no layout: the CPUs' share, and the GPU key is named below
                        or largest_client_cpu(pool, (_units(server_cpus), 0), 0, num_actors))
    else:
        client_cpu_u = 0
    client_cpus = _num(client_cpu_u)

    # The server gets the same GPU share as a client actor (it trains generators/anchors there).
    share = auto_gpu_share(pool if clients_use_gpu else gpu_nodes, _units(server_cpus), client_cpu_u, num_actors) if gpu_nodes else 0.0
    client_gpus = fixed_client_gpus if res.client_num_gpus != "auto" else (share if clients_use_gpu else 0.0)
    server_gpus = fixed_server_gpus if res.server_num_gpus != "auto" else share

    issues: list[ConfigIssue] = []
    server, client = (_units(server_cpus), _units(server_gpus)), (client_cpu_u, _units(client_gpus))
    server_fits = not any(server) or any(_take(s, *server) is not None for s in shapes)
    if server_fits and (pool_cpus <= 0 or (client_cpu_u <= 0 and res.client_num_cpus == "auto")):
        issues.append(ConfigIssue(key="resources.client_num_cpus", value=res.client_num_cpus,
                                  allowed=f"the cluster's {pool_cpus:g} CPUs leave nothing for {num_actors} client actors "
                                  "(an autoscaling cluster without workers yet: give its worker node types, see "
                                  "docs/cluster.md, or set resources.cluster_cpus to the CPUs of one worker node)"))
    elif not server_fits or (any(server) and any(client)):  # both non-empty: one placement group (fleet.py) holds them
        _check_layout(issues, res, shapes, server, client, num_actors)
    concurrency = min(num_actors, max(1, int(pool_cpus))) if fed.concurrency == "auto" else min(fed.concurrency, num_actors)
    needed = min_real_slots(fed, virtual_clock=getattr(cfg, "system", None) is not None)
    if needed is not None and needed > concurrency:
        issues.append(ConfigIssue(
            key="federation.buffer_size", value=fed.buffer_size,
            allowed=f"at most the concurrency this cluster gives ({concurrency}: min(client actors {num_actors}, "
            f"{'CPUs ' + format(pool_cpus, 'g') if fed.concurrency == 'auto' else 'federation.concurrency'}))"))
    if issues:
        raise ConfigError(issues, "(resources)")

    if res.torch_threads != "auto":
        threads = int(res.torch_threads)
    elif client_cpus >= 1:
        threads = int(client_cpus)
    else:
        threads = max(1, int(pool_cpus // max(concurrency, 1)))
    return ResourcePlan(num_actors, per_actor, client_cpus, client_gpus, server_cpus, server_gpus, threads, concurrency)


def _check_layout(issues: list[ConfigIssue], res, shapes: list[NodeShape], server: tuple[int, int],
                  client: tuple[int, int], n: int) -> None:
    """An issue naming the key to change when the server and ``n`` client bundles cannot all be
    placed on ``shapes`` (with the per-node arithmetic)."""
    nodes = "; ".join(f"{k} x {s.describe()}" for s, k in _grouped(shapes))
    lay = layout(shapes, server, client, n)
    if lay is None:
        by_gpu = bool(server[1]) and layout(shapes, (server[0], 0), client, n) is not None
        key = "resources.server_num_gpus" if by_gpu else "resources.server_num_cpus"
        issues.append(ConfigIssue(key=key, value=getattr(res, key.split(".")[1]), allowed=(
            f"the server's bundle ({_num(server[0]):g} CPU, {_num(server[1]):g} GPU) fits on no node of the cluster "
            f"({nodes})" + ("; a fractional GPU share must fit on one GPU, a larger one takes whole GPUs of one node"
                           if by_gpu else f"; at most {max(s.cpu for s in shapes) / UNIT:g} CPU on one node"))))
        return
    if lay.fitting >= n:
        return
    cpu_only = layout(shapes, (server[0], 0), (client[0], 0), n)
    gpu_bound = client[1] > 0 and cpu_only is not None and cpu_only.fitting >= n
    arithmetic = describe_layout(lay, server, client, n)
    if gpu_bound:
        issues.append(ConfigIssue(key="resources.client_num_gpus", value=res.client_num_gpus, allowed=(
            f"{n} client actors of {_num(client[1]):g} GPU and the server's {_num(server[1]):g} GPU do not fit the "
            f"nodes' GPUs ({arithmetic}); a fractional share must fit on one GPU"
            + (f" (at most {UNIT // client[1]} per GPU)" if client[1] < UNIT else "") + ": lower it or use 'auto'")))
        return
    best = largest_client_cpu(shapes, server if res.server_num_gpus != "auto" else (server[0], 0),
                              client[1] if res.client_num_gpus != "auto" else 0, n)  # an auto GPU share follows the CPUs
    hint = (f"at most {_num(best):g} fits" if best > 0 else "no CPU share fits")
    issues.append(ConfigIssue(key="resources.client_num_cpus", value=res.client_num_cpus, allowed=(
        f"{arithmetic}; {hint}: lower it, use 'auto', or raise resources.clients_per_actor")))


def _grouped(shapes: Sequence[NodeShape]) -> list[tuple[NodeShape, int]]:
    out: dict[NodeShape, int] = {}
    for s in shapes:
        out[s] = out.get(s, 0) + 1
    return list(out.items())


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
