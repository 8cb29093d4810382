"""The client's update path without Ray: train -> valid upload -> evaluate, and state round trip."""

import numpy as np
import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState, UpdateSchema, validate_update
from rayfed_proto.runtime.client_core import ClientRunner


@pytest.fixture(scope="module")
def setup():
    cfg = build_config({}, ["algorithm.name=fedproto", "federation.num_clients=4", "model.feature_dim=16",
                            "data.partition.beta=1.0", "data.image_size=16"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 4, cfg.seed, cfg.data.test_fraction)
    return cfg, ds, part


def test_client_update_is_valid_and_evaluation_counts_add_up(setup):
    cfg, ds, part = setup
    runner = ClientRunner(cfg, part.clients[1], ds, torch.device("cpu"))  # client 1: cnn_narrow
    meta, update = runner.train(GlobalState(version=0))
    schema = UpdateSchema(4, ds.num_classes, 16)
    assert validate_update(update, schema, current_version=0) is None
    assert meta["busy_s"] > 0 and meta["upload_bytes"] == update.nbytes > 0
    assert set(update.prototypes.class_ids) == set(np.unique(ds.labels[part.clients[1].train_idx]))
    bank = GlobalState(version=1, prototypes=update.prototypes)
    ev = runner.evaluate(bank)
    assert ev["n"] == len(part.clients[1].test_idx) and 0 <= ev["head_correct"] <= ev["n"]
    assert ev["proto_correct"] is not None and ev["state_version"] == 1


def test_client_state_round_trip_continues_identically(setup):
    cfg, ds, part = setup
    a = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    a.train(GlobalState(version=0))
    b = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    _, ua = a.train(GlobalState(version=1))
    _, ub = b.train(GlobalState(version=1))
    np.testing.assert_allclose(ua.prototypes.vectors, ub.prototypes.vectors, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_embedding_silhouette_by_hand_and_undefined_cases():
    from rayfed_proto.runtime.client_core import embedding_silhouette

    # two tight, far-apart clusters: a = 0.5 (mean distance within), b = 10 (to the other): s = 1 - a/b
    feats = torch.tensor([[0.0, 0.0], [0.5, 0.0], [10.0, 0.0], [10.5, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])
    # point 0: a = 0.5, b = (10 + 10.5) / 2 = 10.25 -> 1 - 0.5/10.25; points 1, 2 share b = 9.75 by symmetry
    expected = np.mean([1 - 0.5 / 10.25, 1 - 0.5 / 9.75, 1 - 0.5 / 9.75, 1 - 0.5 / 10.25])
    assert embedding_silhouette(feats, labels) == pytest.approx(expected)
    assert embedding_silhouette(feats, torch.zeros(4, dtype=torch.long)) is None  # one class
    assert embedding_silhouette(feats[:2], torch.tensor([0, 1])) is None  # as many classes as samples


@pytest.mark.parametrize("n, k, dim, block", [(50, 3, 4, 1024), (203, 7, 16, 64), (40, 20, 2, 7), (300, 2, 32, 128)])
def test_embedding_silhouette_equals_scikit_learns(n, k, dim, block):
    from sklearn.metrics import silhouette_score

    from rayfed_proto.runtime.client_core import embedding_silhouette

    gen = torch.Generator().manual_seed(n)
    labels = torch.randint(0, k, (n,), generator=gen)
    labels[:k] = torch.arange(k)  # every class present; with k=20 of 40 some have a single sample (s_i = 0)
    feats = torch.randn(n, dim, generator=gen) + 2.0 * torch.nn.functional.one_hot(labels % dim, dim).float()
    feats[5] = feats[6]  # a duplicate point (distance 0)
    expected = silhouette_score(feats.double().numpy(), labels.numpy(), metric="euclidean")
    assert embedding_silhouette(feats, labels, block=block) == pytest.approx(expected, rel=1e-7, abs=1e-12)  # both use float64 distances


def test_evaluation_reports_a_silhouette_in_range(setup):
    cfg, ds, part = setup
    runner = ClientRunner(cfg, part.clients[2], ds, torch.device("cpu"))
    ev = runner.evaluate(GlobalState(version=0))
    assert ev["silhouette"] is None or -1.0 <= ev["silhouette"] <= 1.0


def test_silhouette_of_a_diverged_model_is_none_not_a_crash():
    from rayfed_proto.runtime.client_core import embedding_silhouette

    feats = torch.tensor([[0.0, 0.0], [float("nan"), 0.0], [10.0, 0.0], [10.5, 0.0]])
    assert embedding_silhouette(feats, torch.tensor([0, 0, 1, 1])) is None


def _momentum_runner(algorithm: str, *extra: str) -> tuple:
    cfg = build_config({}, [f"algorithm.name={algorithm}", "federation.num_clients=2", "model.group=HtFE1",
                            "model.feature_dim=8", "data.partition.beta=1.0", "data.image_size=16",
                            "data.num_samples=200", "data.name=synthetic", "training.momentum=0.9", *extra])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    runner = ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))
    seen = []  # momentum buffers present when each local update starts
    inner = runner.algorithm.local_train

    def recording(model, optimizer, *args, **kwargs):
        seen.append({id(p): optimizer.state[p]["momentum_buffer"].clone()
                     for p in model.parameters() if "momentum_buffer" in optimizer.state.get(p, {})})
        return inner(model, optimizer, *args, **kwargs)

    runner.algorithm.local_train = recording
    return runner, seen


@pytest.mark.parametrize("algorithm", ["fedavg", "fedproto", "fedsa", "fedtgp", "fedsap", "fedsc"])
def test_every_local_update_starts_with_a_fresh_optimizer(algorithm):
    # every reference builds its optimizer per round (original FedProto lib/update.py, HtFLlib's
    # train(), MOON's train_net): no momentum carries over, weights broadcast or not
    runner, seen = _momentum_runner(algorithm)
    _, first = runner.train(GlobalState(version=0, weights=None))
    ends = {id(p): runner.optimizer.state[p]["momentum_buffer"].clone() for p in runner.model.parameters()
            if "momentum_buffer" in runner.optimizer.state.get(p, {})}
    assert seen[0] == {} and ends and all(float(b.abs().sum()) > 0 for b in ends.values())
    runner.train(GlobalState(version=1, weights=first.weights))
    assert seen[1] == {}
    runner.train(GlobalState(version=2))  # no weights (a personal model): still no momentum at the start
    assert seen[2] == {}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedproto"])
def test_keep_optimizer_state_carries_momentum_to_the_next_update(algorithm):
    runner, seen = _momentum_runner(algorithm, "training.keep_optimizer_state=true")
    _, first = runner.train(GlobalState(version=0))
    ends = {id(p): runner.optimizer.state[p]["momentum_buffer"].clone() for p in runner.model.parameters()}
    runner.train(GlobalState(version=1, weights=first.weights))  # kept although FedAvg's weights are replaced
    assert set(seen[1]) == set(ends) and all(torch.equal(seen[1][k], ends[k]) for k in ends)


def test_after_the_reset_the_first_step_is_a_plain_gradient_step():
    # SGD momentum 0.9, lr 0.01: with a fresh state the first step is p - lr * g exactly (buffer = g)
    runner, _ = _momentum_runner("fedavg", "training.batch_size=1000")  # one batch per epoch: one step
    _, first = runner.train(GlobalState(version=0))
    start = {k: torch.tensor(v) for k, v in first.weights.items()}
    runner.model.load_state_dict(start)
    runner.model.zero_grad()
    xb, yb = runner.train_x, runner.train_y
    loss, _ = runner.algorithm.loss(runner.model, xb, yb)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in runner.model.named_parameters()}
    runner.model.load_state_dict(start)  # the same forward pass again inside train()
    _, second = runner.train(GlobalState(version=1, weights=first.weights))
    for n, g in grads.items():
        np.testing.assert_allclose(second.weights[n], (start[n] - 0.01 * g).numpy(), rtol=1e-4, atol=1e-6)


def _fedavg_runner(layout: str):
    cfg = build_config({}, ["algorithm.name=fedavg", "federation.num_clients=2", "model.group=HtFE1", "data.image_size=16",
                            "data.name=synthetic", "data.num_samples=200", "data.channels=3", "data.global_test_fraction=0",
                            f"training.memory_format={layout}"])
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, 2, cfg.seed, cfg.data.test_fraction)
    return ClientRunner(cfg, part.clients[0], ds, torch.device("cpu"))


def test_memory_format_auto_is_channels_last_on_cpu_contiguous_on_gpu_and_a_bad_value_names_the_key():
    from rayfed_proto.runtime.core import memory_format

    cfg = build_config({}, [])
    assert cfg.training.memory_format == "auto"
    assert memory_format(cfg, torch.device("cpu")) == torch.channels_last
    assert memory_format(cfg, torch.device("cuda")) == torch.contiguous_format
    forced = build_config({}, ["training.memory_format=channels_last"])
    assert memory_format(forced, torch.device("cuda")) == torch.channels_last
    with pytest.raises(Exception, match="training.memory_format"):
        build_config({}, ["training.memory_format=nhwc"])


def test_channels_last_changes_the_layout_not_the_model():
    nhwc, nchw = _fedavg_runner("auto"), _fedavg_runner("contiguous")
    conv = next(m for m in nhwc.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    for a, b in zip(nhwc.model.state_dict().values(), nchw.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the same initial values, only laid out differently
    _, ua = nhwc.train(GlobalState(version=0))
    _, ub = nchw.train(GlobalState(version=0))
    for k, w in ua.weights.items():  # uploads are ordinary C-ordered arrays, equal up to float rounding
        assert w.flags["C_CONTIGUOUS"]
        np.testing.assert_allclose(w, ub.weights[k], rtol=1e-4, atol=1e-5)
    # a received global model (C-ordered arrays) keeps the client's layout
    nhwc.train(GlobalState(version=1, weights=ub.weights))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_own_class_candidates_reach_the_clients_prototype_accuracy(setup):
    """evaluation.proto_candidates: own_classes scores against the bank vectors of the classes in the
    client's training split only (the count is the runner's, the candidates its training labels'
    classes; hand-computed predictions are in test_eval_protocol.py)."""
    from rayfed_proto.algorithms.common import nearest_prototype_predict
    from rayfed_proto.messages import PrototypeSet

    cfg, ds, part = setup
    results, expected = {}, {}
    for mode in ("all", "own_classes"):
        c = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"proto_candidates": mode})})
        runner = ClientRunner(c, part.clients[1], ds, torch.device("cpu"))
        runner.train_y = runner.train_y[runner.train_y < 5]  # a client whose training split holds classes 0-4 only
        own = runner.train_y.unique().numpy()
        runner.model.eval()
        with torch.no_grad():
            feats = runner.model.features(runner.test_x)
        vectors = [feats[runner.test_y == k].mean(0) if (runner.test_y == k).any() else torch.zeros(feats.shape[1])
                   for k in own] + [feats.mean(0)]  # class 9, foreign, at the centre of every test feature
        bank = PrototypeSet(np.append(own, 9), torch.stack(vectors).numpy().astype(np.float32), np.ones(len(own) + 1))
        results[mode] = runner.evaluate(GlobalState(version=1, prototypes=bank))["proto_correct"]
        cand = torch.as_tensor(own) if mode == "own_classes" else None
        expected[mode] = int((nearest_prototype_predict(feats, bank, cand) == runner.test_y).sum())
    assert results == expected and results["own_classes"] != results["all"]  # the option reached the count
