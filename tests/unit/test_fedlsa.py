"""FedLSA (papers/fedlsa.md Eq. 3-10) against values computed by hand."""

import math

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.fedlsa import (
    AnchorMapping,
    anchor_ce_loss,
    anchor_l2_loss,
    compactness_loss,
    separation_loss,
    train_anchors,
)
from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate, GlobalState
from rayfed_proto.models.zoo import ProtoModel

ALGO = ALGORITHMS.get("fedlsa")
CPU = torch.device("cpu")
# three unit anchors: a0 . a1 = 0, a0 . a2 = -1, a1 . a2 = 0
ANCHORS = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]


def tiny_model():
    """A real ProtoModel with FedLSA's parts: encoder (Linear 4 -> 6), 2-layer projector to 3,
    unit-sphere features, head to 3 classes."""
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 6), torch.nn.ReLU())
    return ProtoModel("tiny", backbone, 6, 3, 3, projector="mlp", normalize=True)


def tiny_spec(seed=0, num_clients=2):
    return FederationSpec(num_clients=num_clients, num_classes=3, feature_dim=3, seed=seed, build_model=tiny_model)


def fixed_spec():
    """FixedModel (features = x in 2-d, zero head over 3 classes) as the homogeneous model."""
    return FederationSpec(num_clients=2, num_classes=3, feature_dim=2, seed=0, build_model=lambda: FixedModel(2, 3))


def client_with(anchors=ANCHORS, **opts):
    client = ALGO.Client(ALGO.Options(**opts), fixed_spec(), client_id=0)
    model = FixedModel()
    client.receive(GlobalState(version=1, prototypes=pset(range(len(anchors)), anchors, [1] * len(anchors))), model)
    return client, model


# ----------------------------------------------------------------------------- options and config


def test_defaults_are_from_the_papers_grid():
    o = ALGO.Options()
    assert (o.lam, o.alpha, o.tau, o.server_epochs) == (0.7, 0.4, 0.1, 500)
    assert o.server_lr == 1.0  # FedAvg's mixing rate, not the anchors' learning rate
    assert (o.anchor_optimizer, o.anchor_lr, o.compactness) == ("sgd", 0.01, "vmf")
    with pytest.raises(ValueError):
        ALGO.Options(tau=0.0)


def test_config_defaults_give_the_hyperspherical_model():
    cfg = build_config({"algorithm": {"name": "fedlsa"}, "model": {"group": "HtFE1"}})
    assert (cfg.model.projector, cfg.model.normalize_features, cfg.data.global_test_fraction) == ("mlp", True, 0.2)
    cfg = build_config({"algorithm": {"name": "fedlsa"}, "model": {"group": "HtFE1", "projector": "linear"}})
    assert cfg.model.projector == "linear"  # overridable
    assert ALGO.requires_homogeneous_models


# ----------------------------------------------------------------------------- Eq. 3 and Eq. 4


def test_separation_loss_by_hand():
    a = torch.tensor(ANCHORS)
    # tau = 0.5: i=0: log((e^{0/0.5} + e^{-1/0.5}) / 2) = log((1 + e^-2) / 2); i=1: log((e^0 + e^0) / 2) = 0;
    # i=2: as i=0. Mean: (2/3) log((1 + e^-2) / 2)
    expected = 2 / 3 * math.log((1 + math.exp(-2)) / 2)
    assert separation_loss(a, 0.5).item() == pytest.approx(expected, rel=1e-6)
    # two identical anchors: log(e^{1/tau} / 1) = 1/tau = 10 at tau 0.1 (tau inside the exp)
    same = torch.tensor([[0.6, 0.8], [0.6, 0.8]])
    assert separation_loss(same, 0.1).item() == pytest.approx(10.0, rel=1e-5)
    assert separation_loss(a[:1], 0.1).item() == 0.0  # one anchor: no pair


def test_anchor_ce_loss_by_hand_and_the_classifier_stays_frozen():
    w = torch.eye(2, requires_grad=True)
    b = torch.tensor([0.0, 1.0], requires_grad=True)
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    # logits a0: [1, 0 + 1] = [1, 1] -> CE = log 2; a1: [0, 2] -> CE(target 1) = log(1 + e^-2)
    loss = anchor_ce_loss(a, w, b)
    assert loss.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(-2))) / 2, rel=1e-6)
    loss.backward()
    assert w.grad is None and b.grad is None  # phi_glo is frozen
    assert a.grad is not None and a.grad.abs().sum() > 0


def test_anchor_training_against_a_fixed_classifier_puts_each_anchor_in_its_class():
    torch.manual_seed(0)
    mapping = AnchorMapping(num_classes=3, input_dim=4, hidden_dim=8, anchor_dim=3)
    opt = torch.optim.SGD(mapping.parameters(), lr=0.5)
    w, b = 5 * torch.eye(3), torch.zeros(3)
    first = train_anchors(mapping, opt, w, b, alpha=0.0, tau=0.1, epochs=1)
    last = train_anchors(mapping, opt, w, b, alpha=0.0, tau=0.1, epochs=100)
    assert last["anchor_ace"] < first["anchor_ace"]
    with torch.no_grad():
        anchors = mapping()
    assert torch.allclose(anchors.norm(dim=1), torch.ones(3), atol=1e-6)  # on the unit sphere
    assert (anchors @ w.T + b).argmax(1).tolist() == [0, 1, 2]  # anchor i is classified as i
    # a zero classifier gives L_ACE no gradient (constant ln 3): L_SEP alone spreads the anchors apart,
    # towards its minimum for 3 unit vectors, the equilateral triangle: every a_i . a_j = -1/2, so
    # L_SEP = log(e^{-0.5 / 0.1}) = -5
    torch.manual_seed(1)
    mapping = AnchorMapping(num_classes=3, input_dim=4, hidden_dim=32, anchor_dim=3)
    opt = torch.optim.SGD(mapping.parameters(), lr=0.1)
    off = ~torch.eye(3, dtype=torch.bool)
    first = train_anchors(mapping, opt, torch.zeros(3, 3), torch.zeros(3), alpha=1.0, tau=0.1, epochs=1)
    last = train_anchors(mapping, opt, torch.zeros(3, 3), torch.zeros(3), alpha=1.0, tau=0.1, epochs=100)
    assert first["anchor_ace"] == pytest.approx(math.log(3), rel=1e-6)
    assert first["anchor_sep"] > 0 and last["anchor_sep"] == pytest.approx(-5.0, abs=0.05)
    with torch.no_grad():
        cos = (mapping() @ mapping().T)[off]
    torch.testing.assert_close(cos, torch.full((6,), -0.5), atol=0.02, rtol=0)


# ----------------------------------------------------------------------------- Eq. 8-10 on the client


def test_compactness_loss_by_hand():
    a = torch.tensor(ANCHORS)
    h = torch.tensor([[1.0, 0.0]])
    # tau 0.5: logits a_j . h / tau = [2, 0, -2] -> -log(e^2 / (e^2 + 1 + e^-2)) = log(1 + e^-2 + e^-4)
    expected = math.log(1 + math.exp(-2) + math.exp(-4))
    assert compactness_loss(h, torch.tensor([0]), a, 0.5).item() == pytest.approx(expected, rel=1e-6)
    # class 2 without anchor: out of the softmax -> log(1 + e^-2); a sample of class 2 is skipped
    mask = torch.tensor([True, True, False])
    assert compactness_loss(h, torch.tensor([0]), a, 0.5, mask).item() == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)
    both = compactness_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 2]), a, 0.5, mask)
    assert both.item() == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)


X = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
Y = torch.tensor([0, 1])
# tau 0.5: sample 0 logits [2, 0, -2] -> log(1 + e^-2 + e^-4); sample 1 (h = (0, 1)) logits [0, 2, 0]
# -> log(1 + 2 e^-2). FixedModel: zero head -> CE = ln 3.
COM = (math.log(1 + math.exp(-2) + math.exp(-4)) + math.log(1 + 2 * math.exp(-2))) / 2


def test_client_loss_is_ce_plus_lambda_com():
    client, model = client_with(lam=0.7, tau=0.5)
    loss, terms = client.loss(model, X, Y)
    assert set(terms) == {"ce", "com"}
    assert terms["ce"] == pytest.approx(math.log(3), rel=1e-6)
    assert terms["com"] == pytest.approx(COM, rel=1e-6)
    assert loss.item() == pytest.approx(math.log(3) + 0.7 * COM, rel=1e-6)
    # features of any length are put on the sphere for L_COM (identity on FedLSA's unit h)
    assert client.loss(model, 3 * X, Y)[1]["com"] == pytest.approx(COM, rel=1e-6)


def test_zero_lambda_leaves_com_out_but_logs_it():
    client, model = client_with(lam=0.0, tau=0.5)
    x = X.clone().requires_grad_(True)
    loss, terms = client.loss(model, x, Y)
    assert loss.item() == pytest.approx(math.log(3), rel=1e-6)
    assert terms["com"] == pytest.approx(COM, rel=1e-6)
    loss.backward()
    assert x.grad.abs().sum() == 0  # zero head: CE has no gradient to the features, and L_COM is off


def test_l2_compactness_variant_of_the_ablation_by_hand():
    a = torch.tensor(ANCHORS)
    # ||(1,0) - a_0||^2 = 0, ||(0,1) - a_0||^2 = 1 + 1 = 2 -> mean 1
    assert anchor_l2_loss(X, torch.tensor([0, 0]), a).item() == pytest.approx(1.0)
    # ||(1,0) - a_1||^2 = 2; the second sample's class 2 has no anchor: skipped -> 2
    assert anchor_l2_loss(X, torch.tensor([1, 2]), a, torch.tensor([True, True, False])).item() == pytest.approx(2.0)
    client, model = client_with(lam=0.5, tau=0.5, compactness="l2")
    loss, terms = client.loss(model, X, torch.tensor([0, 2]))
    # sample 0 on a_0: 0; sample 1, (0, 1) against a_2 = (-1, 0): 1 + 1 = 2 -> mean 1
    assert terms["com"] == pytest.approx(1.0) and loss.item() == pytest.approx(math.log(3) + 0.5, rel=1e-6)


def test_client_without_anchors_trains_on_ce_only():
    client = ALGO.Client(ALGO.Options(), fixed_spec(), 0)
    model = FixedModel()
    client.receive(GlobalState(version=0), model)
    loss, terms = client.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3)) and terms["com"] == 0.0
    assert client.inference_bank() is None


# ----------------------------------------------------------------------------- server


def test_server_broadcasts_weights_and_unit_anchors_for_every_class_from_version_zero():
    server = ALGO.Server(ALGO.Options(server_epochs=5), tiny_spec(), CPU)
    state = server.broadcast(0)
    assert set(state.weights) == set(tiny_model().state_dict())
    assert state.prototypes.class_ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(state.prototypes.vectors, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(server.guidance_bank().vectors, state.prototypes.vectors)
    assert server.global_model().head.weight.shape == (3, 3)


def test_server_averages_weights_then_learns_anchors_on_the_new_classifier():
    server = ALGO.Server(ALGO.Options(server_epochs=20, anchor_lr=0.1), tiny_spec(), CPU)
    w0 = {k: np.zeros_like(v) for k, v in server.global_weights.items()}
    w1 = {k: np.ones_like(v) for k, v in server.global_weights.items()}
    before = server.broadcast(0).prototypes.vectors.copy()
    metrics = server.aggregate([ClientUpdate(0, 0, 1, weights=w0), ClientUpdate(1, 0, 3, weights=w1)], [1.0, 1.0], 1)
    # FedAvg: (1 * 0 + 3 * 1) / 4 = 0.75 in every float tensor
    np.testing.assert_allclose(server.global_weights["head.weight"], 0.75)
    assert metrics["server_mixing_rate"] == 1.0 and {"anchor_loss", "anchor_ace", "anchor_sep"} <= set(metrics)
    assert metrics["anchor_loss"] == pytest.approx(metrics["anchor_ace"] + 0.4 * metrics["anchor_sep"], rel=1e-5)
    assert not np.allclose(server.broadcast(1).prototypes.vectors, before)  # trained again at this version
    assert server.aggregate([], [], 2) == {}  # nothing uploaded: nothing trained


def test_zero_server_epochs_keeps_the_initial_anchors():
    server = ALGO.Server(ALGO.Options(server_epochs=0), tiny_spec(), CPU)
    before = server.broadcast(0).prototypes.vectors.copy()
    with torch.no_grad():
        np.testing.assert_allclose(before, server.mapping().numpy(), rtol=1e-6)  # A = nor(Theta(R)) untrained
    w = {k: v + 1.0 for k, v in server.global_weights.items()}
    server.aggregate([ClientUpdate(0, 0, 2, weights=w)], [1.0], 1)
    np.testing.assert_array_equal(server.broadcast(1).prototypes.vectors, before)


def test_server_is_seeded():
    a = ALGO.Server(ALGO.Options(server_epochs=3), tiny_spec(seed=4), CPU).broadcast(0)
    b = ALGO.Server(ALGO.Options(server_epochs=3), tiny_spec(seed=4), CPU).broadcast(0)
    np.testing.assert_array_equal(a.prototypes.vectors, b.prototypes.vectors)


# ----------------------------------------------------------------------------- round trip and state


def _train_round(server, version, clients, models, data):
    state = server.broadcast(version - 1)
    updates = []
    for client, model, (x, y) in zip(clients, models, data, strict=True):
        client.receive(state, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        terms = client.local_train(model, opt, TrainBatchIterator(x, y, 4, torch.Generator().manual_seed(0)), 1, CPU)
        assert set(terms) == {"loss", "ce", "com", "nonfinite_steps"}
        updates.append(client.make_update(model, x, y))
    return updates


@pytest.mark.parametrize("anchor_optimizer", ["sgd", "adam"])
def test_round_trip_and_state_dict_restores_identical_broadcasts(anchor_optimizer):
    torch.manual_seed(0)
    opts = ALGO.Options(server_epochs=10, anchor_optimizer=anchor_optimizer, anchor_momentum=0.9, anchor_lr=0.05)
    server = ALGO.Server(opts, tiny_spec(), CPU)
    clients = [ALGO.Client(opts, tiny_spec(), k) for k in range(2)]
    models = [tiny_model() for _ in range(2)]
    # client 1 holds class 2 alone (class held by one client)
    data = [(torch.randn(8, 4), torch.tensor([0, 1] * 4)), (torch.randn(8, 4), torch.tensor([1, 2] * 4))]
    v0 = server.broadcast(0).prototypes.vectors.copy()
    updates = _train_round(server, 1, clients, models, data)
    assert all(u.weights is not None and u.prototypes is None for u in updates)  # weights only (FedAvg path)
    np.testing.assert_array_equal(clients[0].inference_bank().vectors, v0)  # predicts with the anchors it received
    server.aggregate(updates, [1.0, 1.0], 1)

    state = server.state_dict()
    fresh = ALGO.Server(opts, tiny_spec(seed=9), CPU)  # other seed: everything must come from the state
    fresh.load_state_dict(state)
    a, b = server.broadcast(1), fresh.broadcast(1)
    np.testing.assert_array_equal(a.prototypes.vectors, b.prototypes.vectors)
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])
    # R, Theta and the optimizer state (momentum / Adam moments) were restored: the next version is identical
    updates = _train_round(server, 2, clients, models, data)
    server.aggregate(updates, [1.0, 0.5], 2)
    fresh.aggregate(updates, [1.0, 0.5], 2)
    np.testing.assert_allclose(fresh.broadcast(2).prototypes.vectors, server.broadcast(2).prototypes.vectors, rtol=0, atol=1e-7)
    # the saved state is a copy: training on does not change it (the runtime rolls back with it)
    assert not np.allclose(np.asarray(state["anchors"]), server.broadcast(2).prototypes.vectors)
    again = ALGO.Server(opts, tiny_spec(seed=5), CPU)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.broadcast(1).prototypes.vectors, a.prototypes.vectors)
