"""n-way k-shot (issue 24, item 5): the k shots per class are all training samples, and each client's
test set is drawn apart: data.partition.test_shots (15, FedProto's --test_shots) samples of each of its
classes, from the dataset's test split when it has one, else from samples no client trains on."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from rayfed_proto.config import ConfigError, PartitionConfig, build_config
from rayfed_proto.data import ArrayDataset, Partition, make_partition


def make_ds(labels, is_train=None, domains=None) -> ArrayDataset:
    labels = np.asarray(labels, dtype=np.int64)
    return ArrayDataset(
        name="toy", images=np.zeros((len(labels), 1, 2, 2), dtype=np.uint8), labels=labels,
        num_classes=int(labels.max()) + 1, is_train=None if is_train is None else np.asarray(is_train, dtype=bool),
        domains=None if domains is None else np.asarray(domains),
        domain_names=[] if domains is None else [f"d{i}" for i in range(int(np.max(domains)) + 1)],
        mean=(0.0,), std=(1.0,),
    )


@pytest.fixture(scope="module")
def ds() -> ArrayDataset:
    """2000 samples, 10 classes of 200."""
    return make_ds(np.random.default_rng(5).permutation(np.repeat(np.arange(10), 200)))


def every_train(p: Partition) -> np.ndarray:
    return np.concatenate([c.train_idx for c in p.clients])


def check_shots(p: Partition, n_way: int, k: int, test_shots: int) -> None:
    """Exactly k training and test_shots test samples of each of n_way classes, tests apart from all training."""
    train, test = p.label_counts("train"), p.label_counts("test")
    trained = every_train(p)
    for i, c in enumerate(p.clients):
        classes = np.flatnonzero(train[i])
        assert len(classes) == n_way and (train[i, classes] == k).all(), (i, train[i])
        assert np.array_equal(np.flatnonzero(test[i]), classes), (i, test[i])  # the client's classes only
        assert (test[i, classes] == test_shots).all(), (i, test[i])
        assert len(np.unique(c.test_idx)) == len(c.test_idx)
        assert not np.intersect1d(c.test_idx, trained).size  # no client trains on a test sample


def test_k_shots_are_all_training_samples_and_the_test_set_is_drawn_apart(ds):
    # the default test_shots (15) beside k = 20: the old 75/25 split of the k shots gave 15 + 5
    p = make_partition(ds, PartitionConfig(name="nway_kshot", n_way=3, k_shot=20), num_clients=6, seed=0)
    check_shots(p, n_way=3, k=20, test_shots=15)
    assert (p.sizes("train") == 60).all() and (p.sizes("test") == 45).all()
    tests = np.concatenate([c.test_idx for c in p.clients])
    assert len(np.unique(tests)) == len(tests)  # plenty of samples: no two clients share a test sample


def test_test_shots_sets_the_test_samples_per_class(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=4, k_shot=9, test_shots=6)
    check_shots(make_partition(ds, cfg, num_clients=12, seed=3), n_way=4, k=9, test_shots=6)


def test_same_seed_gives_exactly_the_same_partition(ds, tmp_path):
    cfg = PartitionConfig(name="nway_kshot", n_way=3, k_shot=20, test_shots=10, unlabelled_per_client=12)
    a = make_partition(ds, cfg, num_clients=8, seed=11)
    b = make_partition(ds, cfg, num_clients=8, seed=11)
    assert a == b
    for x, y in zip(a.clients, b.clients, strict=True):
        assert np.array_equal(x.train_idx, y.train_idx) and np.array_equal(x.test_idx, y.test_idx)
        assert np.array_equal(x.unlabelled_idx, y.unlabelled_idx)
    assert make_partition(ds, cfg, num_clients=8, seed=12) != a
    a.save_parquet(tmp_path / "p.parquet")  # the file keeps the drawn test sets
    assert Partition.load_parquet(tmp_path / "p.parquet") == a


def test_oversubscribed_classes_keep_full_test_sets_shared_between_clients():
    # 3 classes of 30: 6 clients x 10 shots of every class exceed the 30 - 15 samples open to training, so
    # clients share training samples (a warning); the 15 set aside still give every client 15 test samples
    small = make_ds(np.repeat(np.arange(3), 30))
    with pytest.warns(UserWarning, match="ran out of unused samples"):
        p = make_partition(small, PartitionConfig(name="nway_kshot", n_way=3, k_shot=10), num_clients=6, seed=0)
    check_shots(p, n_way=3, k=10, test_shots=15)
    tests = np.concatenate([c.test_idx for c in p.clients])
    assert len(np.unique(tests)) == 3 * 15  # the held-out 15 per class, shared by the 6 clients


def test_a_class_with_too_few_untrained_samples_warns_and_gives_what_there_is():
    # class 1 has 4 samples: 3 are set aside (one must stay open to training), so its test sets have 3
    small = make_ds(np.array([0] * 40 + [1] * 4))
    with pytest.warns(UserWarning, match=r"classes \[1\] have fewer than data\.partition\.test_shots = 5 "
                                         r"samples that no client trains on"):
        p = make_partition(small, PartitionConfig(name="nway_kshot", n_way=2, k_shot=1, test_shots=5),
                           num_clients=1, seed=0)
    assert p.label_counts("test")[0].tolist() == [5, 3]
    assert not np.intersect1d(p.clients[0].test_idx, p.clients[0].train_idx).size


def test_a_test_split_of_its_own_gives_the_shots_and_the_test_sets():
    labels = np.tile(np.arange(4), 100)
    is_train = np.arange(400) < 300  # 75 training and 25 test samples per class
    with_split = make_ds(labels, is_train=is_train)
    p = make_partition(with_split, PartitionConfig(name="nway_kshot", n_way=2, k_shot=15, test_shots=6),
                       num_clients=4, seed=1)
    check_shots(p, n_way=2, k=15, test_shots=6)
    for c in p.clients:
        assert is_train[c.train_idx].all() and not is_train[c.test_idx].any()
    with pytest.warns(UserWarning, match=r"fewer than data\.partition\.test_shots = 30 samples in the dataset's "
                                         r"test split"):
        short = make_partition(with_split, PartitionConfig(name="nway_kshot", n_way=2, k_shot=5, test_shots=30),
                               num_clients=2, seed=1)
    assert set(np.unique(short.label_counts("test"))) == {0, 25}  # every test sample of the class, no more


def test_by_domain_tests_each_client_on_its_own_domain():
    labels = np.tile(np.arange(3), 160)
    domains = np.repeat([0, 1], 240)
    dom = make_ds(labels, domains=domains)
    cfg = PartitionConfig(name="by_domain", clients_per_domain=[2, 2], within_domain="nway_kshot", n_way=2,
                          k_shot=12, test_shots=8)
    p = make_partition(dom, cfg, num_clients=4, seed=2)
    check_shots(p, n_way=2, k=12, test_shots=8)
    for c, d in zip(p.clients, p.client_domains, strict=True):
        assert (domains[np.concatenate([c.train_idx, c.test_idx])] == d).all()


def test_unlabelled_pools_leave_the_shots_alone_and_never_meet_a_test_set(ds):
    base = PartitionConfig(name="nway_kshot", n_way=3, k_shot=20)
    plain = make_partition(ds, base, num_clients=6, seed=2)
    p = make_partition(ds, base.model_copy(update={"unlabelled_per_client": 30}), num_clients=6, seed=2)
    assert all(np.array_equal(a.train_idx, b.train_idx) for a, b in zip(plain.clients, p.clients, strict=True))
    check_shots(p, n_way=3, k=20, test_shots=15)
    pools = np.concatenate([c.unlabelled_idx for c in p.clients])
    tests = np.concatenate([c.test_idx for c in p.clients])
    assert len(pools) == 6 * 30 and not np.intersect1d(pools, tests).size


def test_other_partitioners_keep_the_stratified_split(ds):
    p = make_partition(ds, PartitionConfig(name="iid", test_shots=3), num_clients=4, seed=0, test_fraction=0.25)
    total, test = p.label_counts(), p.label_counts("test")  # per (client, class): round-half-up(n / 4), not 3
    assert np.array_equal(test, np.minimum(np.floor(total * 0.25 + 0.5), total - 1).astype(int))


def test_test_shots_is_validated_with_its_key():
    with pytest.raises(ConfigError, match=r"data\.partition\.test_shots = 0: Input should be greater than or equal to 1"):
        build_config({}, ["data.partition.test_shots=0"])


def test_fedsap_digits_preset_trains_on_20_shots_and_tests_on_15_per_class():
    from rayfed_proto.cli import resolve_config_arg
    from rayfed_proto.config import load_config
    from rayfed_proto.data import load_dataset

    cfg = load_config(resolve_config_arg("fedsap_digits"))
    ds = load_dataset(cfg.data, cfg.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 1,200 shots of 1,797 digits: the most drawn classes run out (warned)
        p = make_partition(ds, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction)
    check_shots(p, n_way=3, k=20, test_shots=15)


# ----------------------------------------------------------------------------- FedProto's sampling (issue 35, item 5)


def test_n_per_client_is_drawn_uniformly_as_fedprotos_n_list(ds):
    """exps/federated_main.py: n_list = np.random.randint(max(2, ways - stdev), min(num_classes,
    ways + stdev + 1), num_users): n uniform in [max(2, 4 - 2), min(9, 4 + 2)] = [2, 6], drawn first."""
    cfg = PartitionConfig(name="nway_kshot", n_way=4, n_way_std=2, k_shot=5, test_shots=3)
    p = make_partition(ds, cfg, num_clients=30, seed=11)
    ways = (p.label_counts("train") > 0).sum(axis=1)
    np.testing.assert_array_equal(ways, np.random.default_rng(11).integers(2, 7, size=30))
    assert ways.min() == 2 and ways.max() == 6
    assert (p.label_counts("train")[p.label_counts("train") > 0] == 5).all()


def test_n_way_std_is_capped_below_the_number_of_classes(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=8, n_way_std=3, k_shot=2, test_shots=1)
    ways = (make_partition(ds, cfg, num_clients=40, seed=0).label_counts("train") > 0).sum(axis=1)
    assert ways.min() == 5 and ways.max() == 9  # min(C - 1, 8 + 3) = 9, as randint's exclusive min(C, 12)


def test_k_per_client_is_uniform_around_k_shot(ds):
    """FedProto's k_list: uniform integers, one k per client shared by its classes, drawn after n."""
    cfg = PartitionConfig(name="nway_kshot", n_way=2, n_way_std=1, k_shot=6, k_shot_std=3, test_shots=2)
    counts = make_partition(ds, cfg, num_clients=40, seed=4).label_counts("train")
    rng = np.random.default_rng(4)
    rng.integers(2, 4, size=40)  # n_list first
    expected_k = rng.integers(3, 10, size=40)  # [6 - 3, 6 + 3]
    for row, k in zip(counts, expected_k, strict=True):
        assert set(row[row > 0]) == {k}


def test_normal_k_keeps_the_rule_before_issue_35(ds):
    cfg = PartitionConfig(name="nway_kshot", n_way=2, k_shot=5, k_shot_std=3, k_shot_distribution="normal")
    ks = [set(r[r > 0]).pop() for r in make_partition(ds, cfg, num_clients=20, seed=0).label_counts("train")]
    assert min(ks) >= 1 and len(set(ks)) > 2


@pytest.mark.parametrize("name,shots", [("mnist", 40), ("cifar10", 15), ("cifar100", 5), ("digits", 15), ("synthetic", 15)])
def test_test_shots_default_to_fedprotos_per_dataset_value(name, shots):
    from rayfed_proto.config import DataConfig

    assert DataConfig(name=name).partition.test_shots == shots
    assert DataConfig(name=name, partition={"test_shots": 7}).partition.test_shots == 7  # an explicit value wins


def test_unset_test_shots_follow_the_datasets_name_in_make_partition():
    labels = np.random.default_rng(5).permutation(np.repeat(np.arange(10), 200))
    mnist_like = make_ds(labels)
    mnist_like.name = "mnist"
    p = make_partition(mnist_like, PartitionConfig(name="nway_kshot", n_way=2, k_shot=5), num_clients=4, seed=0)
    assert set(p.label_counts("test")[p.label_counts("test") > 0]) == {40}
