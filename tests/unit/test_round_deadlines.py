"""Sync rounds with a deadline and over-selection (federation.round_deadline_s, over_selection) on
the virtual clock, driven by hand through a fake port (no Ray): which updates are kept, which are
dropped and why, when the round closes; and the config rules that allow them."""

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from doubles import FakePort

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.runtime.policies import SyncRounds, make_policy
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.system import SystemModel

# 10 samples x 1 epoch x 1.0 s / speed: compute 10, 5, 2.5, 2, 20, 1 simulated seconds
SPEEDS = [1.0, 2.0, 4.0, 5.0, 0.5, 10.0]
COMPUTE = [10.0, 5.0, 2.5, 2.0, 20.0, 1.0]
META = {"download_bytes": 0, "upload_bytes": 0, "busy_s": 0.0, "terms": {}}


def policy(per_round: int, deadline_s=None, over_selection=1.0, seed=0, windows=None):
    """``windows``: client -> its online windows (CSV availability; clients not listed are always online)."""
    system = SystemModel(SPEEDS, ["cnn"] * 6, {"cnn": 1.0}, [10] * 6, 1,
                         **({"availability": "csv", "windows": windows} if windows else {}))
    assert list(system.compute_s) == COMPUTE
    pol = SyncRounds(6, per_round, np.random.default_rng(seed), VirtualClock(system, seed), deadline_s=deadline_s,
                     over_selection=over_selection)
    port = FakePort(len(SPEEDS), logged=("submit", "step", "offline", "deadline", "over_selection"))
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


def test_a_drop_is_counted_offline_first_then_deadline_then_over_selection():
    """After the round's K-th finish: a client that went offline mid-update is lost offline (it
    never finished), one finishing after the deadline is a deadline drop, only one finishing in
    time but after the first K is an over-selection drop."""
    # all 6 selected (ceil(3 x 2)); finish order 5 (1 s), 3 (2), 2 (2.5), 1 (offline at 4), 0 (offline at 8), 4 (20)
    pol, port = policy(per_round=2, deadline_s=6.0, over_selection=3.0, windows={1: [(0.0, 4.0)], 0: [(0.0, 8.0)]})
    pol.fill()
    assert sorted(port.in_flight) == list(range(6))
    for c in range(6):
        come_back(pol, port, c)
    assert port.log == [("submit", 5), ("submit", 3), ("over_selection", 2), ("offline", 1), ("offline", 0),
                        ("deadline", 4)]
    for _ in range(2):  # dropped ones need no receipt
        pol.on_receipt({})
    assert port.log[-1] == ("step",)
    pol.on_new_version(1)
    assert pol.clock.now == 2.0  # the round closed at its K-th finish, whatever came after


def test_before_the_kth_finish_an_update_lost_offline_after_the_deadline_is_counted_offline():
    # 6 selected (ceil(1.5 x 4)); 5, 3, 2 finish in time; 1 is lost at 4 s, 0 and 4 finish after 3 s
    pol, port = policy(per_round=4, deadline_s=3.0, over_selection=1.5, windows={1: [(0.0, 4.0)]})
    pol.fill()
    for c in range(6):
        come_back(pol, port, c)
    assert port.log == [("submit", 5), ("submit", 3), ("submit", 2), ("offline", 1), ("deadline", 0), ("deadline", 4)]
    for _ in range(3):
        pol.on_receipt({})
    assert port.log[-1] == ("step",)
    pol.on_new_version(1)
    assert pol.clock.now == 3.0  # closed at the deadline, not when client 1 went offline


@pytest.mark.parametrize("seed", range(8))
def test_every_dispatched_update_is_kept_dropped_once_or_still_in_flight(seed):
    """Random windows, deadline, over-selection and return order: at every moment dispatched =
    submitted + dropped (offline, deadline, over-selection) + in flight, and each drop's reason is
    the first that holds in the order offline, deadline, over-selection."""
    rng = np.random.default_rng(seed)
    windows = {c: [(0.0, float(rng.uniform(0.5, 25.0)))] for c in range(6) if rng.random() < 0.5}
    deadline = float(rng.uniform(1.5, 15.0))
    pol, port = policy(per_round=int(rng.integers(1, 4)), deadline_s=deadline, over_selection=float(rng.uniform(1.0, 3.0)),
                       seed=seed, windows=windows)
    pol.fill()
    dispatched = sorted(port.in_flight)
    for c in rng.permutation(dispatched):
        come_back(pol, port, int(c))
        decided = [c for what, *c in port.log if what != "step" for c in c]
        assert len(decided) == len(set(decided))  # once each
        assert len(decided) + pol.clock.in_flight() == len(dispatched)
    by_reason = {what: [c for w, *c in port.log if w == what for c in c]
                 for what in ("submit", "offline", "deadline", "over_selection")}
    assert sorted(c for cs in by_reason.values() for c in cs) == dispatched
    assert len(by_reason["submit"]) <= pol.per_round
    for c in by_reason["offline"]:
        assert c in windows and windows[c][0][1] < COMPUTE[c]  # it would have finished after its window's end
    for c in by_reason["deadline"]:
        assert COMPUTE[c] > deadline and not (c in windows and windows[c][0][1] < COMPUTE[c])
    for c in by_reason["over_selection"]:
        assert COMPUTE[c] <= deadline and not (c in windows and windows[c][0][1] < COMPUTE[c])
        assert len(by_reason["submit"]) == pol.per_round  # only once the first K were kept


def test_the_scheduler_counts_round_drops_per_client_and_resumes_them_and_old_checkpoints_load():
    import dataclasses

    from rayfed_proto.runtime.scheduler import Scheduler, SchedulerStats

    sched = SimpleNamespace(stats=SchedulerStats())
    for client, reason in [(1, "deadline"), (1, "deadline"), (2, "over_selection"), (1, "over_selection")]:
        Scheduler.dropped_by_round(sched, client, dict(META), reason)
    st = sched.stats
    assert (st.updates_dropped_deadline, st.updates_dropped_over_selection) == (2, 2)
    assert st.client_dropped_deadline == {1: 2} and st.client_dropped_over_selection == {2: 1, 1: 1}
    with pytest.raises(ValueError):
        Scheduler.dropped_by_round(sched, 0, dict(META), "offline")

    def load(stats: dict[str, Any]) -> SchedulerStats:
        target = SimpleNamespace(policy=SimpleNamespace(rng=np.random.default_rng(0), load_state_dict=lambda s, put: None),
                                 evals=SimpleNamespace(), recovery=SimpleNamespace())
        rng_state = np.random.default_rng(1).bit_generator.state
        Scheduler.load_state_dict(target, {"rng": rng_state, "stats": stats, "wall_s": 0.0, "failures": {}})
        return target.stats

    assert load(dataclasses.asdict(st)) == st  # resumed exactly
    old = {k: v for k, v in dataclasses.asdict(st).items()
           if k not in ("client_dropped_deadline", "client_dropped_over_selection")}  # a checkpoint from before them
    resumed = load(old)
    assert resumed.client_dropped_deadline == {} == resumed.client_dropped_over_selection
    assert resumed.updates_dropped_deadline == 2


def test_the_summary_row_and_final_counters_show_round_drops_only_for_selective_rounds():
    from rayfed_proto.runtime.policies import AsyncSlots, ServerNeeds
    from rayfed_proto.runtime.scheduler import SchedulerStats
    from rayfed_proto.runtime.stepping import ServerThread
    from rayfed_proto.tracking import metric_names as names
    from rayfed_proto.tracking.round_metrics import dispatch_counters

    stats = SchedulerStats(dispatched=260, updates_dropped_offline=3, updates_dropped_deadline=29,
                           updates_dropped_over_selection=37)
    offline = {"updates dropped offline": "3 of 260 dispatched (client offline before the update finished)"}
    both, _ = policy(per_round=2, deadline_s=5.0, over_selection=2.0)
    assert both.summary_rows(stats) == {**offline, "updates dropped by the round": (
        "66 of 260 dispatched: 29 after the deadline (5 s from the round start), 37 beyond the first 2 to finish "
        "(4 selected per round)")}
    deadline_only, _ = policy(per_round=2, deadline_s=5.0)
    assert deadline_only.summary_rows(stats)["updates dropped by the round"].endswith(
        "dispatched: 29 after the deadline (5 s from the round start)")
    over_only, _ = policy(per_round=2, over_selection=2.0)
    assert "deadline" not in over_only.summary_rows(stats)["updates dropped by the round"]
    assert policy(per_round=2)[0].summary_rows(stats) == offline  # plain sync rounds (with a clock): no round row
    real_time = AsyncSlots(6, 2, ServerNeeds(ServerThread(2), 5), np.random.default_rng(0))
    assert real_time.summary_rows(stats) == {}  # no clock: no client goes offline, no rounds
    assert dispatch_counters(stats) == {names.FEDERATION_UPDATES_DISPATCHED: 260,
                                        names.FEDERATION_UPDATES_DROPPED_OFFLINE: 3,
                                        names.FEDERATION_UPDATES_DROPPED_DEADLINE: 29,
                                        names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION: 37}


def test_a_failed_run_logs_the_round_drop_counters_too(tmp_path):
    from rayfed_proto.runtime.driver import _record_failure
    from rayfed_proto.runtime.scheduler import SchedulerStats
    from rayfed_proto.tracking import metric_names as names

    logged = []
    tracker = SimpleNamespace(log_metrics=lambda m, step: logged.append((step, dict(m))), set_tags=lambda tags: None)
    stats = SchedulerStats(dispatched=12, updates_dropped_offline=1, updates_dropped_deadline=2,
                           updates_dropped_over_selection=3)
    dead_server = SimpleNamespace(stats=SimpleNamespace(remote=lambda: None))  # its counters cannot be read
    _record_failure(SimpleNamespace(stats=stats, server=dead_server, version=2), tracker, [], tmp_path, "no progress")
    ((step, counters),) = logged
    assert step == 2 and {k: counters[k] for k in (names.FEDERATION_UPDATES_DROPPED_OFFLINE,
                                                   names.FEDERATION_UPDATES_DROPPED_DEADLINE,
                                                   names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION)} == {
        names.FEDERATION_UPDATES_DROPPED_OFFLINE: 1, names.FEDERATION_UPDATES_DROPPED_DEADLINE: 2,
        names.FEDERATION_UPDATES_DROPPED_OVER_SELECTION: 3}


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
