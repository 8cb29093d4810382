"""The run's actors (:class:`ActorFleet`): one placement group, worker actors that start before
their data is ready, the server, restore from a checkpoint, restarts into the same bundle (from
the checkpoint store it owns), checkpoints, shutdown.

Order of a start (``run_experiment``)::

    fleet.start_workers()      # placement group (all or nothing) + worker processes start (import torch ...)
    ... the driver partitions the data, creates the output folder, starts the MLflow run ...
    fleet.data_ref = ray.put(dataset)             # once; every actor maps it zero-copy
    fleet.assign(groups, partition, ...)          # which worker hosts which clients
    fleet.new_server(); fleet.setup_workers()     # data handed over through the object store
    fleet.wait_started(...)                       # every actor built, or a clear error
    fleet.restore(checkpoint)                     # a resumed run: server and clients as checkpointed

Inside a Ray Tune trial the trial's own placement group already holds every actor (Tune
captures the actors a trial creates), so no second group is made there.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import ray

from rayfed_proto.config import InputError
from rayfed_proto.runtime import autoscale

log = logging.getLogger("rayfed_proto")


class ActorFleet:
    def __init__(self, cfg_dict: dict, plan, fed, name: str, cluster: Optional[dict] = None):
        self.cfg_dict, self.plan, self.fed, self.name = cfg_dict, plan, fed, name
        self.cluster = cluster or {}  # the cluster's resources when the run was planned (for messages)
        self.store = None  # the run's CheckpointStore: restarts and resumes read it, checkpoints go to it
        self.run_dir = None  # the run folder: its files go beside the checkpoints of a remote store (runstore.py)
        self._run_files_stored = False
        self.pg = None
        self.requested = False  # an autoscaler request of this run stands (withdrawn once placed, or at shutdown)
        self.generation: dict[Any, int] = {}
        self.handles: dict[str, Any] = {"actors": [], "server": None}
        self.data_ref = None
        self.groups: list[list[int]] = []
        self.setup_refs: list = []
        self.closed = False  # shut down: the actors are killed and the placement group removed

    # ------------------------------------------------------------------ placement
    def _bundles(self) -> Optional[list[dict[str, float]]]:
        """Server bundle first, then one per worker; None when a bundle would be empty (explicit
        zero shares), which a placement group cannot hold."""
        p = self.plan

        def bundle(cpus: float, gpus: float) -> dict[str, float]:
            return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}

        bundles = [bundle(p.server_num_cpus, p.server_num_gpus)] + [bundle(p.client_num_cpus, p.client_num_gpus)] * p.num_actors
        return bundles if all(bundles) else None

    def _strategy(self, index: int) -> dict[str, Any]:
        if self.pg is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)}

    def _make_group(self) -> None:
        from ray.util import get_current_placement_group, placement_group

        if get_current_placement_group() is not None:  # a Tune trial: its group already holds the actors
            return
        bundles = self._bundles()
        if bundles is not None:
            # PACK: on one node when it fits, spread over nodes when not; all bundles or none
            self.pg = placement_group(bundles, strategy="PACK", name=f"rayfed:{self.name}")
            self.requested = autoscale.request_if_short(bundles)  # an autoscaling cluster: ask for the nodes

    # ------------------------------------------------------------------ actors
    def _new_worker_actor(self, a: int):
        from rayfed_proto.runtime.actors import ClientActor

        self.generation[a] = self.generation.get(a, -1) + 1
        return ClientActor.options(num_cpus=self.plan.client_num_cpus, num_gpus=self.plan.client_num_gpus,
                                   name=f"rayfed:{self.name}:client:{a}:{self.generation[a]}",
                                   **self._strategy(1 + a)).remote(self.cfg_dict, self.plan.torch_threads)

    def start_workers(self) -> None:
        """Reserve the placement group and start the worker processes (no data yet)."""
        self._make_group()
        self.handles["actors"] = [self._new_worker_actor(a) for a in range(self.plan.num_actors)]

    def assign(self, groups: list[list[int]], partition, num_classes: int, channels: int, image_size: int,
               needs) -> None:
        """Which worker hosts which clients, the data's shape, and what the federation policy
        asks of the server (:class:`~rayfed_proto.runtime.policies.ServerNeeds`)."""
        self.groups, self.partition, self.needs = groups, partition, needs
        self.shape = (num_classes, channels, image_size)

    def _setup(self, a: int, actor):
        splits = [self.partition.clients[c] for c in self.groups[a]]
        return actor.setup.remote(self.data_ref, splits, self.partition.public_idx)

    def setup_workers(self) -> None:
        self.setup_refs = [self._setup(a, actor) for a, actor in enumerate(self.handles["actors"])]

    def new_worker(self, a: int):
        """A replacement for worker ``a`` (same bundle, same clients), set up from the object store.
        When worker ``a`` went down with its node, its bundle still points at that node until Ray
        declares the node dead and reschedules the bundle elsewhere; a replacement started before
        dies unstarted, so it is retried (``autoscale.replace_until_started``)."""
        return autoscale.replace_until_started(lambda: self._started_worker(a), self.cfg_dict["resources"]["placement_timeout_s"])

    def _started_worker(self, a: int):
        actor = self._new_worker_actor(a)
        return actor, self._setup(a, actor)

    def new_server(self):
        from rayfed_proto.runtime.actors import ServerActor

        self.generation["server"] = self.generation.get("server", -1) + 1
        p = self.plan
        self.handles["server"] = ServerActor.options(
            num_cpus=p.server_num_cpus, num_gpus=p.server_num_gpus,
            name=f"rayfed:{self.name}:server:{self.generation['server']}", **self._strategy(0)).remote(
            self.cfg_dict, *self.shape, self.needs, max(1, p.torch_threads),
            self.data_ref, self.partition.global_test_idx, self.partition.public_idx)
        return self.handles["server"]

    def wait_started(self, timeout: float, progress: bool) -> None:
        """Block until the placement group is placed and every actor is built and set up; a
        request the cluster cannot place fails loudly, naming what was asked and what it has."""
        p, cluster = self.plan, self.cluster
        asked = (f"Each client actor asks {p.client_num_cpus:g} CPU and {p.client_num_gpus:g} GPU, the server "
                 f"{p.server_num_cpus:g} CPU and {p.server_num_gpus:g} GPU ({p.num_actors} client actors + 1 server, one "
                 f"placement group); the cluster has {cluster.get('CPU', 0):g} CPU and {cluster.get('GPU', 0):g} GPU "
                 f"(other jobs may hold some). Lower resources.client_num_gpus / client_num_cpus, raise "
                 f"resources.clients_per_actor, or raise resources.placement_timeout_s.")
        deadline = time.monotonic() + timeout
        if self.pg is not None:  # shows the nodes arriving; withdraws the autoscaler request once placed
            try:
                autoscale.wait_placed(self.pg, self._bundles(), timeout, progress, asked, self.requested)
            finally:
                self.requested = False  # wait_placed withdrew it, placed or not
        refs = list(self.setup_refs) + [self.handles["server"].info.remote()]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(refs), desc="starting actors", unit="actor", dynamic_ncols=True, leave=False)
        pending = refs
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise InputError(f"{len(pending)} of {len(refs)} actors were not started within {timeout:.0f} s. {asked}")
                ray.get(ready)  # re-raises an actor's constructor or setup error
                if bar is not None:
                    bar.update(len(ready))
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------------ checkpoints and restarts
    def restore(self, ckpt) -> int:
        """Server and every worker's clients as ``ckpt`` saved them; returns the server's version."""
        version = ray.get(self.handles["server"].restore.remote(ckpt.server_state()))
        rngs = ckpt.actor_rng()
        _restore_clients([(actor, self.groups[a], rngs.get(a)) for a, actor in enumerate(self.handles["actors"])], ckpt)
        return version

    def save_checkpoint(self, server_snap: dict[str, Any], actor_snaps: list, driver: dict[str, Any], run_id):
        """Write one checkpoint (retried; None when it failed and the previous one stands)."""
        clients = _Chained([states for states, _ in actor_snaps])
        path = self.store.save_or_warn(server_snap["core"]["version"], server=server_snap, clients=clients,
                                       actor_rng={a: rng for a, (_, rng) in enumerate(actor_snaps)}, driver=driver,
                                       run_id=run_id)
        log.info("checkpoint written: %s", path)
        if path is not None and not self._run_files_stored and self.run_dir is not None:
            from rayfed_proto.runtime import runstore

            # a remote store holds what `run --resume URI` needs to rebuild the run folder
            self._run_files_stored = runstore.store_run_files(self.store, self.run_dir)
        return path

    def restart_worker(self, a: int, echo=print):
        """Worker ``a`` died: a new one in its bundle, its clients from the latest checkpoint (or fresh)."""
        actor = self.new_worker(a)
        latest = self.store.latest()
        restored = _restore_clients([(actor, self.groups[a], None)], latest) if latest is not None else 0
        echo(f"client actor {a} recreated " + (f"from the checkpoint of version {latest.version}" if restored
                                               else "re-initialised (no checkpoint yet)"))
        return actor

    def restart_server(self, echo=print) -> tuple[Any, int]:
        """The server died: a new one from the latest checkpoint (or from scratch); (handle, version)."""
        server = self.new_server()
        latest = self.store.latest()
        if latest is not None:
            version = ray.get(server.restore.remote(latest.server_state()))
        else:
            ray.get(server.info.remote())  # started; a fresh server is at version 0
            version = 0
        echo(f"server actor recreated at version {version} " + ("(from checkpoint)" if latest is not None
                                                               else "(from scratch: no checkpoint yet)"))
        return server, version

    def withdraw_request(self) -> None:
        """Withdraw this run's autoscaler request if it still stands (nothing otherwise)."""
        if self.requested:
            self.requested = False
            autoscale.withdraw_request()

    def shutdown(self) -> None:
        """Withdraw the run's autoscaler request, kill the actors and remove the placement group;
        later calls do nothing. Every way out of a run comes here (driver.py), so no request of
        a run that failed, was interrupted or finished keeps nodes up."""
        self.withdraw_request()
        if self.closed:
            return
        self.closed = True
        handles = list(self.handles["actors"]) + ([self.handles["server"]] if self.handles["server"] is not None else [])
        if self.handles["server"] is not None:
            try:
                ray.get(self.handles["server"].stop.remote(), timeout=5)  # the server's training thread
            except Exception:  # already dead: killing it below is enough
                pass
        try:  # parked states on disk: each worker removes its folder (a dead one's goes with the next run)
            ray.get([a.close.remote() for a in self.handles["actors"]], timeout=10)
        except Exception:
            pass
        for h in handles:
            try:
                ray.kill(h)
            except Exception:  # already dead: nothing to release
                pass
        if self.pg is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # the cluster is gone already
                pass
            self.pg = None


def actor_infos(handles: list) -> list[dict[str, Any]]:
    """Placement and memory of each actor; one that died after the last version reports NaNs."""
    from ray.exceptions import RayActorError

    out = []
    for h in handles:
        try:
            out.append(ray.get(h.info.remote()))
        except RayActorError:
            out.append({"dead": True, "peak_rss_mib": float("nan"), "pss_mib": float("nan")})
    return out


class _Chained:
    """(client, state) over every worker's :class:`~rayfed_proto.runtime.actors.RemoteStates`,
    iterable again (a failed checkpoint write is retried; a generator would be spent)."""

    def __init__(self, parts: list):
        self.parts = parts

    def __iter__(self):
        return ((c, st) for states in self.parts for c, st in states.items())


def _restore_clients(workers: list[tuple[Any, list[int], Any]], ckpt, chunk: int = 32, window: int = 2) -> int:
    """Load the checkpointed states of each ``(actor, clients, rng)`` in ``workers`` into its actor;
    clients without one keep their fresh start. Returns how many were restored.

    First each worker is offered the state files themselves (``ClientActor.adopt_files``): a
    worker that parks on disk and can reach the checkpoint (the driver's node) links them into
    its parking folder and checks each against the manifest's SHA-256 there, without loading
    them. The states it could not take (a damaged one among them) come as bytes: the driver reads each file and checks
    its SHA-256 (``ckpt.client_bytes``), the worker loads the bytes and parks them, ``chunk``
    clients at a time, the workers served in turn, up to ``window`` chunks in flight per worker:
    the driver reads the next chunk while the workers load theirs, and it holds at most
    ``window`` chunks per worker, not every client's state. An actor runs its calls in the order
    sent, so the RNG state goes with its first call."""
    saved = set(ckpt.manifest.get("clients", [])) if ckpt.manifest.get("clients") is not None else None
    offers, todos = [], []
    for actor, clients, rng in workers:
        todo = [c for c in clients if saved is None or c in saved]
        files = {c: f for c in todo if (f := ckpt.client_file(c)) is not None}
        offers.append(actor.adopt_files.remote(files, rng))
        todos.append((todo, files))
    queues, linked = [], 0  # per worker: (actor, the chunks of client ids whose bytes it needs)
    for (actor, _, _), (todo, files), left in zip(workers, todos, ray.get(offers), strict=True):
        taken = set(files) - set(left)
        linked += len(taken)
        rest = [c for c in todo if c not in taken]
        queues.append((actor, [rest[i : i + chunk] for i in range(0, len(rest), chunk)]))
    inflight: dict[int, list] = {id(actor): [] for actor, _ in queues}
    sent = 0
    for turn in range(max((len(q[1]) for q in queues), default=0)):
        for actor, chunks in queues:
            if turn >= len(chunks):
                continue
            states = {c: data for c in chunks[turn] if (data := ckpt.client_bytes(c)) is not None}
            mine = inflight[id(actor)]
            mine.append(actor.restore.remote(states, None))
            sent += len(states)
            if len(mine) >= window:
                ray.get(mine.pop(0))
    ray.get([ref for refs in inflight.values() for ref in refs])
    log.info("restored %d client states: %d linked from the checkpoint's files by their workers, %d read and sent "
             "by the driver", linked + sent, linked, sent)
    return linked + sent
