"""The "latest upload" memory (``common.LatestUploads``) shared by ``aggregation_scope: latest`` of the
prototype servers (FedProto, FedTGP, FedSA, FedSAP), FedProtoKD and FedSC: newest wins, an older
upload arriving late never replaces a newer one, staleness weights, state, and the checkpoint
layouts the servers wrote before it existed. Values computed by hand."""

import random
import threading
import warnings

import numpy as np
import pytest
import torch
from doubles import FixedModel, pset
from pydantic import ValidationError

from rayfed_proto.algorithms import ALGORITHMS, FederationSpec
from rayfed_proto.algorithms.common import LatestUploads
from rayfed_proto.algorithms.fedprotokd import PUBLIC_LOGITS
from rayfed_proto.config import build_config
from rayfed_proto.messages import ClientUpdate
from rayfed_proto.models.zoo import build_model
from rayfed_proto.runtime.checkpoint import CheckpointStore

CPU = torch.device("cpu")


def arr(*values):
    return np.array(values, np.float32)


def logits_fields(a):
    return {"logits": a.copy()}


def logits_from_fields(e):
    return np.array(e["logits"])


# ----------------------------------------------------------------------------- the class


def test_newest_upload_wins_and_equal_versions_take_the_later_arrival():
    mem = LatestUploads(0.5)
    assert mem.offer(0, arr(1, 0), base_version=1)
    assert mem.offer(0, arr(2, 0), base_version=3)  # newer: replaces
    np.testing.assert_array_equal(mem[0][0], [2, 0])
    assert mem[0][1] == 3
    assert mem.offer(0, arr(5, 0), base_version=3)  # same version (a resubmission): the later arrival wins
    np.testing.assert_array_equal(mem[0][0], [5, 0])
    assert mem.offer(1, arr(0, 1), base_version=0)  # another client: its own entry
    assert len(mem) == 2 and list(mem) == [0, 1] and 1 in mem and 2 not in mem


def test_an_older_upload_arriving_later_never_replaces_a_newer_one():
    mem = LatestUploads(0.5)
    assert mem.offer(4, arr(9, 9), base_version=5)
    assert not mem.offer(4, arr(1, 1), base_version=4)  # trained on an older version, arrived later: refused
    assert not mem.offer(4, arr(2, 2), base_version=0)
    payload, tau = mem[4]
    np.testing.assert_array_equal(payload, [9, 9])
    assert tau == 5


def test_submissions_on_several_threads_keep_each_clients_newest():
    """Uploads of versions 0..39 for each of 4 clients, offered in a shuffled order from 8 threads:
    whatever the arrival order, each client ends with its version-39 upload."""
    mem = LatestUploads(0.5)
    jobs = [(c, v) for c in range(4) for v in range(40)]
    random.Random(0).shuffle(jobs)
    start = threading.Barrier(8)

    def work(part):
        start.wait()
        for c, v in part:
            mem.offer(c, arr(c, v), base_version=v)

    threads = [threading.Thread(target=work, args=(jobs[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in range(4):
        np.testing.assert_array_equal(mem[c][0], [c, 39])
        assert mem[c][1] == 39


def test_staleness_weights_at_a_version():
    mem = LatestUploads(0.5)
    mem.offer(2, "a", base_version=0)
    mem.offer(0, "b", base_version=2)
    mem.offer(1, "c", base_version=4)
    mem.offer(2, "d", base_version=1)  # replaces "a" and keeps client 2's place (first arrival)
    # version 5 being produced: t = 4; staleness 4 - tau = 3, 2, 0 -> (1 + s)^-0.5 = 1/2, 3^-0.5, 1
    got = mem.weighted(5)
    assert [(c, p) for c, p, _ in got] == [(2, "d"), (0, "b"), (1, "c")]
    np.testing.assert_allclose([w for _, _, w in got], [0.5, 3 ** -0.5, 1.0])
    # exponent 1: 1/4, 1/3, 1; an upload trained on the version being produced counts as fresh (1)
    mem = LatestUploads(1.0)
    mem.offer(0, "x", base_version=0)
    mem.offer(1, "y", base_version=6)
    np.testing.assert_allclose([w for _, _, w in mem.weighted(4)], [1 / 4, 1.0])
    assert LatestUploads(0.5).weighted(3) == []


def test_state_round_trip_is_plain_and_a_copy():
    mem = LatestUploads(0.5)
    mem.offer(3, pset([0, 2], [[1, 2], [3, 4]], [5, 6]), base_version=2)
    mem.offer(1, pset([1], [[7, 8]], [9]), base_version=0)
    state = mem.state_dict()
    assert list(state) == ["3", "1"] and state["3"]["trained_on"] == 2 and type(state["3"]["trained_on"]) is int
    assert all(isinstance(v, (np.ndarray, int)) for e in state.values() for v in e.values())
    fresh = LatestUploads(0.5)
    fresh.load_state_dict(state)
    assert list(fresh) == [3, 1] and fresh[3][1] == 2 and fresh[1][1] == 0
    for c in (3, 1):
        for field in ("class_ids", "vectors", "counts"):
            np.testing.assert_array_equal(getattr(fresh[c][0], field), getattr(mem[c][0], field))
    # a later upload does not reach the saved state; loading it again rolls the memory back
    mem.offer(1, pset([1], [[0, 0]], [1]), base_version=3)
    assert state["1"]["trained_on"] == 0
    mem.load_state_dict(state)
    assert mem[1][1] == 0
    np.testing.assert_array_equal(mem[1][0].vectors, [[7, 8]])
    # any payload, with its own codec; the loaded memory keeps the guard
    logits = LatestUploads(0.5)
    logits.offer(0, arr(1, 2, 3), base_version=4)
    state = logits.state_dict(logits_fields)
    assert list(state["0"]) == ["logits", "trained_on"]
    back = LatestUploads(0.5)
    back.load_state_dict(state, logits_from_fields)
    np.testing.assert_array_equal(back[0][0], [1, 2, 3])
    assert not back.offer(0, arr(0, 0, 0), base_version=3)


def test_a_saved_memory_loads_from_a_checkpoint_with_weights_only(tmp_path):
    mem = LatestUploads(0.5)
    mem.offer(2, pset([1], [[1, 2]], [3]), base_version=7)
    store = CheckpointStore(tmp_path)
    store.save(8, server={"algorithm": {"latest": mem.state_dict()}}, clients=[], actor_rng={}, driver={}, run_id="r")
    fresh = LatestUploads(0.5)
    fresh.load_state_dict(store.latest().server_state()["algorithm"]["latest"])  # torch.load(weights_only=True)
    assert fresh[2][1] == 7
    np.testing.assert_array_equal(fresh[2][0].vectors, [[1, 2]])


# ----------------------------------------------------------------------------- one option name


@pytest.mark.parametrize("name,default", [("fedproto", "buffer"), ("fedtgp", "buffer"), ("fedsa", "buffer"),
                                          ("fedsap", "buffer"), ("fedprotokd", "latest"), ("fedsc", "latest")])
def test_every_method_names_the_scope_aggregation_scope_with_its_own_default(name, default):
    options = ALGORITHMS.get(name).Options
    assert "aggregation_scope" in options.model_fields and "prototype_scope" not in options.model_fields
    assert options.model_fields["aggregation_scope"].default == default


def test_fedsc_accepts_prototype_scope_as_a_deprecated_alias():
    options = ALGORITHMS.get("fedsc").Options
    with pytest.warns(FutureWarning, match="prototype_scope is deprecated.*renamed algorithm.aggregation_scope"):
        o = options(prototype_scope="buffer")
    assert o.aggregation_scope == "buffer" and "prototype_scope" not in o.model_dump()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name: no warning
        assert options(aggregation_scope="buffer").aggregation_scope == "buffer"
    with pytest.warns(FutureWarning):
        assert options(prototype_scope="latest", aggregation_scope="latest").aggregation_scope == "latest"
    with pytest.raises(ValidationError) as err:
        options(prototype_scope="buffer", aggregation_scope="latest")
    assert err.value.errors()[0]["loc"] == ("prototype_scope",) and "keep aggregation_scope only" in str(err.value)
    with pytest.warns(FutureWarning), pytest.raises(ValidationError, match="aggregation_scope"):
        options(prototype_scope="everything")
    # a config in the wild: the resolved config (what is saved and logged) holds the new name
    with pytest.warns(FutureWarning):
        cfg = build_config({"algorithm": {"name": "fedsc", "prototype_scope": "buffer"}, "model": {"group": "HtFE1"}})
    assert cfg.algorithm.options()["aggregation_scope"] == "buffer" and "prototype_scope" not in cfg.algorithm.options()
    assert cfg.algorithm_options().aggregation_scope == "buffer"


# ----------------------------------------------------------------------------- the guard in each server


@pytest.mark.parametrize("name", ["fedproto", "fedsap"])
def test_prototype_server_keeps_the_newer_upload_of_a_client(name):
    algo = ALGORITHMS.get(name)
    spec = FederationSpec(num_clients=2, num_classes=3, feature_dim=2, seed=0)
    server = algo.Server(algo.Options(aggregation_scope="latest", aggregation="uniform"), spec, CPU)
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0], [[0, 0]], [1])),
                      ClientUpdate(1, 0, 1, prototypes=pset([0], [[2, 0]], [1]))], [1.0, 1.0], version=1)
    server.aggregate([ClientUpdate(0, 1, 1, prototypes=pset([0], [[4, 0]], [1]))], [1.0], version=2)
    # client 0's upload trained on version 0 arrives late (another thread): it must not replace [4, 0]
    server.aggregate([ClientUpdate(0, 0, 1, prototypes=pset([0], [[8, 0]], [1]))], [1.0], version=3)
    assert server.latest[0][1] == 1
    np.testing.assert_array_equal(server.latest[0][0].vectors, [[4, 0]])
    # version 3 (t = 2): client 0 tau 1 -> (1 + 1)^-0.5; client 1 tau 0 -> (1 + 2)^-0.5; uniform mean of class 0
    w0, w1 = 2 ** -0.5, 3 ** -0.5
    np.testing.assert_allclose(server.broadcast(3).prototypes.vectors[0], [(4 * w0 + 2 * w1) / (w0 + w1), 0], rtol=1e-6)


def kd_spec(public=2):
    public_x = torch.randn(public, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    return FederationSpec(num_clients=2, num_classes=3, feature_dim=4, seed=0, staleness_exponent=1.0, in_channels=1,
                          image_size=8, build_arch=lambda arch, d: build_model(arch, 1, 8, 3, d), public_x=public_x)


def kd_options(**kw):
    return ALGORITHMS.get("fedprotokd").Options(server_arch="cnn", generator_epochs=1, server_epochs=1,
                                                server_batch_size=2, **kw)


def kd_update(client, base, logits, protos=None):
    return ClientUpdate(client, base, 5, prototypes=protos, extras={PUBLIC_LOGITS: np.array(logits, np.float32)})


def test_fedprotokd_keeps_the_newer_logits_and_prototypes_of_a_client():
    server = ALGORITHMS.get("fedprotokd").Server(kd_options(), kd_spec(), CPU)
    newer, older = [[3, 0, 0], [0, 3, 0]], [[0, 0, 9], [9, 0, 0]]
    server._collect([kd_update(0, 1, newer, pset([0], [[1, 1, 1, 1]], [1]))], [1.0], version=2)
    logits, protos = server._collect([kd_update(0, 0, older, pset([0], [[7, 7, 7, 7]], [1])),
                                      kd_update(1, 2, newer)], [1.0, 1.0], version=3)
    # client 0 keeps its version-1 logits and prototypes: t = 2, staleness 1 -> (1 + 1)^-1 = 1/2; client 1: 1
    assert server.latest_logits[0][1] == 1 and server.latest_protos[0][1] == 1
    assert [w for _, w in logits] == [0.5, 1.0] and [w for _, w in protos] == [0.5]
    np.testing.assert_array_equal(logits[0][0], newer)
    np.testing.assert_array_equal(protos[0][0].vectors, [[1, 1, 1, 1]])
    assert 1 not in server.latest_protos  # an upload without prototypes stores none


def sc_server(**kw):
    algo = ALGORITHMS.get("fedsc")
    spec = FederationSpec(num_clients=2, num_classes=2, feature_dim=2, seed=0, build_model=lambda: FixedModel(2, 2))
    return algo.Server(algo.Options(**{"num_neighbors": 0, "aggregation_scope": "latest", **kw}), spec, CPU)


def test_fedsc_keeps_the_newer_upload_of_a_client():
    # one client, M = 0: r = c and e = 1, so the consistent prototype o is the stored upload itself
    server = sc_server()
    a, b = pset([0], [[1, 0]], [2]), pset([0], [[5, 0]], [2])
    server.aggregate([ClientUpdate(0, 0, 2, prototypes=a)], [1.0], 1)
    server.aggregate([ClientUpdate(0, 1, 2, prototypes=b)], [1.0], 2)
    server.aggregate([ClientUpdate(0, 0, 2, prototypes=a)], [1.0], 3)  # older, arriving late
    assert server.latest[0][1] == 1
    np.testing.assert_allclose(server.broadcast(3).prototypes.vectors, [[5, 0]])
    # buffer scope: a client twice in one buffer, the newer first -> the newer is used
    buffered = sc_server(aggregation_scope="buffer")
    buffered.aggregate([ClientUpdate(0, 1, 2, prototypes=b), ClientUpdate(0, 0, 2, prototypes=a)], [1.0, 1.0], 2)
    np.testing.assert_allclose(buffered.broadcast(2).prototypes.vectors, [[5, 0]])


# ----------------------------------------------------------------------------- checkpoints written before LatestUploads


def old_prototype_entry(ids, vecs, counts, trained_on):
    """One client's entry as base.py, fedsc.py and FedProtoKD's ``latest_protos`` wrote it."""
    return {"class_ids": np.array(ids, np.int64), "vectors": np.array(vecs, np.float32),
            "counts": np.array(counts, np.int64), "trained_on": trained_on}


def assert_same_state(a, b):
    assert list(a) == list(b)
    for c in a:
        assert list(a[c]) == list(b[c])
        for k in a[c]:
            np.testing.assert_array_equal(a[c][k], b[c][k])


def test_prototype_server_loads_the_old_layout():
    algo = ALGORITHMS.get("fedproto")
    spec = FederationSpec(num_clients=4, num_classes=3, feature_dim=2, seed=0)
    server = algo.Server(algo.Options(aggregation_scope="latest", aggregation="uniform"), spec, CPU)
    bank = server.state_dict()["bank"]
    old = {"3": old_prototype_entry([0], [[2, 0]], [1], 0), "1": old_prototype_entry([0, 2], [[6, 0], [1, 1]], [2, 2], 1)}
    server.load_state_dict({"bank": bank, "latest": old})
    assert list(server.latest) == [3, 1] and server.latest[3][1] == 0 and server.latest[1][1] == 1
    assert_same_state(server.state_dict()["latest"], old)  # and it writes the same layout back
    assert not server.latest.offer(1, pset([0], [[0, 0]], [1]), 0)  # the guard holds after loading
    # version 2 (t = 1) from nothing new: client 3 staleness 1 -> 2^-0.5, client 1 staleness 0 -> 1
    server.aggregate([ClientUpdate(2, 1, 1, prototypes=pset([1], [[0, 3]], [1]))], [1.0], version=2)
    w3 = 2 ** -0.5
    np.testing.assert_allclose(server.broadcast(2).prototypes.vectors[0], [(2 * w3 + 6) / (w3 + 1), 0], rtol=1e-6)
    # a checkpoint without the key (buffer scope) loads with an empty memory
    server.load_state_dict({"bank": bank})
    assert len(server.latest) == 0


def test_fedprotokd_loads_the_old_layout():
    server = ALGORITHMS.get("fedprotokd").Server(kd_options(), kd_spec(), CPU)
    state = server.state_dict()
    state["latest_logits"] = {"1": {"logits": np.array([[1, 0, 0], [0, 1, 0]], np.float32), "trained_on": 2},
                              "0": {"logits": np.array([[0, 0, 1], [0, 2, 0]], np.float32), "trained_on": 0}}
    state["latest_protos"] = {"1": old_prototype_entry([2], [[1, 2, 3, 4]], [1], 2)}
    server.load_state_dict(state)
    assert server.latest_logits[1][1] == 2 and server.latest_protos[1][1] == 2
    np.testing.assert_array_equal(server.latest_logits[0][0], [[0, 0, 1], [0, 2, 0]])
    saved = server.state_dict()
    assert_same_state(saved["latest_logits"], state["latest_logits"])
    assert_same_state(saved["latest_protos"], state["latest_protos"])
    # version 4 (t = 3), exponent 1: client 0 (tau 0) 1/4, client 1 (tau 2) 1/2, in client order
    logits, protos = server._collect([], [], version=4)
    assert [w for _, w in logits] == [0.25, 0.5] and [w for _, w in protos] == [0.5]


def test_fedsc_loads_the_old_layout():
    server = sc_server()
    state = server.state_dict()
    state["latest"] = {"1": old_prototype_entry([0], [[3, 0]], [2], 1), "0": old_prototype_entry([0], [[1, 0]], [2], 1)}
    server.load_state_dict(state)
    assert list(server.latest) == [1, 0] and server.latest[0][1] == 1
    assert_same_state(server.state_dict()["latest"], state["latest"])
    # version 2 (t = 1): both fresh and alike (2 samples of class 0 each): o = (1 + 3) / 2
    server.aggregate([], [], 2)
    np.testing.assert_allclose(server.broadcast(2).prototypes.vectors, [[2, 0]], rtol=1e-6)
