"""Recovery on a fake port (no Ray): deaths, drains and checkpoints, and what each one counts."""

from types import SimpleNamespace
from typing import Any, Optional

import pytest
from ray.exceptions import RayActorError

from rayfed_proto.runtime import recovery as recovery_mod
from rayfed_proto.runtime.inflight import InFlight, Pending
from rayfed_proto.runtime.recovery import Recovery, RecoveryPort, StopRequested
from rayfed_proto.runtime.scheduler import Limits, Scheduler, SchedulerStats


class FakeRecoveryPort:
    """The scheduler's side of :class:`RecoveryPort`, as plain values, with the in-flight table and
    counters (the scheduler's own ``SchedulerStats``) recovery is given, and a log of what it asked for."""

    def fill(self, entries: dict[str, Pending]) -> None:
        for ref, p in entries.items():
            self.inflight.add(ref, p)

    def __init__(self, actor_clients: list[list[int]], version: int = 4, restored: Optional[int] = 2,
                 restart_actors: bool = True, at_server: int = 0, outcomes: Optional[list] = None):
        self.version, self.actor_clients, self.restored = version, actor_clients, restored
        self.restart_actors, self.at_server, self.outcomes = restart_actors, at_server, outcomes or []
        self.inflight = InFlight()
        self.stats = SchedulerStats()
        self.log: list[tuple] = []
        self.generation = [0] * len(actor_clients)  # restarts of each worker
        self.dies_at_snapshot: set[int] = set()  # workers found dead when snapshotted (once)

    def exclude(self, client: int) -> bool:
        if client in self.stats.excluded:
            return False
        self.stats.excluded.append(client)
        return True

    def restart_client_actor(self, actor: int) -> bool:
        if self.restart_actors:
            self.generation[actor] += 1
            self.log.append(("restart_client_actor", actor))
        return self.restart_actors

    def update_lost(self, p: Pending) -> None:
        self.stats.updates_lost_client += 1
        self.log.append(("on_lost", p.client))

    def eval_part_lost(self, version: int) -> None:
        self.log.append(("eval_part_lost", version))

    def updates_at_server(self) -> int:
        return self.at_server

    def restart_server(self) -> Optional[int]:
        self.log.append(("restart_server",))
        return self.restored

    def rewind_to(self, version: int) -> None:
        self.log.append(("rewind_to", version))
        self.version = version

    def snapshot_server(self) -> Any:
        return {"version": self.version}

    def snapshot_client_actor(self, actor: int) -> Any:
        if actor in self.dies_at_snapshot:
            self.dies_at_snapshot.discard(actor)
            raise RayActorError()
        return (actor, self.generation[actor])

    def write_checkpoint(self, server_snap: Any, actor_snaps: list) -> bool:
        self.log.append(("write", self.version, server_snap, list(actor_snaps)))
        return self.outcomes.pop(0)


def _members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def test_the_scheduler_and_the_fake_implement_every_operation_of_the_recovery_port():
    members = _members(RecoveryPort)
    assert {"restart_client_actor", "rewind_to", "write_checkpoint", "version"} <= members
    assert [m for m in sorted(members - {"version"}) if not callable(getattr(Scheduler, m, None))] == []
    assert [m for m in sorted(members) if not hasattr(FakeRecoveryPort([[0]]), m)] == []


def _limits(**over) -> Limits:
    return Limits(**{"rounds": 10, "eval_every": 1, **over})


def _recovery(port: FakeRecoveryPort, limits: Limits, last_checkpoint: int) -> Recovery:
    return Recovery(port, limits, port.stats, port.inflight, port.actor_clients, last_checkpoint)


def _train(client: int, actor: int, ref: str) -> Pending:
    return Pending(None, "train", client=client, actor=actor, update_ref=ref)


def test_a_client_actor_dying_with_an_update_in_flight_loses_its_work_and_is_recreated():
    port = FakeRecoveryPort([[0, 1], [2]])
    lost = _train(0, 0, "up0")  # already taken out of the table by the handler that saw the death
    port.fill({"m1": _train(1, 0, "up1"), "e0": Pending(None, "eval", version=3, actor=0),
                     "r1": Pending(None, "receipt", client=1, actor=-1), "m2": _train(2, 1, "up2"),
                     "e1": Pending(None, "eval", version=3, actor=1)})
    rec = _recovery(port, _limits(max_client_failures=1), last_checkpoint=-1)
    rec.client_actor_died(0, lost, RayActorError())
    assert sorted(port.inflight) == ["e1", "m2", "r1"]  # the other worker's work and the server's receipt stay
    assert port.log == [("restart_client_actor", 0), ("on_lost", 0), ("on_lost", 1), ("eval_part_lost", 3)]
    st = port.stats
    assert (st.client_failures, st.updates_lost_client, st.updates_lost_server, st.excluded) == (1, 2, 0, [])
    assert rec.failures == {0: 1, 1: 1}

    # a second death puts both clients over reliability.max_client_failures=1: excluded, once each
    rec.client_actor_died(0, None, RayActorError())
    rec.client_actor_died(0, None, RayActorError())
    assert (st.client_failures, st.excluded, rec.failures) == (3, [0, 1], {0: 3, 1: 3})
    assert port.generation == [3, 0]


def test_an_update_trained_against_a_dead_server_is_lost_at_the_server_once_and_the_policy_is_not_told():
    port = FakeRecoveryPort([[0]], version=7, restored=5, at_server=3)
    port.fill({"m0": _train(0, 0, "up0"), "r": Pending(None, "receipt", client=0)})
    rec = _recovery(port, _limits(), last_checkpoint=5)
    rec.server_died(RayActorError())
    assert port.log == [("restart_server",), ("rewind_to", 5)] and port.version == 5
    assert (port.stats.server_restarts, port.stats.updates_lost_server) == (1, 3) and rec.orphans == {"up0"}
    rec.client_actor_died(0, port.inflight.pop("m0"), RayActorError())  # the orphan's worker dies too
    assert (port.stats.updates_lost_server, port.stats.updates_lost_client) == (4, 0)
    assert ("on_lost", 0) not in port.log and rec.orphans == set()


def test_a_death_without_a_restart_or_over_the_limit_fails_the_run_after_counting_it():
    port = FakeRecoveryPort([[0]], restart_actors=False)
    with pytest.raises(RuntimeError, match="client actor 0 died and no restart is configured"):
        _recovery(port, _limits(), -1).client_actor_died(0, None, RayActorError())
    assert port.stats.client_failures == 1

    port = FakeRecoveryPort([[0]])
    rec = _recovery(port, _limits(max_server_failures=1), -1)
    rec.server_died(RayActorError())
    with pytest.raises(RuntimeError, match=r"server actor died \(2 times; limit reliability.max_server_failures=1\)"):
        rec.server_died(RayActorError())
    assert port.log.count(("restart_server",)) == 1 and port.stats.server_restarts == 2


def test_a_checkpoint_drain_recreates_a_worker_found_dead_and_saves_its_restored_state():
    port = FakeRecoveryPort([[0], [1, 2]], version=4, outcomes=[True])
    port.fill({"m0": _train(0, 0, "up0")})
    rec = _recovery(port, _limits(checkpoint_every=2), last_checkpoint=2)
    rec.on_version(3)
    assert not rec.draining()
    rec.on_version(4)
    assert rec.draining() and rec.stop_reason is None
    rec.check_drain_timeout()  # the drain starts: running work may finish
    assert rec.drain_since is not None
    port.inflight.pop("m0")  # quiet: the scheduler checkpoints now
    port.dies_at_snapshot = {1}
    rec.checkpoint()
    assert port.log == [("restart_client_actor", 1), ("write", 4, {"version": 4}, [(0, 0), (1, 1)])]
    assert (rec.last_checkpoint, rec.checkpoint_due, rec.drain_since, rec.draining()) == (4, False, None, False)
    assert (port.stats.checkpoints, port.stats.checkpoints_failed, port.stats.client_failures) == (1, 0, 1)
    assert rec.failures == {1: 1, 2: 1}


def test_a_stop_whose_drain_times_out_ends_at_the_last_checkpoint(monkeypatch):
    port = FakeRecoveryPort([[0]], version=6)
    port.fill({"m0": _train(0, 0, "up0")})
    rec = _recovery(port, _limits(stop_at_version=6, drain_timeout_s=30.0), last_checkpoint=4)
    rec.on_version(6)
    assert rec.stop_reason == "faults.stop_at_version=6" and rec.draining()
    now = iter([100.0, 131.0])
    monkeypatch.setattr(recovery_mod, "time", SimpleNamespace(perf_counter=lambda: next(now)))
    rec.check_drain_timeout()
    with pytest.raises(StopRequested) as stop:
        rec.check_drain_timeout()
    assert (stop.value.reason, stop.value.version) == ("faults.stop_at_version=6 (drain timed out)", 4)


def test_a_failed_write_is_counted_and_tried_again_at_the_same_version():
    port = FakeRecoveryPort([[0]], version=4, outcomes=[False, True])
    rec = _recovery(port, _limits(), last_checkpoint=2)
    rec.checkpoint()  # the final version's write fails: counted, and not taken as done
    assert (port.stats.checkpoints, port.stats.checkpoints_failed) == (0, 1) and rec.last_checkpoint == 2
    rec.checkpoint()  # the end of the run tries the same version again: written
    assert (port.stats.checkpoints, port.stats.checkpoints_failed) == (1, 1) and rec.last_checkpoint == 4
    rec.checkpoint()  # already written: nothing to do
    assert [e[1] for e in port.log if e[0] == "write"] == [4, 4] and port.stats.checkpoints == 1


def test_the_summary_names_failed_checkpoints_and_the_newest_usable_one():
    from rayfed_proto.runtime.scheduler import SchedulerStats
    from rayfed_proto.tracking.run_end import checkpoint_summary as _checkpoint_summary

    store = SimpleNamespace(latest=lambda: SimpleNamespace(version=6))
    assert _checkpoint_summary(SchedulerStats(checkpoints=3), store) == "3 written; newest: version 6"
    row = _checkpoint_summary(SchedulerStats(checkpoints=3, checkpoints_failed=1), store)
    assert row.startswith("3 written, 1 FAILED") and row.endswith("newest: version 6")

    def damaged():
        raise OSError("unreadable manifest")

    assert _checkpoint_summary(SchedulerStats(), SimpleNamespace(latest=damaged)) == "0 written; none usable"
