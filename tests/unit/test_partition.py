"""Partitioners, holdouts and the per-client split: coverage, disjointness, skew, determinism, errors."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rayfed_proto.config import PartitionConfig
from rayfed_proto.data import PARTITIONERS, ArrayDataset, ClientSplit, Partition, make_partition
from rayfed_proto.data.partition import long_tail_counts
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
    train, test = p.label_counts("train"), p.label_counts("test")
    assert ((train > 0).sum(axis=1) == 4).all()
    assert set(np.unique(train[train > 0])) == {7}  # the k shots all train
    assert np.array_equal(test > 0, train > 0) and set(np.unique(test[test > 0])) == {15}  # test_shots apart
    idx = all_indices(p)
    assert len(np.unique(idx)) == len(idx) == 10 * 4 * (7 + 15)  # disjoint; the rest stays unused


def test_nway_kshot_std_varies_shots_per_client(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=2, k_shot=5, k_shot_std=3)
    counts = make_partition(ds, cfg, num_clients=20, seed=0).label_counts("train")
    per_client = [set(np.unique(row[row > 0])) for row in counts]
    assert all(len(s) == 1 for s in per_client)  # one k per client, shared by its classes
    ks = np.array([s.pop() for s in per_client])
    assert ks.min() >= 1 and len(np.unique(ks)) > 2


def test_nway_kshot_reuses_samples_with_a_warning_when_a_class_runs_out():
    ds = make_ds(np.repeat(np.arange(3), 10))  # 10 samples per class, 2 of them set aside for testing
    cfg = PartitionConfig(name="nway_kshot", n_way=3, k_shot=6, test_shots=2)
    with pytest.warns(UserWarning, match="ran out of unused samples"):
        p = make_partition(ds, cfg, num_clients=3, seed=0)
    assert (p.label_counts("train") == 6).all() and (p.label_counts("test") == 2).all()
    trained = np.concatenate([c.train_idx for c in p.clients])
    for c in p.clients:  # shared across clients, never repeated within one; no test sample is trained on
        idx = np.concatenate([c.train_idx, c.test_idx])
        assert len(np.unique(idx)) == len(idx)
        assert not np.intersect1d(c.test_idx, trained).size


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


# --------------------------------------------------------------------------- default path pinned


def digest(p: Partition) -> str:
    h = hashlib.sha256()
    for c in p.clients:
        h.update(c.train_idx.astype(np.int64).tobytes() + b"|" + c.test_idx.astype(np.int64).tobytes() + b"#")
    return h.hexdigest()[:16]


# Digests of partitions made by the code before holdouts and by_domain existed (commit
# 666959c): calls with only the old arguments must keep giving exactly these partitions.
# nway_kshot's changed on purpose in issue 24 (item 5): its k shots all train and its test sets
# are drawn apart (data.partition.test_shots), so its digest is that of the new split.
PINNED = {"iid": "4919845111e5a842", "dirichlet": "aa25adadc13da3d2", "pathological": "1c805aa4e8d7cfce",
          "nway_kshot": "843a3ec6d7b83563", "natural": "5bbbdb7c622feaec"}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_default_path_is_unchanged(ds, name):
    cfg = PartitionConfig(name=name, min_samples=5, n_way=3, k_shot=10)
    p = make_partition(ds, cfg, num_clients=8, seed=7)
    assert digest(p) == PINNED[name]
    explicit = make_partition(ds, cfg, num_clients=8, seed=7, test_fraction=0.25, global_test_fraction=0.0,
                              public_size=0, long_tail_ratio=None)
    assert explicit == p
    assert len(p.global_test_idx) == 0 and len(p.public_idx) == 0 and p.client_domains is None
    assert p.global_test_idx.dtype == np.int64 and p.public_idx.dtype == np.int64


# --------------------------------------------------------------------------- by_domain


def make_domain_ds(per_domain_class: np.ndarray, names=None) -> ArrayDataset:
    """per_domain_class[d, c] samples of class c in domain d."""
    labels, domains = [], []
    for d, row in enumerate(per_domain_class):
        for c, n in enumerate(row):
            labels += [c] * int(n)
            domains += [d] * int(n)
    labels = np.array(labels)
    return ArrayDataset(name="toydom", images=np.zeros((len(labels), 1, 2, 2), dtype=np.uint8), labels=labels,
                        num_classes=per_domain_class.shape[1], domains=np.array(domains),
                        domain_names=names or [f"d{i}" for i in range(len(per_domain_class))], mean=(0.0,), std=(1.0,))


@pytest.fixture(scope="module")
def dom() -> ArrayDataset:
    """4 domains x 10 classes, 30 samples of each class in each domain (1200)."""
    return make_domain_ds(np.full((4, 10), 30), names=["mnist", "usps", "svhn", "synth"])


def test_by_domain_fedlsa_digits_split(dom):
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 4, 2, 3], within_domain="iid")
    p = make_partition(dom, cfg, num_clients=10, seed=0)
    assert p.client_domains == [0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    assert p.domain_names == ["mnist", "usps", "svhn", "synth"]
    for c, d in zip(p.clients, p.client_domains, strict=True):
        assert (dom.domains[np.concatenate([c.train_idx, c.test_idx])] == d).all()  # one domain per client
    assert np.array_equal(np.sort(all_indices(p)), np.arange(len(dom)))
    # iid inside a domain: the domain's 300 samples dealt evenly (usps: 4 x 75)
    assert p.sizes().tolist() == [300, 75, 75, 75, 75, 150, 150, 100, 100, 100]


def test_by_domain_none_spreads_evenly_remainder_first(dom):
    p = make_partition(dom, PartitionConfig(name="by_domain"), num_clients=7, seed=0)
    assert p.client_domains == [0, 0, 1, 1, 2, 2, 3]
    p = make_partition(dom, PartitionConfig(name="by_domain"), num_clients=4, seed=0)
    assert p.client_domains == [0, 1, 2, 3]


def test_by_domain_composes_with_dirichlet_label_skew(dom):
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[3, 3, 2, 2], within_domain="dirichlet",
                          beta=0.1, min_samples=20)
    p = make_partition(dom, cfg, num_clients=10, seed=1)
    assert p.client_domains == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert p.sizes().min() >= 20
    assert ((p.label_counts() == 0).sum(axis=1) > 0).mean() > 0.5  # label skew inside the domains
    assert np.array_equal(np.sort(all_indices(p)), np.arange(len(dom)))
    assert make_partition(dom, cfg, num_clients=10, seed=1) == p


@pytest.mark.parametrize(("value", "num_clients", "message"), [
    ([1, 4, 2], 7, r"clients_per_domain = \[1, 4, 2\] has 3 entries but the dataset has 4 domains \['mnist', 'usps'"),
    ([1, 0, 2, 3], 6, r"clients_per_domain = \[1, 0, 2, 3\]: every count must be an integer >= 1"),
    ([1, 4, 2, 3], 9, r"clients_per_domain = \[1, 4, 2, 3\] sums to 10 but federation\.num_clients = 9"),
    (None, 3, r"clients_per_domain = None spreads federation\.num_clients = 3 evenly over the 4 domains"),
])
def test_by_domain_clients_per_domain_errors(dom, value, num_clients, message):
    with pytest.raises(ValueError, match=r"data\.partition\." + message):
        make_partition(dom, PartitionConfig(name="by_domain", clients_per_domain=value), num_clients=num_clients, seed=0)


@pytest.mark.parametrize("within", ["natural", "by_domain", "shards"])
def test_by_domain_within_domain_errors(dom, within):
    with pytest.raises(ValueError, match=rf"data\.partition\.within_domain = '{within}' is not allowed; "
                                         r"allowed: dirichlet, iid, nway_kshot, pathological"):
        make_partition(dom, PartitionConfig(name="by_domain", within_domain=within), num_clients=4, seed=0)


def test_by_domain_needs_domains_and_reports_inner_errors(ds, dom):
    with pytest.raises(ValueError, match=r"'by_domain' needs a multi-domain dataset .* 'toy' has none"):
        make_partition(ds, PartitionConfig(name="by_domain"), num_clients=4, seed=0)
    cfg = PartitionConfig(name="by_domain", within_domain="pathological", classes_per_client=1)
    with pytest.raises(ValueError, match=r"inside domain 'mnist' \(300 samples, 2 clients.*covers only 2 of 10 classes"):
        make_partition(dom, cfg, num_clients=8, seed=0)


def test_by_domain_percent_gives_each_client_a_random_percent_of_its_domain(dom):
    # FPL's protocol: usps 10 % of 300 = 30 per client (4 clients), svhn 20 % = 60 (2 clients),
    # mnist and synth not named: their clients share the whole domain as before
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 4, 2, 3], percent={"usps": 10, "svhn": 20})
    p = make_partition(dom, cfg, num_clients=10, seed=0)
    assert p.sizes().tolist() == [300, 30, 30, 30, 30, 60, 60, 100, 100, 100]
    for c, d in zip(p.clients, p.client_domains, strict=True):
        assert (dom.domains[np.concatenate([c.train_idx, c.test_idx])] == d).all()
    idx = all_indices(p)
    assert len(np.unique(idx)) == len(idx) == 840  # disjoint; 180 of usps and 180 of svhn unused
    assert make_partition(dom, cfg, num_clients=10, seed=0) == p
    other = make_partition(dom, cfg, num_clients=10, seed=1)
    assert not np.array_equal(other.clients[1].train_idx, p.clients[1].train_idx)  # a random subset, by seed


def test_by_domain_percent_counts_the_domain_after_holdouts(dom):
    # the global test set holds floor(30 x 0.2 + 0.5) = 6 of each (domain, class): 240 per domain
    # left; 10 % of 240 = 24 per client; 100 %, one client: all 240
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 1, 1, 1], percent={"mnist": 10, "usps": 100})
    p = make_partition(dom, cfg, num_clients=4, seed=0, global_test_fraction=0.2)
    assert p.sizes().tolist() == [24, 240, 240, 240]
    assert not np.isin(all_indices(p), p.global_test_idx).any()


@pytest.mark.parametrize(("percent", "message"), [
    ({"usbs": 5}, r"data\.partition\.percent = \{'usbs': 5\.0\}: unknown domain\(s\) 'usbs'; allowed: the dataset's "
                  r"domains mnist, usps, svhn, synth"),
    ({"mnist": 0.1}, r"data\.partition\.percent\['mnist'\] = 0\.1: 0\.1 % of the domain's 300 samples .* less than one "
                     r"sample per client; raise it to at least 0\.333334"),
    ({"usps": 30}, r"data\.partition\.percent\['usps'\] = 30\.0: 4 clients x 90 samples \(30\.0 % each\) exceed the "
                   r"domain's 300 samples .*at most 25\.0 % with 4 clients"),
])
def test_by_domain_percent_errors_name_the_key_value_and_limit(dom, percent, message):
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 4, 2, 3], percent=percent)
    with pytest.raises(ValueError, match=message):
        make_partition(dom, cfg, num_clients=10, seed=0)


@pytest.mark.parametrize(("sets", "message"), [
    (["data.partition.percent={mnist: 1}"], r"data\.partition\.percent = \{'mnist': 1\.0\}: only with "
                                            r"data\.partition\.name = by_domain \(now 'dirichlet'\)"),
    (["data.name=multidigits", "data.partition.name=by_domain", "data.partition.percent={mnist: 1, syn: 1}"],
     r"data\.partition\.percent = .*keys from the domains of 'multidigits' in use: mnist, usps, svhn, synth \(unknown: syn\)"),
    (["data.name=multidigits", "data.domains=[usps, svhn]", "data.partition.name=by_domain",
      "data.partition.percent={mnist: 1}"], r"in use: usps, svhn \(unknown: mnist\)"),
    (["data.name=multidigits", "data.partition.name=by_domain", "data.partition.percent={mnist: 0}"],
     r"data\.partition\.percent = \{'mnist': 0\}: percentages in \(0, 100\]"),
    (["data.name=multidigits", "data.partition.name=by_domain", "data.partition.percent={mnist: 101}"],
     r"out of range: \{'mnist': 101\.0\}"),
])
def test_percent_config_errors(sets, message):
    from rayfed_proto.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=message):
        build_config({}, sets)


# --------------------------------------------------------------------------- holdouts


def test_long_tail_counts_by_hand():
    assert long_tail_counts(np.array([8, 8, 8]), 4).tolist() == [8, 4, 2]  # 8 * 4^(-r/2)
    assert long_tail_counts(np.array([5, 8, 8]), 4).tolist() == [5, 2, 1]  # n_max capped by the head
    assert long_tail_counts(np.array([8, 8, 1]), 4).tolist() == [4, 2, 1]  # n_max = 1 * 4 by the tail
    assert long_tail_counts(np.array([3, 7, 5]), 1).tolist() == [3, 3, 3]  # rho = 1: balanced
    c = long_tail_counts(np.full(10, 100), 10)
    assert c[0] == 100 and c[-1] == 10 and (np.diff(c) <= 0).all()
    assert long_tail_counts(np.array([6]), 50).tolist() == [6]


def test_long_tail_subsamples_the_pool_only():
    toy = make_ds(np.repeat(np.arange(3), 8))  # 8 per class
    p = make_partition(toy, PartitionConfig(name="iid"), num_clients=2, seed=0, long_tail_ratio=4)
    assert p.label_counts().sum(axis=0).tolist() == [8, 4, 2]
    # with a global test set first: 2 of 8 per class held out (balanced), the pool 6 per class -> 6, 3, 1
    p = make_partition(toy, PartitionConfig(name="iid"), num_clients=2, seed=0, global_test_fraction=0.25,
                       long_tail_ratio=4)
    assert np.bincount(toy.labels[p.global_test_idx]).tolist() == [2, 2, 2]
    assert p.label_counts().sum(axis=0).tolist() == [6, 3, 1]
    assert len(np.intersect1d(all_indices(p), p.global_test_idx)) == 0


def test_global_test_is_stratified_by_domain_and_class():
    # (domain, class) counts 10, 5 / 4, 1 with fraction 0.2 -> round-half-up 2, 1 / 1, 0 (a singleton stays)
    toy = make_domain_ds(np.array([[10, 5], [4, 1]]))
    p = make_partition(toy, PartitionConfig(name="iid"), num_clients=2, seed=3, global_test_fraction=0.2)
    held = p.global_test_idx
    got = {(int(d), int(c)): int(((toy.domains[held] == d) & (toy.labels[held] == c)).sum())
           for d in range(2) for c in range(2)}
    assert got == {(0, 0): 2, (0, 1): 1, (1, 0): 1, (1, 1): 0}
    assert np.array_equal(np.sort(np.concatenate([all_indices(p), held])), np.arange(len(toy)))


def test_public_set_then_global_test_then_clients_are_disjoint(dom):
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 4, 2, 3])
    p = make_partition(dom, cfg, num_clients=10, seed=5, public_size=100, global_test_fraction=0.2)
    assert len(p.public_idx) == 100 and p.public_idx.dtype == np.int64
    assert np.array_equal(p.public_idx, np.unique(p.public_idx))
    # every domain is represented in the uniform public draw (25 expected per domain)
    assert (np.bincount(dom.domains[p.public_idx], minlength=4) > 5).all()
    # 1100 left; 20% per (domain, class) stratum (about 27.5 each) -> about 220
    assert abs(len(p.global_test_idx) - 220) <= 20
    every = np.concatenate([all_indices(p), p.global_test_idx, p.public_idx])
    assert np.array_equal(np.sort(every), np.arange(len(dom)))  # disjoint and complete
    assert p.client_domains == [0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    q = make_partition(dom, cfg, num_clients=10, seed=5, public_size=100, global_test_fraction=0.2)
    r = make_partition(dom, cfg, num_clients=10, seed=6, public_size=100, global_test_fraction=0.2)
    assert q == p and not np.array_equal(r.public_idx, p.public_idx)


def test_holdout_errors_name_the_keys(ds):
    cfg = PartitionConfig(name="iid")
    with pytest.raises(ValueError, match=r"data\.public_size = 2000 leaves no training samples: .* has 2000 samples"):
        make_partition(ds, cfg, num_clients=2, seed=0, public_size=2000)
    with pytest.raises(ValueError, match=r"data\.global_test_fraction must be in \[0, 1\), got 1\.0"):
        make_partition(ds, cfg, num_clients=2, seed=0, global_test_fraction=1.0)
    with pytest.raises(ValueError, match=r"data\.long_tail_ratio must be >= 1 \(n_max / n_min\), got 0\.5"):
        make_partition(ds, cfg, num_clients=2, seed=0, long_tail_ratio=0.5)
    with pytest.raises(ValueError, match=r"data\.public_size = 1990, .* leave 10 of the dataset's 2000 samples for "
                                         r"the clients, fewer than federation\.num_clients = 20 x 1 sample"):
        make_partition(ds, cfg, num_clients=20, seed=0, public_size=1990)
    with pytest.raises(ValueError, match=r"data\.long_tail_ratio = 100.*fewer than federation\.num_clients = 40 x "
                                         r"data\.partition\.min_samples = 10"):
        make_partition(ds, PartitionConfig(name="dirichlet", min_samples=10), num_clients=40, seed=0,
                       global_test_fraction=0.5, long_tail_ratio=100)


def test_parquet_round_trip_with_holdouts_and_domains(dom, tmp_path):
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[1, 4, 2, 3], within_domain="dirichlet", beta=0.5)
    p = make_partition(dom, cfg, num_clients=10, seed=2, public_size=50, global_test_fraction=0.1, long_tail_ratio=5)
    p.save_parquet(tmp_path / "p.parquet")
    q = Partition.load_parquet(tmp_path / "p.parquet")
    assert q == p
    assert np.array_equal(q.global_test_idx, p.global_test_idx) and np.array_equal(q.public_idx, p.public_idx)
    assert q.client_domains == p.client_domains == [0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    assert q.domain_names == ["mnist", "usps", "svhn", "synth"]
    t = q.to_table()
    held = t.filter(pc.equal(t.column("client_id"), -1))
    assert sorted(set(held.column("split").to_pylist())) == ["global_test", "public"]
    assert held.num_rows == len(p.global_test_idx) + len(p.public_idx)


def test_old_partition_files_still_load(tmp_path):
    # a file in the format written before holdouts existed: no holdout rows, no domain metadata
    table = pa.table({"client_id": pa.array([0, 0, 1], type=pa.int32()), "sample_index": pa.array([0, 2, 1], type=pa.int64()),
                      "split": ["train", "test", "train"], "label": pa.array([0, 0, 1], type=pa.int64())})
    meta = {"num_classes": 2, "partitioner": "iid", "seed": 0, "num_samples": 3, "num_clients": 2}
    pq.write_table(table.replace_schema_metadata({f"rayfed_proto.{k}": str(v) for k, v in meta.items()}),
                   str(tmp_path / "old.parquet"))
    p = Partition.load_parquet(tmp_path / "old.parquet")
    assert p.clients[0] == ClientSplit(0, np.array([0]), np.array([2]))
    assert len(p.global_test_idx) == 0 and len(p.public_idx) == 0
    assert p.client_domains is None and p.domain_names == []


def test_by_domain_domain_smaller_than_its_clients():
    toy = make_domain_ds(np.array([[3, 3], [1, 1]]), names=["big", "small"])
    with pytest.raises(ValueError, match=r"domain 'small' has 2 samples \(after any holdouts\), fewer than its 3 clients "
                                         r"\(data\.partition\.clients_per_domain = \[1, 3\]\)"):
        make_partition(toy, PartitionConfig(name="by_domain", clients_per_domain=[1, 3]), num_clients=4, seed=0)


def test_unlabelled_pools_are_of_the_clients_classes_disjoint_and_balanced(ds, tmp_path):
    base = PartitionConfig(name="nway_kshot", n_way=3, k_shot=8)
    plain = make_partition(ds, base, num_clients=6, seed=2)
    p = make_partition(ds, base.model_copy(update={"unlabelled_per_client": 30}), num_clients=6, seed=2)
    held = all_indices(p)
    pools = [c.unlabelled_idx for c in p.clients]
    for a, b in zip(plain.clients, p.clients, strict=True):  # train untouched: the pool has its own stream
        assert np.array_equal(a.train_idx, b.train_idx) and len(b.test_idx) == len(a.test_idx)
        assert len(a.unlabelled_idx) == 0  # (nway_kshot's test sets are drawn after the pools, around them)
    everything = np.concatenate(pools)
    assert len(np.unique(everything)) == len(everything) == 6 * 30  # no sample in two pools
    assert not np.intersect1d(everything, held).size  # nor held by any client
    for c, pool in zip(p.clients, pools, strict=True):
        classes = np.unique(ds.labels[c.train_idx])
        per_class = np.bincount(ds.labels[pool], minlength=10)
        assert set(np.flatnonzero(per_class)) == set(classes)  # closed set: the client's classes only
        assert per_class[classes].tolist() == [10, 10, 10]  # 30 over 3 classes, round robin
    p.save_parquet(tmp_path / "pools.parquet")
    q = Partition.load_parquet(tmp_path / "pools.parquet")
    assert q == p and all(np.array_equal(a.unlabelled_idx, b.unlabelled_idx) for a, b in zip(p.clients, q.clients, strict=True))
    assert (q.sizes("train") == p.sizes("train")).all()  # pools are no part of the splits


def test_unlabelled_pool_runs_short_with_a_warning():
    # 10 per class: 2 set aside for testing, and 2 clients x 2 classes x 3 shots leave 2 per class
    ds = make_ds(np.repeat(np.arange(2), 10))
    cfg = PartitionConfig(name="nway_kshot", n_way=2, k_shot=3, test_shots=2, unlabelled_per_client=3)
    with pytest.warns(UserWarning, match="unlabelled_per_client"):
        p = make_partition(ds, cfg, num_clients=2, seed=0)
    assert sorted(len(c.unlabelled_idx) for c in p.clients) == [1, 3]  # 4 free samples, first come first served


def test_a_partition_table_with_interleaved_rows_loads_each_group_in_table_order(tmp_path):
    """Rows of one client and split need not be contiguous: each group is read in the table's order
    (the order save_parquet writes), whatever the order of the groups."""
    table = pa.table({"client_id": pa.array([1, 0, -1, 1, 0, 1, -1, 0], type=pa.int32()),
                      "sample_index": pa.array([7, 5, 3, 1, 6, 0, 2, 4], type=pa.int64()),
                      "split": ["train", "test", "public", "train", "train", "unlabelled", "global_test", "test"],
                      "label": pa.array([1, 0, 1, 0, 0, 1, 0, 1], type=pa.int64())})
    meta = {"num_classes": 2, "partitioner": "iid", "seed": 0, "num_samples": 8, "num_clients": 3}
    pq.write_table(table.replace_schema_metadata({f"rayfed_proto.{k}": str(v) for k, v in meta.items()}),
                   str(tmp_path / "mixed.parquet"))
    p = Partition.load_parquet(tmp_path / "mixed.parquet")
    assert p.clients[0] == ClientSplit(0, np.array([6]), np.array([5, 4]))
    assert p.clients[1] == ClientSplit(1, np.array([7, 1]), np.array([], dtype=np.int64), np.array([0]))
    assert p.clients[2] == ClientSplit(2, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert list(p.global_test_idx) == [2] and list(p.public_idx) == [3]
    assert list(p.labels) == [1, 0, 0, 1, 1, 0, 0, 1]


def test_fedlsa_paper_preset_gives_each_client_fpls_one_percent_of_its_domain():
    from rayfed_proto.cli import resolve_config_arg
    from rayfed_proto.config import load_config

    part = load_config(resolve_config_arg("fedlsa_digits")).data.partition
    assert (part.name, part.clients_per_domain) == ("by_domain", [1, 4, 2, 3])
    assert part.percent == {"mnist": 1, "usps": 1, "svhn": 1, "synth": 1}  # RethinkFL datasets/digits.py percent_dict


def test_n_way_normal_draws_round_of_a_gaussian_clipped_to_the_classes():
    """FedSAP appendix Table 5: n ~ N(mu_n, sigma^2) per client; the same generator's draws,
    rounded and clipped to [1, C], computed here by hand."""
    from rayfed_proto.data.partition import kshot_ways

    cfg = PartitionConfig(name="nway_kshot", n_way=3, n_way_std=2, n_way_distribution="normal")
    got = kshot_ways(cfg, 5, 200, np.random.default_rng(7))
    want = np.clip(np.rint(np.random.default_rng(7).normal(3, 2, size=200)), 1, 5)
    assert got.tolist() == want.astype(int).tolist()
    assert got.min() == 1 and got.max() == 5  # sigma 2 reaches both clips in 200 draws
    uniform = kshot_ways(PartitionConfig(name="nway_kshot", n_way=3, n_way_std=2), 5, 200, np.random.default_rng(7))
    assert set(uniform.tolist()) == {2, 3, 4}  # the default stays FedProto's uniform [max(2, n-s), min(C-1, n+s)]
    with pytest.raises(ValueError, match="n_way_distribution"):
        PartitionConfig(name="nway_kshot", n_way_distribution="poisson")
