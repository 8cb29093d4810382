"""The driver-side loop: keep ``concurrency`` clients busy, hand updates to the server as they land.

One loop serves both modes (sync is async with buffer = the round's sampled clients and no
overlap between rounds):

* a *slot* is a client update in flight; free slots are filled with sampled clients whose
  actor is idle (seeded sampling: uniform over idle clients in async mode, a fresh sample of
  ceil(rho N) clients per round in sync mode);
* ``ray.wait`` returns whatever finishes first: a client's metadata (its upload's ObjectRef goes
  straight to ``server.submit``, never through the driver), new versions (async: the server's
  training thread aggregates whenever its buffer is full and ``wait_versions`` hands over each
  version's state ObjectRef, put once by the server; sync: the receipt of the round's ``step``),
  or an evaluation result; every later client and the version's evaluation receive that ref;
* every ``eval_every`` versions all clients are evaluated against that version's state; the
  metrics are assembled once all results for that version are in.

The scheduler never inspects a payload and never names an algorithm.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

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
    excluded: list[int] = field(default_factory=list)  # clients dropped from sampling after repeated failures


class StopRequested(Exception):
    """The run was stopped (signal or fault injection) after a clean drain and checkpoint."""

    def __init__(self, reason: str, version: int):
        super().__init__(f"{reason} at version {version}")
        self.reason, self.version = reason, version


class Scheduler:
    def __init__(
        self,
        *,
        mode: str,
        buffer_size: int,
        num_clients: int,
        rounds: int,
        concurrency: int,
        clients_per_round: int,
        eval_every: int,
        seed: int,
        server,
        actors: list,
        actor_clients: list[list[int]],
        on_eval: Callable[[int, dict[str, Any]], None],
        on_version: Optional[Callable[[int], None]] = None,
        checkpoint_every: int = 0,
        on_checkpoint: Optional[Callable[[int, dict[str, Any], list[tuple[dict, Any]]], None]] = None,
        restart_client_actor: Optional[Callable[[int], Any]] = None,
        restart_server: Optional[Callable[[], tuple[Any, int]]] = None,
        max_client_failures: int = 3,
        max_server_failures: int = 3,
        drain_timeout_s: float = 300.0,
        stop_at_version: Optional[int] = None,
        start_version: int = 0,
        evaluate_start: bool = True,
        progress=None,
    ):
        self.mode, self.buffer_size, self.num_clients, self.rounds = mode, buffer_size, num_clients, rounds
        self.concurrency, self.clients_per_round, self.eval_every = concurrency, clients_per_round, eval_every
        self.rng = np.random.default_rng([seed, 0x5C4ED])  # client sampling stream
        self.server, self.actors, self.actor_clients = server, actors, actor_clients
        self.actor_of = {c: a for a, cs in enumerate(actor_clients) for c in cs}
        self.on_eval, self.on_version = on_eval, on_version
        self.stats = SchedulerStats()
        self.checkpoint_every, self.on_checkpoint = checkpoint_every, on_checkpoint
        self.restart_client_actor, self.restart_server = restart_client_actor, restart_server
        self.max_client_failures, self.max_server_failures = max_client_failures, max_server_failures
        self.drain_timeout_s, self.stop_at_version = drain_timeout_s, stop_at_version
        self.evaluate_start = evaluate_start
        if progress is None:
            from rayfed_proto.runtime.progress import ProgressWatch

            progress = ProgressWatch()  # no limits
        self.progress = progress  # stops a run that makes no progress (NoProgressError)
        self.failures: dict[int, int] = {}  # client -> actor deaths while it had work in flight
        self.checkpoint_due = False  # drain, then checkpoint (async); sync checkpoints at round ends
        self.stop_reason: Optional[str] = None
        self.drain_started: Optional[float] = None
        self.last_checkpoint_version = start_version if start_version > 0 else -1  # a resume starts at a checkpoint
        self.wall_offset = 0.0  # wall time of the run before a resume

        self.version = start_version
        self.global_ref = server.global_state.remote()
        self.train_refs: dict[Any, tuple[int, Any]] = {}  # meta ref -> (client, update ref)
        self.receipt_refs: set = set()
        self.eval_refs: dict[Any, int] = {}  # ref -> version
        self.eval_results: dict[int, list] = {}
        self.eval_pending: dict[int, int] = {}
        self.eval_snapshot: dict[int, tuple] = {}  # version -> (scheduler stats, wall, server stats ref)
        self.evals_due: list[tuple[int, Any]] = []  # (version, state ref): evaluated once the next work is dispatched
        self.busy_actors: set[int] = set()
        self.round_queue: list[int] = []
        self.round_outstanding = 0
        self.step_ref = None
        self.versions_ref = None  # async: the outstanding server.wait_versions call
        self.backlog = 0  # accepted updates waiting at the server (latest report) ...
        self.backlog_version = 0  # ... and the server version it was read at
        self.unreported_submits = 0  # submitted, receipt not back yet
        self.submits_since_version = 0  # sync: submitted in the running round
        self.eval_actor: dict[Any, int] = {}  # eval ref -> actor index
        self.eval_incomplete: set[int] = set()
        self.orphans: set = set()  # update refs trained against a server that died
        self.round_was_started = False
        self.first_update_unix: Optional[float] = None  # when the first local update came back (startup cost)
        self.t0 = time.perf_counter()

    # ---------------------------------------------------------------------------- helpers
    def wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.t0

    def _idle_clients(self) -> list[int]:
        busy = {c for c, _ in self.train_refs.values()}
        return [c for c in range(self.num_clients)
                if c not in busy and self.actor_of[c] not in self.busy_actors and c not in self.stats.excluded]

    # ---------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Sampling stream, counters and wall clock (checkpoints); in-flight work is not state:
        checkpoints are taken when there is none."""
        return {"version": self.version, "rng": self.rng.bit_generator.state,
                "stats": dataclasses.asdict(self.stats), "wall_s": self.wall(), "failures": dict(self.failures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.stats = SchedulerStats(**state["stats"])
        self.stats.last_terms = {int(c): t for c, t in self.stats.last_terms.items()}
        self.wall_offset = float(state["wall_s"])
        self.t0 = time.perf_counter()
        self.failures = {int(c): n for c, n in state["failures"].items()}

    def request_stop(self, reason: str) -> None:
        """Stop taking new work, let running updates finish (sync: the running round), checkpoint,
        and end the run with :class:`StopRequested`. Safe to call from a signal handler."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("%s: finishing the running updates, then checkpointing (up to %.0f s)", reason, self.drain_timeout_s)

    def _dispatch(self, client: int) -> None:
        a = self.actor_of[client]
        meta_ref, update_ref = self.actors[a].train.options(num_returns=2).remote(client, self.global_ref)
        self.train_refs[meta_ref] = (client, update_ref)
        self.busy_actors.add(a)
        self.stats.dispatched += 1

    def _start_round(self) -> None:
        if self.stats.excluded:
            pool = np.array([c for c in range(self.num_clients) if c not in self.stats.excluded])
            chosen = self.rng.choice(pool, size=min(self.clients_per_round, len(pool)), replace=False)
        else:  # the unchanged draw when nobody is excluded: resumed and uninterrupted runs sample alike
            chosen = self.rng.choice(self.num_clients, size=self.clients_per_round, replace=False)
        self.round_queue = sorted(int(c) for c in chosen)
        self.round_outstanding = len(self.round_queue)
        self.round_was_started = True

    def _draining(self) -> bool:
        return self.stop_reason is not None or self.checkpoint_due

    def _fill_slots(self) -> None:
        if self.version >= self.rounds:
            return
        if self.mode == "sync":
            round_idle = not self.round_queue and self.round_outstanding == 0 and self.step_ref is None
            if round_idle and not self._draining():
                self._start_round()
            # Every client of the round is dispatched at once: each queues on its host actor, so
            # a worker goes from one client to the next without waiting for the driver, and
            # the round's evaluation (queued after) fills the time its stragglers leave idle.
            while self.round_queue:
                self._dispatch(self.round_queue.pop(0))
        else:
            # Backpressure: while a full next version already waits at the server, a new update
            # would only wait there too and grow stale; let the server catch up first.
            while (not self._draining() and len(self.train_refs) < self.concurrency
                   and self.backlog + self.unreported_submits < self.buffer_size):
                idle = self._idle_clients()
                if not idle:
                    break
                self._dispatch(int(self.rng.choice(idle)))

    def _note_backlog(self, backlog: int, at_version: int) -> None:
        # readings can arrive out of order: a receipt taken before the server's last step must
        # not overwrite a later reading (it would stall dispatch until the next one)
        if at_version >= self.backlog_version:
            self.backlog, self.backlog_version = backlog, at_version

    def _start_eval(self, version: int, state_ref) -> None:
        # Counters are read now, when the version exists: evaluation results arrive later (they
        # queue behind local updates on the actors) and must not be credited with later work.
        self.eval_snapshot[version] = (dataclasses.replace(self.stats, last_terms=dict(self.stats.last_terms)),
                                       self.wall(), self.server.stats.remote(version))
        self.eval_pending[version] = len(self.actors)
        self.eval_results[version] = []
        for a, clients in enumerate(self.actor_clients):
            ref = self.actors[a].evaluate.remote(clients, state_ref)
            self.eval_refs[ref] = version
            self.eval_actor[ref] = a

    def _start_due_evals(self) -> None:
        due, self.evals_due = self.evals_due, []
        for version, state_ref in due:
            self._start_eval(version, state_ref)

    def _eval_due(self, version: int) -> bool:
        return version % self.eval_every == 0 or version == self.rounds

    # ---------------------------------------------------------------------------- handlers
    def _on_meta(self, ref) -> None:
        client, update_ref = self.train_refs.pop(ref)
        self.busy_actors.discard(self.actor_of[client])
        try:
            meta = ray.get(ref)
        except RayActorError as err:
            self._client_actor_died(self.actor_of[client], (client, update_ref), err)
            return
        if update_ref in self.orphans:  # trained against a server that has since died
            self.orphans.discard(update_ref)
            self.stats.updates_lost_server += 1
            return
        if self.first_update_unix is None:
            self.first_update_unix = time.time()
        self.stats.busy_s += meta["busy_s"]
        self.stats.bytes_up += meta["upload_bytes"]
        self.stats.bytes_down += meta["download_bytes"]
        self.stats.last_terms[client] = dict(meta["terms"])
        if self.version >= self.rounds:
            self.stats.withheld += 1  # finished: late updates are not submitted
            return
        self.receipt_refs.add(self.server.submit.remote(update_ref))
        self.unreported_submits += 1
        self.submits_since_version += 1

    def _client_actor_died(self, a: int, lost: Optional[tuple[int, Any]], err: BaseException) -> None:
        """A client actor died (noticed through ``lost`` = (client, update ref), or an evaluation
        when None):
        the updates in flight on it are lost, it is recreated (from the last checkpoint of its
        clients, or re-initialised), and each client it hosts has one more failure; a client over
        ``max_client_failures`` is excluded from sampling instead of failing the run."""
        if lost is not None:
            self._lose_update(*lost)
        self.stats.client_failures += 1
        log.warning("client actor %d (clients %s) died: %s", a, self.actor_clients[a], type(err).__name__)
        for c in self.actor_clients[a]:
            self.failures[c] = self.failures.get(c, 0) + 1
            if self.failures[c] > self.max_client_failures and c not in self.stats.excluded:
                self.stats.excluded.append(c)
                log.warning("client %d failed %d times (limit reliability.max_client_failures=%d): excluded from sampling",
                            c, self.failures[c], self.max_client_failures)
                if self.mode == "sync" and c in self.round_queue:
                    self.round_queue.remove(c)
                    self.round_outstanding -= 1
        # every other call queued on the dead actor fails too: drop them here, once per death
        for ref, (c, update_ref) in list(self.train_refs.items()):
            if self.actor_of[c] == a:
                del self.train_refs[ref]
                self._lose_update(c, update_ref)
        lost_evals = [(ref, v) for ref, v in self.eval_refs.items() if self.eval_actor.get(ref) == a]
        for ref, _ in lost_evals:
            del self.eval_refs[ref]
            self.eval_actor.pop(ref, None)
        self.busy_actors.discard(a)
        if self.restart_client_actor is None:
            raise RuntimeError(f"client actor {a} died and no restart is configured") from err
        self.actors[a] = self.restart_client_actor(a)
        self.progress.pause()  # the restart's time is not a stall
        for _, version in lost_evals:
            self._eval_part_lost(version)
        self._maybe_step()

    def _lose_update(self, client: int, update_ref) -> None:
        if update_ref in self.orphans:  # already lost with a dead server; its round was abandoned
            self.orphans.discard(update_ref)
            self.stats.updates_lost_server += 1
            return
        self.stats.updates_lost_client += 1
        if self.mode == "sync":
            self.round_outstanding -= 1  # the round goes on without this update

    def _maybe_step(self) -> None:
        if (self.mode == "sync" and self.round_outstanding == 0 and not self.round_queue and self.step_ref is None
                and self.round_was_started):
            self.round_was_started = False
            self.step_ref = self.server.step.remote()
            self.receipt_refs.add(self.step_ref)

    def _server_died(self, err: BaseException) -> None:
        """The server actor died: recreate it from the last checkpoint (or from scratch) and carry
        on from its version. Updates in flight or buffered are counted as lost, not re-requested:
        the versions after the checkpoint are recomputed from fresh client work."""
        self.stats.server_restarts += 1
        if self.stats.server_restarts > self.max_server_failures or self.restart_server is None:
            raise RuntimeError(f"server actor died ({self.stats.server_restarts} times; limit "
                               f"reliability.max_server_failures={self.max_server_failures})") from err
        # submitted but not yet in a version: sync, this round's submissions (the buffer empties at
        # each step); async, the latest backlog reading plus submissions not yet acknowledged
        at_server = self.submits_since_version if self.mode == "sync" else self.backlog + self.unreported_submits
        self.server, restored = self.restart_server()
        self.progress.pause()
        log.warning("server actor died (%s); recreated at version %d (was %d); %d updates lost at the server, "
                    "%d in flight", type(err).__name__, restored, self.version, at_server, len(self.train_refs))
        self.stats.updates_lost_server += at_server
        self.submits_since_version = 0
        self.stats.versions_redone += max(0, self.version - restored)
        self.orphans.update(update_ref for _, update_ref in self.train_refs.values())
        self.version = restored
        self.global_ref = self.server.global_state.remote()
        self.receipt_refs.clear()
        self.step_ref = self.versions_ref = None
        self.backlog = self.unreported_submits = 0
        self.backlog_version = restored
        self.round_queue, self.round_outstanding, self.round_was_started = [], 0, False  # sync: the round is abandoned
        for ref, version in list(self.eval_refs.items()):  # evaluations of versions that no longer exist
            if version > restored:
                del self.eval_refs[ref]
        for version in [v for v in self.eval_pending if v > restored]:
            del self.eval_pending[version], self.eval_results[version], self.eval_snapshot[version]
        self.evals_due = [(v, ref) for v, ref in self.evals_due if v <= restored]

    def _on_receipt(self, ref) -> None:
        self.receipt_refs.discard(ref)
        try:
            receipt = ray.get(ref)
        except RayActorError as err:
            self._server_died(err)
            return
        if ref is not self.step_ref:
            self.progress.on_receipt(receipt, self.version)
            self.unreported_submits -= 1
            if "backlog" in receipt:
                self._note_backlog(receipt["backlog"], receipt["version"])
        if ref is self.step_ref:
            self.step_ref = None
        elif self.mode == "sync":
            self.round_outstanding -= 1
            self._maybe_step()
        if receipt.get("new_version") is not None:  # sync: the round's step
            if receipt.get("aggregated") == 0:
                self.stats.versions_empty += 1
            self.progress.on_version(receipt["new_version"], receipt.get("aggregated"))
            self._on_new_version(receipt["new_version"], receipt["state_ref"])

    def _on_versions(self, ref) -> None:
        """Async: the server's training thread produced these versions since the last wait."""
        self.versions_ref = None
        try:
            reply = ray.get(ref)
        except RayActorError as err:
            self._server_died(err)
            return
        self._note_backlog(reply["backlog"], reply["version"])
        for version, state_ref in sorted(reply["versions"], key=lambda vs: vs[0]):
            self.progress.on_version(version)
            self._on_new_version(version, state_ref)

    def _on_new_version(self, new_version: int, state_ref) -> None:
        if self.mode == "sync":
            self.submits_since_version = 0  # the round's step consumed them
        # each version is evaluated against its own state, whatever order versions are seen in;
        # started after the next updates are dispatched, so the evaluation queues behind them on
        # each worker and overlaps the server's aggregation instead of delaying the next round
        if self._eval_due(new_version):
            self.evals_due.append((new_version, state_ref))
        if new_version > self.version:
            self.version = new_version
            self.global_ref = state_ref
            if self.on_version:
                self.on_version(self.version)
            if self.checkpoint_every and self.version % self.checkpoint_every == 0 and self.version < self.rounds:
                self.checkpoint_due = True
            if self.stop_at_version is not None and self.version >= self.stop_at_version:
                self.request_stop(f"faults.stop_at_version={self.stop_at_version}")

    def _eval_part_lost(self, version: int) -> None:
        if version in self.eval_pending:
            self.eval_incomplete.add(version)
            self._eval_part_done(version)

    def _on_eval_result(self, ref) -> None:
        version = self.eval_refs.pop(ref)
        a = self.eval_actor.pop(ref, None)
        try:
            results = ray.get(ref)
        except RayActorError as err:
            if a is not None:
                self._client_actor_died(a, None, err)
            self._eval_part_lost(version)
            return
        wrong = {r["state_version"] for r in results} - {version}
        if wrong:  # an invariant, not an input error: evaluation must see exactly its version's state
            raise RuntimeError(f"evaluation of version {version} received the state of version(s) {sorted(wrong)}")
        self.eval_results[version].extend(results)
        self._eval_part_done(version)

    def _eval_part_done(self, version: int) -> None:
        self.eval_pending[version] -= 1
        if self.eval_pending[version] == 0:
            del self.eval_pending[version]
            results = self.eval_results.pop(version)
            stats, wall, server_ref = self.eval_snapshot.pop(version)
            try:
                server_stats = ray.get(server_ref)
            except RayActorError:  # the server died after producing it: the version is redone
                return
            if version in self.eval_incomplete:
                self.eval_incomplete.discard(version)
                self.stats.evals_incomplete += 1
            if results:
                self.on_eval(version, self._metrics(version, results, server_stats, stats, wall))

    # ---------------------------------------------------------------------------- metrics
    def _metrics(self, version: int, results: list[dict], server: dict, stats: SchedulerStats, wall: float) -> dict[str, Any]:
        # client order, not arrival order: float means must not depend on which actor answered first
        results = sorted((r for r in results if r["n"] > 0), key=lambda r: r["client_id"])  # no test samples: no accuracy
        n = np.array([r["n"] for r in results], float)
        head = np.array([r["head_correct"] for r in results], float)
        m: dict[str, Any] = {
            "head_acc": float(head.sum() / n.sum()),
            "head_acc_mean": float(np.mean(head / n)),
            "head_acc_std": float(np.std(head / n)),
        }
        if all(r["proto_correct"] is not None for r in results):
            proto = np.array([r["proto_correct"] for r in results], float)
            m.update(proto_acc=float(proto.sum() / n.sum()), proto_acc_mean=float(np.mean(proto / n)),
                     proto_acc_std=float(np.std(proto / n)))
        # every term a method reports from local training (loss, its parts, pseudo-label counts ...):
        # the mean over clients of each one's latest update, as train_<term>
        for key in sorted({k for terms in stats.last_terms.values() for k in terms}):
            values = [t[key] for _, t in sorted(stats.last_terms.items()) if key in t and math.isfinite(t[key])]
            m[f"train_{key}"] = float(np.mean(values)) if values else float("nan")
        m["clients_nonfinite"] = sum(1 for r in results if r.get("nonfinite"))  # models that produce NaN/inf features
        silhouettes = [r["silhouette"] for r in results if r.get("silhouette") is not None]
        if silhouettes:
            m["silhouette_mean"] = float(np.mean(silhouettes))
        margin_min, margin_mean = server["margin"]
        m.update(
            proto_margin_min=margin_min, proto_margin_mean=margin_mean,
            bytes_up=stats.bytes_up, bytes_down=stats.bytes_down,
            staleness_mean=server["staleness_mean"], staleness_max=server["staleness_max"],
            updates_accepted=server["accepted"], updates_dropped=server["dropped_stale"], updates_late=server["late"],
            versions_rolled_back=server["rolled_back"],
            updates_refused=server["refused"], updates_dispatched=stats.dispatched,
            client_busy_s=stats.busy_s, server_train_s=server["server_train_s"], wall_s=wall,
            slot_utilisation=stats.busy_s / (self.concurrency * wall) if wall > 0 else float("nan"),
        )
        for k, v in server.get("server_metrics", {}).items():
            m[k] = v
        m["per_client"] = results  # taken out by the driver (tracking.clients: client/<id>/... series)
        return m

    # ---------------------------------------------------------------------------- main loop
    def _quiet(self) -> bool:
        """No update in flight or unsubmitted, no aggregation requested: a consistent cut."""
        return (not self.train_refs and not self.receipt_refs and self.step_ref is None
                and not (self.mode == "sync" and (self.round_queue or self.round_outstanding)))

    def _checkpoint(self) -> None:
        """Snapshot the server and every client actor (at a quiet point) and hand them to
        ``on_checkpoint``. An actor found dead here is handled like any other death first."""
        self.checkpoint_due = False
        self.drain_started = None
        if self.on_checkpoint is None or self.last_checkpoint_version == self.version:
            return
        try:
            server_snap = ray.get(self.server.snapshot.remote())
        except RayActorError as err:  # restored from the previous checkpoint: nothing new to save
            self._server_died(err)
            return
        actor_snaps = []
        for a in range(len(self.actors)):
            try:
                actor_snaps.append(ray.get(self.actors[a].snapshot.remote()))
            except RayActorError as err:  # recreated from the previous checkpoint: that is its state now
                self._client_actor_died(a, None, err)
                actor_snaps.append(ray.get(self.actors[a].snapshot.remote()))
        self.on_checkpoint(self.version, server_snap, actor_snaps)
        self.last_checkpoint_version = self.version
        self.stats.checkpoints += 1

    def _check_drain_timeout(self) -> None:
        if not self._draining():
            return
        if self.drain_started is None:
            self.drain_started = time.perf_counter()
        elif time.perf_counter() - self.drain_started > self.drain_timeout_s:
            in_flight = len(self.train_refs)
            self.drain_started = None
            if self.stop_reason is not None:
                log.warning("%d updates still running after reliability.drain_timeout_s=%.0f s: abandoned; the last "
                            "periodic checkpoint is the resume point", in_flight, self.drain_timeout_s)
                raise StopRequested(self.stop_reason + " (drain timed out)", self.last_checkpoint_version)
            log.warning("checkpoint at version %d skipped: %d updates still running after %.0f s",
                        self.version, in_flight, self.drain_timeout_s)
            self.checkpoint_due = False

    def run(self) -> int:
        """Run until ``rounds`` versions exist and their evaluation is logged; returns the version.
        Raises :class:`StopRequested` after a requested stop (checkpoint written when possible)."""
        if self.evaluate_start:
            self.evals_due.append((self.version, self.global_ref))
        # receipts too: one for an earlier version may still be due for evaluation after the last
        while self.version < self.rounds or self.eval_refs or self.receipt_refs or self.evals_due:
            self._fill_slots()  # takes no new work while draining
            self._start_due_evals()
            # every checkpoint (not only a stop's) waits for running evaluations, so every version up to
            # it is in the history it saves: a resume cannot evaluate an earlier version again
            if self._draining() and self._quiet() and not self.eval_refs and not self.evals_due:
                self._checkpoint()
                if self.stop_reason is not None:
                    raise StopRequested(self.stop_reason, self.version)
                continue
            if (self.mode == "async" and self.versions_ref is None and self.version < self.rounds
                    and not (self.stop_reason and self._quiet())):
                self.versions_ref = self.server.wait_versions.remote()
            pending = list(self.train_refs) + list(self.receipt_refs) + list(self.eval_refs)
            if self.versions_ref is not None and self.version < self.rounds:
                pending.append(self.versions_ref)
            if not pending:
                if self._draining():
                    continue  # quiet now: checkpoint / stop at the top of the loop
                raise RuntimeError("scheduler stalled: nothing in flight before the last version")
            # a timeout, so that a stop requested by a signal handler is seen while waiting
            ready, _ = ray.wait(pending, num_returns=1, timeout=1.0)
            self._check_drain_timeout()
            if self._draining() or self.version >= self.rounds:
                self.progress.pause()  # a checkpoint drain or the final evaluations: not a stall
            self.progress.check(self.version)
            if not ready:
                continue
            ref = ready[0]
            if ref in self.train_refs:
                self._on_meta(ref)
            elif ref in self.receipt_refs:
                self._on_receipt(ref)
            elif ref in self.eval_refs:
                self._on_eval_result(ref)
            else:
                self._on_versions(ref)
        # let in-flight local updates finish so actors are quiet before shutdown; they count as withheld
        if self.train_refs:
            done, _ = ray.wait(list(self.train_refs), num_returns=len(self.train_refs), timeout=120)
            for ref in done:
                self._on_meta(ref)
        return self.version
