"""FedScale traces (device capacity, behaviour) and the dropout rule: a client that goes offline
before its update would finish loses that update."""

import math
import pickle
import pickletools

import numpy as np
import pandas as pd
import pytest
from doubles import FakePort

from rayfed_proto.config import ConfigError, build_config, semantic_issues
from rayfed_proto.runtime.policies import ServerNeeds, SyncRounds, VirtualAsync
from rayfed_proto.runtime.simclock import VirtualClock
from rayfed_proto.runtime.stepping import SimulatedSteps
from rayfed_proto.system import (
    SystemModel,
    fedscale_bandwidths,
    fedscale_speeds,
    fedscale_windows,
    load_behaviour_trace,
    load_device_trace,
    map_trace_clients,
)

# FedScale's shapes: client_device_capacity and client_behave_trace (ids are ints, often from 1)
DEVICE = {1: {"computation": 20.0, "communication": 8000.0}, 2: {"computation": 40.0, "communication": 800.0},
          3: {"computation": 10.0, "communication": 80.0}, 4: {"computation": 80.0, "communication": 16000.0}}
BEHAVE = {1: {"active": [0.0, 50.0], "inactive": [10.0, 100.0], "finish_time": 100.0, "model": "x"},
          2: {"active": [20.0], "inactive": [30.0], "finish_time": 60.0},
          3: {"active": [0.0], "inactive": [1000.0], "finish_time": 1000.0}}


def _pickle(path, obj, protocol=4):
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


# --------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_device_trace_pickle_in_fedscale_format(tmp_path, protocol):
    trace = load_device_trace(_pickle(tmp_path / "client_device_capacity", DEVICE, protocol).rename(
        tmp_path / "client_device_capacity.pkl"))
    assert trace == {1: (20.0, 8000.0), 2: (40.0, 800.0), 3: (10.0, 80.0), 4: (80.0, 16000.0)}


def test_behaviour_trace_pickle_in_fedscale_format(tmp_path):
    trace = load_behaviour_trace(_pickle(tmp_path / "client_behave_trace.pkl", BEHAVE))
    assert trace == {1: ([(0.0, 10.0), (50.0, 100.0)], 100.0), 2: ([(20.0, 30.0)], 60.0),
                     3: ([(0.0, 1000.0)], 1000.0)}


class Boom:
    def __reduce__(self):
        return (print, ("EXECUTED",))


def test_a_pickle_with_a_global_is_refused_and_nothing_is_executed(tmp_path, capsys):
    path = _pickle(tmp_path / "evil.pkl", {1: {"computation": Boom(), "communication": 1.0}})
    assert any(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in pickletools.genops(path.read_bytes()))
    with pytest.raises(ConfigError) as err:
        load_device_trace(path)
    (issue,) = err.value.issues
    assert issue.key == "system.speed.path" and issue.value == str(path)
    assert "refused global" in issue.allowed  # print is builtins.print, or ray's safe_print once Ray patched it and "plain dicts, lists and numbers" in issue.allowed
    assert "EXECUTED" not in capsys.readouterr().out
    # a numpy scalar needs a global too: refused, as any object
    with pytest.raises(ConfigError, match="refused global numpy"):
        load_device_trace(_pickle(tmp_path / "np.pkl", {1: {"computation": np.float64(1.0), "communication": 2.0}}))


@pytest.mark.parametrize(("obj", "needle"), [
    ([1, 2], "non-empty dict"),
    ({1: {"computation": 0.0, "communication": 1.0}}, "must be > 0"),
    ({1: {"computation": "fast", "communication": 1.0}}, "computation 'fast' is not a finite number"),
    ({1: [1, 2]}, "expected a dict"),
])
def test_bad_device_pickles_name_the_key_file_and_problem(tmp_path, obj, needle):
    path = _pickle(tmp_path / "d.pkl", obj)
    with pytest.raises(ConfigError) as err:
        load_device_trace(path, "system.bandwidth.path")
    assert err.value.issues[0].key == "system.bandwidth.path" and err.value.issues[0].value == str(path)
    assert needle in err.value.issues[0].allowed


@pytest.mark.parametrize(("rec", "needle"), [
    ({"active": [5.0], "inactive": [1.0], "finish_time": 10.0}, "0 <= active < inactive"),
    ({"active": [0.0, 1.0], "inactive": [2.0], "finish_time": 10.0}, "same length"),
    ({"active": [0.0], "inactive": [2.0], "finish_time": 0.0}, "finish_time 0.0 must be > 0"),
    ({"active": [0.0], "inactive": [2.0]}, "finish_time None is not a finite number"),
])
def test_bad_behaviour_pickles_are_refused(tmp_path, rec, needle):
    with pytest.raises(ConfigError) as err:
        load_behaviour_trace(_pickle(tmp_path / "b.pkl", {7: rec}))
    assert err.value.issues[0].key == "system.availability.path" and needle in err.value.issues[0].allowed


def test_csv_and_parquet_forms_equal_the_pickle(tmp_path):
    dev = pd.DataFrame({"client_id": list(DEVICE), "computation": [v["computation"] for v in DEVICE.values()],
                        "communication": [v["communication"] for v in DEVICE.values()]})
    dev.to_csv(tmp_path / "dev.csv", index=False)
    dev.to_parquet(tmp_path / "dev.parquet", index=False)
    rows = [(c, a, b, r["finish_time"]) for c, r in BEHAVE.items() for a, b in zip(r["active"], r["inactive"], strict=True)]
    beh = pd.DataFrame(rows, columns=["client_id", "active", "inactive", "finish_time"])
    beh.to_csv(tmp_path / "beh.csv", index=False)
    beh.to_parquet(tmp_path / "beh.parquet", index=False)
    as_str = lambda t: {str(k): v for k, v in t.items()}  # noqa: E731  (tabular ids are read as text)
    expected_dev = as_str(load_device_trace(_pickle(tmp_path / "dev.pkl", DEVICE)))
    expected_beh = as_str(load_behaviour_trace(_pickle(tmp_path / "beh.pkl", BEHAVE)))
    assert load_device_trace(tmp_path / "dev.csv") == expected_dev == load_device_trace(tmp_path / "dev.parquet")
    assert load_behaviour_trace(tmp_path / "beh.csv") == expected_beh == load_behaviour_trace(tmp_path / "beh.parquet")


def test_tabular_errors_name_the_line(tmp_path):
    (tmp_path / "d.csv").write_text("client_id,computation,communication\n1,5,10\n1,6,10\n2,x,3\n")
    with pytest.raises(ConfigError) as err:
        load_device_trace(tmp_path / "d.csv")
    assert [i.allowed for i in err.value.issues] == ["line 4: computation 'x' is not a number"]
    (tmp_path / "e.csv").write_text("client_id,computation,communication\n1,5,10\n1,6,10\n")
    with pytest.raises(ConfigError, match="line 3: client_id 1 appears twice"):
        load_device_trace(tmp_path / "e.csv")
    (tmp_path / "b.csv").write_text("client_id,active,inactive,finish_time\n1,0,5,10\n1,6,8,20\n")
    with pytest.raises(ConfigError, match="different finish_time values"):
        load_behaviour_trace(tmp_path / "b.csv")
    pd.DataFrame({"client_id": [1], "speed": [1.0]}).to_parquet(tmp_path / "w.parquet")
    with pytest.raises(ConfigError, match="columns client_id,computation,communication; got client_id,speed"):
        load_device_trace(tmp_path / "w.parquet")


# --------------------------------------------------------------------------- the mapping


def test_mapping_is_a_function_of_the_seed_exactly():
    ids = [4, 1, 3, 2]
    assert map_trace_clients(ids, 4, seed=0, salt=1) == map_trace_clients([1, 2, 3, 4], 4, seed=0, salt=1)
    assert map_trace_clients(ids, 4, seed=0, salt=1) == [int(i) for i in np.array([1, 2, 3, 4])[
        np.random.default_rng([0, 0x7ACE, 1]).permutation(4)]]
    assert sorted(map_trace_clients(ids, 4, seed=5, salt=1)) == [1, 2, 3, 4]  # distinct while the trace suffices
    seeds = {tuple(map_trace_clients(ids, 4, seed=s, salt=1)) for s in range(6)}
    assert len(seeds) > 1  # another seed, another mapping
    many = map_trace_clients(ids, 10, seed=3, salt=1)  # more run clients than trace clients: cycled
    assert many[:4] == many[4:8] == map_trace_clients(ids, 4, seed=3, salt=1) and many[8:] == many[:2]


def test_speeds_bandwidths_and_windows_from_the_traces(tmp_path):
    dev = load_device_trace(_pickle(tmp_path / "d.pkl", DEVICE))
    mapped = map_trace_clients(dev, 4, seed=0, salt=1)
    speeds = fedscale_speeds(dev, 4, seed=0)
    comp = np.array([DEVICE[t]["computation"] for t in mapped])
    assert speeds.tolist() == (np.median(comp) / comp).tolist()  # the median device: speed 1
    assert fedscale_bandwidths(dev, 4, seed=0).tolist() == [DEVICE[t]["communication"] * 125.0 for t in mapped]
    _, periods = fedscale_windows(load_behaviour_trace(_pickle(tmp_path / "b.pkl", BEHAVE)), 4, seed=0)
    behave = map_trace_clients(BEHAVE, 4, seed=0, salt=2)
    assert periods == {c: BEHAVE[t]["finish_time"] for c, t in enumerate(behave)}


# --------------------------------------------------------------------------- availability and the dropout rule


def model(windows=None, periods=None, availability="fedscale", compute=(10.0, 10.0), **kw):
    return SystemModel([1.0] * len(compute), ["a"] * len(compute), {"a": 1.0}, [int(c) for c in compute], 1,
                       availability=availability, windows=windows, periods=periods, **kw)


def test_periodic_windows_repeat_every_finish_time():
    m = model({0: [(0.0, 10.0), (50.0, 100.0)], 1: [(20.0, 30.0)]}, {0: 100.0, 1: 60.0})
    rng = np.random.default_rng(0)
    assert m.online_clients([0, 1], 5.0, rng) == [0] and m.online_clients([0, 1], 145.0, rng) == [1]
    assert m.online_clients([0, 1], 305.0, rng) == [0]
    assert m.next_online_time([0, 1], 12.0) == 20.0 and m.next_online_time([1], 31.0) == 80.0
    assert m.offline_at(1, 85.0) == 90.0
    # client 0's window [50, 100) runs on into the next period's [0, 10): offline at 110
    assert m.offline_at(0, 60.0) == 110.0 and m.offline_at(0, 105.0) == 110.0
    assert model({0: [(0.0, 5.0)]}, {0: 5.0}, compute=(1.0,)).offline_at(0, 12.0) == math.inf  # always online
    assert model(availability="always").offline_at(0, 3.0) == math.inf
    csv = model({0: [(0.0, 10.0), (20.0, 40.0)]}, availability="csv")
    assert csv.offline_at(0, 25.0) == 40.0 and csv.offline_at(1, 25.0) == math.inf  # client 1: no windows


def test_per_client_bandwidth_times_transfers():
    m = model(availability="always", upload_bytes_per_s=100.0, download_bytes_per_s=100.0,
              client_upload_bytes_per_s=[10.0, 1000.0], client_download_bytes_per_s=[20.0, 2000.0])
    assert m.update_duration(0, 200, 100) == 10.0 + 10.0 + 10.0
    assert m.update_duration(1, 200, 100) == 10.0 + 0.1 + 0.1
    assert m.transfer_s(200, 100) == 3.0  # no client: the single values


def meta(down=0, up=0):
    return {"download_bytes": down, "upload_bytes": up, "busy_s": 0.5, "terms": {}, "update": 1}


def test_drop_rule_on_the_clock_by_hand():
    """Client 0 online [0, 12): its 10 s update + 3 s upload would finish at 13 > 12, so it is lost at
    12; client 1 online [0, 100): finishes at 10 + 1 = 11. Without transfers client 0 would make it."""
    m = model({0: [(0.0, 12.0)], 1: [(0.0, 100.0)]}, availability="csv", upload_bytes_per_s=1.0)
    clock = VirtualClock(m, seed=0)
    e0, e1 = clock.start(0, "t0"), clock.start(1, "t1")
    assert (e0.offline_at, e0.finish, e1.offline_at) == (12.0, 10.0, 100.0)
    clock.finish(e0, meta(up=3), "u0")
    assert e0.dropped and e0.finish == 12.0
    assert clock.pop_ready() is None  # client 1 may still finish first (lower bound 10)
    clock.finish(e1, meta(up=1), "u1")
    assert [(e.client, e.finish, e.dropped) for e in (clock.pop_ready(), clock.pop_ready())] == [
        (1, 11.0, False), (0, 12.0, True)]
    assert clock.now == 12.0
    # an update whose compute alone overruns the window: its lower bound is the window's end
    clock2 = VirtualClock(model({0: [(0.0, 4.0)]}, availability="csv"), seed=0)
    e = clock2.start(0, "t")
    assert e.finish == 4.0
    clock2.finish(e, meta(), "u")
    assert e.dropped and e.finish == 4.0
    # exactly at the window's end: delivered
    clock3 = VirtualClock(model({0: [(0.0, 10.0)]}, availability="csv"), seed=0)
    e = clock3.start(0, "t")
    clock3.finish(e, meta(), "u")
    assert not e.dropped


def test_a_dropped_pending_update_survives_a_checkpoint():
    m = model({0: [(0.0, 4.0)]}, availability="csv")
    clock = VirtualClock(m, seed=0)
    e = clock.start(0, "t")
    clock.finish(e, meta(), "u")
    state = clock.state_dict(lambda u: u)
    assert state["pending"][0]["dropped"] and state["pending"][0]["update"] is None
    again = VirtualClock(m, seed=0)
    again.load_state_dict(state, lambda u: u)
    (e2,) = again.entries.values()
    assert (e2.dropped, e2.finish, e2.offline_at, e2.update) == (True, 4.0, 4.0, None)


def test_virtual_async_drops_frees_the_slot_at_the_window_end_and_dispatches_a_replacement():
    # client 0 online [0, 5) only: its 10 s update is lost at 5; client 1 (no windows) replaces it then
    m = model({0: [(0.0, 5.0)]}, availability="csv", compute=(10.0, 3.0))
    policy = VirtualAsync(2, 1, ServerNeeds(SimulatedSteps(1), math.inf), np.random.default_rng(1), VirtualClock(m, seed=0))
    port = FakePort(2, rounds=10)
    policy.bind(port)
    policy.fill()
    assert port.clients("dispatch") == [0]  # the seeded choice (rng seed 1)
    (e,) = policy.clock.entries.values()
    policy.on_update(port.in_flight.pop(e.client), meta())  # its computation came back
    policy.fill()
    assert port.clients("offline") == [0] and port.clients("hand_over") == [] and policy.clock.now == 5.0
    assert port.clients("dispatch") == [0, 1]  # the replacement, at 5 s (client 0 is offline from then on)
    assert policy.clock.entries[1].start == 5.0 and policy.held_back() == 0


def test_sync_round_goes_on_without_a_dropped_update_and_lasts_until_the_client_left():
    m = model({0: [(0.0, 5.0)]}, availability="csv", compute=(10.0, 3.0))
    policy = SyncRounds(2, 2, np.random.default_rng(0), VirtualClock(m, seed=0))
    port = FakePort(2, rounds=10)
    policy.bind(port)
    policy.fill()
    assert sorted(port.clients("dispatch")) == [0, 1]
    for c in (0, 1):
        policy.on_update(port.in_flight.pop(c), meta())  # the computations came back
    assert port.clients("offline") == [0] and port.clients("submit") == [1]
    policy.on_receipt({})  # client 1's receipt: the round is complete
    assert port.log.count(("step",)) == 1 and policy.round_end == 5.0  # max(3 s, client 0 gone at 5 s)


# --------------------------------------------------------------------------- config


def test_config_kinds_and_cross_checks(tmp_path):
    dev = _pickle(tmp_path / "d.pkl", DEVICE)
    beh = _pickle(tmp_path / "b.pkl", BEHAVE)
    cfg = build_config({}, ["system.speed.kind=fedscale", f"system.speed.path={dev}",
                            "system.availability.kind=fedscale", f"system.availability.path={beh}",
                            "system.bandwidth.kind=fedscale", f"system.bandwidth.path={dev}"])
    assert cfg.system.bandwidth.kind == "fedscale" and semantic_issues(cfg) == []

    def issues(*overrides):
        with pytest.raises(ConfigError) as err:
            build_config({}, list(overrides))
        return err.value.issues

    (bad_kind,) = issues("system.bandwidth.kind=gaussian")
    assert bad_kind.key == "system.bandwidth.kind" and "constant, lognormal, fedscale" in bad_kind.allowed
    (both,) = issues("system.bandwidth.kind=fedscale", f"system.bandwidth.path={dev}", "system.upload_bytes_per_s=10")
    assert both.key == "system.bandwidth.kind" and "system.upload_bytes_per_s unset" in both.allowed
    (lonely,) = issues("system.bandwidth.kind=lognormal")
    assert (lonely.key, lonely.value) == ("system.bandwidth.kind", "lognormal")
    (missing,) = issues("system.availability.kind=fedscale", f"system.availability.path={tmp_path}/no.pkl")
    assert missing.key == "system.availability.path" and "an existing trace file" in missing.allowed
