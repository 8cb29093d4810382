"""Losses and aggregation of FedProto, FedTGP and FedAvg against values computed by hand."""

import math

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.common import (
    PrototypeBank,
    aggregate_prototypes,
    alignment_loss,
    local_prototypes,
    nearest_prototype_predict,
    prototype_margin,
    safe_cdist,
    staleness_weight,
)
from rayfed_proto.algorithms.fedavg import average_weights
from rayfed_proto.algorithms.fedtgp import adaptive_margin, margin_contrastive_loss
from rayfed_proto.messages import ClientUpdate, GlobalState, PrototypeSet

SPEC = FederationSpec(num_clients=4, num_classes=3, feature_dim=2, seed=0)


# ----------------------------------------------------------------------------- shared pieces

def test_safe_cdist_values_and_clamp():
    a = torch.tensor([[0.0, 0.0]])
    b = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    d = safe_cdist(a, b)
    assert d[0, 0].item() == pytest.approx(5.0)
    assert d[0, 1].item() == pytest.approx(1e-6)  # sqrt(1e-12), not 0: the gradient stays finite
    a.requires_grad_(True)
    safe_cdist(a, b)[0, 1].backward()
    assert torch.isfinite(a.grad).all()


@pytest.mark.parametrize("staleness,a,expected", [(0, 0.5, 1.0), (3, 0.5, 0.5), (1, 1.0, 0.5), (7, 0.0, 1.0)])
def test_staleness_weight(staleness, a, expected):
    assert staleness_weight(staleness, a) == pytest.approx(expected)


def test_staleness_weight_rejects_negative():
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(-1, 0.5)


def test_aggregation_weighted_uniform_and_staleness():
    a = pset([0], [[1, 0]], [1])
    b = pset([0, 1], [[3, 0], [0, 2]], [3, 2])
    # no staleness: class 0 = (1*1 + 3*3) / 4 = 2.5 (sample-weighted) or (1 + 3) / 2 = 2 (uniform)
    w = aggregate_prototypes([a, b], [1.0, 1.0], "weighted")
    assert w[0][0] == pytest.approx([2.5, 0.0])
    assert w[1][0] == pytest.approx([0.0, 2.0])
    assert aggregate_prototypes([a, b], [1.0, 1.0], "uniform")[0][0] == pytest.approx([2.0, 0.0])
    # b is stale (weight 0.5): weighted (1*1 + 0.5*3*3) / (1 + 1.5) = 2.2; uniform (1 + 0.5*3) / 1.5
    w = aggregate_prototypes([a, b], [1.0, 0.5], "weighted")
    assert w[0][0] == pytest.approx([2.2, 0.0])
    assert w[0][1] == pytest.approx(2.5)
    assert aggregate_prototypes([a, b], [1.0, 0.5], "uniform")[0][0] == pytest.approx([2.5 / 1.5, 0.0])


def test_alignment_loss_skips_classes_without_target():
    feats = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    labels = torch.tensor([0, 1])
    targets = torch.zeros(2, 2)
    mask = torch.tensor([True, False])  # class 1 has no global prototype
    assert alignment_loss(feats, labels, targets, mask, "sum").item() == pytest.approx(5.0)
    assert alignment_loss(feats, labels, targets, mask, "mean").item() == pytest.approx(2.5)
    assert alignment_loss(feats, labels, targets, torch.tensor([False, False]), "sum").item() == 0.0


def test_local_prototypes_are_class_means_with_counts():
    model = FixedModel(num_classes=2)
    x = torch.tensor([[0.0, 0.0], [2.0, 2.0], [5.0, 1.0]])
    y = torch.tensor([1, 1, 2])
    ps = local_prototypes(model, x, y)
    assert ps.class_ids.tolist() == [1, 2]
    assert ps.counts.tolist() == [2, 1]
    np.testing.assert_allclose(ps.vectors, [[1.0, 1.0], [5.0, 1.0]])


def test_prototype_margin_and_nearest_prediction():
    vecs = np.array([[0, 0], [3, 4], [0, 1]], np.float32)
    lo, mean = prototype_margin(vecs)
    assert lo == pytest.approx(1.0)
    assert mean == pytest.approx((1 + math.sqrt(18) + 1) / 3)
    assert all(math.isnan(v) for v in prototype_margin(vecs[:1]))
    bank = pset([4, 7], [[0, 0], [10, 0]], [1, 1])
    pred = nearest_prototype_predict(torch.tensor([[1.0, 0.0], [9.0, 1.0]]), bank)
    assert pred.tolist() == [4, 7]
    assert nearest_prototype_predict(torch.zeros(1, 2), None) is None


def test_bank_keeps_classes_nobody_uploaded():
    bank = PrototypeBank(3, 2)
    bank.update({0: (np.array([1, 1], np.float32), 2.0), 2: (np.array([5, 5], np.float32), 1.0)}, version=1)
    bank.update({0: (np.array([2, 2], np.float32), 1.0)}, version=2)
    s = bank.as_set()
    assert s.class_ids.tolist() == [0, 2]  # class 1 never had a vector: absent
    np.testing.assert_allclose(s.vectors, [[2, 2], [5, 5]])  # class 2 kept its version-1 vector
    assert bank.updated_at.tolist() == [2, -1, 1]


# ----------------------------------------------------------------------------- FedProto

def test_fedproto_client_loss_by_hand():
    algo = ALGORITHMS.get("fedproto")
    client = algo.Client(algo.Options(lam=2.0, alignment_reduction="sum"), SPEC, client_id=0)
    model = FixedModel(num_classes=3)
    client.receive(GlobalState(version=1, prototypes=pset([0], [[0, 0]], [1])), model)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = torch.tensor([0, 1])
    loss, terms = client.loss(model, x, y)
    # zero head -> uniform logits over 3 classes: CE = ln 3; only sample 0 has a prototype: 1 + 4 = 5
    assert terms["ce"] == pytest.approx(math.log(3))
    assert terms["align"] == pytest.approx(5.0)
    assert loss.item() == pytest.approx(math.log(3) + 2.0 * 5.0)


def test_fedproto_server_default_is_the_reference_plain_mean_over_clients():
    # HtFLlib serverproto.proto_aggregation: sum of the clients' prototypes / number of clients
    algo = ALGORITHMS.get("fedproto")
    assert algo.Options().aggregation == "uniform"
    server = algo.Server(algo.Options(), SPEC, torch.device("cpu"))
    u1 = ClientUpdate(0, 0, 4, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 3]))
    u2 = ClientUpdate(1, 0, 3, prototypes=pset([0], [[3, 0]], [3]))
    server.aggregate([u1, u2], [1.0, 1.0], version=1)
    # class 0: ([1, 0] + [3, 0]) / 2 = [2, 0], whatever the counts (1 and 3; weighted: [2.5, 0])
    np.testing.assert_allclose(server.broadcast(1).prototypes.vectors, [[2.0, 0.0], [0.0, 1.0]], rtol=1e-6)


def test_fedproto_server_partial_participation_and_staleness():
    algo = ALGORITHMS.get("fedproto")
    server = algo.Server(algo.Options(aggregation="weighted"), SPEC, torch.device("cpu"))
    u1 = ClientUpdate(0, 0, 4, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 3]))
    u2 = ClientUpdate(1, 0, 3, prototypes=pset([0], [[3, 0]], [3]))
    server.aggregate([u1, u2], [1.0, 0.5], version=1)
    state = server.broadcast(1)
    assert state.prototypes.class_ids.tolist() == [0, 1]
    # class 0: (1*1*[1,0] + 0.5*3*[3,0]) / (1 + 1.5) = [2.2, 0]
    np.testing.assert_allclose(state.prototypes.vectors[0], [2.2, 0.0], rtol=1e-6)
    server.aggregate([ClientUpdate(2, 1, 2, prototypes=pset([1], [[0, 5]], [2]))], [1.0], version=2)
    state = server.broadcast(2)
    np.testing.assert_allclose(state.prototypes.vectors[0], [2.2, 0.0], rtol=1e-6)  # kept
    np.testing.assert_allclose(state.prototypes.vectors[1], [0.0, 5.0])


def test_latest_scope_uses_every_clients_last_upload_with_age_weights():
    algo = ALGORITHMS.get("fedproto")
    server = algo.Server(algo.Options(aggregation_scope="latest", aggregation="uniform"), SPEC, torch.device("cpu"))
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0], [[0, 0]], [1]))], [1.0], version=1)
    server.aggregate([ClientUpdate(1, 1, 1, prototypes=pset([0], [[4, 0]], [1]))], [1.0], version=2)
    # client 0's upload is one version old: weight (1 + 1)^-0.5; client 1's is fresh: weight 1
    w0 = 2 ** -0.5
    np.testing.assert_allclose(server.broadcast(2).prototypes.vectors[0], [4 / (1 + w0), 0.0], rtol=1e-5)


# ----------------------------------------------------------------------------- FedTGP

def test_fedtgp_adaptive_margin_by_hand():
    means = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    # nearest-other distances: 1, sqrt(18), 1 -> max = sqrt(18) = 4.2426
    assert adaptive_margin(means, 100.0) == pytest.approx(math.sqrt(18), rel=1e-5)
    assert adaptive_margin(means, 2.0) == pytest.approx(2.0)  # clipped by tau
    assert adaptive_margin(means[:1], 7.0) == pytest.approx(7.0)  # one class: no gap, tau


def test_fedtgp_margin_contrastive_loss_by_hand():
    protos = torch.tensor([[0.0, 0.0]])
    labels = torch.tensor([0])
    generated = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    # distances [~0, 5]; margin 1 on the true class -> logits [-1, -5]: CE = log(1 + e^-4)
    loss = margin_contrastive_loss(protos, labels, generated, margin=1.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-4)), rel=1e-4)


def test_fedtgp_server_trains_generator_and_broadcasts_seen_classes_only():
    algo = ALGORITHMS.get("fedtgp")
    spec = FederationSpec(num_clients=2, num_classes=4, feature_dim=8, seed=0)
    server = algo.Server(algo.Options(server_epochs=30, server_lr=0.1, broadcast_classes="seen"), spec, torch.device("cpu"))
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(2, 8)).astype(np.float32) * 3
    ups = [ClientUpdate(c, 0, 5, prototypes=PrototypeSet(np.array([0, 2]), centres + rng.normal(size=(2, 8)).astype(np.float32) * 0.1,
                                                          np.array([2, 3]))) for c in range(2)]
    before = server.generator(torch.tensor([0, 2])).detach()
    metrics = server.aggregate(ups, [1.0, 1.0], version=1)
    state = server.broadcast(1)
    assert state.prototypes.class_ids.tolist() == [0, 2]  # classes 1 and 3 were never uploaded
    after = torch.tensor(state.prototypes.vectors)
    expected_margin = float(np.linalg.norm(centres[0] - centres[1]))
    assert metrics["server_margin"] == pytest.approx(min(expected_margin, 100.0), rel=0.1)
    # training pulls each generated prototype towards its class's uploads
    target = torch.tensor(centres)
    assert (after - target).norm(dim=1).mean() < (before - target).norm(dim=1).mean()


def test_fedtgp_broadcasts_every_class_the_generator_knows_by_default():
    """HtFLlib servertgp.py update_Gen: global_protos[class_id] = PROTO(class_id) for every class
    of range(num_classes), once the generator has trained; nothing before."""
    algo = ALGORITHMS.get("fedtgp")
    spec = FederationSpec(num_clients=2, num_classes=4, feature_dim=8, seed=0)
    server = algo.Server(algo.Options(server_epochs=2), spec, torch.device("cpu"))
    assert len(server.broadcast(0).prototypes) == 0
    ups = [ClientUpdate(c, 0, 5, prototypes=pset([0, 2], np.ones((2, 8)) * (c + 1), [2, 3])) for c in range(2)]
    server.aggregate(ups, [1.0, 1.0], version=1)
    state = server.broadcast(1)
    assert state.prototypes.class_ids.tolist() == [0, 1, 2, 3]
    with torch.no_grad():
        np.testing.assert_allclose(state.prototypes.vectors, server.generator.eval()(torch.arange(4)).numpy(), rtol=1e-6)


@pytest.mark.parametrize("scope,new,trained_on,work,expected", [
    ("latest", 2, 20, "per_update", 10),  # the default experiment: K = 2 of N = 20 uploads -> 100 x 2 / 20
    ("latest", 2, 2, "per_update", 100),  # only the buffer's clients have uploaded yet
    ("latest", 1, 3, "per_update", 33),
    ("latest", 1, 1000, "per_update", 1),  # at least one epoch
    ("buffer", 2, 2, "per_update", 100),  # the buffer: the reference's server_epochs
    ("latest", 2, 20, "per_version", 100),
])
def test_fedtgp_server_epochs_keep_the_references_work_per_client_update(scope, new, trained_on, work, expected):
    algo = ALGORITHMS.get("fedtgp")
    spec = FederationSpec(num_clients=1000, num_classes=3, feature_dim=4, seed=0)
    server = algo.Server(algo.Options(aggregation_scope=scope, server_work=work), spec, torch.device("cpu"))
    assert server.epochs_for(new, trained_on) == expected


def test_fedtgp_async_version_trains_the_scaled_epochs():
    """aggregation_scope latest: a version of 1 update trains on 4 clients' uploads -> 100 / 4 = 25
    epochs (the reference's work for one client update), not 100."""
    algo = ALGORITHMS.get("fedtgp")
    spec = FederationSpec(num_clients=4, num_classes=3, feature_dim=4, seed=0)
    server = algo.Server(algo.Options(aggregation_scope="latest"), spec, torch.device("cpu"))
    rng = np.random.default_rng(0)
    ups = [ClientUpdate(c, 0, 5, prototypes=pset([0, 1], rng.normal(size=(2, 4)), [2, 3])) for c in range(4)]
    assert server.aggregate(ups, [1.0] * 4, version=1)["server_epochs"] == 100.0  # all four are new
    assert server.aggregate(ups[:1], [1.0], version=2)["server_epochs"] == 25.0


def test_fedtgp_server_lr_and_batch_size_follow_the_clients_unless_set():
    """HtFLlib servertgp.py FedTGP.__init__: server_learning_rate = args.local_learning_rate,
    batch_size = args.batch_size."""
    from rayfed_proto.config import build_config

    opts = build_config({}, ["training.lr=0.05", "training.batch_size=32"]).algorithm_options()
    assert (opts.server_lr, opts.server_batch_size) == (0.05, 32)
    opts = build_config({}, ["training.lr=0.05", "algorithm.server_lr=0.2", "algorithm.server_batch_size=7"]).algorithm_options()
    assert (opts.server_lr, opts.server_batch_size) == (0.2, 7)
    assert (build_config({}).algorithm_options().server_lr, build_config({}).algorithm_options().server_batch_size) == (0.01, 10)
    assert "server_lr" not in build_config({}, ["algorithm.name=fedproto", "training.lr=0.05"]).algorithm.model_extra


def test_fedproto_inference_bank_is_the_latest_rounds_aggregate_by_default():
    """HtFLlib serverproto.py: global_protos = proto_aggregation(this round's uploads), and
    clientproto.py test_metrics scores against it: a class nobody uploaded this round is not a
    candidate. The training guidance keeps every class's last vector."""
    algo = ALGORITHMS.get("fedproto")
    server = algo.Server(algo.Options(), SPEC, torch.device("cpu"))
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 1]))], [1.0], version=1)
    server.aggregate([ClientUpdate(1, 1, 1, prototypes=pset([2], [[5, 5]], [1]))], [1.0], version=2)
    client = algo.Client(algo.Options(), SPEC, 0)
    client.receive(server.broadcast(2), FixedModel(num_classes=3))
    assert client.guidance.class_ids.tolist() == [0, 1, 2]  # the alignment targets: every class's last vector
    assert client.inference_bank().class_ids.tolist() == [2]
    np.testing.assert_allclose(client.inference_bank().vectors, [[5, 5]])
    # last_seen: every class's last vector, and the broadcast carries nothing more than the bank
    kept = algo.Server(algo.Options(inference_memory="last_seen"), SPEC, torch.device("cpu"))
    kept.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0, 1], [[1, 0], [0, 1]], [1, 1]))], [1.0], version=1)
    kept.aggregate([ClientUpdate(1, 1, 1, prototypes=pset([2], [[5, 5]], [1]))], [1.0], version=2)
    assert kept.broadcast(2).extras == {}
    client.receive(kept.broadcast(2), FixedModel(num_classes=3))
    assert client.inference_bank().class_ids.tolist() == [0, 1, 2]


def test_fedproto_and_fedsa_keep_last_seen_banks_in_async_mode():
    from rayfed_proto.config import build_config

    for name in ("fedproto", "fedsa"):
        assert build_config({}, [f"algorithm.name={name}", "federation.mode=sync"]).algorithm_options().inference_memory == "round"
        assert build_config({}, [f"algorithm.name={name}"]).algorithm_options().inference_memory == "last_seen"
        assert build_config({}, [f"algorithm.name={name}", "algorithm.inference_memory=round"]
                            ).algorithm_options().inference_memory == "round"


@pytest.mark.parametrize("name", ["fedtgp", "fedsa", "fedsap", "fedproto", "fedavg"])
def test_server_state_dict_is_a_snapshot_not_a_view(name):
    # the runtime rolls a non-finite version back to the state_dict taken before aggregating:
    # if it aliased live tensors, the "before" state would move with training and restore nothing
    algo = ALGORITHMS.get(name)
    spec = FederationSpec(num_clients=2, num_classes=3, feature_dim=4, seed=0,
                          build_model=lambda: torch.nn.Linear(4, 3))
    opts = algo.Options(**({"server_epochs": 5, "server_lr": 0.5} if "server_epochs" in algo.Options.model_fields else {}))
    server = algo.Server(opts, spec, torch.device("cpu"))
    rng = np.random.default_rng(1)
    ups = [ClientUpdate(c, 0, 5, prototypes=pset([0, 1], rng.normal(size=(2, 4)), [2, 3]),
                        weights={k: v + 1.0 for k, v in server.state_dict()["global_weights"].items()} if name == "fedavg" else None)
           for c in range(2)]
    before = server.state_dict()
    frozen = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in _flat(before).items()}
    server.aggregate(ups, [1.0, 1.0], version=1)
    for k, v in _flat(before).items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, frozen[k], err_msg=f"{name}: state_dict()[{k}] changed with training")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ----------------------------------------------------------------------------- FedAvg

def test_average_weights_by_hand():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(1, np.int64)}
    b = {"w": np.array([3.0, 4.0], np.float32), "n": np.array(2, np.int64)}
    out = average_weights([a, b], [1.0, 3.0])
    np.testing.assert_allclose(out["w"], [2.5, 3.5])
    assert out["n"] == 2 and out["n"].dtype == np.int64  # (1 + 6) / 4 = 1.75 -> rounded


def test_fedavg_server_sync_is_exact_average_and_stale_buffer_moves_less():
    algo = ALGORITHMS.get("fedavg")
    spec = FederationSpec(num_clients=2, num_classes=2, feature_dim=2, seed=0,
                          build_model=lambda: torch.nn.Linear(2, 2, bias=False))
    server = algo.Server(algo.Options(), spec, torch.device("cpu"))
    server.global_weights = {"weight": np.zeros((2, 2), np.float32)}
    u = [ClientUpdate(0, 0, 1, weights={"weight": np.ones((2, 2), np.float32)}),
         ClientUpdate(1, 0, 3, weights={"weight": np.full((2, 2), 5.0, np.float32)})]
    server.aggregate(u, [1.0, 1.0], version=1)
    np.testing.assert_allclose(server.broadcast(1).weights["weight"], 4.0)  # (1*1 + 3*5) / 4
    server.global_weights = {"weight": np.zeros((2, 2), np.float32)}
    metrics = server.aggregate(u, [0.5, 0.5], version=2)
    # both stale (weight 0.5): average still 4, mixed in at rate 0.5 -> 2
    assert metrics["server_mixing_rate"] == pytest.approx(0.5)
    np.testing.assert_allclose(server.broadcast(2).weights["weight"], 2.0)


def test_fedavg_client_loads_global_weights_and_uploads_weights_only():
    algo = ALGORITHMS.get("fedavg")
    client = algo.Client(algo.Options(), SPEC, 0)
    model = FixedModel(num_classes=2)
    client.receive(GlobalState(version=3, weights={"head.weight": np.full((2, 2), 7.0, np.float32)}), model)
    assert torch.all(model.head.weight == 7.0)
    up = client.make_update(model, torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]))
    assert up.prototypes is None and up.base_version == 3 and up.num_samples == 4
    np.testing.assert_allclose(up.weights["head.weight"], 7.0)
    assert client.inference_bank() is None


def test_batches_cover_every_sample_once_and_never_leave_a_singleton():
    from rayfed_proto.algorithms.base import TrainBatchIterator

    it = TrainBatchIterator(torch.arange(21).float().unsqueeze(1), torch.arange(21), 10, torch.Generator().manual_seed(0))
    batches = [yb for _, yb in it.epoch()]
    assert [len(b) for b in batches] == [10, 11]  # 21 = 10 + 10 + 1: the 1 joins the previous batch
    assert sorted(torch.cat(batches).tolist()) == list(range(21))


def test_fedtgp_pair_weights_give_a_weighted_mean_loss():
    protos = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    labels = torch.tensor([0, 0])
    generated = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    per_pair = [margin_contrastive_loss(protos[i : i + 1], labels[i : i + 1], generated, 1.0).item() for i in range(2)]
    w = torch.tensor([1.0, 0.25])
    expected = (per_pair[0] * 1.0 + per_pair[1] * 0.25) / 1.25
    assert margin_contrastive_loss(protos, labels, generated, 1.0, w).item() == pytest.approx(expected, rel=1e-5)


def test_prototype_server_state_round_trips_as_plain_arrays():
    algo = ALGORITHMS.get("fedproto")
    server = algo.Server(algo.Options(aggregation_scope="latest"), SPEC, torch.device("cpu"))
    server.aggregate([ClientUpdate(1, 0, 2, prototypes=pset([2], [[1, 2]], [2]))], [1.0], version=1)
    state = server.state_dict()
    leaves = [v for e in state["latest"].values() for v in e.values()] + list(state["bank"].values())
    assert all(isinstance(v, (np.ndarray, int)) for v in leaves)
    fresh = algo.Server(algo.Options(aggregation_scope="latest"), SPEC, torch.device("cpu"))
    fresh.load_state_dict(state)
    np.testing.assert_allclose(fresh.broadcast(1).prototypes.vectors, server.broadcast(1).prototypes.vectors)
    assert fresh.latest[1][1] == 0


@pytest.mark.parametrize("shape,version,expected", [
    ("linear", 0, 0.0), ("linear", 20, 0.0), ("linear", 60, 0.5), ("linear", 100, 1.0), ("linear", 500, 1.0),
    ("cosine", 60, 0.5), ("cosine", 40, 0.5 * (1 - math.cos(math.pi * 0.25))),
    ("sigmoid", 20, 0.0), ("sigmoid", 60, 0.5), ("sigmoid", 100, 1.0),
    ("step", 99, 0.0), ("step", 100, 1.0),
])
def test_alignment_schedule_values_at_chosen_rounds(shape, version, expected):
    from rayfed_proto.algorithms.schedules import AlignmentSchedule

    assert AlignmentSchedule(shape=shape, start=20, length=80).factor(version) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("version,expected", [(0, 0.0), (19, 0.0), (20, 1 / 80), (59, 0.5), (98, 79 / 80), (99, 1.0)])
def test_alignment_schedule_counts_rounds_from_one(version, expected):
    """FedSAP: "from 0 to 0.7 until round 100". Round r (from 1) trains against version r - 1,
    so the last round of a 100-round run (version 99) has the full weight."""
    from rayfed_proto.algorithms.schedules import AlignmentSchedule

    assert AlignmentSchedule(start=20, length=80).at_version(version) == pytest.approx(expected, abs=1e-12)


def test_fedproto_alignment_weight_follows_the_schedule():
    algo = ALGORITHMS.get("fedproto")
    opts = algo.Options(lam=0.7, alignment_schedule={"start": 20, "length": 80})
    assert opts.alignment_weight(10) == 0.0 and opts.alignment_weight(59) == pytest.approx(0.35)
    assert opts.alignment_weight(99) == pytest.approx(0.7)  # round 100
    assert algo.Options(lam=0.7).alignment_weight(0) == pytest.approx(0.7)  # no schedule: constant
    client = algo.Client(opts, SPEC, 0)
    model = FixedModel(num_classes=3)
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([0])
    client.receive(GlobalState(version=10, prototypes=pset([0], [[0, 0]], [1])), model)
    assert client.loss(model, x, y)[0].item() == pytest.approx(math.log(3))  # before the ramp: CE only


def test_guarded_step_skips_nonfinite_loss_and_gradients():
    from rayfed_proto.algorithms.base import guarded_step

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.tensor([[1.0, 2.0]])
    assert not guarded_step(model, opt, model(x).sum() * float("nan"))  # NaN loss: no step
    assert not guarded_step(model, opt, (model(x) * torch.tensor(float("inf"))).sum() * 0 + model(x).sum() * 1e39 * 1e39)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert guarded_step(model, opt, model(x).sum())  # a finite step is applied
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
