"""Lanes (``resources.batch_clients: lanes``, training/batched.py): clients of one architecture
queue for a few rows of one vmapped model; each client's result is what it computes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.training import batched
from tests.unit.test_batched_clients import (  # noqa: F401  (float64 and _one_thread are fixtures)
    BATCHED,
    CPU,
    _bn_members,
    _federation,
    _host,
    _one_after_another,
    _one_thread,
    _params,
    _relative_gap,
    _train_rounds,
    float64,
)


def _double(members):
    """The members' models, optimizer state and data in float64 (the parameters stay the objects the optimizer holds)."""
    for m in members:
        m.model.double()
        m.batches.x = m.batches.x.double()
    return members


def _state(members) -> list[list[torch.Tensor]]:
    return [[t.detach().clone() for t in m.model.state_dict().values()] for m in members]


def _opt_state(m) -> list[torch.Tensor]:
    return [torch.as_tensor(v) for s in m.optimizer.state_dict()["state"].values() for v in s.values()]


def _assert_same(a_members, b_members, terms_a, terms_b, tol=1e-10):
    for a, b, ta, tb in zip(a_members, b_members, terms_a, terms_b, strict=True):
        for x, y in zip(_state([a])[0], _state([b])[0], strict=True):
            if x.is_floating_point():
                assert float((x - y).norm()) <= tol * max(float(x.norm()), 1.0)
            else:
                assert torch.equal(x, y)  # num_batches_tracked: the client's own steps
        sa, sb = _opt_state(a), _opt_state(b)
        assert len(sa) == len(sb)
        for x, y in zip(sa, sb, strict=True):
            torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol)
        assert ta.keys() == tb.keys()
        for k in ta:  # tallied in float32 (metrics)
            assert ta[k] == pytest.approx(tb[k], rel=1e-6, abs=1e-7), k
        pa, pb = a.algorithm._train_protos, b.algorithm._train_protos
        np.testing.assert_array_equal(pa.class_ids, pb.class_ids)
        np.testing.assert_allclose(pa.vectors, pb.vectors, rtol=1e-6, atol=1e-7)  # float32 prototypes


@pytest.mark.parametrize(("optimizer", "hyper"), [("sgd", {"momentum": 0.9, "weight_decay": 1e-3}), ("adam", {})])
@pytest.mark.parametrize("drop_last", [False, True])
def test_two_lanes_for_five_clients_equal_each_client_alone(optimizer, hyper, drop_last):
    # 2, 4, 1, 3 and 2 batches an epoch: three clients enter a lane freed mid-run, next to a client
    # still training; with fold some steps have two shapes (a sub-group), with drop one
    sizes = [17, 33, 8, 25, 19]
    alone, lanes = (_double(_bn_members("fedproto", optimizer, sizes, **hyper)) for _ in range(2))
    for m in alone + lanes:
        m.batches.drop_last = drop_last
        m.optimizer.max_grad_norm = 0.05
    # a client that already holds optimizer state (training.keep_optimizer_state) enters a lane with it
    warm = _one_after_another([alone[4]], epochs=1) + _one_after_another([lanes[4]], epochs=1)
    assert warm[0] == warm[1]
    terms_alone = _one_after_another(alone)
    terms_lanes = batched.train_together(lanes, 2, CPU, lanes=2)
    _assert_same(alone, lanes, terms_alone, terms_lanes)


def test_one_lane_is_the_clients_one_after_another_and_many_lanes_today_s_batched_group():
    sizes = [17, 33, 8]
    alone, one, many = (_double(_bn_members("fedproto", "sgd", sizes, momentum=0.5)) for _ in range(3))
    terms_alone = _one_after_another(alone)
    _assert_same(alone, one, terms_alone, batched.train_together(one, 2, CPU, lanes=1))
    _assert_same(alone, many, terms_alone, batched.train_together(many, 2, CPU, lanes=10))


def test_a_client_with_an_empty_split_takes_its_lane_as_alone():
    # an empty split is one empty batch an epoch: a non-finite step, skipped, in either path
    sizes = [17, 0, 8]
    alone, lanes = (_double(_bn_members("fedavg", "sgd", sizes)) for _ in range(2))
    terms_alone = _one_after_another(alone)
    terms_lanes = batched.train_together(lanes, 2, CPU, lanes=1)
    assert terms_lanes[1] == terms_alone[1] == {"loss": 0.0, "nonfinite_steps": 2.0}
    for a, b in zip(alone, lanes, strict=True):
        for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("method", BATCHED)
def test_lanes_equal_one_after_another_per_method_with_a_resumed_host(method):
    """Five clients of different sample counts in two lanes (three swapped in mid-run), two rounds;
    then each host is rebuilt from its clients' state_dicts (a resumed run) and trains a third."""
    cfg, ds, part, public_x = _federation(method, "training.lr=0.05", "resources.lanes=2",
                                          "training.trailing_batch=drop", clients=5)
    assert len({len(c.train_idx) for c in part.clients}) > 1
    hosts, servers, metas = {}, {}, {}
    for mode in ("off", "lanes"):
        hosts[mode] = _host(cfg, ds, part, public_x, mode)
        servers[mode], metas[mode] = _train_rounds(hosts[mode], cfg, ds, public_x, 2)
        resumed = _host(cfg, ds, part, public_x, mode)
        resumed.load_state_dicts(hosts[mode].state_dicts())
        hosts[mode] = resumed
        metas[mode] += _train_rounds(resumed, cfg, ds, public_x, 1, servers[mode])[1]
    assert {t.dtype for ps in _params(hosts["lanes"]).values() for t in ps if t.is_floating_point()} == {torch.float64}
    assert _relative_gap(_params(hosts["off"]), _params(hosts["lanes"])) <= 1e-9  # the fixture's bound
    for off, on in zip(metas["off"], metas["lanes"], strict=True):
        assert [m["client_id"] for m in off] == [m["client_id"] for m in on]
        for a, b in zip(off, on, strict=True):
            assert a["terms"].keys() == b["terms"].keys()
            assert a["terms"]["loss"] == pytest.approx(b["terms"]["loss"], rel=1e-6, abs=1e-7)


def test_lanes_config_and_clear_errors():
    cfg = build_config({}, ["resources.batch_clients=lanes"])
    assert (cfg.resources.batch_clients, cfg.resources.lanes) == ("lanes", 8)
    assert build_config({}, ["resources.lanes=3"]).resources.lanes == 3
    with pytest.raises(ConfigError, match=r"resources.lanes"):
        build_config({}, ["resources.lanes=0"])


def test_lanes_batch_on_the_cpu_too():
    from rayfed_proto.runtime.client_core import batches_on

    assert batches_on("lanes", CPU) and batches_on("lanes", torch.device("cuda"))
