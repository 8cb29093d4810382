"""Partitioners and the per-client split: coverage, disjointness, skew, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest

from rayfed_proto.config import PartitionConfig
from rayfed_proto.data import PARTITIONERS, ArrayDataset, ClientSplit, Partition, make_partition
from rayfed_proto.registry import UnknownNameError


def make_ds(labels, client_ids=None, is_train=None, num_classes=None) -> ArrayDataset:
    labels = np.asarray(labels, dtype=np.int64)
    return ArrayDataset(
        name="toy", images=np.zeros((len(labels), 1, 4, 4), dtype=np.uint8), labels=labels,
        num_classes=num_classes or int(labels.max()) + 1,
        client_ids=None if client_ids is None else np.asarray(client_ids),
        is_train=None if is_train is None else np.asarray(is_train, dtype=bool),
        mean=(0.0,), std=(1.0,),
    )


@pytest.fixture(scope="module")
def ds() -> ArrayDataset:
    """2000 samples, 10 unevenly sized classes, and 8 natural clients."""
    rng = np.random.default_rng(123)
    labels = rng.choice(10, size=2000, p=np.linspace(1, 2, 10) / np.linspace(1, 2, 10).sum())
    return make_ds(labels, client_ids=rng.integers(0, 8, size=2000) * 5 + 2)


def all_indices(p: Partition) -> np.ndarray:
    return np.concatenate([np.concatenate([c.train_idx, c.test_idx]) for c in p.clients])


COVERING = ["iid", "dirichlet", "pathological", "natural"]


@pytest.mark.parametrize("name", COVERING)
def test_covering_partitioners_assign_every_sample_exactly_once(ds, name):
    p = make_partition(ds, PartitionConfig(name=name, min_samples=5), num_clients=8, seed=0)
    idx = all_indices(p)
    assert len(p) == 8 and [c.client_id for c in p.clients] == list(range(8))
    assert np.array_equal(np.sort(idx), np.arange(len(ds)))  # disjoint and complete
    assert p.sizes().sum() == len(ds)
    assert np.array_equal(p.label_counts().sum(axis=0), np.bincount(ds.labels, minlength=10))
    assert all(c.train_idx.dtype == np.int64 and c.test_idx.dtype == np.int64 for c in p.clients)


@pytest.mark.parametrize("name", COVERING + ["nway_kshot"])
def test_same_seed_same_partition_other_seed_differs(ds, name):
    cfg = PartitionConfig(name=name, min_samples=5, n_way=3, k_shot=10)
    a = make_partition(ds, cfg, num_clients=8, seed=1)
    b = make_partition(ds, cfg, num_clients=8, seed=1)
    c = make_partition(ds, cfg, num_clients=8, seed=2)
    assert a == b
    assert a != c


def test_iid_is_even_and_mixed(ds):
    p = make_partition(ds, PartitionConfig(name="iid"), num_clients=7, seed=0)
    assert p.sizes().max() - p.sizes().min() <= 1
    assert (p.label_counts() > 0).all()


def test_dirichlet_honours_min_samples_and_skews_labels(ds):
    p = make_partition(ds, PartitionConfig(name="dirichlet", beta=0.1, min_samples=40), num_clients=10, seed=3)
    assert p.sizes().min() >= 40
    # beta = 0.1 concentrates each client on few classes: most clients miss some class
    assert ((p.label_counts() == 0).sum(axis=1) > 0).mean() > 0.5


def test_dirichlet_impossible_min_samples_names_the_key(ds):
    with pytest.raises(ValueError, match=r"data\.partition\.min_samples = 300 .*2000 samples.*8 clients"):
        make_partition(ds, PartitionConfig(name="dirichlet", min_samples=300), num_clients=8, seed=0)


def test_dirichlet_gives_up_after_bounded_attempts():
    # 10 clients x 10 samples out of 100: every client must get exactly its even share, which
    # Dir(0.01) essentially never draws
    ds = make_ds(np.repeat(np.arange(10), 10))
    with pytest.raises(ValueError, match=r"no draw in 1000 .*larger data\.partition\.beta"):
        make_partition(ds, PartitionConfig(name="dirichlet", beta=0.01, min_samples=10), num_clients=10, seed=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_gives_exactly_k_classes_per_client(ds, k):
    p = make_partition(ds, PartitionConfig(name="pathological", classes_per_client=k), num_clients=12, seed=0)
    assert ((p.label_counts() > 0).sum(axis=1) == k).all()
    assert np.array_equal(np.sort(all_indices(p)), np.arange(len(ds)))


def test_pathological_rejects_too_many_classes_or_too_few_slots(ds):
    with pytest.raises(ValueError, match=r"classes_per_client = 11 exceeds the 10 classes"):
        make_partition(ds, PartitionConfig(name="pathological", classes_per_client=11), num_clients=4, seed=0)
    with pytest.raises(ValueError, match=r"covers only 4 of 10 classes"):
        make_partition(ds, PartitionConfig(name="pathological", classes_per_client=2), num_clients=2, seed=0)


def test_nway_kshot_classes_and_shots(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=4, k_shot=7, k_shot_std=0)
    p = make_partition(ds, cfg, num_clients=10, seed=0)
    counts = p.label_counts()
    assert ((counts > 0).sum(axis=1) == 4).all()
    assert set(np.unique(counts[counts > 0])) == {7}
    idx = all_indices(p)
    assert len(np.unique(idx)) == len(idx) == 10 * 4 * 7  # disjoint; the rest stays unused


def test_nway_kshot_std_varies_shots_per_client(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=2, k_shot=5, k_shot_std=3)
    counts = make_partition(ds, cfg, num_clients=20, seed=0).label_counts()
    per_client = [set(np.unique(row[row > 0])) for row in counts]
    assert all(len(s) == 1 for s in per_client)  # one k per client, shared by its classes
    ks = np.array([s.pop() for s in per_client])
    assert ks.min() >= 1 and len(np.unique(ks)) > 2


def test_nway_kshot_reuses_samples_with_a_warning_when_a_class_runs_out():
    ds = make_ds(np.repeat(np.arange(3), 10))  # 10 samples per class
    cfg = PartitionConfig(name="nway_kshot", n_way=3, k_shot=6)
    with pytest.warns(UserWarning, match="ran out of unused samples"):
        p = make_partition(ds, cfg, num_clients=3, seed=0)
    assert (p.label_counts() == 6).all()
    for c in p.clients:  # shared across clients, never repeated within one
        idx = np.concatenate([c.train_idx, c.test_idx])
        assert len(np.unique(idx)) == len(idx)


def test_nway_kshot_rejects_n_way_above_class_count(ds):
    with pytest.raises(ValueError, match=r"data\.partition\.n_way = 11 exceeds the 10 classes"):
        make_partition(ds, PartitionConfig(name="nway_kshot", n_way=11), num_clients=3, seed=0)


def test_natural_replays_client_ids_in_sorted_order(ds):
    p = make_partition(ds, PartitionConfig(name="natural"), num_clients=8, seed=0)
    for new_id, old_id in enumerate(np.unique(ds.client_ids)):
        c = p.clients[new_id]
        assert np.array_equal(np.sort(np.concatenate([c.train_idx, c.test_idx])), np.flatnonzero(ds.client_ids == old_id))


def test_natural_errors_name_the_fix(ds):
    with pytest.raises(ValueError, match=r"needs per-sample client ids.*'client_ids' key of an npz"):
        make_partition(make_ds(ds.labels), PartitionConfig(name="natural"), num_clients=8, seed=0)
    with pytest.raises(ValueError, match=r"8 distinct client ids.*set federation\.num_clients=8"):
        make_partition(ds, PartitionConfig(name="natural"), num_clients=5, seed=0)


def test_split_is_stratified_per_client(ds):
    p = make_partition(ds, PartitionConfig(name="iid"), num_clients=5, seed=0, test_fraction=0.25)
    train, test = p.label_counts("train"), p.label_counts("test")
    total = train + test
    assert ((train > 0) & (test > 0))[total >= 4].all()
    # per (client, class): round-half-up(n * 0.25) test samples
    assert np.array_equal(test, np.minimum(np.floor(total * 0.25 + 0.5), total - 1).astype(int))
    assert abs(test.sum() / total.sum() - 0.25) < 0.01
    for c in p.clients:
        assert len(np.intersect1d(c.train_idx, c.test_idx)) == 0


def test_singleton_class_goes_to_train():
    ds = make_ds([0, 1, 1, 1, 1, 1, 1, 1])
    p = make_partition(ds, PartitionConfig(name="iid"), num_clients=1, seed=0)
    assert 0 in p.clients[0].train_idx and 0 not in p.clients[0].test_idx


def test_is_train_column_replaces_the_split(ds):
    is_train = np.arange(len(ds)) % 3 != 0
    with_split = make_ds(ds.labels, is_train=is_train)
    p = make_partition(with_split, PartitionConfig(name="iid"), num_clients=4, seed=0)
    for c in p.clients:
        assert is_train[c.train_idx].all() and not is_train[c.test_idx].any()
    assert sum(len(c.test_idx) for c in p.clients) == (~is_train).sum()


def test_parquet_round_trip(ds, tmp_path):
    for name in ("dirichlet", "nway_kshot"):  # nway_kshot leaves samples unused
        p = make_partition(ds, PartitionConfig(name=name, min_samples=5, n_way=3, k_shot=5), num_clients=6, seed=4)
        p.save_parquet(tmp_path / f"{name}.parquet")
        q = Partition.load_parquet(tmp_path / f"{name}.parquet")
        assert q == p
        assert (q.num_classes, q.partitioner, q.seed, len(q)) == (10, name, 4, 6)
        assert np.array_equal(q.label_counts("test"), p.label_counts("test"))
        for a, b in zip(p.clients, q.clients, strict=True):
            assert a == b


def test_table_columns_and_types(ds):
    p = make_partition(ds, PartitionConfig(name="iid"), num_clients=3, seed=0)
    t = p.to_table()
    assert t.schema.names == ["client_id", "sample_index", "split", "label"]
    assert [str(f.type) for f in t.schema] == ["int32", "int64", "string", "int64"]
    assert t.num_rows == len(ds)
    assert np.array_equal(t.column("label").to_numpy(), ds.labels[t.column("sample_index").to_numpy()])
    assert set(t.column("split").to_pylist()) == {"train", "test"}


def test_partition_equality_sees_a_moved_sample():
    base = dict(num_classes=2, partitioner="iid", seed=0, labels=np.array([0, 1, 0, 1]))
    a = Partition([ClientSplit(0, np.array([0, 1]), np.array([2])), ClientSplit(1, np.array([3]), np.array([], dtype=np.int64))], **base)
    b = Partition([ClientSplit(0, np.array([0, 1]), np.array([], dtype=np.int64)), ClientSplit(1, np.array([3]), np.array([2]))], **base)
    assert a != b


def test_unknown_partitioner_lists_the_known_ones(ds):
    with pytest.raises(UnknownNameError, match="allowed: by_domain, dirichlet, iid, natural, nway_kshot, pathological"):
        make_partition(ds, PartitionConfig(name="shards"), num_clients=2, seed=0)
    assert set(PARTITIONERS.names()) == {"by_domain", "dirichlet", "iid", "natural", "nway_kshot", "pathological"}
