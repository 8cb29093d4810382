"""Message validation at the border and the server's buffer/staleness/version logic (no Ray)."""

import math

import numpy as np
import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate, PrototypeSet, UpdateSchema, validate_update
from rayfed_proto.runtime.policies import ServerNeeds
from rayfed_proto.runtime.server_core import ServerCore
from rayfed_proto.runtime.stepping import EveryK, OnRequest, ServerThread

SCHEMA = UpdateSchema(num_clients=3, num_classes=4, feature_dim=2, weight_shapes={"w": (2, 2)})


def good(**kw):
    base = dict(client_id=1, base_version=2, num_samples=5,
                prototypes=PrototypeSet(np.array([0, 3]), np.zeros((2, 2), np.float32), np.array([2, 3])))
    base.update(kw)
    return ClientUpdate(**base)


def test_valid_update_passes():
    assert validate_update(good(), SCHEMA, current_version=2) is None
    assert validate_update(good(num_samples=None), SCHEMA, current_version=2) is None  # the count is optional


def test_fedavg_refuses_to_weight_an_update_without_a_sample_count():
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.algorithms.base import FederationSpec

    algo = ALGORITHMS.get("fedavg")
    spec = FederationSpec(num_clients=3, num_classes=4, feature_dim=2, seed=0,
                          build_model=lambda: torch.nn.Linear(2, 2, bias=False))
    server = algo.Server(algo.Options(), spec, torch.device("cpu"))
    w = {k: np.array(v) for k, v in server.global_weights.items()}
    server.aggregate([ClientUpdate(2, 0, 5, weights=w)], [1.0], version=1)  # with a count: accepted
    with pytest.raises(ValueError, match=r"clients \[2\] carry no num_samples"):
        server.aggregate([ClientUpdate(2, 0, None, weights=w)], [1.0], version=1)


@pytest.mark.parametrize("update,needle", [
    (good(prototypes=PrototypeSet(np.array([0]), np.array([[np.nan, 0]], np.float32), np.array([1]))), "non-finite"),
    (good(prototypes=PrototypeSet(np.array([0]), np.array([[np.inf, 0]], np.float32), np.array([1]))), "non-finite"),
    (good(prototypes=PrototypeSet(np.array([0]), np.zeros((1, 3), np.float32), np.array([1]))), "shape"),
    (good(prototypes=PrototypeSet(np.array([0, 9]), np.zeros((2, 2), np.float32), np.array([1, 1]))), "unknown class ids [9]"),
    (good(prototypes=PrototypeSet(np.array([1, 1]), np.zeros((2, 2), np.float32), np.array([1, 1]))), "duplicate"),
    (good(prototypes=PrototypeSet(np.array([1]), np.zeros((1, 2), np.float32), np.array([0]))), "counts"),
    (good(base_version=3), "future"),
    (good(client_id=7), "unknown client id 7"),
    (good(num_samples=0), "num_samples"),
    (good(weights={"w": np.zeros((3, 2), np.float32)}), "shape (3, 2), expected (2, 2)"),
    (good(weights={"w": np.full((2, 2), np.nan, np.float32)}), "non-finite"),
    (good(weights={"v": np.zeros((2, 2), np.float32)}), "weight keys differ"),
    ("not an update", "not a ClientUpdate"),
])
def test_bad_updates_are_refused_with_reason(update, needle):
    reason = validate_update(update, SCHEMA, current_version=2)
    assert reason is not None and needle in reason


def _core(mode="async", buffer=2, **fed):
    cfg = build_config({"algorithm": {"name": "fedproto"}, "model": {"feature_dim": 2},
                        "federation": {"mode": mode, "num_clients": 3, "rounds": 5, "concurrency": 3,
                                       "buffer_size": buffer, "eval_every": 1, **fed}})
    return ServerCore(cfg, num_classes=4, in_channels=1, image_size=8, device=torch.device("cpu"),
                      needs=ServerNeeds(EveryK(buffer) if mode == "async" else OnRequest(),  # sync: as SyncRounds declares
                                        max_staleness=cfg.federation.max_staleness if mode == "async" else math.inf))


def upd(client, version, value=1.0):
    return ClientUpdate(client, version, 4, prototypes=PrototypeSet(np.array([0]), np.full((1, 2), value, np.float32), np.array([4])))


def test_async_buffer_produces_a_version_every_k_accepted_updates():
    core = _core(buffer=2)
    r1 = core.submit(upd(0, 0))
    assert r1["accepted"] and "new_version" not in r1 and core.version == 0
    r2 = core.submit(upd(1, 0, 3.0))
    assert r2["new_version"] == 1 and core.version == 1
    np.testing.assert_allclose(core.state.prototypes.vectors[0], [2.0, 2.0])  # mean of 1 and 3 (equal counts)


def test_refused_and_stale_updates_are_counted_never_aggregated():
    core = _core(buffer=1, max_staleness=1)
    bad = upd(0, 0)
    bad.prototypes.vectors[:] = np.nan
    assert not core.submit(bad)["accepted"]
    for v in range(3):  # versions 1, 2, 3
        core.submit(upd(1, v, 1.0))
    r = core.submit(upd(2, 0, 100.0))  # staleness 3 > 1
    assert not r["accepted"] and "staleness 3" in r["reason"]
    stats = core.read_stats()
    assert stats["refused"] == 1 and stats["dropped_stale"] == 1 and stats["accepted"] == 3
    assert np.isfinite(core.state.prototypes.vectors).all()
    np.testing.assert_allclose(core.state.prototypes.vectors[0], [1.0, 1.0])


def test_staleness_statistics_window():
    core = _core(buffer=1)
    core.submit(upd(0, 0))          # staleness 0 -> v1
    core.submit(upd(1, 0))          # staleness 1 -> v2
    core.submit(upd(2, 0))          # staleness 2 -> v3
    s = core.read_stats()
    assert s["staleness_mean"] == pytest.approx(1.0) and s["staleness_max"] == 2
    assert core.read_stats()["staleness_max"] == 0  # window restarts


def test_sync_core_waits_for_step_and_ignores_staleness_limit():
    core = _core(mode="sync", buffer=2)
    for c in range(3):
        assert core.submit(upd(c, 0))["accepted"]
    assert core.version == 0  # sync: the scheduler decides when the round is complete
    assert core.step()["new_version"] == 1


def test_updates_after_the_last_version_are_counted_as_late():
    core = _core(buffer=1)
    for _ in range(5):
        core.submit(upd(0, core.version))
    assert core.version == 5
    r = core.submit(upd(1, 5))
    assert not r["accepted"] and core.read_stats()["late"] == 1


def test_stats_report_the_requested_versions_margin_and_server_metrics():
    core = _core(buffer=1)
    core.submit(upd(0, 0, 1.0))  # v1: class 0 only -> margin undefined
    core.submit(upd(1, 1, 2.0))  # v2
    s1 = core.read_stats(version=1)
    assert s1["version"] == 2  # counters are current ...
    assert all(np.isnan(s1["margin"]))  # ... but the margin is version 1's (one class: none)
    assert core.read_stats(version=7)["server_metrics"] == {}


def test_server_core_state_round_trip_continues_identically():
    core = _core(buffer=2)
    for c, v in ((0, 0), (1, 0), (2, 1)):
        core.submit(upd(c, v, float(c + 1)))
    state = core.state_dict()
    twin = _core(buffer=2)
    twin.load_state_dict(state)
    assert twin.version == core.version == 1 and len(twin.buffer) == 1
    for server in (core, twin):
        server.submit(upd(0, 1, 5.0))  # completes the buffer: version 2
    np.testing.assert_allclose(twin.state.prototypes.vectors, core.state.prototypes.vectors)
    assert twin.read_stats()["accepted"] == core.read_stats()["accepted"] == 4


def test_background_intake_does_not_wait_for_server_training():
    import threading

    core = _core(buffer=2)
    core.stepping = ServerThread(2)  # a training thread steps: submit only buffers
    training_started, release = threading.Event(), threading.Event()
    real_aggregate = core.algorithm.aggregate

    def slow_aggregate(updates, weights, version):  # stands in for a long generator training
        training_started.set()
        release.wait(10)
        return real_aggregate(updates, weights, version)

    core.algorithm.aggregate = slow_aggregate
    for c in range(2):
        assert "new_version" not in core.submit(upd(c, 0))  # background: submit never trains
    trainer = threading.Thread(target=core.wait_and_step, args=(5.0,))
    trainer.start()
    assert training_started.wait(5)
    r = core.submit(upd(2, 0))  # arrives while the server trains: accepted at once, staleness 0
    assert r["accepted"] and r["staleness"] == 0 and core.version == 0
    release.set()
    trainer.join(5)
    assert core.version == 1 and len(core.buffer) == 1  # the new update waits for the next version


def test_a_non_finite_aggregate_is_rolled_back_and_counted():
    core = _core(buffer=1)
    core.submit(upd(0, 0, 1.0))  # v1: class 0 at (1, 1)
    real = core.algorithm.aggregate

    def blows_up(updates, weights, version):  # stands in for server training that diverged
        out = real(updates, weights, version)
        core.algorithm.bank.vectors[:] = np.inf
        return out

    core.algorithm.aggregate = blows_up
    assert core.submit(upd(1, 1, 5.0))["accepted"]
    assert core.version == 2  # the run goes on ...
    np.testing.assert_allclose(core.state.prototypes.vectors[0], [1.0, 1.0])  # ... from the previous state
    assert np.isfinite(core.algorithm.bank.vectors).all()
    assert core.read_stats()["rolled_back"] == 1


def test_sync_round_is_aggregated_in_client_order_whatever_the_arrival_order():
    results = []
    for order in ((0, 1, 2), (2, 0, 1)):
        core = _core(mode="sync")
        seen = []
        real = core.algorithm.aggregate
        core.algorithm.aggregate = lambda u, w, v, seen=seen, real=real: (seen.extend(x.client_id for x in u), real(u, w, v))[1]
        for c in order:
            core.submit(upd(c, 0, float(c)))
        core.step()
        results.append(seen)
    assert results[0] == results[1] == [0, 1, 2]
