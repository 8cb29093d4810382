"""The scheduler's other half: actor deaths, drains, checkpoints and stops.

:class:`~rayfed_proto.runtime.scheduler.Scheduler` runs the happy path (dispatch, submit, step,
evaluate); whatever interrupts it is here, so that the loop reads alone. :class:`Recovery` reads the
scheduler's in-flight table (:class:`~rayfed_proto.runtime.inflight.InFlight`) and counts into its
stats, and works the federation through a narrow :class:`RecoveryPort` that the scheduler
implements (as policies do through :class:`~rayfed_proto.runtime.policies.Port`): a dead client actor is recreated from
the last checkpoint of its clients, a dead server from the last checkpoint, and the work lost with
them is counted, never silently redone. A drain (a checkpoint due, or a stop requested by a signal
or ``faults.stop_at_version``) takes no new work, lets the running work finish, and checkpoints at
the quiet point. No Ray calls here (only its error type): recovery is tested with a fake port.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Protocol

from ray.exceptions import RayActorError

from rayfed_proto.runtime.inflight import InFlight, Kind, Pending

log = logging.getLogger("rayfed_proto")


class RecoveryPort(Protocol):
    """What recovery may do to the federation beyond the in-flight table and the counters it is
    given; the scheduler implements it."""

    version: int  # the newest version the driver knows

    # a client actor died
    def exclude(self, client: int) -> bool: ...  # out of sampling for good; False: it already was
    def restart_client_actor(self, actor: int) -> bool: ...  # recreate it (its clients' last checkpoint); False: no restart configured
    def update_lost(self, p: Pending) -> None: ...  # a local update lost with its actor: counted, the policy told
    def eval_part_lost(self, version: int) -> None: ...  # one worker's part of an evaluation lost with it

    # the server died
    def updates_at_server(self) -> int: ...  # updates the server holds that a restart loses
    def restart_server(self) -> Optional[int]: ...  # recreate it; the version it restored (None: no restart configured)
    def rewind_to(self, version: int) -> None: ...  # back to the restored version: the dead server's work dropped

    # checkpoints
    def snapshot_server(self) -> Any: ...  # raises RayActorError if the server is dead
    def snapshot_client_actor(self, actor: int) -> Any: ...  # raises RayActorError if it is dead
    def write_checkpoint(self, server_snap: Any, actor_snaps: list) -> bool: ...  # at ``version``; True: written


class RecoveryLimits(Protocol):
    """What recovery reads of the run's limits (:class:`~rayfed_proto.runtime.scheduler.Limits`)."""

    rounds: int
    checkpoint_every: int
    max_client_failures: int
    max_server_failures: int
    drain_timeout_s: float
    stop_at_version: Optional[int]


class StopRequested(Exception):
    """The run was stopped (signal or fault injection) after a clean drain and checkpoint."""

    def __init__(self, reason: str, version: int):
        super().__init__(f"{reason} at version {version}")
        self.reason, self.version = reason, version


class Recovery:
    """``stats``: the scheduler's counters (:class:`~rayfed_proto.runtime.scheduler.SchedulerStats`);
    ``inflight``: its table; ``actor_clients``: the clients each worker hosts; ``checkpoints``: a
    checkpoint writer is configured."""

    def __init__(self, port: RecoveryPort, limits: RecoveryLimits, stats, inflight: InFlight,
                 actor_clients: list[list[int]], last_checkpoint: int, checkpoints: bool = True):
        self.port, self.limits, self.stats, self.inflight = port, limits, stats, inflight
        self.actor_clients, self.checkpoints = actor_clients, checkpoints
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
        port, limit = self.port, self.limits.max_client_failures
        self.stats.client_failures += 1
        clients = self.actor_clients[a]
        log.warning("client actor %d (clients %s) died: %s", a, clients, type(err).__name__)
        for c in clients:
            self.failures[c] = self.failures.get(c, 0) + 1
            if self.failures[c] > limit and port.exclude(c):
                log.warning("client %d failed %d times (limit reliability.max_client_failures=%d): excluded from "
                            "sampling", c, self.failures[c], limit)
        queued = self.inflight.drop_on_actor(a)  # every other call queued on the dead actor fails too: once per death
        if not port.restart_client_actor(a):
            raise RuntimeError(f"client actor {a} died and no restart is configured") from err
        for q in ([lost] if lost is not None else []) + queued:
            if q.kind is Kind.TRAIN:
                self.lose_update(q)
            else:
                port.eval_part_lost(q.version)

    def orphaned(self, update_ref) -> bool:
        """An update trained against a server that has since died: counted lost (once)."""
        if update_ref not in self.orphans:
            return False
        self.orphans.discard(update_ref)
        self.stats.updates_lost_server += 1
        return True

    def lose_update(self, p: Pending) -> None:
        if not self.orphaned(p.update_ref):  # an orphan's round was abandoned with its server
            self.port.update_lost(p)

    def server_died(self, err: BaseException) -> None:
        """The server actor died: recreate it from the last checkpoint (or from scratch) and carry
        on from its version. Updates in flight or buffered are counted as lost, not re-requested:
        the versions after the checkpoint are recomputed from fresh client work."""
        port, limit = self.port, self.limits.max_server_failures
        self.stats.server_restarts += 1
        restarts = self.stats.server_restarts
        at_server, in_flight, was = port.updates_at_server(), self.inflight.update_refs(), port.version
        restored = port.restart_server() if restarts <= limit else None
        if restored is None:
            raise RuntimeError(f"server actor died ({restarts} times; limit "
                               f"reliability.max_server_failures={limit})") from err
        log.warning("server actor died (%s); recreated at version %d (was %d); %d updates lost at the server, "
                    "%d in flight", type(err).__name__, restored, was, at_server, len(in_flight))
        self.stats.updates_lost_server += at_server
        self.orphans.update(in_flight)
        port.rewind_to(restored)  # the versions after it are redone

    # ---------------------------------------------------------------------------- drains, checkpoints, stops
    def draining(self) -> bool:
        return self.stop_reason is not None or self.checkpoint_due

    def request_stop(self, reason: str) -> None:
        """Stop taking new work, let running updates finish (sync: the running round), checkpoint,
        and end the run with :class:`StopRequested`. Safe to call from a signal handler."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("%s: finishing the running updates, then checkpointing (up to %.0f s)", reason,
                        self.limits.drain_timeout_s)

    def on_version(self, version: int) -> None:
        """A checkpoint every ``checkpoint_every`` versions; ``faults.stop_at_version``."""
        limits = self.limits
        if limits.checkpoint_every and version % limits.checkpoint_every == 0 and version < limits.rounds:
            self.checkpoint_due = True
        if limits.stop_at_version is not None and version >= limits.stop_at_version:
            self.request_stop(f"faults.stop_at_version={limits.stop_at_version}")

    def checkpoint(self) -> None:
        """Snapshot the server and every client actor (at a quiet point) and hand them to
        ``on_checkpoint``. An actor found dead here is handled like any other death first."""
        port = self.port
        self.checkpoint_due, self.drain_since = False, None
        if not self.checkpoints or self.last_checkpoint == port.version:
            return
        try:
            server_snap = port.snapshot_server()
        except RayActorError as err:  # restored from the previous checkpoint: nothing new to save
            self.server_died(err)
            return
        actor_snaps = []
        for a in range(len(self.actor_clients)):
            try:
                actor_snaps.append(port.snapshot_client_actor(a))
            except RayActorError as err:  # recreated from the previous checkpoint: that is its state now
                self.client_actor_died(a, None, err)
                actor_snaps.append(port.snapshot_client_actor(a))
        try:
            written = port.write_checkpoint(server_snap, actor_snaps)
        except RayActorError as err:  # died while its states were fetched: this checkpoint is not written
            a = getattr(err, "actor_index", None)
            if a is None:
                raise
            log.warning("client actor %d died while checkpoint %d was written; the previous checkpoint stands", a,
                        port.version)
            self.client_actor_died(a, None, err)
            written = False
        if written:
            self.last_checkpoint = port.version
        # failed after retries: the previous checkpoint stands; the next one due (or the end's) tries again
        if written:
            self.stats.checkpoints += 1
        else:
            self.stats.checkpoints_failed += 1

    def check_drain_timeout(self) -> None:
        if not self.draining():
            return
        timeout = self.limits.drain_timeout_s
        if self.drain_since is None:
            self.drain_since = time.perf_counter()
        elif time.perf_counter() - self.drain_since > timeout:
            in_flight, self.drain_since = self.inflight.count(Kind.TRAIN), None
            if self.stop_reason is not None:
                log.warning("%d updates still running after reliability.drain_timeout_s=%.0f s: abandoned; the last "
                            "periodic checkpoint is the resume point", in_flight, timeout)
                raise StopRequested(self.stop_reason + " (drain timed out)", self.last_checkpoint)
            log.warning("checkpoint at version %d skipped: %d updates still running after %.0f s",
                        self.port.version, in_flight, timeout)
            self.checkpoint_due = False
