"""Sync rounds with a deadline and over-selection (federation.round_deadline_s, over_selection) on
the virtual clock, driven by hand through a fake port (no Ray): which updates are kept, which are
dropped and why, when the round closes; and the config rules that allow them."""

import math
from typing import Any

import numpy as np
import pytest

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime.policies import Pending, SyncRounds, make_policy
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.system import SystemModel

# 10 samples x 1 epoch x 1.0 s / speed: compute 10, 5, 2.5, 2, 20, 1 simulated seconds
SPEEDS = [1.0, 2.0, 4.0, 5.0, 0.5, 10.0]
COMPUTE = [10.0, 5.0, 2.5, 2.0, 20.0, 1.0]
META = {"download_bytes": 0, "upload_bytes": 0, "busy_s": 0.0, "terms": {}}


class Port:
    def __init__(self, rounds: int = 5):
        self.version, self.rounds = 0, rounds
        self.log: list[tuple] = []
        self.in_flight: dict[int, Pending] = {}

    def accepting(self) -> bool:
        return self.version < self.rounds

    def dispatch(self, client: int) -> Pending:
        p = self.in_flight[client] = Pending(handler=None, kind="train", client=client)
        return p

    def submit(self, p: Pending, meta: dict[str, Any]) -> None:
        self.log.append(("submit", p.client))

    def request_step(self) -> None:
        self.log.append(("step",))

    def eligible(self, one_per_actor: bool = False) -> list[int]:
        return [c for c in range(len(SPEEDS)) if c not in self.in_flight]

    def account(self, client: int, meta: dict[str, Any]) -> None:
        pass

    def dropped_offline(self, client: int, meta: dict[str, Any]) -> None:
        self.log.append(("offline", client))

    def dropped_by_round(self, client: int, meta: dict[str, Any], reason: str) -> None:
        self.log.append((reason, client))


def policy(per_round: int, deadline_s=None, over_selection=1.0, seed=0):
    system = SystemModel(SPEEDS, ["cnn"] * 6, {"cnn": 1.0}, [10] * 6, 1)
    assert list(system.compute_s) == COMPUTE
    pol = SyncRounds(6, per_round, np.random.default_rng(seed), VirtualClock(system, seed), deadline_s=deadline_s,
                     over_selection=over_selection)
    port = Port()
    pol.bind(port)
    return pol, port


def come_back(pol, port, client):
    pol.on_update(port.in_flight.pop(client), dict(META))


def test_over_selection_keeps_the_first_k_to_finish_in_simulated_order_whatever_order_work_returns():
    pol, port = policy(per_round=2, over_selection=2.0)
    pol.fill()
    chosen = sorted(port.in_flight)
    assert len(chosen) == 4 == pol.selected  # ceil(2.0 x 2)
    by_finish = sorted(chosen, key=lambda c: COMPUTE[c])
    for c in reversed(by_finish[1:]):  # the slowest first: nothing can be decided before the fastest is back
        come_back(pol, port, c)
        assert port.log == []
    come_back(pol, port, by_finish[0])
    assert port.log == [("submit", by_finish[0]), ("submit", by_finish[1]),
                        ("over_selection", by_finish[2]), ("over_selection", by_finish[3])]
    for _ in range(2):
        pol.on_receipt({})
    assert port.log[-1] == ("step",)
    port.version = 1
    pol.on_new_version(1)
    assert pol.clock.now == COMPUTE[by_finish[1]]  # the round closed at its K-th finish
    assert not pol.clock.entries


def test_a_deadline_drops_the_updates_that_would_finish_later_and_closes_the_round_at_it():
    pol, port = policy(per_round=4, deadline_s=4.0)
    pol.fill()
    chosen = sorted(port.in_flight)
    assert len(chosen) == 4
    for c in chosen:
        come_back(pol, port, c)
    late = [c for c in chosen if COMPUTE[c] > 4.0]
    assert late, "the seeded sample holds a client slower than the deadline"
    assert sorted(c for what, *c in port.log if what == "deadline" for c in c) == sorted(late)
    kept = [c for what, *c in port.log if what == "submit" for c in c]
    assert kept == sorted((c for c in chosen if COMPUTE[c] <= 4.0), key=lambda c: COMPUTE[c])  # simulated order
    for _ in kept:
        pol.on_receipt({})
    assert port.log[-1] == ("step",)
    pol.on_new_version(1)
    assert pol.clock.now == 4.0  # the round lasted until its deadline, not until its slowest client


def test_an_update_lost_with_its_actor_releases_the_ones_it_held_back():
    pol, port = policy(per_round=2, over_selection=2.0)
    pol.fill()
    by_finish = sorted(port.in_flight, key=lambda c: COMPUTE[c])
    for c in by_finish[1:]:
        come_back(pol, port, c)
    assert port.log == []  # the fastest is still running
    pol.on_lost(port.in_flight.pop(by_finish[0]))
    assert port.log == [("submit", by_finish[1]), ("submit", by_finish[2]), ("over_selection", by_finish[3])]


def test_without_a_deadline_or_over_selection_the_sample_and_the_path_are_unchanged():
    plain, port = policy(per_round=2)
    assert not plain.selective and plain.selected == 2
    plain.fill()
    same, port2 = policy(per_round=2, over_selection=1.0)
    same.fill()
    assert sorted(port.in_flight) == sorted(port2.in_flight)


def test_make_policy_passes_the_federation_settings():
    fed = build_config({}, ["federation.mode=sync", "federation.num_clients=6", "federation.participation=0.5",
                            "federation.over_selection=1.5", "federation.round_deadline_s=30",
                            "system.speed.kind=constant"]).federation
    system = SystemModel(SPEEDS, ["cnn"] * 6, {"cnn": 1.0}, [10] * 6, 1)
    pol = make_policy(fed, system, seed=0, real_slots=1)
    assert (pol.per_round, pol.selected, pol.deadline_s, pol.selective) == (3, 5, 30.0, True)  # ceil(1.5 x 3)
    assert math.isinf(make_policy(fed.model_copy(update={"round_deadline_s": None}), system, seed=0,
                                  real_slots=1).deadline_s)


@pytest.mark.parametrize("over,key,words", [
    (["federation.mode=async", "system.speed.kind=constant", "federation.round_deadline_s=10"],
     "federation.round_deadline_s", "unless federation.mode is sync with a virtual clock"),
    (["federation.mode=sync", "federation.over_selection=1.5", "federation.participation=0.5"],
     "federation.over_selection", "(here mode sync, no system:)"),
    (["federation.mode=sync", "system.speed.kind=constant", "federation.num_clients=4", "federation.participation=0.5",
      "federation.over_selection=2.5"], "federation.over_selection", "at most federation.num_clients"),
    (["federation.round_deadline_s=0"], "federation.round_deadline_s", "greater than 0"),
    (["federation.over_selection=0.9"], "federation.over_selection", "greater than or equal to 1"),
])
def test_deadlines_and_over_selection_are_refused_outside_simulated_sync_rounds(over, key, words):
    with pytest.raises(ConfigError) as exc:
        build_config({}, over)
    issues = {i.key: i for i in exc.value.issues}
    assert key in issues and words in issues[key].allowed, str(exc.value)
