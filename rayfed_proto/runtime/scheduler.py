"""The driver-side event loop: one table of in-flight work, one ``ray.wait``, a federation policy.

The loop (:meth:`Scheduler.run`) reads like the algorithm::

    while versions remain (or their evaluations are running):
        policy.fill()                  # dispatch local updates (virtual clock: release finished ones)
        evaluations.start_ready()      # each due version, in every client's state as of that version
        checkpoint when draining and quiet
        ref = ray.wait(in-flight)      # whatever finishes first
        in_flight.pop(ref).handler(ref)

Every remote call the driver waits on is one entry of ``self.inflight`` (an
:class:`~rayfed_proto.runtime.inflight.InFlight` table, ``{ObjectRef: Pending}`` indexed by kind,
worker and client: Ray's ``ActorPool`` idea): a local update's metadata (its upload's ObjectRef goes
straight to ``server.submit``, never through the driver), a submission receipt, a sync round's
step, an evaluation, the async server's ``wait_versions``. Each entry names its handler.

How work is handed out is the run's :mod:`federation policy <rayfed_proto.runtime.policies>`,
which works through the narrow port this class implements (``dispatch``, ``submit``,
``hand_over``, ``request_step``, ``eligible``...); which versions are evaluated in which client
states is :class:`~rayfed_proto.runtime.evaluations.Evaluations`. The scheduler itself handles
failures, checkpoints and stops, never inspects a payload and never names an algorithm or a mode.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

from rayfed_proto.runtime.actors import RemoteStates
from rayfed_proto.runtime.evaluations import Evaluations
from rayfed_proto.runtime.inflight import SERVER_WORK, InFlight, Kind, Pending
from rayfed_proto.runtime.policies import FederationPolicy
from rayfed_proto.runtime.recovery import Recovery, StopRequested
from rayfed_proto.runtime.simclock import NoClientOnline

__all__ = ["Hooks", "Limits", "Scheduler", "SchedulerStats", "StopRequested"]

log = logging.getLogger("rayfed_proto")


@dataclass
class SchedulerStats:
    dispatched: int = 0
    busy_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    withheld: int = 0  # finished after the last version: never submitted
    last_terms: dict[int, dict[str, float]] = field(default_factory=dict)  # client -> its latest training terms
    client_failures: int = 0  # client actor deaths noticed (one per actor death)
    updates_lost_client: int = 0  # in flight on a client actor that died
    server_restarts: int = 0
    updates_lost_server: int = 0  # in flight or buffered when the server died
    versions_redone: int = 0  # produced by a server that died after its last checkpoint
    evals_incomplete: int = 0  # evaluations that lost some clients' results to an actor death
    checkpoints: int = 0
    checkpoints_failed: int = 0  # checkpoint writes that failed after retries (the previous one stands)
    versions_empty: int = 0  # sync: versions whose round had no accepted update (aggregated nothing)
    client_updates: dict[int, int] = field(default_factory=dict)  # client -> local updates dispatched to it
    excluded: list[int] = field(default_factory=list)  # clients dropped from sampling after repeated failures
    updates_dropped_offline: int = 0  # virtual clock: lost because the client went offline before they finished
    client_dropped_offline: dict[int, int] = field(default_factory=dict)  # client -> its updates dropped offline
    dropped_kept: int = 0  # dropped offline, but no state from before it was kept (resumed run): training kept
    updates_dropped_deadline: int = 0  # sync, virtual clock: would finish after federation.round_deadline_s
    updates_dropped_over_selection: int = 0  # sync, virtual clock: finished after the round's first K (over_selection)
    client_dropped_deadline: dict[int, int] = field(default_factory=dict)  # client -> its updates dropped by a deadline
    client_dropped_over_selection: dict[int, int] = field(default_factory=dict)  # client -> dropped by over-selection


@dataclass
class Limits:
    """The run's length and cadence, and how many failures it survives."""

    rounds: int
    eval_every: int
    real_slots: int = 1  # parallel execution slots (for utilisation)
    checkpoint_every: int = 0
    max_client_failures: int = 3
    max_server_failures: int = 3
    drain_timeout_s: float = 300.0
    stop_at_version: Optional[int] = None
    start_version: int = 0
    evaluate_start: bool = True  # the history lacks the start version (Evaluations.evaluates_start decides)
    eval_clients: Optional[list[int]] = None  # the clients every evaluation covers (None: all)

    @classmethod
    def for_run(cls, cfg, real_slots: int, start_version: int, evaluated: set[int],
                eval_clients: Optional[list[int]]) -> Limits:
        """A run's limits from its config; ``evaluated``: the versions its history holds (a resume
        does not evaluate its start version again)."""
        fed, rel = cfg.federation, cfg.reliability
        stop = cfg.faults.stop_at_version  # unless a resume starts at or after it: the stop it asked for has happened
        return cls(rounds=fed.rounds, eval_every=fed.eval_every, real_slots=real_slots,
                   checkpoint_every=cfg.checkpoint.every, max_client_failures=rel.max_client_failures,
                   max_server_failures=rel.max_server_failures, drain_timeout_s=rel.drain_timeout_s,
                   stop_at_version=stop if stop is not None and stop > start_version else None,
                   start_version=start_version, evaluate_start=start_version not in evaluated, eval_clients=eval_clients)


@dataclass
class Hooks:
    """What the driver does when something happens (MLflow, the progress bar, checkpoints, restarts)."""

    on_eval: Callable[[int, dict[str, Any]], None]
    on_version: Optional[Callable[[int], None]] = None
    on_checkpoint: Optional[Callable[[int, dict[str, Any], list], bool]] = None  # True: written
    restart_client_actor: Optional[Callable[[int], Any]] = None
    restart_server: Optional[Callable[[], tuple[Any, int]]] = None


class Scheduler:
    def __init__(self, policy: FederationPolicy, server, actors: list, actor_clients: list[list[int]], limits: Limits,
                 hooks: Hooks, progress=None, batch_clients: bool = False):
        if progress is None:
            from rayfed_proto.runtime.progress import ProgressWatch

            progress = ProgressWatch()  # no limits
        self.policy, self.limits, self.hooks, self.progress = policy, limits, hooks, progress
        self.server, self.actors, self.actor_clients = server, actors, actor_clients
        self.batch_clients = batch_clients  # resources.batch_clients on/auto: dispatch_group sends a worker's clients at once
        self.actor_of = {c: a for a, cs in enumerate(actor_clients) for c in cs}
        self.stats = SchedulerStats()
        self.inflight = InFlight()  # the one table of work the driver waits on
        self.recovery = Recovery(self, limits, self.stats, self.inflight, actor_clients,
                                 last_checkpoint=limits.start_version if limits.start_version > 0 else -1,
                                 checkpoints=hooks.on_checkpoint is not None)
        self.started = time.perf_counter()  # wall time counts from here (minus a resumed run's earlier time)
        self.version = limits.start_version
        self.global_ref = server.global_state.remote()
        self.first_update_unix: Optional[float] = None  # when the first local update came back (startup cost)
        counts = {c: n for host in ray.get([a.update_counts.remote() for a in actors]) for c, n in host.items()}
        self.evals = Evaluations(limits.eval_every, limits.rounds, counts, self.version, self.stats, hooks.on_eval,
                                 limits.real_slots, ray.get, limits.eval_clients)
        policy.bind(self)

    # ---------------------------------------------------------------------------- the port (policies.Port)
    @property
    def rounds(self) -> int:
        return self.limits.rounds

    def accepting(self) -> bool:
        return self.version < self.rounds and not self.recovery.draining()

    def dispatch(self, client: int) -> Pending:
        """Start ``client``'s local update against the newest version."""
        a = self.actor_of[client]
        meta_ref, update_ref = self.actors[a].train.options(num_returns=2).remote(
            client, self.global_ref, self.evals.keep_from(client), self.policy.may_lose(client))
        return self._training(client, a, meta_ref, update_ref)

    def dispatch_group(self, clients: list[int]) -> list[Pending]:
        """Start the local updates of ``clients`` against the newest version, one Pending each, in
        order. With ``resources.batch_clients`` on or auto the clients one worker hosts go to it in one
        call, where they may step as one batched model; each still has its own entry."""
        if not self.batch_clients:
            return [self.dispatch(c) for c in clients]
        by_actor: dict[int, list[int]] = {}
        for c in clients:  # an update that may be lost keeps its undo state: it goes alone (ClientHost.discard)
            by_actor.setdefault(("alone", c) if self.policy.may_lose(c) else self.actor_of[c], []).append(c)
        started: dict[int, Pending] = {}
        for key, group in by_actor.items():
            if len(group) == 1:
                started[group[0]] = self.dispatch(group[0])
                continue
            a = key
            refs = self.actors[a].train_group.options(num_returns=2 * len(group)).remote(
                group, self.global_ref, [self.evals.keep_from(c) for c in group])
            for c, meta_ref, update_ref in zip(group, refs[0::2], refs[1::2], strict=True):
                started[c] = self._training(c, a, meta_ref, update_ref)
        return [started[c] for c in clients]

    def _training(self, client: int, a: int, meta_ref, update_ref) -> Pending:
        """Count a started local update and enter it in the in-flight table."""
        self.stats.dispatched += 1
        self.stats.client_updates[client] = self.stats.client_updates.get(client, 0) + 1
        return self.inflight.add(meta_ref, Pending(self._on_update, Kind.TRAIN, client=client, update_ref=update_ref, actor=a))

    def submit(self, p: Pending, meta: dict[str, Any]) -> None:
        self.inflight.add(self.server.submit.remote(p.update_ref), Pending(
            self._on_receipt, Kind.RECEIPT, client=p.client, update_no=meta["update"], ticket=self.evals.ticket()))

    def hand_over(self, update, client: int, meta: dict[str, Any]) -> bool:
        ticket = self.evals.ticket()
        try:  # synchronous: the next dispatch must see the version this submission may produce
            receipt = ray.get(self.server.submit.remote(update))
        except RayActorError as err:
            self.stats.updates_lost_server += 1
            self.recovery.server_died(err)
            self.evals.handed(client, meta["update"], self.version, ticket)
            return False
        self.evals.handed(client, meta["update"], receipt["version"], ticket)
        self._handle_receipt(receipt, step=False)
        return True

    def request_step(self) -> None:
        self.inflight.add(self.server.step.remote(), Pending(self._on_receipt, Kind.STEP))

    def step_now(self) -> bool:
        """Virtual clock: the server's step ends now in simulated time; its version is taken at once
        (the next dispatch must see it). False: the server died."""
        try:
            receipt = ray.get(self.server.step.remote())
        except RayActorError as err:
            self.recovery.server_died(err)
            return False
        self._handle_receipt(receipt, step=True)
        return True

    def eligible(self, one_per_actor: bool = False) -> list[int]:
        """Clients not excluded and with nothing in flight (``one_per_actor``: on a worker with
        nothing in flight), in client order: a seeded choice must not depend on the layout."""
        busy = self.inflight.busy_clients()
        if one_per_actor:
            busy_actors = {self.actor_of[c] for c in busy}
            return [c for c in range(len(self.actor_of))
                    if c not in busy and c not in self.stats.excluded and self.actor_of[c] not in busy_actors]
        mask = np.ones(len(self.actor_of), dtype=bool)  # one pass in numpy: 10,000 clients at every dispatch
        mask[list(busy.union(self.stats.excluded))] = False
        return np.flatnonzero(mask).tolist()

    def training(self) -> int:
        return self.inflight.count(Kind.TRAIN)

    def account(self, client: int, meta: dict[str, Any]) -> None:
        """Count a finished local update (busy time, traffic, its training terms)."""
        self.stats.busy_s += meta["busy_s"]
        self.stats.bytes_up += meta["upload_bytes"]
        self.stats.bytes_down += meta["download_bytes"]
        self.stats.last_terms[client] = dict(meta["terms"])

    def lost_at_server(self, n: int) -> None:
        self.stats.updates_lost_server += n

    def dropped_offline(self, client: int, meta: dict[str, Any]) -> None:
        """A local update lost because its client went offline before it finished (virtual clock):
        never submitted. The client did train (busy time, download counted); its upload never
        completed (not counted), and the training is discarded (FedScale): its worker puts the
        client's state back to before the update (dispatched ``may_lose``), so evaluations, which
        never see an unhandled update, and its next update start from the same state."""
        a = self.actor_of[client]
        self.inflight.add(self.actors[a].discard.remote(client), Pending(self._on_discarded, Kind.DISCARD, client=client, actor=a))
        self.stats.updates_dropped_offline += 1
        self.stats.client_dropped_offline[client] = self.stats.client_dropped_offline.get(client, 0) + 1
        self.stats.busy_s += meta["busy_s"]
        self.stats.bytes_down += meta["download_bytes"]

    def dropped_by_round(self, client: int, meta: dict[str, Any], reason: str) -> None:
        """A sync round's update dropped by its deadline or because the first K of an over-selected
        round had finished (virtual clock): never submitted, so the server never sees it. The client
        did train (busy time, download counted; its upload never counted), and its model keeps the
        training, as after a refused update."""
        if reason == "deadline":
            self.stats.updates_dropped_deadline += 1
            per_client = self.stats.client_dropped_deadline
        elif reason == "over_selection":
            self.stats.updates_dropped_over_selection += 1
            per_client = self.stats.client_dropped_over_selection
        else:
            raise ValueError(f"reason must be deadline or over_selection, got {reason!r}")
        per_client[client] = per_client.get(client, 0) + 1
        self.stats.busy_s += meta["busy_s"]
        self.stats.bytes_down += meta["download_bytes"]

    # ---------------------------------------------------------------------------- the loop
    def run(self) -> int:
        """Run until ``rounds`` versions exist and their evaluation is logged; returns the version.
        Raises :class:`StopRequested` after a requested stop (checkpoint written when possible)."""
        if self.evals.evaluates_start(self.version, in_history=not self.limits.evaluate_start):
            self.evals.formed(self.version, self.global_ref, lambda: self._counters(self.version), force=True)
        try:
            self._loop()
        except NoClientOnline:
            self._wind_down()  # the versions formed so far are still evaluated: the failed run keeps them
            raise
        self._finish_in_flight()
        return self.version

    def _loop(self) -> None:
        while self._work_left():
            self.policy.fill()  # takes no new work while draining
            # after the dispatch: on each worker the evaluation queues behind the next updates and
            # overlaps the server's work; it still sees each client as of its version (evaluations.py)
            self.evals.start_ready(self._launch_eval)
            # every checkpoint (not only a stop's) waits for running evaluations, so every version up to
            # it is in the history it saves: a resume cannot evaluate an earlier version again
            if self.recovery.draining() and self._quiet() and not self.evals.busy():
                self.recovery.checkpoint()
                if self.recovery.stop_reason is not None:
                    raise StopRequested(self.recovery.stop_reason, self.version)
                continue
            self._ask_for_versions()
            # after the last version the server's wait_versions never returns: not waited on
            waiting = self.inflight.refs(set(Kind) if self.version < self.rounds else set(Kind) - {Kind.VERSIONS})
            if not waiting:
                if self.recovery.draining() or not self._work_left():
                    continue  # quiet now: checkpoint / stop at the top of the loop
                raise RuntimeError("scheduler stalled: nothing in flight before the last version")
            # a timeout, so that a stop requested by a signal handler is seen while waiting
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            self.recovery.check_drain_timeout()
            if self.recovery.draining() or self.version >= self.rounds:
                self.progress.pause()  # a checkpoint drain or the final evaluations: not a stall
            self.progress.check(self.version)
            if ready:
                p = self.inflight.pop(ready[0])
                p.handler(ready[0], p)

    def _wind_down(self, timeout_s: float = 120.0) -> None:
        """No client can ever be online again: let the evaluations of the versions already formed
        run and be logged (no new local update starts), so that the failed run's history holds them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.evals.start_ready(self._launch_eval)
            waiting = self.inflight.refs(SERVER_WORK | {Kind.EVAL})
            if not waiting:
                return
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            if ready:
                p = self.inflight.pop(ready[0])
                try:
                    p.handler(ready[0], p)
                except NoClientOnline:  # a handler that tried to dispatch again: nothing more will start
                    pass

    def _work_left(self) -> bool:
        # receipts too: one for an earlier version may still be due for evaluation after the last
        return (self.version < self.rounds or self.evals.busy()
                or self.inflight.any(SERVER_WORK | {Kind.EVAL}))

    def _ask_for_versions(self) -> None:
        """Async (real time): keep one ``wait_versions`` call outstanding at the server."""
        if (self.policy.waits_for_versions and self.version < self.rounds and not (self.recovery.stop_reason and self._quiet())
                and not self.inflight.count(Kind.VERSIONS)):
            self.inflight.add(self.server.wait_versions.remote(), Pending(self._on_versions, Kind.VERSIONS))

    def _finish_in_flight(self) -> None:
        """Let running local updates finish so actors are quiet before shutdown; they are withheld."""
        train = self.inflight.refs({Kind.TRAIN})
        if train:
            done, _ = ray.wait(train, num_returns=len(train), timeout=120)
            for ref in done:
                self._on_update(ref, self.inflight.pop(ref))
        self.stats.withheld += self.policy.held_back()

    # ---------------------------------------------------------------------------- handlers
    def _on_update(self, ref, p: Pending) -> None:
        try:
            meta = ray.get(ref)
        except RayActorError as err:
            self.recovery.client_actor_died(p.actor, p, err)
            return
        if self.recovery.orphaned(p.update_ref):  # trained against a server that has since died
            return
        if self.first_update_unix is None:
            self.first_update_unix = time.time()
        p.update_no = meta["update"]
        if self.version >= self.rounds:  # finished: late updates are not submitted
            self.account(p.client, meta)
            self.stats.withheld += not self.policy.on_late(p, meta)
            return
        self.policy.on_update(p, meta)

    def _on_discarded(self, ref, p: Pending) -> None:
        try:
            if not ray.get(ref):  # no state kept: a worker restored from a checkpoint since (docs/simulation.md)
                self.stats.dropped_kept += 1
        except RayActorError as err:
            self.recovery.client_actor_died(p.actor, None, err)

    def _on_receipt(self, ref, p: Pending) -> None:
        try:
            receipt = ray.get(ref)
        except RayActorError as err:
            self.recovery.server_died(err)
            self.evals.handed(p.client, p.update_no, self.version, p.ticket)
            return
        self.evals.handed(p.client, p.update_no, receipt.get("version", self.version), p.ticket)
        self._handle_receipt(receipt, step=p.kind is Kind.STEP)

    def _handle_receipt(self, receipt: dict[str, Any], step: bool) -> None:
        """A submission's receipt (which may carry a new version) or a sync round's step."""
        if not step:
            self.progress.on_receipt(receipt, self.version)
            self.policy.on_receipt(receipt)
        if receipt.get("new_version") is not None:
            if step and receipt.get("aggregated") == 0:
                self.stats.versions_empty += 1
            self.progress.on_version(receipt["new_version"], receipt.get("aggregated") if step else None)
            self._on_new_version(receipt["new_version"], receipt["state_ref"])

    def _on_versions(self, ref, p: Pending) -> None:
        """Async: the server's training thread produced these versions since the last wait."""
        try:
            reply = ray.get(ref)
        except RayActorError as err:
            self.recovery.server_died(err)
            return
        self.policy.on_server_report(reply["backlog"], reply["version"])
        for version, state_ref in sorted(reply["versions"], key=lambda vs: vs[0]):
            self.progress.on_version(version)
            self._on_new_version(version, state_ref)

    def _on_new_version(self, new_version: int, state_ref) -> None:
        self.policy.on_new_version(new_version)
        self.evals.formed(new_version, state_ref, lambda: self._counters(new_version))
        if new_version > self.version:
            self.version, self.global_ref = new_version, state_ref
            if self.hooks.on_version:
                self.hooks.on_version(self.version)
            self.recovery.on_version(self.version)

    def _counters(self, version: int) -> tuple:
        """The run's counters when ``version`` is formed: its evaluation reports them, however
        much later it ends. With a virtual clock the server's are read at once (reproducible)."""
        server_stats = self.policy.server_counters(self.server.stats.remote(version), ray.get)
        stats = dataclasses.replace(self.stats, last_terms=dict(self.stats.last_terms),
                                    client_updates=dict(self.stats.client_updates),
                                    client_dropped_offline=dict(self.stats.client_dropped_offline),
                                    client_dropped_deadline=dict(self.stats.client_dropped_deadline),
                                    client_dropped_over_selection=dict(self.stats.client_dropped_over_selection))
        return stats, self.wall(), self.policy.sim_now(), server_stats

    def _launch_eval(self, version: int, state_ref, as_of: dict[int, int]) -> int:
        """One evaluation call per worker hosting a client of ``as_of`` (every client, or the sample)."""
        parts = 0
        for a, clients in enumerate(self.actor_clients):
            if mine := [c for c in clients if c in as_of]:
                ref = self.actors[a].evaluate.remote(mine, state_ref, {c: as_of[c] for c in mine})
                self.inflight.add(ref, Pending(self._on_eval_result, Kind.EVAL, version=version, actor=a))
                parts += 1
        return parts

    def _on_eval_result(self, ref, p: Pending) -> None:
        try:
            results = ray.get(ref)
        except RayActorError as err:
            self.recovery.client_actor_died(p.actor, None, err)
            self.evals.part_lost(p.version)
            return
        self.evals.result(p.version, results)

    # ---------------------------------------------------------------------------- state
    def wall(self) -> float:
        return time.perf_counter() - self.started

    def _quiet(self) -> bool:
        """No update in flight or unsubmitted, no aggregation requested: a consistent cut."""
        return not self.inflight.any(SERVER_WORK | {Kind.TRAIN}) and self.policy.quiet()

    def state_dict(self) -> dict[str, Any]:
        """Sampling stream, counters, wall clock and the policy's state (the virtual clock and the
        updates waiting in simulated time); in-flight real work is not state: checkpoints are
        taken when there is none."""
        return {"version": self.version, "rng": self.policy.rng.bit_generator.state,
                "stats": dataclasses.asdict(self.stats), "wall_s": self.wall(), "failures": dict(self.recovery.failures),
                "policy": self.policy.state_dict(ray.get), "evaluations": self.evals.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.rng.bit_generator.state = state["rng"]
        self.stats = SchedulerStats(**state["stats"])
        self.stats.last_terms = {int(c): t for c, t in self.stats.last_terms.items()}
        for key in ("client_dropped_offline", "client_dropped_deadline", "client_dropped_over_selection"):
            # per-client drop counts with int keys; absent from older checkpoints: empty (the dataclass default)
            setattr(self.stats, key, {int(c): n for c, n in getattr(self.stats, key).items()})
        self.evals.stats = self.recovery.stats = self.stats
        self.started = time.perf_counter() - float(state["wall_s"])
        self.recovery.failures = {int(c): n for c, n in state["failures"].items()}
        self.policy.load_state_dict(state.get("policy", {}), ray.put)
        if "evaluations" in state:  # checkpoints from before the evaluation invariant: the clients' states now
            self.evals.load_state_dict(state["evaluations"])

    # ---------------------------------------------------------------------------- stops and checkpoints (the driver, signals)
    def request_stop(self, reason: str) -> None:
        """Drain, checkpoint and end the run with :class:`StopRequested` (safe from a signal handler)."""
        self.recovery.request_stop(reason)

    def stop_requested(self) -> bool:
        return self.recovery.stop_reason is not None

    def checkpoint(self) -> None:
        """Checkpoint now (the run's end: at a quiet point, so that it can be continued)."""
        self.recovery.checkpoint()

    # ---------------------------------------------------------------------------- the recovery port (recovery.RecoveryPort)
    # with ``version`` above: all that Recovery may do here beyond the table and the counters it is given
    def exclude(self, client: int) -> bool:
        """Take ``client`` out of sampling for good (listed in ``stats.excluded``); False: it already was."""
        if client in self.stats.excluded:
            return False
        self.stats.excluded.append(client)
        self.policy.exclude(client)
        return True

    def restart_client_actor(self, actor: int) -> bool:
        """Recreate ``actor`` in place (``fleet.handles`` shares the list); its clients' states are
        those it restored. False: no restart is configured."""
        if self.hooks.restart_client_actor is None:
            return False
        self.actors[actor] = self.hooks.restart_client_actor(actor)
        self.evals.actor_restarted(ray.get(self.actors[actor].update_counts.remote()))
        self.progress.pause()  # the restart's time is not a stall
        return True

    def update_lost(self, p: Pending) -> None:
        self.stats.updates_lost_client += 1
        self.policy.on_lost(p)

    def eval_part_lost(self, version: int) -> None:
        self.evals.part_lost(version)

    def updates_at_server(self) -> int:
        return self.policy.at_server()

    def restart_server(self) -> Optional[int]:
        """Recreate the server (from the last checkpoint, or from scratch); the version it restored.
        None: no restart is configured."""
        if self.hooks.restart_server is None:
            return None
        self.server, restored = self.hooks.restart_server()
        self.progress.pause()
        return restored

    def rewind_to(self, restored: int) -> None:
        """The server went back to ``restored``: the versions after it are redone (counted); the dead
        server's receipts and waits, and evaluations of versions that no longer exist, are dropped."""
        self.stats.versions_redone += max(0, self.version - restored)
        self.version, self.global_ref = restored, self.server.global_state.remote()
        for ref, p in self.inflight.items():
            if p.kind in SERVER_WORK or p.kind is Kind.VERSIONS or (p.kind is Kind.EVAL and p.version > restored):
                self.inflight.pop(ref)
                self.evals.handed(p.client, p.update_no, restored, p.ticket)  # the client's state moved on
        self.policy.server_restarted(restored)
        self.evals.server_restarted(restored)

    def snapshot_server(self) -> Any:
        return ray.get(self.server.snapshot.remote())

    def snapshot_client_actor(self, actor: int) -> tuple:
        """(worker ``actor``'s client states, fetched in chunks as the checkpoint writes them, its RNG)."""
        keep_from = {c: self.evals.keep_from(c) for c in self.actor_clients[actor]}  # kept states none can ask for: dropped
        clients, rng = ray.get(self.actors[actor].snapshot.remote(keep_from))
        return RemoteStates(self.actors[actor], clients, actor), rng

    def write_checkpoint(self, server_snap: Any, actor_snaps: list) -> bool:
        return self.hooks.on_checkpoint(self.version, server_snap, actor_snaps)
