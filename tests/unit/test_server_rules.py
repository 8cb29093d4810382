"""Asynchronous server rules of the weight-sharing methods (mix, FedAsync, FedBuff) against
numbers computed by hand; the reduction to FedAvg in sync mode for FedAvg, FedLSA and FedSC;
option errors; state round trip."""

import numpy as np
import pytest
import torch

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.async_weights import (
    average_weights,
    fedbuff_step,
    mix_step,
    model_delta,
    staleness_scale,
)
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.config import ConfigError, build_config
from rayfed_proto.messages import ClientUpdate
from rayfed_proto.models.zoo import ProtoModel

CPU = torch.device("cpu")
WEIGHT_SHARING = ["fedavg", "fedlsa", "fedsc"]


# ----------------------------------------------------------------------------- staleness functions

@pytest.mark.parametrize("staleness,expected", [(0, 1.0), (3, 1.0), (40, 1.0)])
def test_constant_staleness_is_one(staleness, expected):
    assert staleness_scale("constant", staleness, exponent=0.5) == expected


@pytest.mark.parametrize("staleness,a,expected", [
    (0, 0.5, 1.0),            # (0 + 1)^(-1/2)
    (3, 0.5, 0.5),            # (3 + 1)^(-1/2) = 1/2: FedBuff's 1/sqrt(1 + 3)
    (8, 0.5, 1.0 / 3.0),      # 9^(-1/2)
    (1, 1.0, 0.5),            # 2^(-1)
    (3, 2.0, 1.0 / 16.0),     # 4^(-2)
])
def test_polynomial_staleness_by_hand(staleness, a, expected):
    assert staleness_scale("polynomial", staleness, exponent=a) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("staleness,expected", [
    (0, 1.0), (4, 1.0),       # t - tau <= b = 4: not discounted
    (5, 1.0 / 11.0),          # 1 / (10 (5 - 4) + 1)
    (6, 1.0 / 21.0),          # 1 / (10 (6 - 4) + 1)
])
def test_hinge_staleness_by_hand(staleness, expected):
    assert staleness_scale("hinge", staleness, exponent=0.5, hinge_a=10.0, hinge_b=4.0) == pytest.approx(expected, rel=1e-12)


def test_hinge_with_other_a_b_and_negative_staleness_refused():
    assert staleness_scale("hinge", 3, exponent=0.5, hinge_a=0.5, hinge_b=1.0) == pytest.approx(0.5)  # 1 / (0.5 * 2 + 1)
    with pytest.raises(ValueError, match="staleness"):
        staleness_scale("polynomial", -1, exponent=0.5)


# ----------------------------------------------------------------------------- one step by hand

def _w(value, n=0):
    return {"w": np.array([value, 2.0 * value], np.float32), "n": np.array(n, np.int64)}


def test_fedasync_single_update_step_by_hand():
    # x = [1, 2], x_new = [5, 10], staleness 3, alpha 0.6, polynomial a = 1/2: alpha_t = 0.6 * 0.5 = 0.3
    s = staleness_scale("polynomial", 3, exponent=0.5)
    new, rate = mix_step(_w(1.0, 10), [_w(5.0, 20)], [s], [7], rate_factor=0.6)
    assert rate == pytest.approx(0.3)
    np.testing.assert_allclose(new["w"], [0.7 * 1 + 0.3 * 5, 0.7 * 2 + 0.3 * 10], rtol=1e-6)  # [2.2, 4.4]
    assert new["n"] == 13 and new["n"].dtype == np.int64  # rint(0.7 * 10 + 0.3 * 20) = 13


def test_fedasync_buffer_is_one_step_with_sample_weighted_rate():
    # two updates, s = 1 and 0.5, n = 1 and 2: x_avg = (1*1*a + 0.5*2*b) / 2, rate = alpha * (1 + 1) / 3
    a, b = _w(4.0), _w(8.0)
    new, rate = mix_step(_w(0.0), [a, b], [1.0, 0.5], [1, 2], rate_factor=0.9)
    assert rate == pytest.approx(0.9 * 2.0 / 3.0)
    np.testing.assert_allclose(new["w"], rate * np.array([6.0, 12.0]), rtol=1e-6)  # x_avg = [6, 12], x = 0


def test_fedbuff_step_by_hand_samples_and_uniform():
    x = _w(1.0, 10)
    d1 = {"w": np.array([2.0, -2.0], np.float32), "n": np.array(4, np.int64)}
    d2 = {"w": np.array([4.0, 0.0], np.float32), "n": np.array(6, np.int64)}
    s1, s2 = 1.0, staleness_scale("polynomial", 3, exponent=0.5)  # 1 and 1/2
    # samples (n = 1, 3): Delta_bar = (1*1*d1 + 0.5*3*d2) / 4 = ([2, -2] + [6, 0]) / 4 = [2, -0.5]; eta_g = 0.5
    new, scale = fedbuff_step(x, [d1, d2], [s1, s2], [1, 3], server_lr=0.5, weighting="samples")
    np.testing.assert_allclose(new["w"], [1.0 + 0.5 * 2.0, 2.0 + 0.5 * -0.5], rtol=1e-6)  # [2, 1.75]
    assert scale == pytest.approx(0.5 * 2.5 / 4)
    assert new["n"] == 12 and new["n"].dtype == np.int64  # rint(10 + 0.5 * (4 + 9) / 4) = rint(11.625)
    # uniform (as printed): Delta_bar = (1 * d1 + 0.5 * d2) / K = ([2, -2] + [2, 0]) / 2 = [2, -1]; eta_g = 1
    new, scale = fedbuff_step(x, [d1, d2], [s1, s2], [1, 3], server_lr=1.0, weighting="uniform")
    np.testing.assert_allclose(new["w"], [3.0, 1.0], rtol=1e-6)
    assert scale == pytest.approx(0.75)


def test_model_delta_keeps_dtypes_and_is_exact_for_integers():
    d = model_delta({"w": np.array([3.5], np.float32), "n": np.array(7, np.int64)},
                    {"w": np.array([1.0], np.float32), "n": np.array(5, np.int64)})
    assert d["w"].dtype == np.float32 and d["w"][0] == 2.5
    assert d["n"].dtype == np.int64 and d["n"] == 2
    with pytest.raises(ValueError, match="keys"):
        model_delta({"w": np.zeros(1)}, {"v": np.zeros(1)})


# ----------------------------------------------------------------------------- servers and clients

def tiny_model():
    """A ProtoModel with a BatchNorm (integer num_batches_tracked) and FedLSA's parts."""
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    return ProtoModel("tiny", backbone, 6, 3, 3, projector="mlp", normalize=True)


def spec(seed=0):
    return FederationSpec(num_clients=3, num_classes=3, feature_dim=3, seed=seed, build_model=tiny_model)


def options(name, **kw):
    extra = {"server_epochs": 2} if name == "fedlsa" else {}
    return ALGORITHMS.get(name).Options(**extra, **kw)


DATA = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(k)), torch.tensor([0, 1, 2, 0, 1, 2, k % 3, 0]))
        for k in range(3)]
SIZES = [8, 5, 7]  # different sample counts: the sample weighting matters


def train_round(name, opts, server, version, clients=None):
    """One synchronous round against ``server.broadcast(version - 1)``; returns the updates."""
    algo = ALGORITHMS.get(name)
    clients = clients or [algo.Client(opts, spec(), k) for k in range(3)]
    state = server.broadcast(version - 1)
    updates = []
    for client, (x, y), n in zip(clients, DATA, SIZES, strict=True):
        torch.manual_seed(100 + client.client_id)
        model = tiny_model()
        client.receive(state, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        client.local_train(model, opt, TrainBatchIterator(x[:n], y[:n], 4, torch.Generator().manual_seed(1)), 1, CPU)
        updates.append(client.make_update(model, x[:n], y[:n]))
    return updates


@pytest.mark.parametrize("name", WEIGHT_SHARING)
@pytest.mark.parametrize("rule,kw", [
    ("mix", {}),
    ("fedasync", {"fedasync_alpha": 1.0}),
    ("fedasync", {"fedasync_alpha": 1.0, "staleness_function": "hinge", "hinge_b": 0.0}),
    ("fedbuff", {}),
    ("fedbuff", {"staleness_function": "constant"}),
])
def test_sync_round_is_fedavg_for_every_policy(name, rule, kw):
    """Staleness 0 and the whole round in the buffer: every rule (at rate 1) gives FedAvg's
    sample-weighted average of the trained models, BatchNorm counters included."""
    fedavg_opts, opts = options(name), options(name, server_rule=rule, **kw)
    reference, server = ALGORITHMS.get(name).Server(fedavg_opts, spec(), CPU), ALGORITHMS.get(name).Server(opts, spec(), CPU)
    plain = train_round(name, fedavg_opts, reference, 1)  # full models (mix is today's FedAvg path)
    ups = train_round(name, opts, server, 1)
    for p, u in zip(plain, ups, strict=True):  # same training: fedbuff uploads exactly y_Q - y_0
        for k in p.weights:
            start = server.global_weights[k]
            expected = p.weights[k] - start if rule == "fedbuff" else p.weights[k]
            np.testing.assert_array_equal(u.weights[k], expected.astype(start.dtype))
    fedavg = average_weights([p.weights for p in plain], [float(u.num_samples) for u in plain])  # FedAvg, by hand
    metrics = server.aggregate(ups, [1.0] * 3, version=1)
    assert metrics["server_mixing_rate"] == pytest.approx(1.0)
    got = server.broadcast(1).weights
    assert any("num_batches_tracked" in k for k in got)
    for k, v in fedavg.items():
        assert got[k].dtype == v.dtype
        if rule == "fedbuff":  # x + mean delta: float rounding only
            np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("rule", ["fedasync", "fedbuff"])
def test_rate_below_one_in_sync_is_not_fedavg(rule):
    # the sync test above can fail: with alpha / eta_g = 0.5 the step is half way
    kw = {"fedasync_alpha": 0.5} if rule == "fedasync" else {"server_lr": 0.5}
    opts = options("fedavg", server_rule=rule, **kw)
    server = ALGORITHMS.get("fedavg").Server(opts, spec(), CPU)
    x0 = {k: v.copy() for k, v in server.global_weights.items()}
    plain = train_round("fedavg", options("fedavg"), ALGORITHMS.get("fedavg").Server(options("fedavg"), spec(), CPU), 1)
    fedavg = average_weights([p.weights for p in plain], [float(u.num_samples) for u in plain])
    assert server.aggregate(train_round("fedavg", opts, server, 1), [1.0] * 3, 1)["server_mixing_rate"] == pytest.approx(0.5)
    w = server.global_weights["head.weight"]
    np.testing.assert_allclose(w, 0.5 * x0["head.weight"] + 0.5 * fedavg["head.weight"], atol=1e-6)
    assert not np.allclose(w, fedavg["head.weight"], atol=1e-6)


def _server_with(weights, rule, **kw):
    algo = ALGORITHMS.get("fedavg")
    server = algo.Server(algo.Options(server_rule=rule, **kw),
                         FederationSpec(num_clients=3, num_classes=2, feature_dim=2, seed=0,
                                        build_model=lambda: torch.nn.Linear(2, 2, bias=False)), CPU)
    server.global_weights = {"weight": np.full((2, 2), weights, np.float32)}
    return server


def test_fedasync_server_uses_its_staleness_function_not_the_runtime_weight():
    # version 5 being produced, trained on version 0: staleness 4; hinge b = 4 -> s = 1, alpha = 0.6
    server = _server_with(0.0, "fedasync", staleness_function="hinge")
    up = ClientUpdate(0, 0, 3, weights={"weight": np.full((2, 2), 10.0, np.float32)})
    metrics = server.aggregate([up], [0.01], version=5)  # the runtime's weight (0.01) is not used
    assert metrics["server_mixing_rate"] == pytest.approx(0.6)
    np.testing.assert_allclose(server.global_weights["weight"], 6.0)
    # one version staler: s = 1 / (10 * 1 + 1), alpha_t = 0.6 / 11
    server = _server_with(0.0, "fedasync", staleness_function="hinge")
    server.aggregate([up], [1.0], version=6)
    np.testing.assert_allclose(server.global_weights["weight"], 10.0 * 0.6 / 11, rtol=1e-6)


def test_fedbuff_server_scales_stale_deltas_by_inverse_sqrt():
    # polynomial with federation.staleness_exponent 0.5 (the FederationSpec default): s(3) = 1/2
    server = _server_with(1.0, "fedbuff", server_lr=2.0)
    fresh = ClientUpdate(0, 4, 2, weights={"weight": np.full((2, 2), 1.0, np.float32)})  # staleness 0
    stale = ClientUpdate(1, 1, 2, weights={"weight": np.full((2, 2), 4.0, np.float32)})  # staleness 3
    metrics = server.aggregate([fresh, stale], [1.0, 1.0], version=5)
    # Delta_bar = (1 * 2 * 1 + 0.5 * 2 * 4) / 4 = 1.5; x = 1 + 2 * 1.5 = 4
    np.testing.assert_allclose(server.global_weights["weight"], 4.0)
    assert metrics["server_mixing_rate"] == pytest.approx(2.0 * 3.0 / 4.0)


def test_mix_is_unchanged_and_uses_the_runtime_weights():
    server = _server_with(0.0, "mix")
    u = [ClientUpdate(0, 0, 1, weights={"weight": np.ones((2, 2), np.float32)}),
         ClientUpdate(1, 0, 3, weights={"weight": np.full((2, 2), 5.0, np.float32)})]
    assert server.aggregate(u, [0.5, 0.5], version=9)["server_mixing_rate"] == pytest.approx(0.5)
    np.testing.assert_allclose(server.global_weights["weight"], 2.0)  # average 4 mixed in at 0.5


def test_fedbuff_client_needs_local_train_before_make_update():
    algo = ALGORITHMS.get("fedavg")
    client = algo.Client(algo.Options(server_rule="fedbuff"), spec(), 0)
    model = tiny_model()
    with pytest.raises(RuntimeError, match="y_0"):
        client.make_update(model, DATA[0][0], DATA[0][1])


def test_fedbuff_start_snapshot_is_not_kept_after_the_upload():
    algo = ALGORITHMS.get("fedavg")
    opts = algo.Options(server_rule="fedbuff")
    client = algo.Client(opts, spec(), 0)
    train_round("fedavg", opts, algo.Server(opts, spec(), CPU), 1, clients=[client] + [algo.Client(opts, spec(), k) for k in (1, 2)])
    assert client._start is None  # no model-sized state left on the client between updates
    assert client.state_dict() == {"version": 0}


# ----------------------------------------------------------------------------- state round trip

@pytest.mark.parametrize("name", WEIGHT_SHARING)
@pytest.mark.parametrize("rule", ["fedasync", "fedbuff"])
def test_state_dict_round_trip_continues_identically(name, rule):
    algo = ALGORITHMS.get(name)
    opts = options(name, server_rule=rule)
    server = algo.Server(opts, spec(), CPU)
    server.aggregate(train_round(name, opts, server, 1), [1.0] * 3, 1)
    state = server.state_dict()
    fresh = algo.Server(opts, spec(seed=9), CPU)  # another seed: everything must come from the state
    fresh.load_state_dict(state)
    # a stale buffer next: uploads labelled base version 0 while version 2 is produced (staleness 1)
    ups = train_round(name, opts, server, 1)
    server.aggregate(ups, [0.7] * 3, 2)
    fresh.aggregate(ups, [0.7] * 3, 2)
    a, b = server.broadcast(2).weights, fresh.broadcast(2).weights
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ----------------------------------------------------------------------------- options and config

def _issues(raw):
    with pytest.raises(ConfigError) as exc:
        build_config(raw)
    return {i.key: i for i in exc.value.issues}


@pytest.mark.parametrize("name", WEIGHT_SHARING)
def test_defaults_keep_mix_and_the_papers_values(name):
    o = build_config({"algorithm": {"name": name}, "model": {"group": "HtFE1"}}).algorithm_options()
    assert (o.server_rule, o.server_lr, o.fedasync_alpha, o.staleness_function, o.hinge_a, o.hinge_b,
            o.fedbuff_weighting) == ("mix", 1.0, 0.6, "polynomial", 10.0, 4.0, "samples")


@pytest.mark.parametrize("key,value,needle", [
    ("server_rule", "bogus", "mix"),
    ("staleness_function", "exponential", "hinge"),
    ("fedasync_alpha", 1.5, "1"),
    ("fedasync_alpha", 0.0, "0"),
    ("hinge_a", 0.0, "0"),
    ("hinge_b", -1.0, "0"),
    ("fedbuff_weighting", "median", "samples"),
])
def test_bad_option_values_name_the_key(key, value, needle):
    issues = _issues({"algorithm": {"name": "fedavg", key: value}, "model": {"group": "HtFE1"}})
    issue = issues[f"algorithm.{key}"]
    assert issue.value == value and needle in issue.allowed


def test_server_lr_above_one_only_with_fedbuff():
    issue = _issues({"algorithm": {"name": "fedlsa", "server_lr": 2.0}, "model": {"group": "HtFE1"}})["algorithm.server_lr"]
    assert issue.value == 2.0 and "fedbuff" in issue.allowed
    ok = build_config({"algorithm": {"name": "fedsc", "server_lr": 2.0, "server_rule": "fedbuff"}, "model": {"group": "HtFE1"}})
    assert ok.algorithm_options().server_lr == 2.0


@pytest.mark.parametrize("name", WEIGHT_SHARING)
def test_the_old_key_async_policy_still_works_with_a_warning_and_both_names_at_once_are_refused(name):
    # issue 37: the server-side weighting rules are algorithm.server_rule; "policy" is the federation's
    base = {"name": name}
    with pytest.warns(FutureWarning, match="algorithm.async_policy is now algorithm.server_rule"):
        cfg = build_config({"algorithm": {**base, "async_policy": "fedasync"}, "model": {"group": "HtFE1"}})
    assert cfg.algorithm_options().server_rule == "fedasync" and "async_policy" not in cfg.to_yaml()
    issue = _issues({"algorithm": {**base, "async_policy": "fedbuff", "server_rule": "mix"},
                     "model": {"group": "HtFE1"}})["algorithm.server_rule"]
    assert "async_policy='fedbuff'" in repr(issue.value) and "old name of server_rule" in issue.allowed
