"""The client's update path without Ray: train -> valid upload -> evaluate, and state round trip."""

import numpy as np
import pytest
import torch

from rayfed_proto.config import build_config
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.messages import GlobalState, UpdateSchema, validate_update
from rayfed_proto.runtime.core import ClientRunner


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
    from rayfed_proto.runtime.core import embedding_silhouette

    # two tight, far-apart clusters: a = 0.5 (mean distance within), b = 10 (to the other): s = 1 - a/b
    feats = torch.tensor([[0.0, 0.0], [0.5, 0.0], [10.0, 0.0], [10.5, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])
    # point 0: a = 0.5, b = (10 + 10.5) / 2 = 10.25 -> 1 - 0.5/10.25; points 1, 2 share b = 9.75 by symmetry
    expected = np.mean([1 - 0.5 / 10.25, 1 - 0.5 / 9.75, 1 - 0.5 / 9.75, 1 - 0.5 / 10.25])
    assert embedding_silhouette(feats, labels) == pytest.approx(expected)
    assert embedding_silhouette(feats, torch.zeros(4, dtype=torch.long)) is None  # one class
    assert embedding_silhouette(feats[:2], torch.tensor([0, 1])) is None  # as many classes as samples


def test_evaluation_reports_a_silhouette_in_range(setup):
    cfg, ds, part = setup
    runner = ClientRunner(cfg, part.clients[2], ds, torch.device("cpu"))
    ev = runner.evaluate(GlobalState(version=0))
    assert ev["silhouette"] is None or -1.0 <= ev["silhouette"] <= 1.0


def test_silhouette_of_a_diverged_model_is_none_not_a_crash():
    from rayfed_proto.runtime.core import embedding_silhouette

    feats = torch.tensor([[0.0, 0.0], [float("nan"), 0.0], [10.0, 0.0], [10.5, 0.0]])
    assert embedding_silhouette(feats, torch.tensor([0, 0, 1, 1])) is None
