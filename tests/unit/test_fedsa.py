"""FedSA (papers/fedsa.md Eq. 5-10) against values computed by hand."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.common import nearest_prototype_predict
from rayfed_proto.algorithms.fedsa import (
    classifier_calibration_loss,
    client_margin,
    ema_update,
    initial_anchors,
    margin_statistic,
    mcl_loss,
    project_anchors,
)
from rayfed_proto.messages import ClientUpdate, GlobalState

ALGO = ALGORITHMS.get("fedsa")
SPEC = FederationSpec(num_clients=4, num_classes=3, feature_dim=2, seed=0)
CPU = torch.device("cpu")
# three points with d01 = 5, d02 = 1, d12 = sqrt(3^2 + 3^2) = sqrt(18)
POINTS = [[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]]
PAIRWISE = (5 + 1 + math.sqrt(18)) / 3  # mean over the 3 pairs
NEAREST = (1 + math.sqrt(18) + 1) / 3  # nearest other: 0 -> 2 (1), 1 -> 2 (sqrt 18), 2 -> 0 (1)



class TwoPartModel(torch.nn.Module):
    """A trainable feature extractor (Linear) and a head, to see where gradients go."""

    def __init__(self, dim=2, num_classes=3):
        super().__init__()
        self.extractor = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, num_classes)

    def features(self, x):
        return self.extractor(x)

    def forward_features(self, x):
        f = self.features(x)
        return f, self.head(f)



def anchors_state(version, vecs=POINTS):
    return GlobalState(version=version, prototypes=pset(range(len(vecs)), vecs, [1] * len(vecs)))


def client_with(version=0, vecs=POINTS, **opts):
    client = ALGO.Client(ALGO.Options(**opts), SPEC, client_id=0)
    model = FixedModel()
    client.receive(anchors_state(version, vecs), model)
    return client, model


# ----------------------------------------------------------------------------- options


def test_defaults_are_the_authors_scripts():
    # lokinko/FedSA, system/cross-device setting.sh: -lam 10 -mcl 1.0 -cc 1.0, L_R as nn.MSELoss
    o = ALGO.Options()
    assert (o.lam, o.lambda2, o.lambda3, o.alpha) == (10.0, 1.0, 1.0, 0.9999)
    assert o.alignment_reduction == "mean" and o.inference_bank == "prototypes"
    # lokinko/FedSA clientsa.py cal_local_gap / cal_global_gap (mean nearest-other-class distance)
    # and serversa.py proto_aggregation (plain mean over the uploading clients)
    assert o.margin_statistic == "mean_nearest" and o.aggregation == "uniform"
    assert o.use_embedding_projection and o.use_ema
    with pytest.raises(ValueError):
        ALGO.Options(alpha=1.5)


# ----------------------------------------------------------------------------- Eq. 6 and the margin


def test_margin_statistic_both_kinds_by_hand():
    v = torch.tensor(POINTS)
    assert margin_statistic(v, "mean_pairwise") == pytest.approx(PAIRWISE, rel=1e-5)
    assert margin_statistic(v, "mean_nearest") == pytest.approx(NEAREST, rel=1e-5)
    assert margin_statistic(v[:1], "mean_pairwise") == 0.0  # one class: no margin
    with pytest.raises(ValueError):
        margin_statistic(v, "median")


def test_client_margin_is_max_of_global_and_local():
    anchors = torch.tensor(POINTS)  # d_global = NEAREST = 2.08 (authors' statistic, the default)
    assert client_margin(anchors, None) == pytest.approx(NEAREST, rel=1e-5)  # before any upload: d_local = 0
    assert client_margin(anchors, torch.tensor([[50.0, 0.0]])) == pytest.approx(NEAREST, rel=1e-5)  # 1 class: global
    assert client_margin(anchors, torch.tensor([[0.0, 0.0], [1.0, 0.0]])) == pytest.approx(NEAREST, rel=1e-5)  # local 1 < global
    assert client_margin(anchors, torch.tensor([[0.0, 0.0], [10.0, 0.0]])) == pytest.approx(10.0, rel=1e-5)  # local wins
    assert client_margin(anchors, None, "mean_pairwise") == pytest.approx(PAIRWISE, rel=1e-5)  # Eq. 6 as printed


def test_client_margin_uses_its_last_upload():
    client, model = client_with(version=1)
    assert client.margin() == pytest.approx(NEAREST, rel=1e-5)  # no upload yet: the anchors' statistic
    x = torch.tensor([[0.0, 0.0], [10.0, 0.0], [10.0, 0.0]])
    client.make_update(model, x, torch.tensor([0, 1, 1]))  # local prototypes (0,0) and (10,0): d_local = 10
    assert client.margin() == pytest.approx(10.0, rel=1e-5)
    client.make_update(model, x[:1], torch.tensor([0]))  # one local class: back to d_global
    assert client.margin() == pytest.approx(NEAREST, rel=1e-5)
    printed, model = client_with(version=1, margin_statistic="mean_pairwise")
    assert printed.margin() == pytest.approx(PAIRWISE, rel=1e-5)


# ----------------------------------------------------------------------------- Eq. 7 and Eq. 8


def test_mcl_loss_one_sample_two_classes_by_hand():
    f = torch.tensor([[0.0, 0.0]])
    y = torch.tensor([0])
    anchors = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    # distances [~0, 5]; margin 1 on the true class -> logits [-1, -5]: CE = log(1 + e^-4)
    assert mcl_loss(f, y, anchors, 1.0).item() == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-4)
    # no margin -> logits [0, -5]: log(1 + e^-5)
    assert mcl_loss(f, y, anchors, 0.0).item() == pytest.approx(math.log(1 + math.exp(-5)), rel=1e-4)
    # a class without anchor leaves the softmax; a sample of such a class is skipped
    three = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.1]])
    mask = torch.tensor([True, True, False])
    assert mcl_loss(f, y, three, 1.0, mask).item() == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-4)
    both = mcl_loss(torch.zeros(2, 2), torch.tensor([0, 2]), three, 1.0, mask)
    assert both.item() == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-4)


def test_classifier_calibration_by_hand_and_only_the_head_learns():
    head = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # logits h(A^0) = [1, 0], h(A^1) = [0, 1]: each CE = log(1 + e^-1)
    assert classifier_calibration_loss(head, anchors).item() == pytest.approx(math.log(1 + math.exp(-1)), rel=1e-5)

    model = TwoPartModel()
    feats = model.features(torch.randn(3, 2))  # anchors that came out of the extractor: still detached
    assert feats.requires_grad
    loss = classifier_calibration_loss(model.head, feats)
    loss.backward()
    assert model.extractor.weight.grad is None and model.extractor.bias.grad is None
    assert model.head.weight.grad is not None and model.head.weight.grad.abs().sum() > 0


def test_client_cc_term_reaches_only_the_head():
    client = ALGO.Client(ALGO.Options(lam=0.0, lambda2=0.0, lambda3=1.0), SPEC, 0)
    model = TwoPartModel()
    client.receive(anchors_state(1), model)
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 0])
    loss, terms = client.loss(model, x, y)
    assert terms["cc"] == pytest.approx(classifier_calibration_loss(model.head, torch.tensor(POINTS)).item(), rel=1e-6)
    g_total = torch.autograd.grad(loss, model.extractor.weight)[0]
    g_ce = torch.autograd.grad(F.cross_entropy(model.forward_features(x)[1], y), model.extractor.weight)[0]
    torch.testing.assert_close(g_total, g_ce)  # L_CC adds nothing to the feature extractor's gradient


# ----------------------------------------------------------------------------- anchors and Eq. 10


def test_projection_is_deterministic_keeps_shape_and_spares_the_global_rng():
    a = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)
    expected_next = torch.rand(1)
    torch.manual_seed(11)
    p1 = project_anchors(a, seed=7)
    assert torch.rand(1).item() == expected_next.item()  # global RNG untouched
    p2 = project_anchors(a, seed=7)
    assert p1.shape == (5, 8)
    assert torch.equal(p1, p2)
    assert not torch.equal(p1, project_anchors(a, seed=8))
    assert (p1 >= 0).all()  # ends in ReLU
    # batch statistics over the C anchors: the output does not depend on a common shift of the input
    assert torch.allclose(project_anchors(a + 100.0, seed=7), p1, atol=1e-4)


def test_initial_anchors_seeded_and_er_switch():
    raw = initial_anchors(4, 6, seed=2, project=False)
    np.testing.assert_array_equal(raw, torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).numpy())
    projected = initial_anchors(4, 6, seed=2, project=True)
    np.testing.assert_allclose(projected, project_anchors(torch.tensor(raw), 3).numpy())
    spec = FederationSpec(num_clients=2, num_classes=4, feature_dim=6, seed=2)
    server = ALGO.Server(ALGO.Options(use_embedding_projection=False), spec, CPU)
    np.testing.assert_array_equal(server.broadcast(0).prototypes.vectors, raw)


def test_ema_update_by_hand_only_uploaded_classes():
    a = np.array([[0, 0], [2, 2], [4, 4]], np.float32)
    out = ema_update(a, {1: np.array([4, 0], np.float32)}, alpha=0.5)
    np.testing.assert_allclose(out, [[0, 0], [3, 1], [4, 4]])  # 0.5 * [2, 2] + 0.5 * [4, 0]
    np.testing.assert_array_equal(a[1], [2, 2])  # input not modified


def test_server_broadcasts_every_class_from_version_zero():
    spec = FederationSpec(num_clients=2, num_classes=5, feature_dim=4, seed=0)
    server = ALGO.Server(ALGO.Options(), spec, CPU)
    state = server.broadcast(0)
    assert state.version == 0
    assert state.prototypes.class_ids.tolist() == [0, 1, 2, 3, 4]
    assert state.prototypes.vectors.shape == (5, 4)
    np.testing.assert_array_equal(server.guidance_bank().vectors, state.prototypes.vectors)


def test_server_ema_towards_the_uniform_mean_of_the_uploads_by_default():
    # authors' serversa.py: proto_aggregation, the plain mean over the clients that uploaded a class
    server = ALGO.Server(ALGO.Options(alpha=0.5), SPEC, CPU)
    server.bank.vectors[:] = [[0, 0], [2, 2], [4, 4]]
    u1 = ClientUpdate(0, 0, 4, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 3]))
    u2 = ClientUpdate(1, 0, 3, prototypes=pset([0], [[3, 0]], [3]))
    server.aggregate([u1, u2], [1.0, 1.0], version=1)
    # P^0 = ([1,0] + [3,0]) / 2 = [2, 0] (counts 1 and 3 ignored) -> 0.5*[0,0] + 0.5*[2,0] = [1, 0]
    np.testing.assert_allclose(server.broadcast(1).prototypes.vectors, [[1, 0], [1, 1.5], [4, 4]], rtol=1e-6)
    np.testing.assert_allclose(server.prototypes.as_set().vectors, [[2, 0], [0, 1]], rtol=1e-6)  # inference bank


def test_server_ema_of_staleness_weighted_means_for_uploaded_classes_only():
    server = ALGO.Server(ALGO.Options(alpha=0.5, aggregation="weighted"), SPEC, CPU)
    server.bank.vectors[:] = [[0, 0], [2, 2], [4, 4]]
    u1 = ClientUpdate(0, 0, 4, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 3]))
    u2 = ClientUpdate(1, 0, 3, prototypes=pset([0], [[3, 0]], [3]))
    metrics = server.aggregate([u1, u2], [1.0, 0.5], version=1)
    # P^0 = (1*1*[1,0] + 0.5*3*[3,0]) / 2.5 = [2.2, 0] -> 0.5*[0,0] + 0.5*[2.2,0] = [1.1, 0]
    # P^1 = [0, 1] -> 0.5*[2,2] + 0.5*[0,1] = [1, 1.5]; class 2 not uploaded: kept
    v = server.broadcast(1).prototypes.vectors
    np.testing.assert_allclose(v, [[1.1, 0], [1, 1.5], [4, 4]], rtol=1e-6)
    assert server.bank.updated_at.tolist() == [1, 1, 0]
    assert metrics["anchor_classes_updated"] == 2.0
    assert server.aggregate([], [], version=2) == {}


def test_server_without_ema_keeps_the_initial_anchors():
    server = ALGO.Server(ALGO.Options(alpha=0.5, use_ema=False), SPEC, CPU)
    before = server.broadcast(0).prototypes.vectors.copy()
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0], [[9, 9]], [1]))], [1.0], version=1)
    np.testing.assert_array_equal(server.broadcast(1).prototypes.vectors, before)


def test_inference_bank_is_the_aggregated_client_prototypes_not_the_anchors():
    # authors' clientsa.test_metrics: nearest of the server's global_protos (mean of the uploads)
    server = ALGO.Server(ALGO.Options(alpha=0.5, aggregation="weighted"), SPEC, CPU)
    server.bank.vectors[:] = [[0, 0], [2, 2], [4, 4]]
    u1 = ClientUpdate(0, 0, 4, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 3]))
    u2 = ClientUpdate(1, 0, 3, prototypes=pset([0], [[3, 0]], [3]))
    server.aggregate([u1, u2], [1.0, 0.5], version=1)
    state = server.broadcast(1)
    client = ALGO.Client(ALGO.Options(), SPEC, 0)
    client.receive(state, FixedModel())
    bank = client.inference_bank()
    # P^0 = (1*1*[1,0] + 0.5*3*[3,0]) / 2.5 = [2.2, 0]; P^1 = [0, 1]; class 2 never uploaded: absent
    assert bank.class_ids.tolist() == [0, 1]
    np.testing.assert_allclose(bank.vectors, [[2.2, 0], [0, 1]], rtol=1e-6)
    np.testing.assert_allclose(client.guidance.vectors, [[1.1, 0], [1, 1.5], [4, 4]], rtol=1e-6)  # anchors: EMA
    # f = [1.6, 1.2]: squared distances to the prototypes 1.8 (class 0), 2.6 (class 1) -> class 0;
    # to the anchors 1.69 (class 0), 0.45 (class 1), 13.6 (class 2) -> class 1
    f = torch.tensor([[1.6, 1.2]])
    assert nearest_prototype_predict(f, bank).tolist() == [0]
    assert nearest_prototype_predict(f, client.guidance).tolist() == [1]
    anchors = ALGO.Client(ALGO.Options(inference_bank="anchors"), SPEC, 0)
    anchors.receive(state, FixedModel())
    np.testing.assert_array_equal(anchors.inference_bank().vectors, state.prototypes.vectors)
    # the next round's bank holds only that round's classes (serversa.py: global_protos =
    # proto_aggregation(this round's uploads)); with last_seen a class nobody uploads keeps its vector
    last_seen = ALGO.Server(ALGO.Options(alpha=0.5, aggregation="weighted", inference_memory="last_seen"), SPEC, CPU)
    for srv in (server, last_seen):
        srv.aggregate([u1, u2], [1.0, 0.5], version=1)
        srv.aggregate([ClientUpdate(2, 1, 2, prototypes=pset([2], [[5, 5]], [2]))], [1.0], version=2)
    client.receive(server.broadcast(2), FixedModel())
    assert client.inference_bank().class_ids.tolist() == [2]
    np.testing.assert_allclose(client.inference_bank().vectors, [[5, 5]], rtol=1e-6)
    client.receive(last_seen.broadcast(2), FixedModel())
    np.testing.assert_allclose(client.inference_bank().vectors, [[2.2, 0], [0, 1], [5, 5]], rtol=1e-6)
    fresh = ALGO.Client(ALGO.Options(), SPEC, 0)
    fresh.receive(ALGO.Server(ALGO.Options(), SPEC, CPU).broadcast(0), FixedModel())
    assert fresh.inference_bank() is None


def test_aggregated_prototypes_are_kept_without_ema_and_in_the_state():
    server = ALGO.Server(ALGO.Options(use_ema=False), SPEC, CPU)
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([1], [[9, 9]], [1]))], [1.0], version=1)
    assert server.broadcast(1).extras["client_prototype_ids"].tolist() == [1]
    fresh = ALGO.Server(ALGO.Options(use_ema=False), SPEC, CPU)
    fresh.load_state_dict(server.state_dict())
    np.testing.assert_array_equal(fresh.broadcast(1).extras["client_prototype_vectors"], [[9, 9]])


# ----------------------------------------------------------------------------- Eq. 9 on the client


X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
Y = torch.tensor([0, 1])
# FixedModel: features = x, zero head -> CE = ln 3 and L_CC = ln 3 (uniform logits over 3 classes)
# L_R (sum): ||[1,2] - [0,0]||^2 = 5 and ||[3,4] - [3,4]||^2 = 0 -> mean 2.5
R_SUM = 2.5


def test_client_loss_is_the_weighted_sum_of_the_terms():
    client, model = client_with(version=1, lam=0.5, lambda2=2.0, lambda3=3.0, alignment_reduction="sum")
    loss, terms = client.loss(model, X, Y)
    assert set(terms) == {"ce", "r", "mcl", "cc"}
    assert terms["ce"] == pytest.approx(math.log(3))
    assert terms["cc"] == pytest.approx(math.log(3))
    assert terms["r"] == pytest.approx(R_SUM)
    mcl = mcl_loss(X, Y, torch.tensor(POINTS), NEAREST).item()  # default margin: the authors' statistic
    assert terms["mcl"] == pytest.approx(mcl, rel=1e-5)
    assert loss.item() == pytest.approx(math.log(3) + 0.5 * R_SUM + 2.0 * mcl + 3.0 * math.log(3), rel=1e-5)
    # L_R with the default reduction is divided by D = 2
    client, model = client_with(version=1, lam=0.5, lambda2=0.0, lambda3=0.0)
    assert client.loss(model, X, Y)[1]["r"] == pytest.approx(R_SUM / 2)


def test_zero_lambda_removes_the_term_but_still_logs_it():
    client, model = client_with(version=1, lam=0.5, lambda2=0.0, lambda3=0.0, alignment_reduction="sum")
    loss, terms = client.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3) + 0.5 * R_SUM, rel=1e-6)
    assert terms["mcl"] > 0 and terms["cc"] == pytest.approx(math.log(3))  # logged, not optimised
    loss.backward()
    # only CE touches the head here: its gradient equals CE's alone (L_CC would add to it)
    ce_grad = torch.autograd.grad(F.cross_entropy(model.head(X), Y), model.head.weight)[0]
    torch.testing.assert_close(model.head.weight.grad, ce_grad)
    # lambda3 alone back on: the head gradient changes
    client3, model3 = client_with(version=1, lam=0.5, lambda2=0.0, lambda3=1.0)
    client3.loss(model3, X, Y)[0].backward()
    assert not torch.allclose(model3.head.weight.grad, ce_grad)
    client2, model2 = client_with(version=1, lam=0.0, lambda2=1.0, lambda3=0.0)
    assert client2.loss(model2, X, Y)[0].item() == pytest.approx(math.log(3) + float(terms["mcl"]), rel=1e-5)


def test_alignment_schedule_scales_l_r_only():
    sched = {"start": 20, "length": 80}
    kw = dict(lam=0.7, lambda2=0.5, lambda3=0.0, alignment_reduction="sum", alignment_schedule=sched)
    early, model = client_with(version=10, **kw)
    loss, terms = early.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3) + 0.5 * float(terms["mcl"]), rel=1e-5)  # before the ramp: no L_R, L_MCL stays
    mid, model = client_with(version=59, **kw)  # round 60
    loss, terms = mid.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3) + 0.35 * R_SUM + 0.5 * float(terms["mcl"]), rel=1e-5)  # 0.7 * 0.5


def test_client_without_anchors_trains_on_ce_only():
    client = ALGO.Client(ALGO.Options(lambda2=1.0), SPEC, 0)
    model = FixedModel()
    client.receive(GlobalState(version=0, prototypes=None), model)
    loss, terms = client.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3))
    assert terms["r"] == terms["mcl"] == terms["cc"] == 0.0


def test_local_train_runs_and_lowers_the_loss():
    torch.manual_seed(0)
    spec = FederationSpec(num_clients=1, num_classes=3, feature_dim=2, seed=0)
    server = ALGO.Server(ALGO.Options(), spec, CPU)
    client = ALGO.Client(ALGO.Options(lambda2=1.0), spec, 0)
    model = TwoPartModel()
    client.receive(server.broadcast(0), model)
    x = torch.randn(30, 2)
    y = torch.arange(30) % 3
    x = x + torch.tensor(server.broadcast(0).prototypes.vectors)[y]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = TrainBatchIterator(x, y, 10, torch.Generator().manual_seed(0))
    first = client.local_train(model, opt, it, 1, CPU)
    for _ in range(20):
        last = client.local_train(model, opt, it, 1, CPU)
    assert set(first) == {"loss", "ce", "r", "mcl", "cc", "nonfinite_steps"} and first["nonfinite_steps"] == 0
    assert last["loss"] < first["loss"]
    update = client.make_update(model, x, y)
    assert update.prototypes.class_ids.tolist() == [0, 1, 2]
    assert server.aggregate([update], [1.0], version=1)["anchor_classes_updated"] == 3.0


# ----------------------------------------------------------------------------- state


def test_server_state_round_trips_as_plain_arrays():
    server = ALGO.Server(ALGO.Options(alpha=0.5, aggregation_scope="latest"), SPEC, CPU)
    server.aggregate([ClientUpdate(1, 0, 2, prototypes=pset([2], [[1, 2]], [2]))], [1.0], version=1)
    state = server.state_dict()
    leaves = [v for e in state["latest"].values() for v in e.values()] + list(state["bank"].values())
    assert all(isinstance(v, (np.ndarray, int)) for v in leaves)
    fresh = ALGO.Server(ALGO.Options(alpha=0.5, aggregation_scope="latest"), FederationSpec(4, 3, 2, seed=9), CPU)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(fresh.broadcast(1).prototypes.vectors, server.broadcast(1).prototypes.vectors)
    assert fresh.latest[1][1] == 0


def test_client_state_round_trips_with_its_last_upload():
    client, model = client_with(version=3)
    client.make_update(model, torch.tensor([[0.0, 0.0], [10.0, 0.0]]), torch.tensor([0, 1]))
    state = client.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state["local"].values())
    fresh = ALGO.Client(ALGO.Options(), SPEC, 0)
    fresh.load_state_dict(state)
    fresh.receive(anchors_state(3), model)
    assert fresh.version == 3 and fresh.margin() == pytest.approx(10.0, rel=1e-5)
    np.testing.assert_array_equal(fresh.local.vectors, client.local.vectors)
    empty = ALGO.Client(ALGO.Options(), SPEC, 0)
    empty.load_state_dict(ALGO.Client(ALGO.Options(), SPEC, 0).state_dict())
    assert empty.local is None
