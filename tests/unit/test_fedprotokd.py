"""FedProtoKD (papers/fedprotokd.md Eq. 2-15) against values computed by hand."""

import math

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.base import TrainBatchIterator
from rayfed_proto.algorithms.fedprotokd import (
    PUBLIC_LOGITS,
    SERVER_LOGITS,
    actp_loss,
    class_margins,
    client_distill_loss,
    sample_importance,
    server_kd_loss,
    variance_weighted_logits,
)
from rayfed_proto.config import ConfigError, build_config, load_config
from rayfed_proto.messages import ClientUpdate, GlobalState, UpdateSchema, validate_update
from rayfed_proto.models.zoo import build_model
from rayfed_proto.preset_files import resolve_config_arg

ALGO = ALGORITHMS.get("fedprotokd")
CPU = torch.device("cpu")
C = 3
# three class vectors with d01 = 5, d02 = 1, d12 = sqrt(3^2 + 3^2) = sqrt(18) = 4.2426
POINTS = [[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]]
SQRT18 = math.sqrt(18)


def image_spec(feature_dim=4, public=12, side=8, seed=0, exponent=0.5, clients=2):
    """A spec with a real server-model factory (``build_model``) and a small public image set."""
    public_x = torch.randn(public, 1, side, side, generator=torch.Generator().manual_seed(1))
    return FederationSpec(num_clients=clients, num_classes=C, feature_dim=feature_dim, seed=seed,
                          staleness_exponent=exponent, in_channels=1, image_size=side,
                          build_arch=lambda arch, d: build_model(arch, 1, side, C, d), public_x=public_x)


def test_the_learnable_projection_of_eq3_is_on_by_default_and_a_users_projector_wins():
    cfg = build_config({"algorithm": {"name": "fedprotokd"}})
    assert cfg.model.projector == "linear"
    assert build_config({"algorithm": {"name": "fedprotokd"}, "model": {"projector": "pool"}}).model.projector == "pool"
    for preset in ("fedprotokd_digits", "fedprotokd_cifar10"):
        assert load_config(resolve_config_arg(preset)).model.projector == "linear"


def test_scope_is_the_rounds_uploads_in_sync_mode_and_every_clients_latest_in_async_mode():
    """Sync: only this round's uploads (the paper's S_t); a user's latest with partial participation is refused."""
    sync = {"algorithm": {"name": "fedprotokd"}, "federation": {"mode": "sync", "participation": 0.5}}
    assert build_config(sync).algorithm_options().aggregation_scope == "buffer"
    assert build_config({"algorithm": {"name": "fedprotokd"}}).algorithm_options().aggregation_scope == "latest"
    with pytest.raises(ConfigError) as err:
        build_config({**sync, "algorithm": {"name": "fedprotokd", "aggregation_scope": "latest"}})
    text = str(err.value)
    assert "algorithm.aggregation_scope = 'latest'" in text and "participation 0.5 < 1" in text and "buffer" in text
    full = {"algorithm": {"name": "fedprotokd", "aggregation_scope": "latest"}, "federation": {"mode": "sync"}}
    assert build_config(full).algorithm_options().aggregation_scope == "latest"  # full participation: allowed


def small_options(**kw):
    base = dict(server_arch="cnn", generator_epochs=2, server_epochs=1, server_batch_size=4)
    return ALGO.Options(**{**base, **kw})


# ----------------------------------------------------------------------------- options and contract


def test_defaults_are_the_papers():
    o = ALGO.Options()
    assert (o.epsilon, o.gamma, o.upsilon, o.zeta) == (0.5, 0.5, 0.5, 50.0)
    assert (o.generator_epochs, o.server_epochs, o.server_batch_size, o.server_arch) == (100, 10, 32, "resnet34")
    assert not o.uniform_margin and o.sample_importance and o.client_distill == "before_local"
    # model.projector linear: the learnable projection h_phi_k of Eq. 3
    assert ALGO.config_defaults == {"data.public_size": 2500, "data.global_test_fraction": 0.2,
                                    "model.projector": "linear"}
    with pytest.raises(ValueError):
        ALGO.Options(gamma=1.5)
    with pytest.raises(ValueError, match="unknown architecture 'resnet35'"):
        ALGO.Options(server_arch="resnet35")


@pytest.mark.parametrize("public_x", [None, torch.zeros(0, 1, 8, 8)])
def test_missing_public_set_is_a_clear_error(public_x):
    spec = image_spec()
    spec.public_x = public_x
    with pytest.raises(ValueError, match="data.public_size"):
        ALGO.Client(small_options(), spec, 0)
    with pytest.raises(ValueError, match="data.public_size"):
        ALGO.Server(small_options(), spec, CPU)


def test_public_logits_of_the_wrong_shape_are_refused_at_the_border():
    spec = image_spec(public=12)
    server = ALGO.Server(small_options(), spec, CPU)
    assert server.extras_shapes() == {PUBLIC_LOGITS: (12, C)}
    schema = UpdateSchema(spec.num_clients, C, spec.feature_dim, None, server.extras_shapes())
    good = ClientUpdate(0, 0, 5, prototypes=pset([0], [[0, 0, 0, 0]], [5]),
                        extras={PUBLIC_LOGITS: np.zeros((12, C), np.float32)})
    assert validate_update(good, schema, 0) is None
    wrong = ClientUpdate(0, 0, 5, extras={PUBLIC_LOGITS: np.zeros((11, C), np.float32)})
    assert "public_logits" in validate_update(wrong, schema, 0)
    missing = ClientUpdate(0, 0, 5)
    assert validate_update(missing, schema, 0) is not None
    nan = ClientUpdate(0, 0, 5, extras={PUBLIC_LOGITS: np.full((12, C), np.nan, np.float32)})
    assert "non-finite" in validate_update(nan, schema, 0)


# ----------------------------------------------------------------------------- Eq. 5: class-wise margins


def test_class_margins_by_hand_and_zeta_clips():
    q = torch.tensor(POINTS)
    # nearest other class: 0 -> 2 (1), 1 -> 2 (sqrt 18), 2 -> 0 (1)
    torch.testing.assert_close(class_margins(q, 50.0), torch.tensor([1.0, SQRT18, 1.0]))
    torch.testing.assert_close(class_margins(q, 2.0), torch.tensor([1.0, 2.0, 1.0]))  # zeta clips class 1
    # FedProtoKD-zeta: FedTGP's min(max_c gap_c, zeta) = min(sqrt 18, 50) for every class
    torch.testing.assert_close(class_margins(q, 50.0, uniform=True), torch.full((3,), SQRT18))
    torch.testing.assert_close(class_margins(q, 3.0, uniform=True), torch.full((3,), 3.0))
    # a single class present: no nearest neighbour, the margin is zeta
    torch.testing.assert_close(class_margins(q[:1], 7.0), torch.tensor([7.0]))


def test_server_margins_from_uniform_client_means_with_single_client_classes():
    spec = image_spec(feature_dim=2)
    server = ALGO.Server(small_options(generator_epochs=0, server_epochs=0), spec, CPU)
    u1 = ClientUpdate(0, 0, 10, prototypes=pset([0, 1], [[0, 0], [3, 4]], [1, 9]),
                      extras={PUBLIC_LOGITS: np.zeros((12, C), np.float32)})
    u2 = ClientUpdate(1, 0, 10, prototypes=pset([0, 2], [[2, 0], [0, 1]], [9, 1]),
                      extras={PUBLIC_LOGITS: np.zeros((12, C), np.float32)})
    metrics = server.aggregate([u1, u2], [1.0, 1.0], version=1)
    # Q^0 = ([0,0] + [2,0]) / 2 = [1,0] (counts ignored); Q^1 = [3,4] and Q^2 = [0,1] come from one client each
    # d(Q0,Q1) = sqrt(4 + 16) = 4.4721, d(Q0,Q2) = sqrt(1 + 1) = 1.4142, d(Q1,Q2) = sqrt(18) = 4.2426
    np.testing.assert_allclose(server.margins, [math.sqrt(2), SQRT18, math.sqrt(2)], rtol=1e-5)
    assert metrics["xi_class_1"] == pytest.approx(SQRT18, rel=1e-5)
    assert metrics["xi_mean"] == pytest.approx((2 * math.sqrt(2) + SQRT18) / 3, rel=1e-5)
    # sample-weighted centres: Q^0 = (1 [0,0] + 9 [2,0]) / 10 = [1.8, 0]; d(Q0,Q2) = sqrt(3.24 + 1) = 2.0591
    weighted = ALGO.Server(small_options(generator_epochs=0, server_epochs=0, prototype_mean="weighted", zeta=3.0),
                           spec, CPU)
    weighted.aggregate([u1, u2], [1.0, 1.0], version=1)
    np.testing.assert_allclose(weighted.margins, [math.sqrt(4.24), 3.0, math.sqrt(4.24)], rtol=1e-5)  # zeta 3 clips class 1


# ----------------------------------------------------------------------------- Eq. 6: ACTP loss


def test_actp_loss_uses_each_pairs_own_class_margin():
    generated = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    margins = torch.tensor([1.0, 7.0])
    protos = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    labels = torch.tensor([0, 1])
    # pair (p=[0,0], c=0): distances [~0, 5], + xi^0 = 1 on c -> logits [-1, -5]: CE = log(1 + e^-4) = 0.018150
    # pair (p=[3,4], c=1): distances [5, ~0], + xi^1 = 7 on c -> logits [-5, -7]: CE = log(1 + e^2) = 2.126928
    first, second = math.log(1 + math.exp(-4)), math.log(1 + math.exp(2))
    assert actp_loss(protos[:1], labels[:1], generated, margins).item() == pytest.approx(first, rel=1e-4)
    assert actp_loss(protos, labels, generated, margins).item() == pytest.approx((first + second) / 2, rel=1e-4)
    weighted = actp_loss(protos, labels, generated, margins, torch.tensor([1.0, 3.0]))
    assert weighted.item() == pytest.approx((first + 3 * second) / 4, rel=1e-4)


# ----------------------------------------------------------------------------- Eq. 7: variance-weighted logits

A_LOGITS = [3.0, 0.0, 0.0]  # mean 1, variance (4 + 1 + 1) / 3 = 2
B_LOGITS = [0.0, 2.0, 1.0]  # mean 1, variance (1 + 1 + 0) / 3 = 2/3


def test_variance_weighted_logits_by_hand():
    logits = torch.tensor([[A_LOGITS], [B_LOGITS]])  # (K=2, P=1, C=3)
    # weights 2 / (2 + 2/3) = 0.75 and 0.25: 0.75 [3,0,0] + 0.25 [0,2,1] = [2.25, 0.5, 0.25]
    torch.testing.assert_close(variance_weighted_logits(logits), torch.tensor([[2.25, 0.5, 0.25]]))
    # staleness weights [1, 0.5]: 1*2 : 0.5*2/3 = 6/7 : 1/7 -> [18/7, 2/7, 1/7]
    torch.testing.assert_close(variance_weighted_logits(logits, torch.tensor([1.0, 0.5])),
                               torch.tensor([[18 / 7, 2 / 7, 1 / 7]]))
    # one client: its own logits
    torch.testing.assert_close(variance_weighted_logits(logits[:1]), logits[0])
    # every client flat on a sample (variance 0): the (staleness-)weighted mean, (1*1 + 0.5*2) / 1.5 = 4/3
    flat = torch.tensor([[[1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0]]])
    torch.testing.assert_close(variance_weighted_logits(flat, torch.tensor([1.0, 0.5])), torch.full((1, 3), 4 / 3))
    # per sample: a second sample on which only B is confident takes B's logits
    two = torch.tensor([[A_LOGITS, [1.0, 1.0, 1.0]], [B_LOGITS, B_LOGITS]])
    torch.testing.assert_close(variance_weighted_logits(two)[1], torch.tensor(B_LOGITS))


def test_variance_of_probabilities_bounds_the_weight_of_a_client_with_large_logits():
    # C = 2: population variance of [a, b] is ((a - b) / 2)^2; of softmax([a, b]) it is (tanh((a - b) / 2) / 2)^2
    small, large = [2.0, 0.0], [0.0, 6.0]  # logit variances 1 and 9
    logits = torch.tensor([[small], [large]])
    # Eq. 7 as printed: weights 1/10 and 9/10 -> [0.2, 5.4]; the scale of the logits sets the weight
    torch.testing.assert_close(variance_weighted_logits(logits), torch.tensor([[0.2, 5.4]]))
    # probability_variance: (tanh(1) / 2)^2 = 0.14501 and (tanh(3) / 2)^2 = 0.24753 -> 0.36941 : 0.63059
    va, vb = (math.tanh(1.0) / 2) ** 2, (math.tanh(3.0) / 2) ** 2
    wa, wb = va / (va + vb), vb / (va + vb)
    assert abs(wa - 0.369405) < 1e-5
    torch.testing.assert_close(variance_weighted_logits(logits, variance_of="probabilities"),
                               torch.tensor([[2.0 * wa, 6.0 * wb]]))
    # scaling one client's logits by 10 multiplies its Eq. 7 weight ratio by 100 (1 : 900 -> 99.9 %);
    # on probabilities the weight stays below (C - 1) / C^2 = 0.25 against the other's 0.14501
    scaled = torch.tensor([[small], [[0.0, 60.0]]])
    w_logit = variance_weighted_logits(scaled)[0, 1] / 60.0
    w_prob = variance_weighted_logits(scaled, variance_of="probabilities")[0, 1] / 60.0
    assert abs(float(w_logit) - 900 / 901) < 1e-6
    assert abs(float(w_prob) - 0.25 / (0.25 + va)) < 1e-5
    # the option reaches the server (default: the paper's Eq. 7)
    assert ALGO.Options().logit_weighting == "logit_variance"
    assert ALGO.Options(logit_weighting="probability_variance").logit_weighting == "probability_variance"


def test_async_server_mixes_every_clients_latest_logits_with_staleness_weights():
    spec = image_spec(public=1, exponent=1.0)
    server = ALGO.Server(small_options(), spec, CPU)

    def up(client, base, logits):
        return ClientUpdate(client, base, 5, extras={PUBLIC_LOGITS: np.array([logits], np.float32)})

    logits, _ = server._collect([up(0, 0, A_LOGITS)], [1.0], version=1)
    assert [w for _, w in logits] == [1.0]
    # version 2 from a buffer with client 1 only (trained on version 1); client 0's logits (trained on 0) are
    # remembered with staleness 1 - 0 = 1 -> (1 + 1)^-1 = 0.5; client 1's staleness 0 -> 1
    logits, _ = server._collect([up(1, 1, B_LOGITS)], [1.0], version=2)
    assert [w for _, w in logits] == [0.5, 1.0]
    # Eq. 7: 0.5 * 2 : 1 * 2/3 = 0.6 : 0.4 -> 0.6 [3,0,0] + 0.4 [0,2,1] = [1.8, 0.8, 0.4]
    stacked = torch.tensor(np.stack([a for a, _ in logits]))
    target = variance_weighted_logits(stacked, torch.tensor([w for _, w in logits]))
    torch.testing.assert_close(target, torch.tensor([[1.8, 0.8, 0.4]]))
    # a newer upload of client 0 replaces its old one
    logits, _ = server._collect([up(0, 2, B_LOGITS)], [1.0], version=3)
    assert len(logits) == 2 and [w for _, w in logits] == [1.0, 0.5]
    buffered = ALGO.Server(small_options(aggregation_scope="buffer"), spec, CPU)
    buffered._collect([up(0, 0, A_LOGITS)], [1.0], version=1)
    logits, _ = buffered._collect([up(1, 1, B_LOGITS)], [0.7], version=2)
    assert [w for _, w in logits] == [0.7]  # the buffer only, with the runtime's weights


# ----------------------------------------------------------------------------- Eq. 9: sample importance


def sig(z):
    return 1 / (1 + math.exp(-z))


def test_sample_importance_by_hand():
    d = torch.tensor([1.0, 2.0, 4.0])
    # inverse distances [1, 0.5, 0.25] -> min-max [1, 1/3, 0]; c_d = median = 1/3; phi 0.5, k 10
    norm, c = [1.0, 1 / 3, 0.0], 1 / 3
    text = [0.5 * (1 + n) + 0.5 * sig(10 * (n - c)) for n in norm]  # [1.49936, 0.91667, 0.51722]
    printed = [0.5 * (1 + n) + 0.5 * (1 - sig(10 * (n - c))) for n in norm]  # [1.00064, 0.91667, 0.98278]
    torch.testing.assert_close(sample_importance(d, 0.5, 10.0, "text"), torch.tensor(text), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sample_importance(d, 0.5, 10.0, "printed"), torch.tensor(printed), rtol=1e-4, atol=1e-5)
    assert text[0] == pytest.approx(1.49936, abs=1e-5) and text[2] == pytest.approx(0.51722, abs=1e-5)
    # the default reading decreases with distance
    assert sample_importance(d, 0.5, 10.0).diff().lt(0).all()
    # phi = 1: only the inverse-distance term, 1 + d^
    torch.testing.assert_close(sample_importance(d, 1.0, 10.0), torch.tensor([2.0, 4 / 3, 1.0]), rtol=1e-4, atol=1e-5)
    # a sample without a generated prototype (NaN distance) counts as the farthest (d^ = 0)
    with_nan = sample_importance(torch.tensor([1.0, 2.0, 4.0, float("nan")]), 1.0, 10.0)
    torch.testing.assert_close(with_nan, torch.tensor([2.0, 4 / 3, 1.0, 1.0]), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- Eq. 10-12 and 13-14


KL_HALF = 0.5 * math.log(1.125)  # KL([1/4,1/4,1/2] || [1/3,1/3,1/3]) = 2 (1/4) ln(3/4) + (1/2) ln(3/2) = 0.058892


def test_client_distillation_loss_by_hand():
    student = torch.zeros(1, 3)  # uniform softmax
    teacher = torch.tensor([[0.0, 0.0, math.log(2)]])  # softmax [1/4, 1/4, 1/2]; pseudo-label 2 (Eq. 13)
    loss, kl, ce = client_distill_loss(student, teacher, gamma=0.5)
    assert kl.item() == pytest.approx(KL_HALF, rel=1e-5)
    assert ce.item() == pytest.approx(math.log(3), rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * KL_HALF + 0.5 * math.log(3), rel=1e-5)  # 0.578752
    assert client_distill_loss(student, teacher, gamma=1.0)[0].item() == pytest.approx(KL_HALF, rel=1e-5)
    assert client_distill_loss(student, teacher, gamma=0.0)[0].item() == pytest.approx(math.log(3), rel=1e-6)


def test_server_loss_by_hand():
    feats = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    logits = torch.zeros(2, 3)
    target = torch.tensor([[math.log(2), 0.0, 0.0], [0.0, 0.0, math.log(2)]])  # pseudo-labels 0 and 2
    protos = torch.tensor(POINTS)
    mask = torch.tensor([True, True, False])  # class 2 has no generated prototype: its sample leaves L_pl
    importance = torch.tensor([2.0, 0.5])
    loss, terms = server_kd_loss(feats, logits, target, importance, protos, mask, upsilon=0.25)
    # KL = KL_HALF per sample; CE = ln 3 per sample, weighted mean (2 + 0.5) / 2 ln 3 = 1.25 ln 3
    # L_pl: sample 0 only, ||[1,2] - [0,0]||^2 / D = 5 / 2 = 2.5
    kd = KL_HALF + 1.25 * math.log(3)
    assert terms["kd_kl"] == pytest.approx(KL_HALF, rel=1e-5)
    assert terms["kd_ce"] == pytest.approx(1.25 * math.log(3), rel=1e-5)
    assert terms["pl"] == pytest.approx(2.5, rel=1e-6)
    assert loss.item() == pytest.approx(0.25 * kd + 0.75 * 2.5, rel=1e-5)  # Eq. 12


# ----------------------------------------------------------------------------- client loss phases

X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
Y = torch.tensor([0, 1])


def fixed_client(version, server_logits=None, public=4, **opts):
    spec = FederationSpec(num_clients=2, num_classes=C, feature_dim=2,
                          public_x=torch.ones(public, 2))  # FixedModel: features = x
    client = ALGO.Client(ALGO.Options(**opts), spec, 0)
    model = FixedModel()
    extras = {} if server_logits is None else {SERVER_LOGITS: np.asarray(server_logits, np.float32)}
    client.receive(GlobalState(version, pset([0, 1, 2], POINTS, [1, 1, 1]) if version else None, extras=extras), model)
    return client, model


def test_version_zero_is_cross_entropy_only():
    client, model = fixed_client(0)
    loss, terms = client.loss(model, X, Y)
    assert loss.item() == pytest.approx(math.log(3)) and terms["mse"] == 0.0  # Eq. 2: zero head -> ln 3
    # even with a bank at version 0 (it cannot exist, but the rule is by version)
    client.guidance = pset([0, 1, 2], POINTS, [1, 1, 1])
    assert client.loss(model, X, Y)[0].item() == pytest.approx(math.log(3))


def test_later_versions_add_epsilon_times_the_prototype_mse():
    client, model = fixed_client(1, epsilon=0.5)
    loss, terms = client.loss(model, X, Y)
    # ||[1,2] - P~0=[0,0]||^2 = 5, ||[3,4] - P~1=[3,4]||^2 = 0 -> mean over samples and D=2 dims: 5 / 4 = 1.25
    assert terms["mse"] == pytest.approx(1.25)
    assert loss.item() == pytest.approx(math.log(3) + 0.5 * 1.25, rel=1e-6)  # Eq. 15
    client, model = fixed_client(1, epsilon=0.5, alignment_reduction="sum")
    assert client.loss(model, X, Y)[1]["mse"] == pytest.approx(2.5)


def test_local_train_distils_from_the_server_logits_with_gamma():
    teacher = [[0.0, 0.0, math.log(2)]] * 4
    client, model = fixed_client(1, server_logits=teacher, gamma=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the hand-computed values
    batches = TrainBatchIterator(X, Y, 2, torch.Generator().manual_seed(0))
    terms = client.local_train(model, opt, batches, 1, CPU)
    assert terms["distill_kl"] == pytest.approx(KL_HALF, rel=1e-5)
    assert terms["distill_ce"] == pytest.approx(math.log(3), rel=1e-5)
    assert terms["distill_loss"] == pytest.approx(0.5 * KL_HALF + 0.5 * math.log(3), rel=1e-5)
    assert terms["loss"] == pytest.approx(math.log(3) + 0.5 * 1.25, rel=1e-5)
    assert terms["nonfinite_steps"] == 0
    # version 0: no server logits, no distillation
    client0, model0 = fixed_client(0)
    assert not any(k.startswith("distill") for k in client0.local_train(model0, opt, batches, 1, CPU))
    # gamma 1: KL only
    client1, model1 = fixed_client(1, server_logits=teacher, gamma=1.0)
    assert client1.local_train(model1, opt, batches, 1, CPU)["distill_loss"] == pytest.approx(KL_HALF, rel=1e-5)


@pytest.mark.parametrize("order, expected", [("before_local", ["distill", "private"]),
                                             ("after_local", ["private", "distill"])])
def test_distillation_order(order, expected):
    client, model = fixed_client(1, server_logits=[[0.0, 0.0, 1.0]] * 4, client_distill=order)
    calls = []
    distill, loss = client.distill, client.loss
    client.distill = lambda *a: calls.append("distill") or distill(*a)
    client.loss = lambda *a: calls.append("private") or loss(*a)
    client.local_train(model, torch.optim.SGD(model.parameters(), lr=0.0),
                       TrainBatchIterator(X, Y, 2, torch.Generator().manual_seed(0)), 1, CPU)
    assert calls == expected


def test_update_carries_prototypes_and_public_logits():
    client, model = fixed_client(1, public=5)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    update = client.make_update(model, X, Y)
    np.testing.assert_allclose(update.prototypes.vectors, [[1, 2], [3, 4]])  # Eq. 1, one sample per class
    logits = update.extras[PUBLIC_LOGITS]
    assert logits.dtype == np.float32 and logits.shape == (5, C)
    np.testing.assert_allclose(logits, [[1.0, 1.0, 2.0]] * 5)  # public x = [1, 1] through the head
    assert update.nbytes == update.prototypes.nbytes + 5 * C * 4


def test_counts_are_sent_only_when_the_server_uses_them():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    y = torch.tensor([0, 1, 1])  # real counts: class 0 once, class 1 twice
    client, model = fixed_client(1, public=5)
    update = client.make_update(model, x, y)  # prototype_mean: uniform (default): count-free
    assert update.prototypes.counts.tolist() == [1, 1]
    np.testing.assert_allclose(update.prototypes.vectors, [[1, 2], [4, 5]])
    assert update.num_samples is None  # the dataset size never travels: the server has no use for it
    weighted, model = fixed_client(1, public=5, prototype_mean="weighted")
    assert weighted.make_update(model, x, y).prototypes.counts.tolist() == [1, 2]


# ----------------------------------------------------------------------------- a round end to end


def run_rounds(server, spec, rounds, archs=("mlp", "cnn")):
    torch.manual_seed(0)
    clients = [ALGO.Client(server.options, spec, i) for i in range(len(archs))]
    models = [build_model(a, 1, spec.image_size, C, spec.feature_dim) for a in archs]
    data = [(torch.randn(12, 1, 8, 8, generator=torch.Generator().manual_seed(10 + i)), torch.tensor(y))
            for i, y in enumerate(([0, 1] * 6, [1, 2, 2] * 4))]  # client 1 never holds class 0
    history = []
    for version in range(rounds):
        state = server.broadcast(version)
        updates, terms = [], []
        for client, model, (x, y) in zip(clients, models, data, strict=True):
            client.receive(state, model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            terms.append(client.local_train(model, opt, TrainBatchIterator(x, y, 4, torch.Generator().manual_seed(0)), 1, CPU))
            updates.append(client.make_update(model, x, y))
        history.append((terms, server.aggregate(updates, [1.0] * len(updates), version + 1), updates))
    return history


def test_two_rounds_end_to_end():
    spec = image_spec()
    server = ALGO.Server(small_options(), spec, CPU)
    first = server.broadcast(0)
    assert first.prototypes is None and first.extras == {}  # version 0: nothing to distil or align to
    history = run_rounds(server, spec, 2)
    terms0, metrics, _ = history[0]
    assert all("distill_loss" not in t and t["mse"] == 0.0 for t in terms0)
    terms1, metrics, updates = history[1]
    assert all({"ce", "mse", "distill_kl", "distill_ce", "distill_loss"} <= set(t) for t in terms1)
    assert all(t["mse"] > 0 for t in terms1)
    state = server.broadcast(2)
    assert state.extras[SERVER_LOGITS].shape == (12, C) and state.extras[SERVER_LOGITS].dtype == np.float32
    assert state.prototypes.class_ids.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(server.guidance_bank().vectors, state.prototypes.vectors)
    # Figure 6: margin of each generated prototype to its nearest other class
    v = state.prototypes.vectors
    nearest = [min(np.linalg.norm(v[c] - v[o]) for o in range(C) if o != c) for c in range(C)]
    for c in range(C):
        assert metrics[f"margin_class_{c}"] == pytest.approx(nearest[c], rel=1e-4)
    assert metrics["margin_mean"] == pytest.approx(np.mean(nearest), rel=1e-4)
    assert {"generator_loss", "server_loss", "server_kd", "server_pl", "importance_mean", "xi_class_0"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    model = server.global_model()
    assert not model.training
    _, logits = model.forward_features(server.public_x)
    np.testing.assert_allclose(logits.detach().numpy(), state.extras[SERVER_LOGITS], rtol=1e-5, atol=1e-5)
    schema = UpdateSchema(spec.num_clients, C, spec.feature_dim, None, server.extras_shapes())
    assert all(validate_update(u, schema, 1) is None for u in updates)


@pytest.mark.parametrize("weighting, expected", [("logit_variance", "logits"), ("probability_variance", "probabilities")])
def test_server_aggregates_with_the_configured_eq7_weighting(monkeypatch, weighting, expected):
    import rayfed_proto.algorithms.fedprotokd as kd

    seen = []
    real = kd.variance_weighted_logits
    monkeypatch.setattr(kd, "variance_weighted_logits", lambda *a: seen.append(a[2]) or real(*a))
    spec = image_spec()
    run_rounds(ALGO.Server(small_options(logit_weighting=weighting), spec, CPU), spec, 1)
    assert seen == [expected]


def test_ablations_switch_their_parts():
    spec = image_spec()
    plain = run_rounds(ALGO.Server(small_options(sample_importance=False), spec, CPU), spec, 1)[0][1]
    assert plain["importance_mean"] == plain["importance_min"] == plain["importance_max"] == 1.0
    uniform = run_rounds(ALGO.Server(small_options(uniform_margin=True), spec, CPU), spec, 1)[0][1]
    xi = [uniform[f"xi_class_{c}"] for c in range(C)]
    assert xi[0] == xi[1] == xi[2]
    adaptive = run_rounds(ALGO.Server(small_options(), spec, CPU), spec, 1)[0][1]
    assert len({adaptive[f"xi_class_{c}"] for c in range(C)}) > 1


# ----------------------------------------------------------------------------- state


def test_state_round_trip_restores_an_identical_server():
    spec = image_spec()
    server = ALGO.Server(small_options(server_optimizer="sgd", server_momentum=0.9), spec, CPU)
    history = run_rounds(server, spec, 1)
    updates = history[0][2]
    state = server.state_dict()
    fresh = ALGO.Server(small_options(server_optimizer="sgd", server_momentum=0.9), image_spec(seed=5), CPU)
    fresh.load_state_dict(state)
    a, b = server.broadcast(1), fresh.broadcast(1)
    np.testing.assert_array_equal(a.prototypes.vectors, b.prototypes.vectors)
    np.testing.assert_array_equal(a.extras[SERVER_LOGITS], b.extras[SERVER_LOGITS])
    # the next version is identical too: models, optimizers (momentum), stored uploads, shuffling
    again = [ClientUpdate(u.client_id, 1, u.num_samples, u.prototypes, extras=u.extras) for u in updates]
    ma, mb = server.aggregate(again, [1.0, 1.0], 2), fresh.aggregate(again, [1.0, 1.0], 2)
    assert ma == mb
    np.testing.assert_array_equal(server.broadcast(2).extras[SERVER_LOGITS], fresh.broadcast(2).extras[SERVER_LOGITS])
    # the state is a copy: loading it rolls the server back to version 1 (the runtime's rollback)
    server.load_state_dict(state)
    np.testing.assert_array_equal(server.broadcast(1).extras[SERVER_LOGITS], a.extras[SERVER_LOGITS])
    np.testing.assert_array_equal(server.broadcast(1).prototypes.vectors, a.prototypes.vectors)
    assert set(server.latest_logits) == {0, 1} and server.latest_logits[0][1] == 0


# ----------------------------------------------------------------------------- presets


def test_presets_carry_the_papers_settings():
    from rayfed_proto.cli import resolve_config_arg
    from rayfed_proto.config import load_config

    paper = load_config(resolve_config_arg("fedprotokd_cifar10"))
    assert (paper.data.name, paper.data.partition.name, paper.data.partition.beta) == ("cifar10", "dirichlet", 0.1)
    assert (paper.federation.num_clients, paper.federation.rounds, paper.data.public_size) == (10, 100, 2500)
    assert (paper.training.local_epochs, paper.training.batch_size) == (5, 32)
    assert paper.algorithm_options().server_arch == "resnet34"
    digits = load_config(resolve_config_arg("fedprotokd_digits"))
    assert (digits.data.name, digits.model.group, digits.algorithm_options().server_arch) == ("digits", "small_hetero", "cnn")
    assert digits.data.public_size == 300 and digits.data.global_test_fraction == 0.2
