"""Plan against the cluster that will exist, ask the autoscaler for it, wait while nodes arrive.

A fresh autoscaling cluster (``ray up cluster.yaml``: a head with ``CPU: 0``, ``min_workers: 0``;
the KubeRay RayJob of ``deploy/``: a head with ``num-cpus: 0`` and 0 worker replicas) reports 0
CPUs and 0 GPUs until a worker node joins, and no worker joins until something asks. So a run (and
a sweep) plans its shares against the **nodes** of the cluster as it will be
(:func:`capacity`): the nodes it has now, plus those its autoscaler can add,

* ``resources.cluster_cpus`` / ``resources.cluster_gpus`` when set (planned as ONE node of that
  size: on several nodes leave them unset and give the node types), else
* the worker node types of a Ray cluster launcher config when this process can read one:
  ``$RAYFED_AUTOSCALING_CONFIG`` when set (the KubeRay RayJob mounts its worker group there,
  ``deploy/rayjob.yaml``), else ``~/ray_bootstrap_config.yaml`` (``ray up`` writes it on the
  head, where jobs run): each type's ``resources`` ``max_workers`` times, the largest types
  first, at most the cluster's ``max_workers`` nodes in all, less the workers of that shape that
  are already up.

Ray 2.60 offers no public way to read the node types from another process: the GCS key that
``ray._private.state.get_cluster_config()`` reads is not filled by the v1 autoscaler (checked
with the fake multi-node provider), and the KubeRay autoscaler reads the RayCluster resource, which
a driver cannot, so a launcher-format file and the two keys are what works.

Then, before its actors are placed, a run compares its placement group's bundles with what the
cluster has; when short it asks the autoscaler for exactly those bundles
(``ray.autoscaler.sdk.request_resources``), shows the CPUs/GPUs arriving, and fails after
``resources.placement_timeout_s`` with a message naming what was asked and what the cluster has.
The request is withdrawn (``request_resources(bundles=[])``) once the group is placed (the placed
group holds its nodes, and a standing request would keep nodes up after the run) and on every
other way out of the run (:meth:`ActorFleet.shutdown <rayfed_proto.runtime.fleet.ActorFleet.shutdown>`:
a failure, Ctrl-C, an exception before the first update). A sweep narrows its request as trials
finish (:func:`narrow_request`). Requests are cluster-wide and each replaces the previous one
(Ray's API): two runs starting at once on one cluster can replace each other's request, but a
pending placement group is itself a demand the autoscaler serves, so that only slows the second.
A driver killed outright (SIGKILL, a lost head) cannot withdraw anything: its request stands until
the next run's request replaces it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayfed_proto.config import InputError

log = logging.getLogger("rayfed_proto")

BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # written on the head by `ray up`
NODE_TYPES_ENV = "RAYFED_AUTOSCALING_CONFIG"  # a launcher-format file naming the worker node types (KubeRay)


def node_types_file() -> str:
    """Where the worker node types are read from: ``$RAYFED_AUTOSCALING_CONFIG``, else ``ray up``'s file."""
    return os.environ.get(NODE_TYPES_ENV) or BOOTSTRAP_CONFIG


@dataclass
class Capacity:
    """CPUs/GPUs the cluster has or can grow to, its nodes (each node's resources: those up now,
    then those the autoscaler can add), and where they came from. ``plan_nodes``: the nodes to
    plan shares against when they differ from ``nodes`` (a ``resources.cluster_cpus`` hint)."""

    cpus: float
    gpus: float
    nodes: list[dict[str, float]] = field(default_factory=list)
    source: str = "the cluster now"
    plan_nodes: Optional[list[dict[str, float]]] = None

    def totals(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus}

    @property
    def planning_nodes(self) -> list[dict[str, float]]:
        return self.plan_nodes if self.plan_nodes is not None else self.nodes


def launcher_node_types(path: str | Path = BOOTSTRAP_CONFIG) -> Optional[tuple[list[tuple[dict[str, float], int]], int]]:
    """``([(resources, max_workers), ...], cluster max_workers)`` of the worker node types in a Ray
    cluster launcher config, or None when the file is absent or unreadable. Types that leave their
    ``resources`` to detection (``{}``) count as unknown and are skipped."""
    import yaml

    p = Path(path).expanduser()
    try:
        cfg = yaml.safe_load(p.read_text())
    except (OSError, ValueError) as e:
        if p.exists():
            log.warning("cannot read the autoscaling config %s: %s", p, e)
        return None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("available_node_types"), dict):
        return None
    head = cfg.get("head_node_type")
    types = []
    for name, t in cfg["available_node_types"].items():
        res = {k: float(v) for k, v in (t.get("resources") or {}).items() if k in ("CPU", "GPU")}
        if name != head and res and int(t.get("max_workers", 0)) > 0:
            types.append((res, int(t["max_workers"])))
    return types, int(cfg.get("max_workers", sum(n for _, n in types)))


def launchable_nodes(types: list[tuple[dict[str, float], int]], cluster_max: int,
                     alive: list[dict[str, float]]) -> list[dict[str, float]]:
    """The worker nodes the autoscaler can still add: each type ``max_workers`` times, the largest
    types first, at most ``cluster_max`` nodes in all, less the nodes of that shape already up
    (they count against both limits)."""
    def shape(r: dict[str, float]) -> tuple[float, float]:
        return float(r.get("CPU", 0.0)), float(r.get("GPU", 0.0))

    up: dict[tuple[float, float], int] = {}
    for n in alive:
        up[shape(n)] = up.get(shape(n), 0) + 1
    left = cluster_max
    out: list[dict[str, float]] = []
    for res, n in sorted(types, key=lambda t: (-t[0].get("GPU", 0.0), -t[0].get("CPU", 0.0))):
        have = min(up.get(shape(res), 0), n)
        up[shape(res)] = up.get(shape(res), 0) - have
        left -= have
        add = max(0, min(n - have, left))
        left -= add
        out += [{"CPU": shape(res)[0], "GPU": shape(res)[1]} for _ in range(add)]
    return out


def capacity(resources, bootstrap: str | Path | None = None) -> Capacity:
    """What a run plans against (see the module doc); ``resources`` is the config's section."""
    import ray

    now = ray.cluster_resources()
    nodes = [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    cpus, gpus = float(now.get("CPU", 0.0)), float(now.get("GPU", 0.0))
    hint_cpus, hint_gpus = getattr(resources, "cluster_cpus", None), getattr(resources, "cluster_gpus", None)
    if hint_cpus is not None or hint_gpus is not None:
        c = hint_cpus if hint_cpus is not None else cpus
        g = hint_gpus if hint_gpus is not None else gpus
        if c > cpus or g > gpus:  # planned as one node of that size: a bundle that fits the hint is not refused
            one = {"CPU": float(max(c, cpus)), "GPU": float(max(g, gpus))}
            return Capacity(one["CPU"], one["GPU"], nodes + [{"CPU": float(c), "GPU": float(g)}],
                            "resources.cluster_cpus/cluster_gpus", plan_nodes=[one])
        return Capacity(cpus, gpus, nodes)
    path = bootstrap if bootstrap is not None else node_types_file()
    launcher = launcher_node_types(path)
    if launcher is not None:
        more = launchable_nodes(*launcher, alive=nodes)
        if more:
            return Capacity(cpus + sum(n["CPU"] for n in more), gpus + sum(n["GPU"] for n in more), nodes + more,
                            f"the nodes up now and the worker node types of {path}")
    return Capacity(cpus, gpus, nodes)


def _need(bundles: list[dict[str, float]]) -> dict[str, float]:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            if k in ("CPU", "GPU"):
                need[k] = need.get(k, 0.0) + float(v)
    return need


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{res.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))


def fits_on_nodes(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> bool:
    """Whether ``bundles`` can all be placed at once on ``nodes`` (each node's resources), each
    bundle on one node: first fit, the bundles in Ray's order (GPU, then CPU, largest first); a
    fractional GPU share must fit on one GPU. A heuristic for "short": asking the autoscaler for
    bundles the cluster already holds launches nothing."""
    from rayfed_proto.runtime.resources import UNIT

    free = [({k: v for k, v in n.items() if k != "GPU"}, [UNIT] * int(n.get("GPU", 0.0) + 1e-9)) for n in nodes]
    for b in sorted(bundles, key=lambda b: (-b.get("GPU", 0.0), -b.get("CPU", 0.0))):
        gpu = int(round(b.get("GPU", 0.0) * UNIT))
        for res, gpus in free:
            if any(res.get(k, 0.0) + 1e-9 < v for k, v in b.items() if k != "GPU"):
                continue
            if 0 < gpu < UNIT:
                slot = next((i for i, f in enumerate(gpus) if f >= gpu), None)
                if slot is None:
                    continue
                gpus[slot] -= gpu
            elif gpu >= UNIT:
                idle = [i for i, f in enumerate(gpus) if f == UNIT]
                if len(idle) < -(-gpu // UNIT):
                    continue
                for i in idle[:-(-gpu // UNIT)]:
                    gpus[i] = 0
            for k, v in b.items():
                if k != "GPU":
                    res[k] = res.get(k, 0.0) - v
            break
        else:
            return False
    return True


def request_if_short(bundles: list[dict[str, float]]) -> bool:
    """Ask the autoscaler for ``bundles`` when the cluster's nodes cannot hold them now (its
    totals, or per node); True when asked."""
    import ray

    have = ray.cluster_resources()
    alive = [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    if all(have.get(k, 0.0) + 1e-9 >= v for k, v in _need(bundles).items()) and fits_on_nodes(bundles, alive):
        return False
    from ray.autoscaler.sdk import request_resources

    global _standing
    wanted = _launchable(bundles)
    request_resources(bundles=wanted)
    _standing = wanted
    log.info("asked the autoscaler for %d bundles (%s in all); the cluster has %s", len(bundles), _fmt(_need(bundles)), _fmt(have))
    return True


_standing: Optional[list[dict[str, float]]] = None  # the bundles this process asked for and has not withdrawn


def _launchable(bundles: list[dict[str, float]]) -> list[dict[str, float]]:
    # CPU/GPU only: a node:<ip> pin names a node that exists, which the autoscaler cannot launch
    wanted = [{k: v for k, v in b.items() if k in ("CPU", "GPU") and v > 0} for b in bundles]
    return [b for b in wanted if b]


def withdraw_request() -> None:
    """Withdraw this process's standing ``request_resources`` (a later request replaces it anyway)."""
    global _standing
    _standing = None
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    except Exception as e:  # the cluster is gone: nothing stands
        log.debug("could not withdraw the resource request: %s", e)


def narrow_request(bundles: list[dict[str, float]]) -> bool:
    """Replace this process's standing request with the fewer ``bundles`` (withdraw it when
    there are none left); nothing when no request of this process stands or it is already no
    larger. True when the request changed."""
    global _standing
    if _standing is None:
        return False
    wanted = _launchable(bundles)
    if len(wanted) >= len(_standing):
        return False
    if not wanted:
        withdraw_request()
        return True
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=wanted)
    _standing = wanted
    log.info("narrowed the autoscaler request to %d bundles (%s in all)", len(wanted), _fmt(_need(wanted)))
    return True


def wait_placed(pg, bundles: list[dict[str, float]], timeout_s: float, progress: bool, advice: str = "",
                requested: bool = False, what: str = "the run's placement group") -> None:
    """Block until ``pg`` is placed, showing the cluster's CPUs/GPUs against what the group needs;
    an :class:`InputError` after ``timeout_s`` names what was asked and what the cluster has."""
    import ray

    need = _need(bundles)
    deadline = time.monotonic() + timeout_s
    bar = _bar(need) if progress and requested else None
    ready_ref = pg.ready()
    try:
        while True:
            ready, _ = ray.wait([ready_ref], timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            if ready:
                return
            have = ray.cluster_resources()
            if bar is not None:
                bar.n = min(need.get("CPU", 0.0), have.get("CPU", 0.0))
                bar.set_postfix_str(f"cluster {_fmt(have)}, {sum(1 for n in ray.nodes() if n.get('Alive'))} nodes")
            if time.monotonic() >= deadline:
                alive = [n for n in ray.nodes() if n.get("Alive")]
                cpus_per_node = ", ".join(f"{n['Resources'].get('CPU', 0.0):g}" for n in alive)
                asked = "; asked the autoscaler for them (request_resources) and it did not supply them" if requested else ""
                raise InputError(
                    f"{what} was not placed within {timeout_s:.0f} s (resources.placement_timeout_s): it asks "
                    f"{len(bundles)} bundles, {_fmt(need)} in all (largest bundle {_fmt(max(bundles, key=lambda b: sum(b.values())))}); "
                    f"the cluster has {_fmt(have)} on {len(alive)} nodes (CPUs per node: {cpus_per_node}; each bundle must "
                    f"fit on one node){asked}. {advice}".rstrip())
    finally:
        if bar is not None:
            bar.close()
        if requested:
            withdraw_request()


def _bar(need: dict[str, float]) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=need.get("CPU", 0.0), desc="waiting for nodes (CPUs)", dynamic_ncols=True, leave=False,
                bar_format="{desc}: {n:g}/{total:g} {bar} {elapsed} {postfix}")


def replace_until_started(start, timeout_s: float, pause_s: float = 2.0):
    """``start()`` returns ``(actor, ready_ref)``; the actor once ``ready_ref`` resolves. A
    replacement whose node died under it (ActorDiedError: its bundle is on a node Ray has not yet
    declared dead) is started again until ``timeout_s``; any other error is raised."""
    import ray
    from ray.exceptions import ActorDiedError

    deadline = time.monotonic() + timeout_s
    while True:
        actor, ready = start()
        try:
            ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
            return actor
        except ActorDiedError as e:
            if time.monotonic() + pause_s >= deadline:
                raise
            log.warning("a replacement actor died before it started (%s); its bundle is being rescheduled, retrying",
                        str(e).strip().splitlines()[-1][:200])
            time.sleep(pause_s)
