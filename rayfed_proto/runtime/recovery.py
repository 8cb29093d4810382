"""The scheduler's other half: actor deaths, drains, checkpoints and stops.

:class:`~rayfed_proto.runtime.scheduler.Scheduler` runs the happy path (dispatch, submit, step,
evaluate); whatever interrupts it is here, so that the loop reads alone. :class:`Recovery` works
on the scheduler's in-flight table and actor handles (it is part of the scheduler, not a client
of it): a dead client actor is recreated from the last checkpoint of its clients, a dead server
from the last checkpoint, and the work lost with them is counted, never silently redone. A drain
(a checkpoint due, or a stop requested by a signal or ``faults.stop_at_version``) takes no new
work, lets the running work finish, and checkpoints at the quiet point.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import ray
from ray.exceptions import RayActorError

from rayfed_proto.runtime.actors import RemoteStates
from rayfed_proto.runtime.policies import Pending

log = logging.getLogger("rayfed_proto")


class StopRequested(Exception):
    """The run was stopped (signal or fault injection) after a clean drain and checkpoint."""

    def __init__(self, reason: str, version: int):
        super().__init__(f"{reason} at version {version}")
        self.reason, self.version = reason, version


class Recovery:
    def __init__(self, scheduler, last_checkpoint: int):
        self.s = scheduler
        self.failures: dict[int, int] = {}  # client -> actor deaths while it had work in flight
        self.orphans: set = set()  # update refs trained against a server that died
        self.checkpoint_due = False  # drain, then checkpoint; sync checkpoints at round ends
        self.stop_reason: Optional[str] = None
        self.drain_since: Optional[float] = None
        self.last_checkpoint = last_checkpoint

    # ---------------------------------------------------------------------------- deaths
    def client_actor_died(self, a: int, lost: Optional[Pending], err: BaseException) -> None:
        """A client actor died (noticed through a lost update, or an evaluation when ``lost`` is
        None): the work in flight on it is lost, it is recreated (from the last checkpoint of its
        clients, or re-initialised), and each client it hosts has one more failure; a client over
        ``max_client_failures`` is excluded from sampling instead of failing the run."""
        s, limit = self.s, self.s.limits.max_client_failures
        s.stats.client_failures += 1
        log.warning("client actor %d (clients %s) died: %s", a, s.actor_clients[a], type(err).__name__)
        for c in s.actor_clients[a]:
            self.failures[c] = self.failures.get(c, 0) + 1
            if self.failures[c] > limit and c not in s.stats.excluded:
                s.stats.excluded.append(c)
                log.warning("client %d failed %d times (limit reliability.max_client_failures=%d): excluded from "
                            "sampling", c, self.failures[c], limit)
                s.policy.exclude(c)
        # every other call queued on the dead actor fails too: drop them here, once per death
        queued = [s.inflight.pop(r) for r, q in list(s.inflight.items()) if q.actor == a and q.kind in ("train", "eval")]
        if s.hooks.restart_client_actor is None:
            raise RuntimeError(f"client actor {a} died and no restart is configured") from err
        s.actors[a] = s.hooks.restart_client_actor(a)
        s.evals.actor_restarted(ray.get(s.actors[a].update_counts.remote()))
        s.progress.pause()  # the restart's time is not a stall
        for q in ([lost] if lost is not None else []) + queued:
            if q.kind == "train":
                self.lose_update(q)
            else:
                s.evals.part_lost(q.version)

    def orphaned(self, update_ref) -> bool:
        """An update trained against a server that has since died: counted lost (once)."""
        if update_ref not in self.orphans:
            return False
        self.orphans.discard(update_ref)
        self.s.stats.updates_lost_server += 1
        return True

    def lose_update(self, p: Pending) -> None:
        if not self.orphaned(p.update_ref):  # an orphan's round was abandoned with its server
            self.s.stats.updates_lost_client += 1
            self.s.policy.on_lost(p)

    def server_died(self, err: BaseException) -> None:
        """The server actor died: recreate it from the last checkpoint (or from scratch) and carry
        on from its version. Updates in flight or buffered are counted as lost, not re-requested:
        the versions after the checkpoint are recomputed from fresh client work."""
        s, limit = self.s, self.s.limits.max_server_failures
        s.stats.server_restarts += 1
        if s.stats.server_restarts > limit or s.hooks.restart_server is None:
            raise RuntimeError(f"server actor died ({s.stats.server_restarts} times; limit "
                               f"reliability.max_server_failures={limit})") from err
        at_server, in_flight = s.policy.at_server(), [p for p in s.inflight.values() if p.kind == "train"]
        s.server, restored = s.hooks.restart_server()
        s.progress.pause()
        log.warning("server actor died (%s); recreated at version %d (was %d); %d updates lost at the server, "
                    "%d in flight", type(err).__name__, restored, s.version, at_server, len(in_flight))
        s.stats.updates_lost_server += at_server
        s.stats.versions_redone += max(0, s.version - restored)
        self.orphans.update(p.update_ref for p in in_flight)
        s.version, s.global_ref = restored, s.server.global_state.remote()
        for ref, p in list(s.inflight.items()):
            # the dead server's receipts and waits, and evaluations of versions that no longer exist
            if p.kind in ("receipt", "step", "versions") or (p.kind == "eval" and p.version > restored):
                del s.inflight[ref]
                s.evals.handed(p.client, p.update_no, restored, p.ticket)  # the client's state moved on
        s.policy.server_restarted(restored)
        s.evals.server_restarted(restored)

    # ---------------------------------------------------------------------------- drains, checkpoints, stops
    def draining(self) -> bool:
        return self.stop_reason is not None or self.checkpoint_due

    def request_stop(self, reason: str) -> None:
        """Stop taking new work, let running updates finish (sync: the running round), checkpoint,
        and end the run with :class:`StopRequested`. Safe to call from a signal handler."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("%s: finishing the running updates, then checkpointing (up to %.0f s)", reason,
                        self.s.limits.drain_timeout_s)

    def on_version(self, version: int) -> None:
        """A checkpoint every ``checkpoint_every`` versions; ``faults.stop_at_version``."""
        limits = self.s.limits
        if limits.checkpoint_every and version % limits.checkpoint_every == 0 and version < limits.rounds:
            self.checkpoint_due = True
        if limits.stop_at_version is not None and version >= limits.stop_at_version:
            self.request_stop(f"faults.stop_at_version={limits.stop_at_version}")

    def checkpoint(self) -> None:
        """Snapshot the server and every client actor (at a quiet point) and hand them to
        ``on_checkpoint``. An actor found dead here is handled like any other death first."""
        s = self.s
        self.checkpoint_due, self.drain_since = False, None
        if s.hooks.on_checkpoint is None or self.last_checkpoint == s.version:
            return
        try:
            server_snap = ray.get(s.server.snapshot.remote())
        except RayActorError as err:  # restored from the previous checkpoint: nothing new to save
            self.server_died(err)
            return
        actor_snaps = []
        for a in range(len(s.actors)):
            try:
                actor_snaps.append(self._client_snapshot(a))
            except RayActorError as err:  # recreated from the previous checkpoint: that is its state now
                self.client_actor_died(a, None, err)
                actor_snaps.append(self._client_snapshot(a))
        try:
            written = s.hooks.on_checkpoint(s.version, server_snap, actor_snaps)
        except RayActorError as err:  # died while its states were fetched: this checkpoint is not written
            a = getattr(err, "actor_index", None)
            if a is None:
                raise
            log.warning("client actor %d died while checkpoint %d was written; the previous checkpoint stands", a,
                        s.version)
            self.client_actor_died(a, None, err)
            written = False
        if written:
            self.last_checkpoint = s.version
            s.stats.checkpoints += 1
        else:  # retried and failed: the previous checkpoint stands; the next one due (or the end's) tries again
            s.stats.checkpoints_failed += 1

    def _client_snapshot(self, a: int):
        """(worker ``a``'s client states, fetched in chunks as the checkpoint writes them, its RNG)."""
        clients, rng = ray.get(self.s.actors[a].snapshot.remote())
        return RemoteStates(self.s.actors[a], clients, a), rng

    def check_drain_timeout(self) -> None:
        if not self.draining():
            return
        timeout = self.s.limits.drain_timeout_s
        if self.drain_since is None:
            self.drain_since = time.perf_counter()
        elif time.perf_counter() - self.drain_since > timeout:
            in_flight, self.drain_since = self.s.training(), None
            if self.stop_reason is not None:
                log.warning("%d updates still running after reliability.drain_timeout_s=%.0f s: abandoned; the last "
                            "periodic checkpoint is the resume point", in_flight, timeout)
                raise StopRequested(self.stop_reason + " (drain timed out)", self.last_checkpoint)
            log.warning("checkpoint at version %d skipped: %d updates still running after %.0f s",
                        self.s.version, in_flight, timeout)
            self.checkpoint_due = False
