"""Partitioners and the per-client train/test split: which samples each client owns.

A partitioner (registered in ``PARTITIONERS``) decides the samples of each client; then
:func:`make_partition` splits every client's share into train and test, stratified by class
(or by the dataset's own ``is_train`` column when it has one). ``nway_kshot`` is the exception:
its k shots per class are all training samples, and each client's test set is drawn apart
(``test_shots`` per class of its classes, from samples no client trains on; see
:func:`make_partition`), as in FedProto's code and FedSAP's setup. The result, a
:class:`Partition`, is plain sample indices into the dataset, so it can be saved as Parquet,
logged as an artifact and replayed exactly, independent of how the images are stored.

Before partitioning, :func:`make_partition` can hold samples out of the clients' pool: a
public unlabelled proxy set (``public_idx``), a global test set stratified by (domain, class)
(``global_test_idx``), and samples dropped to shape a long-tailed class profile.

Everything is driven by ``np.random.Generator`` s seeded from the run's seed: the same
dataset, config and seed always give the same partition. Each holdout has its own stream
(``default_rng([seed, k])``), so with no holdout the partitioner and the per-client splits
consume ``default_rng(seed)`` exactly as they did before holdouts existed.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from rayfed_proto.config import (
    ConfigIssue,
    ExperimentConfig,
    PartitionConfig,
    kshot_test_shots,
    register_check,
    unknown_name_issues,
)
from rayfed_proto.data import PARTITIONERS
from rayfed_proto.data.base import ArrayDataset

_SPLITS = ("train", "test")
_UNLABELLED = "unlabelled"  # a client's separate unlabelled pool (data.partition.unlabelled_per_client)
# holdout rows of the Parquet file: client_id -1 and one of these splits
HOLDOUT_CLIENT_ID = -1
_HOLDOUTS = ("global_test", "public")


@register_check("data")
def partitioner_name_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``data.partition.name`` is a registered partitioner (checked when the config is validated)."""
    return unknown_name_issues("data.partition.name", cfg.data.partition.name, PARTITIONERS)


@register_check("data")
def domain_percent_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``data.partition.percent``: only with ``by_domain``, keyed by the dataset's domains
    (a dataset not in ``DOMAIN_NAMES`` is checked when it is partitioned)."""
    from rayfed_proto.data.domains import DOMAIN_NAMES

    percent, part = cfg.data.partition.percent, cfg.data.partition
    if percent is None:
        return []
    key = "data.partition.percent"
    if part.name != "by_domain":
        return [ConfigIssue(key=key, value=percent, allowed=f"only with data.partition.name = by_domain (now {part.name!r})")]
    domains = cfg.data.domains or DOMAIN_NAMES.get(cfg.data.name)
    unknown = [k for k in percent if domains is not None and k not in domains]
    if unknown:
        return [ConfigIssue(key=key, value=percent, allowed=f"keys from the domains of {cfg.data.name!r} in use: "
                            f"{', '.join(domains)} (unknown: {', '.join(unknown)})")]
    return []


def _empty_index() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


@dataclass(eq=False)
class ClientSplit:
    """One client's samples: int64 indices into the dataset. ``unlabelled_idx``: its separate
    unlabelled pool (``data.partition.unlabelled_per_client``; empty by default), samples of its
    classes that no client trains or tests on, whose labels training never reads."""

    client_id: int
    train_idx: np.ndarray
    test_idx: np.ndarray
    unlabelled_idx: np.ndarray = field(default_factory=_empty_index)

    def __post_init__(self) -> None:
        self.unlabelled_idx = np.asarray(self.unlabelled_idx, dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClientSplit):
            return NotImplemented
        return (self.client_id == other.client_id and np.array_equal(self.train_idx, other.train_idx)
                and np.array_equal(self.test_idx, other.test_idx)
                and np.array_equal(self.unlabelled_idx, other.unlabelled_idx))


@dataclass(eq=False)
class Partition:
    """Every client's train/test indices, plus what is needed to read and describe them.

    ``clients[i].client_id == i``. ``labels`` are the dataset's labels (indexed by sample);
    only the labels of samples some client or holdout holds are meaningful after
    :meth:`load_parquet` (the others read back as -1), which is why equality compares
    :meth:`to_table`.

    ``global_test_idx`` (the server's global test set) and ``public_idx`` (the public
    unlabelled proxy set) are samples no client holds; both are empty unless requested.
    For a multi-domain dataset, ``client_domains[i]`` is client i's majority domain (index
    into ``domain_names``; ties go to the lower index, -1 for a client without samples).
    """

    clients: list[ClientSplit]
    num_classes: int
    partitioner: str
    seed: int
    labels: np.ndarray
    global_test_idx: np.ndarray = field(default_factory=_empty_index)
    public_idx: np.ndarray = field(default_factory=_empty_index)
    client_domains: Optional[list[int]] = None
    domain_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.global_test_idx = np.asarray(self.global_test_idx, dtype=np.int64)
        self.public_idx = np.asarray(self.public_idx, dtype=np.int64)
        if self.client_domains is not None:
            self.client_domains = [int(d) for d in self.client_domains]

    def __len__(self) -> int:
        return len(self.clients)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return ((self.num_classes, self.partitioner, self.seed, len(self.labels))
                == (other.num_classes, other.partitioner, other.seed, len(other.labels))
                and (self.client_domains, self.domain_names) == (other.client_domains, other.domain_names)
                and self.to_table().equals(other.to_table()))

    def _indices(self, client: ClientSplit, split: Optional[str]) -> np.ndarray:
        if split is None:
            return np.concatenate([client.train_idx, client.test_idx])
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
        return client.train_idx if split == "train" else client.test_idx

    def sizes(self, split: Optional[str] = None) -> np.ndarray:
        """(num_clients,) sample counts, of one split or both."""
        return np.array([len(self._indices(c, split)) for c in self.clients], dtype=np.int64)

    def label_counts(self, split: Optional[str] = None) -> np.ndarray:
        """(num_clients, num_classes) samples per class, of one split or both."""
        return np.stack([np.bincount(self.labels[self._indices(c, split)], minlength=self.num_classes)
                         for c in self.clients]).astype(np.int64)

    def to_table(self) -> pyarrow.Table:  # noqa: F821 (imported when called: workers never need pyarrow)
        """One row per (client, sample): client_id int32, sample_index int64, split, label int64.

        Holdout samples follow the clients' rows, with client_id -1 and split ``global_test``
        or ``public`` (their label is the dataset's, although the public set is used unlabelled).
        A client's unlabelled pool has split ``unlabelled`` (true labels, likewise).
        """
        client_ids, indices, splits = [], [], []
        groups = [(c.client_id, split, idx) for c in self.clients
                  for split, idx in zip(_SPLITS + (_UNLABELLED,), (c.train_idx, c.test_idx, c.unlabelled_idx), strict=True)]
        groups += [(HOLDOUT_CLIENT_ID, split, idx)
                   for split, idx in zip(_HOLDOUTS, (self.global_test_idx, self.public_idx), strict=True)]
        for client_id, split, idx in groups:
            if client_id == HOLDOUT_CLIENT_ID and len(idx) == 0:
                continue
            client_ids.append(np.full(len(idx), client_id, dtype=np.int32))
            indices.append(idx)
            splits.extend([split] * len(idx))
        index = np.concatenate(indices).astype(np.int64) if indices else np.empty(0, dtype=np.int64)
        import pyarrow as pa

        return pa.table({
            "client_id": pa.array(np.concatenate(client_ids) if client_ids else [], type=pa.int32()),
            "sample_index": pa.array(index, type=pa.int64()),
            "split": pa.array(splits, type=pa.string()),
            "label": pa.array(self.labels[index], type=pa.int64()),
        })

    def save_parquet(self, path: str | Path) -> None:
        meta = {"num_classes": self.num_classes, "partitioner": self.partitioner, "seed": self.seed,
                "num_samples": len(self.labels), "num_clients": len(self.clients)}
        if self.client_domains is not None:
            meta["client_domains"] = json.dumps(self.client_domains)
            meta["domain_names"] = json.dumps(self.domain_names)
        import pyarrow.parquet as pq

        table = self.to_table()
        table = table.replace_schema_metadata({f"rayfed_proto.{k}": str(v) for k, v in meta.items()})
        pq.write_table(table, str(path))

    @classmethod
    def load_parquet(cls, path: str | Path) -> Partition:
        import pyarrow.parquet as pq

        table = pq.read_table(str(path))
        raw = table.schema.metadata or {}
        meta = {k.decode().removeprefix("rayfed_proto."): v.decode() for k, v in raw.items()
                if k.startswith(b"rayfed_proto.")}
        needed = {"num_classes", "partitioner", "seed", "num_samples", "num_clients"}
        if not needed <= set(meta):
            raise ValueError(f"{path}: not a partition written by Partition.save_parquet "
                             f"(missing metadata {', '.join(sorted(needed - set(meta)))})")
        index = table.column("sample_index").to_numpy().astype(np.int64)
        labels = np.full(int(meta["num_samples"]), -1, dtype=np.int64)
        labels[index] = table.column("label").to_numpy()
        rows = _RowGroups(table.column("client_id").to_numpy(), table.column("split"))
        clients = [ClientSplit(i, index[rows.of(i, "train")], index[rows.of(i, "test")], index[rows.of(i, _UNLABELLED)])
                   for i in range(int(meta["num_clients"]))]
        return cls(clients=clients, num_classes=int(meta["num_classes"]), partitioner=meta["partitioner"],
                   seed=int(meta["seed"]), labels=labels,
                   global_test_idx=index[rows.of(HOLDOUT_CLIENT_ID, "global_test")],
                   public_idx=index[rows.of(HOLDOUT_CLIENT_ID, "public")],
                   client_domains=json.loads(meta["client_domains"]) if "client_domains" in meta else None,
                   domain_names=json.loads(meta["domain_names"]) if "domain_names" in meta else [])


class _RowGroups:
    """The rows of a partition table by (client, split), in table order: one stable sort, then a
    binary search per group. (A boolean mask per client and split read the whole table once per
    client: 10,000 clients over 200,000 rows took about 100 s of a resumed run's start-up.)"""

    def __init__(self, client_id: np.ndarray, split) -> None:
        import pyarrow.compute as pc

        encoded = pc.dictionary_encode(split).combine_chunks()
        self.codes = {name: j for j, name in enumerate(encoded.dictionary.to_pylist())}
        width = max(len(self.codes), 1)
        key = (client_id.astype(np.int64) - HOLDOUT_CLIENT_ID) * width + encoded.indices.to_numpy(zero_copy_only=False)
        self.order = np.argsort(key, kind="stable")  # stable: each group keeps the rows' order in the table
        self.sorted_keys = key[self.order]
        self.width = width

    def of(self, client_id: int, split: str) -> np.ndarray:
        """Row numbers of ``client_id``'s ``split`` rows, in table order (none: empty)."""
        j = self.codes.get(split)
        if j is None:
            return np.empty(0, dtype=np.int64)
        k = (client_id - HOLDOUT_CLIENT_ID) * self.width + j
        lo, hi = np.searchsorted(self.sorted_keys, [k, k + 1])
        return self.order[lo:hi]


# --------------------------------------------------------------------------- partitioners


def _check_enough(n: int, num_clients: int) -> None:
    if n < num_clients:
        raise ValueError(f"cannot give {num_clients} clients (federation.num_clients) a sample each: "
                         f"the dataset has {n} samples")


def _class_indices(labels: np.ndarray) -> dict[int, np.ndarray]:
    return {int(c): np.flatnonzero(labels == c) for c in np.unique(labels)}


@PARTITIONERS.register("iid", help="shuffle and deal out evenly")
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
        dataset: ArrayDataset) -> list[np.ndarray]:
    _check_enough(len(labels), num_clients)
    return np.array_split(rng.permutation(len(labels)), num_clients)


# Dirichlet draws that leave a client below min_samples are redrawn; this caps the redraws.
_DIRICHLET_MAX_ATTEMPTS = 1000


@PARTITIONERS.register("dirichlet", help="per-class Dir(beta) proportions over clients (PFLlib/HtFLlib)")
def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
              dataset: ArrayDataset) -> list[np.ndarray]:
    """Label skew as in PFLlib/HtFLlib: for each class, proportions over clients ~ Dir(beta).

    As there, a client already holding its even share (N / num_clients) gets no more of the
    following classes, and the whole draw is repeated until every client has ``min_samples``.
    """
    n, min_samples = len(labels), cfg.min_samples
    if n < num_clients * min_samples:
        raise ValueError(f"data.partition.min_samples = {min_samples} is impossible: the dataset has {n} samples, "
                         f"fewer than {num_clients} clients x {min_samples}")
    by_class = _class_indices(labels)
    for _ in range(_DIRICHLET_MAX_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class.values():
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, cfg.beta))
            # a tiny beta can put all the mass on clients that are full; then ignore fullness
            masked = p * (sizes < n / num_clients)
            p = masked if masked.sum() > 0 else p
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_samples:
            return [np.concatenate(p) for p in parts]
    raise ValueError(f"dirichlet partition: no draw in {_DIRICHLET_MAX_ATTEMPTS} gave every one of {num_clients} "
                     f"clients at least data.partition.min_samples = {min_samples} samples (dataset: {n}); "
                     f"use a larger data.partition.beta (now {cfg.beta}) or a smaller min_samples")


@PARTITIONERS.register("pathological", help="each client gets classes_per_client classes (label shards)")
def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
                 dataset: ArrayDataset) -> list[np.ndarray]:
    """McMahan et al.'s shards, generalised to k classes per client and made exact.

    The original sorts by label and deals 2 random shards per client, so a client can get one
    class twice or a shard straddling two classes. Here each client is first given k distinct
    classes, the classes spread as evenly as possible over the k * num_clients slots; each
    class is then cut into as many shards as clients hold it. Every sample is assigned.
    """
    by_class = _class_indices(labels)
    classes = np.array(sorted(by_class))
    k = cfg.classes_per_client
    if k > len(classes):
        raise ValueError(f"data.partition.classes_per_client = {k} exceeds the {len(classes)} classes in the dataset")
    if k * num_clients < len(classes):
        raise ValueError(f"data.partition.classes_per_client = {k} with {num_clients} clients covers only "
                         f"{k * num_clients} of {len(classes)} classes, so some samples would be unassigned; "
                         f"raise classes_per_client or federation.num_clients")
    # slots per class: equal up to one, the extra ones to random classes
    slots = np.full(len(classes), k * num_clients // len(classes))
    slots[rng.permutation(len(classes))[: k * num_clients % len(classes)]] += 1
    holders: list[list[int]] = [[] for _ in classes]
    for client in rng.permutation(num_clients):
        # the k classes with the most free slots (random among ties); taking the fullest
        # keeps the slot counts balanced, so k classes with free slots always remain
        chosen = np.lexsort((rng.random(len(classes)), -slots))[:k]
        slots[chosen] -= 1
        for c in chosen:
            holders[c].append(int(client))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, owners in zip(classes, holders, strict=True):
        idx = by_class[int(c)]
        if len(idx) < len(owners):
            raise ValueError(f"pathological partition: class {c} has {len(idx)} samples but is shared by "
                             f"{len(owners)} clients; lower data.partition.classes_per_client or federation.num_clients")
        for owner, shard in zip(owners, np.array_split(rng.permutation(idx), len(owners)), strict=True):
            parts[owner].append(shard)
    return [np.concatenate(p) for p in parts]


def _uniform_int(rng: np.random.Generator, low: int, high: int, size: int) -> np.ndarray:
    """``size`` integers uniform in [low, high] (both included)."""
    return rng.integers(low, high + 1, size=size)


def kshot_ways(cfg: PartitionConfig, num_classes: int, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """n per client: ``n_way`` without ``n_way_std``; else uniform in [max(2, n_way - s),
    min(C - 1, n_way + s)], FedProto's ``n_list = np.random.randint(max(2, ways - stdev),
    min(num_classes, ways + stdev + 1), num_users)`` (exps/federated_main.py; numpy's upper bound
    is exclusive). Where that range is empty (n_way < 2 or n_way = C) every client gets n_way.
    ``n_way_distribution: normal``: round(N(n_way, n_way_std)) per client, clipped to [1, C]
    (FedSAP appendix Table 5)."""
    s = cfg.n_way_std
    if s > 0 and cfg.n_way_distribution == "normal":
        # FedSAP appendix Table 5: n ~ N(mu_n, sigma^2), rounded, clipped to [1, C]
        return np.clip(np.rint(rng.normal(cfg.n_way, s, size=num_clients)), 1, num_classes).astype(np.int64)
    low, high = max(2, cfg.n_way - s), min(num_classes - 1, cfg.n_way + s)
    if s == 0 or low > high:
        return np.full(num_clients, cfg.n_way)
    return _uniform_int(rng, low, high, num_clients)


def kshot_shots(cfg: PartitionConfig, num_clients: int, rng: np.random.Generator) -> Optional[np.ndarray]:
    """k per client drawn up front with ``k_shot_distribution: uniform``: uniform integers in
    [k_shot - k_shot_std, k_shot + k_shot_std] (at least 1), FedProto's ``k_list =
    np.random.randint(...)`` (exps/federated_main.py; its bounds differ by dataset by one either
    side, e.g. [shots - stdev + 1, shots + stdev] for CIFAR-10: here symmetric). None: k is
    ``k_shot``, or with ``normal`` drawn per client in the loop (the rule before issue 35)."""
    if cfg.k_shot_std == 0 or cfg.k_shot_distribution == "normal":
        return None
    low = max(1, int(round(cfg.k_shot - cfg.k_shot_std)))
    return _uniform_int(rng, low, max(low, int(round(cfg.k_shot + cfg.k_shot_std))), num_clients)


@PARTITIONERS.register("nway_kshot", help="FedProto: n_way random classes per client, k_shot training samples each")
def nway_kshot(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
               dataset: ArrayDataset) -> list[np.ndarray]:
    """FedProto's protocol: every client draws n classes and ``k`` training samples of each.

    n is ``n_way``, or per client uniform around it with ``n_way_std`` (:func:`kshot_ways`); ``k``
    is ``k_shot``, or per client uniform in ``k_shot`` +- ``k_shot_std`` (:func:`kshot_shots`;
    ``k_shot_distribution: normal``: ``round(N(k_shot, k_shot_std))``, at least 1). Samples
    are drawn without replacement across clients; once a class is used up, its later clients
    draw from the whole class again (so clients can share samples; a warning says so), still
    without repeating a sample within a client. Samples no client draws stay unused.

    Every sample returned is a training sample: :func:`make_partition` gives this partitioner
    only the samples training may use (the dataset's train split, or all but a per-class test
    reserve) and draws each client's test set itself (:func:`_kshot_test_sets`).
    """
    by_class = _class_indices(labels)
    classes = np.array(sorted(by_class))
    if cfg.n_way > len(classes):
        raise ValueError(f"data.partition.n_way = {cfg.n_way} exceeds the {len(classes)} classes in the dataset")
    ways = kshot_ways(cfg, len(classes), num_clients, rng)  # FedProto: n_list, then k_list
    shots = kshot_shots(cfg, num_clients, rng)
    pools = {c: rng.permutation(idx) for c, idx in by_class.items()}  # unused samples, drawn from the front
    reused: set[int] = set()
    capped: set[int] = set()
    parts = []
    for i in range(num_clients):
        if shots is not None:
            k = int(shots[i])
        else:
            k = cfg.k_shot if cfg.k_shot_std == 0 else max(1, int(round(rng.normal(cfg.k_shot, cfg.k_shot_std))))
        chosen = []
        for c in rng.choice(classes, size=int(ways[i]), replace=False):
            c = int(c)
            if k > len(by_class[c]):
                capped.add(c)
            take = min(k, len(by_class[c]))
            fresh, pools[c] = pools[c][:take], pools[c][take:]
            if len(fresh) < take:
                reused.add(c)
                others = np.setdiff1d(by_class[c], fresh)
                fresh = np.concatenate([fresh, rng.choice(others, size=take - len(fresh), replace=False)])
            chosen.append(fresh)
        parts.append(np.concatenate(chosen))
    if reused:
        warnings.warn(f"nway_kshot: classes {sorted(reused)} ran out of unused samples, so some clients share "
                      f"samples of them; lower data.partition.k_shot or federation.num_clients to avoid it",
                      stacklevel=2)
    if capped:
        warnings.warn(f"nway_kshot: classes {sorted(capped)} have fewer samples open to training than the k drawn for "
                      f"some clients; those clients got all of them instead", stacklevel=2)
    return parts


@PARTITIONERS.register("natural", help="the dataset's own client_ids column (npz/folder data)")
def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
            dataset: ArrayDataset) -> list[np.ndarray]:
    """Replay the dataset's ``client_ids`` exactly; ids are renumbered 0..K-1 in sorted order."""
    if dataset.client_ids is None:
        raise ValueError(f"data.partition.name = 'natural' needs per-sample client ids, and dataset {dataset.name!r} "
                         f"has none; they come from the 'client_ids' key of an npz file, or client_N directories "
                         f"or a client_id column of index.csv for a folder dataset")
    ids = np.unique(dataset.client_ids)
    if len(ids) != num_clients:
        raise ValueError(f"dataset {dataset.name!r} has {len(ids)} distinct client ids, but federation.num_clients = "
                         f"{num_clients}; set federation.num_clients={len(ids)}")
    order = np.argsort(dataset.client_ids, kind="stable")  # one sort, not a scan per client (10,000 writers)
    starts = np.searchsorted(dataset.client_ids[order], ids)
    return np.split(order, starts[1:])


# --------------------------------------------------------------------------- domains


def _view(dataset: ArrayDataset, idx: np.ndarray) -> ArrayDataset:
    """The dataset's columns at ``idx``; the images are a zero-copy placeholder of the right
    shape (partitioners read labels and columns, never pixels)."""
    idx = np.asarray(idx, dtype=np.int64)
    _, c, h, w = dataset.images.shape
    images = np.broadcast_to(np.zeros((1, c, h, w), dtype=dataset.images.dtype), (len(idx), c, h, w))
    return ArrayDataset(
        name=dataset.name, images=images, labels=dataset.labels[idx], num_classes=dataset.num_classes,
        class_names=dataset.class_names,
        client_ids=None if dataset.client_ids is None else dataset.client_ids[idx],
        is_train=None if dataset.is_train is None else dataset.is_train[idx],
        domains=None if dataset.domains is None else dataset.domains[idx], domain_names=list(dataset.domain_names),
        mean=dataset.mean, std=dataset.std,
    )


# partitioners that cannot run inside a domain: by_domain itself, and natural (it replays
# the dataset's own clients, whose count is not the domain's)
_NOT_WITHIN_DOMAIN = ("by_domain", "natural")


def resolve_clients_per_domain(value: Optional[list[int]], num_clients: int, domain_names: list[str]) -> list[int]:
    """Clients per domain (in ``domain_names`` order): ``value`` checked, or an even spread.

    None gives every domain ``num_clients // D`` clients and one more to each of the first
    ``num_clients % D`` domains.
    """
    key, d = "data.partition.clients_per_domain", len(domain_names)
    if value is None:
        if num_clients < d:
            raise ValueError(f"{key} = None spreads federation.num_clients = {num_clients} evenly over the {d} domains "
                             f"{domain_names}, which needs at least one client per domain; raise "
                             f"federation.num_clients to >= {d} or select fewer domains with data.domains")
        base, extra = divmod(num_clients, d)
        return [base + (i < extra) for i in range(d)]
    counts = list(value)
    if len(counts) != d:
        raise ValueError(f"{key} = {counts} has {len(counts)} entries but the dataset has {d} domains {domain_names}: "
                         f"give one client count per domain, in that order")
    if any(int(k) != k or k < 1 for k in counts):
        raise ValueError(f"{key} = {counts}: every count must be an integer >= 1 (each domain needs a client)")
    if sum(counts) != num_clients:
        raise ValueError(f"{key} = {counts} sums to {sum(counts)} but federation.num_clients = {num_clients}; "
                         f"the counts must sum to num_clients")
    return [int(k) for k in counts]


def resolve_domain_percents(value: Optional[dict[str, float]], domain_names: list[str]) -> list[Optional[float]]:
    """``data.partition.percent`` per domain, in ``domain_names`` order (None: the whole domain)."""
    value = value or {}
    unknown = [k for k in value if k not in domain_names]
    if unknown:
        raise ValueError(f"data.partition.percent = {value}: unknown domain(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: the dataset's domains {', '.join(domain_names)}")
    return [value.get(name) for name in domain_names]


def domain_share(name: str, available: int, clients: int, percent: float) -> int:
    """Samples each of a domain's ``clients`` gets with ``percent``: ``floor(percent / 100 x
    available)``, FPL's ``int(percent * len)`` (WenkeHuang/RethinkFL datasets/utils/
    federated_dataset.py, ``partition_digits_domain_skew_loaders``), ``available`` being the
    domain's samples left for the clients after any holdouts. E.g. 1 % of 7,291: 72 each."""
    share = math.floor(percent / 100 * available + 1e-9)  # 1e-9: 10 % of 30 is 3, not 2.9999...
    key = f"data.partition.percent[{name!r}] = {percent}"
    if share < 1:
        raise ValueError(f"{key}: {percent} % of the domain's {available} samples (after any holdouts) is less than one "
                         f"sample per client; raise it to at least {math.ceil(100 / available * 1e6) / 1e6}")
    if share * clients > available:
        raise ValueError(f"{key}: {clients} clients x {share} samples ({percent} % each) exceed the domain's {available} "
                         f"samples (after any holdouts); at most {math.floor(100 / clients * 1e6) / 1e6} % with "
                         f"{clients} clients")
    return share


@PARTITIONERS.register("by_domain", help="domain skew: clients_per_domain clients per domain, within_domain inside each")
def by_domain(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
              dataset: ArrayDataset) -> list[np.ndarray]:
    """Domain skew (FedLSA): each client holds samples of one domain only.

    Domain d gets ``clients_per_domain[d]`` clients (FedLSA's Digits: [1, 4, 2, 3] over mnist,
    usps, svhn, synth); its samples are partitioned over them with the ``within_domain``
    partitioner, so label skew (e.g. ``dirichlet`` with ``beta``) composes with domain skew.
    Clients are numbered domain by domain: the first domain's clients come first.

    With ``percent[name]`` (FPL's protocol, which FedLSA follows) only a random subset of the
    domain, k x :func:`domain_share` samples for its k clients, drawn without replacement from
    the partition's stream, is dealt out (``iid``: exactly ``domain_share`` each); the rest of
    the domain stays unused.
    """
    if dataset.domains is None:
        raise ValueError(f"data.partition.name = 'by_domain' needs a multi-domain dataset (a per-sample domains column), "
                         f"and dataset {dataset.name!r} has none; use digits_domains, multidigits, office_caltech10 or pacs")
    allowed = [n for n in PARTITIONERS.names() if n not in _NOT_WITHIN_DOMAIN]
    if cfg.within_domain not in allowed:
        raise ValueError(f"data.partition.within_domain = {cfg.within_domain!r} is not allowed; allowed: {', '.join(allowed)}")
    within = PARTITIONERS.get(cfg.within_domain)
    names = dataset.domain_names
    counts = resolve_clients_per_domain(cfg.clients_per_domain, num_clients, names)
    percents = resolve_domain_percents(cfg.percent, names)
    parts: list[np.ndarray] = []
    for d, (name, k) in enumerate(zip(names, counts, strict=True)):
        members = np.flatnonzero(dataset.domains == d)
        if len(members) < k:
            raise ValueError(f"by_domain: domain {name!r} has {len(members)} samples (after any holdouts), fewer than its "
                             f"{k} clients (data.partition.clients_per_domain = {cfg.clients_per_domain}); give it "
                             f"fewer clients")
        if percents[d] is not None:  # FPL's protocol: each client a random percent of the domain
            members = np.sort(rng.choice(members, size=k * domain_share(name, len(members), k, percents[d]), replace=False))
        sub = _view(dataset, members)
        try:
            got = within(sub.labels, k, rng, cfg, sub)
        except ValueError as err:
            raise ValueError(f"by_domain, inside domain {name!r} ({len(members)} samples, {k} clients, "
                             f"data.partition.within_domain = {cfg.within_domain!r}): {err}") from err
        parts.extend(members[np.asarray(g, dtype=np.int64)] for g in got)
    return parts


# --------------------------------------------------------------------------- holdouts


def long_tail_counts(available: np.ndarray, ratio: float) -> np.ndarray:
    """Per-class sample counts of an exponential long tail with imbalance ``ratio`` = n_max / n_min.

    Class rank r (0 for ``available[0]``, the head) keeps ``n_r = floor(n_max * ratio^(-r/(C-1)))``
    samples (at least 1), as in Cao et al. 2019 (LDAM, CIFAR-LT), which FedSC's Table 2
    follows. ``n_max`` is the largest head size for which every class has enough samples:
    ``min_r floor(available[r] * ratio^(r/(C-1)))``. E.g. available (8, 8, 8), ratio 4:
    (8, 4, 2).
    """
    avail = np.asarray(available, dtype=np.int64)
    c = len(avail)
    if c <= 1:
        return avail.copy()
    eps = 1e-9  # 8 * 4^(-1/2) must floor to 4, not 3
    power = np.arange(c) / (c - 1)
    n_max = int(min(math.floor(a * ratio ** p + eps) for a, p in zip(avail, power, strict=True)))
    counts = np.array([max(1, math.floor(n_max * ratio ** (-p) + eps)) for p in power], dtype=np.int64)
    return np.minimum(counts, avail)


def _stratified_holdout(idx: np.ndarray, strata: np.ndarray, fraction: float,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held): per stratum, min(floor(n * fraction + 0.5), n - 1) samples are held out."""
    kept, held = [_empty_index()], [_empty_index()]
    for s in np.unique(strata):
        members = rng.permutation(idx[strata == s])
        n_held = min(int(np.floor(len(members) * fraction + 0.5)), len(members) - 1)
        held.append(members[:n_held])
        kept.append(members[n_held:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


def _needs_min_samples(cfg: PartitionConfig) -> bool:
    return cfg.name == "dirichlet" or (cfg.name == "by_domain" and cfg.within_domain == "dirichlet")


def _holdouts(dataset: ArrayDataset, cfg: PartitionConfig, num_clients: int, seed: int, global_test_fraction: float,
              public_size: int, long_tail_ratio: Optional[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool, global_test_idx, public_idx): the samples left for the clients and the two holdouts."""
    n = len(dataset)
    if public_size < 0 or int(public_size) != public_size:
        raise ValueError(f"data.public_size must be an integer >= 0, got {public_size!r}")
    if not 0 <= global_test_fraction < 1:
        raise ValueError(f"data.global_test_fraction must be in [0, 1), got {global_test_fraction!r}")
    if long_tail_ratio is not None and not long_tail_ratio >= 1:
        raise ValueError(f"data.long_tail_ratio must be >= 1 (n_max / n_min), got {long_tail_ratio!r}")
    pool = np.arange(n, dtype=np.int64)
    public = _empty_index()
    if public_size:
        if public_size >= n:
            raise ValueError(f"data.public_size = {public_size} leaves no training samples: the dataset {dataset.name!r} "
                             f"has {n} samples")
        rng = np.random.default_rng([seed, 1])
        public = np.sort(rng.choice(n, size=int(public_size), replace=False)).astype(np.int64)
        pool = np.setdiff1d(pool, public)
    global_test = _empty_index()
    if global_test_fraction > 0:
        rng = np.random.default_rng([seed, 2])
        labels = dataset.labels[pool]
        strata = labels if dataset.domains is None else dataset.domains[pool] * (int(labels.max()) + 1) + labels
        pool, global_test = _stratified_holdout(pool, strata, global_test_fraction, rng)
    if long_tail_ratio is not None:
        rng = np.random.default_rng([seed, 3])
        labels = dataset.labels[pool]
        classes = np.unique(labels)  # ranked by class index: class 0 (if present) is the head
        counts = long_tail_counts(np.array([(labels == c).sum() for c in classes]), float(long_tail_ratio))
        kept = [rng.choice(pool[labels == c], size=int(k), replace=False) for c, k in zip(classes, counts, strict=True)]
        pool = np.sort(np.concatenate(kept)).astype(np.int64) if kept else _empty_index()
    per_client = cfg.min_samples if _needs_min_samples(cfg) else 1
    if len(pool) < num_clients * per_client:
        what = f"data.partition.min_samples = {per_client}" if per_client > 1 else "1 sample"
        raise ValueError(f"the holdouts (data.public_size = {public_size}, data.global_test_fraction = "
                         f"{global_test_fraction}, data.long_tail_ratio = {long_tail_ratio}) leave {len(pool)} of the "
                         f"dataset's {n} samples for the clients, fewer than federation.num_clients = {num_clients} x "
                         f"{what}; lower the holdouts, federation.num_clients or data.partition.min_samples")
    return pool, global_test, public


# --------------------------------------------------------------------------- partition



def _stratified_split(idx: np.ndarray, labels: np.ndarray, test_fraction: float,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per class: round(n * test_fraction) samples to test, at most n - 1 (a singleton stays in train)."""
    train, test = [], []
    client_labels = labels[idx]
    for c in np.unique(client_labels):
        members = rng.permutation(idx[client_labels == c])
        n_test = min(int(np.floor(len(members) * test_fraction + 0.5)), len(members) - 1)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return (np.sort(np.concatenate(train)) if train else np.empty(0, dtype=np.int64),
            np.sort(np.concatenate(test)) if test else np.empty(0, dtype=np.int64))


def _is_kshot(cfg: PartitionConfig) -> bool:
    """n-way k-shot, on the whole pool or inside each domain: k training shots, test sets drawn apart."""
    return cfg.name == "nway_kshot" or (cfg.name == "by_domain" and cfg.within_domain == "nway_kshot")


def _test_reserve(pool: np.ndarray, dataset: ArrayDataset, test_shots: int, rng: np.random.Generator) -> np.ndarray:
    """For a dataset without a test split of its own: per class (per domain and class on a
    multi-domain set), ``min(test_shots, n - 1)`` random samples of ``pool`` that no client may
    train on, so every class keeps test samples however many clients draw shots of it."""
    labels = dataset.labels[pool]
    strata = labels if dataset.domains is None else dataset.domains[pool] * dataset.num_classes + labels
    held = [_empty_index()]
    for s in np.unique(strata):
        members = pool[strata == s]
        held.append(rng.choice(members, size=min(test_shots, len(members) - 1), replace=False).astype(np.int64))
    return np.sort(np.concatenate(held))


def _kshot_test_sets(train: list[np.ndarray], candidates: np.ndarray, dataset: ArrayDataset, test_shots: int,
                     rng: np.random.Generator, source: str) -> list[np.ndarray]:
    """Each client's test set: ``test_shots`` samples of every class of its training split (on a
    multi-domain set, of the domains of its training split), drawn from ``candidates``.

    Clients are served in order, each class from one random order of its candidates: first the
    candidates no earlier client tests on, so the test sets are disjoint while they last (as the
    blocks FedProto's code deals the clients from the test split, lib/sampling.py
    ``cifar10_noniid_lt``); then, for what is missing, candidates another client already tests on
    (shared, never twice in one client; FedSAP evaluates every client on one centralised test
    set restricted to its classes). A class with fewer than ``test_shots`` candidates gives each
    of its clients all of them, with a warning.
    """
    labels = dataset.labels
    cand_labels = labels[candidates]
    order = {int(c): rng.permutation(candidates[cand_labels == c]) for c in np.unique(cand_labels)}
    given = np.zeros(len(labels), dtype=bool)
    short: set[int] = set()
    tests = []
    for idx in train:
        domains = None if dataset.domains is None else np.unique(dataset.domains[idx])
        chosen = [_empty_index()]
        for c in np.unique(labels[idx]):
            eligible = order.get(int(c), _empty_index())
            if domains is not None:
                eligible = eligible[np.isin(dataset.domains[eligible], domains)]
            fresh = eligible[~given[eligible]][:test_shots]
            chosen.append(fresh)
            missing = test_shots - len(fresh)
            if missing:
                seen = eligible[given[eligible]]
                if len(seen):
                    chosen.append(rng.choice(seen, size=min(missing, len(seen)), replace=False))
                if len(seen) < missing:
                    short.add(int(c))
            given[fresh] = True
        tests.append(np.sort(np.concatenate(chosen)).astype(np.int64))
    if short:
        warnings.warn(f"nway_kshot: classes {sorted(short)} have fewer than data.partition.test_shots = {test_shots} "
                      f"{source}, so the clients holding them test on fewer; lower data.partition.test_shots "
                      f"(or k_shot / federation.num_clients when clients train on most of the class)", stacklevel=3)
    return tests


def _unlabelled_pools(clients: list[ClientSplit], candidates: np.ndarray, labels: np.ndarray, size: int,
                      rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's unlabelled pool: ``size`` samples of the classes of its training split, drawn
    from ``candidates`` (samples no client holds) without replacement across clients, spread
    evenly over its classes (round robin over them, in a random order). A client gets fewer when
    its classes run out (a warning names them)."""
    cand_labels = labels[candidates]
    free = {int(c): list(rng.permutation(candidates[cand_labels == c])) for c in np.unique(cand_labels)}
    pools, short = [], []
    for client in clients:
        classes = [int(c) for c in rng.permutation(np.unique(labels[client.train_idx]))]
        chosen: list[int] = []
        while len(chosen) < size:
            before = len(chosen)
            for c in classes:
                if len(chosen) < size and free.get(c):
                    chosen.append(int(free[c].pop()))
            if len(chosen) == before:
                break
        if len(chosen) < size:
            short.append((client.client_id, len(chosen)))
        pools.append(np.sort(np.array(chosen, dtype=np.int64)))
    if short:
        warnings.warn(f"data.partition.unlabelled_per_client = {size}: the samples no client holds ran out for "
                      f"clients (id, pool size) {short}; use a partitioner that leaves samples unused (nway_kshot) "
                      f"with a smaller k_shot or fewer clients", stacklevel=3)
    return pools


def _client_domains(dataset: ArrayDataset, clients: list[ClientSplit]) -> Optional[list[int]]:
    if dataset.domains is None:
        return None
    out = []
    for c in clients:
        idx = np.concatenate([c.train_idx, c.test_idx])
        counts = np.bincount(dataset.domains[idx], minlength=dataset.num_domains)
        out.append(int(counts.argmax()) if len(idx) else -1)
    return out


def _split_shares(parts: list, dataset: ArrayDataset, kshot: bool, test_fraction: float,
                  rng: np.random.Generator) -> list[ClientSplit]:
    """Each client's share split into train and test: k-shot, all train (test sets come later);
    with an ``is_train`` column, by it; otherwise stratified by class, ``test_fraction`` per class."""
    clients = []
    for client_id, idx in enumerate(parts):
        idx = np.asarray(idx, dtype=np.int64)
        if kshot:
            train, test = np.sort(idx), _empty_index()
        elif dataset.is_train is not None:
            mask = dataset.is_train[idx]
            train, test = np.sort(idx[mask]), np.sort(idx[~mask])
        else:
            train, test = _stratified_split(idx, dataset.labels, test_fraction, rng)
        clients.append(ClientSplit(client_id, train, test))
    return clients


def _assign_kshot_tests(clients: list[ClientSplit], everyone: np.ndarray, dataset: ArrayDataset, test_shots: int,
                        rng: np.random.Generator) -> None:
    """k-shot: each client's test set, ``test_shots`` per class of its classes, from the dataset's
    test split (``is_train``) or else from the samples no client trains on or holds unlabelled."""
    if dataset.is_train is not None:
        candidates = everyone[~dataset.is_train[everyone]]
        source = "samples in the dataset's test split (is_train false)"
    else:
        taken = np.concatenate([np.concatenate([c.train_idx, c.unlabelled_idx]) for c in clients])
        candidates = np.setdiff1d(everyone, taken)
        source = "samples that no client trains on"
    tests = _kshot_test_sets([c.train_idx for c in clients], candidates, dataset, test_shots, rng, source)
    for client, test in zip(clients, tests, strict=True):
        client.test_idx = test


def make_partition(dataset: ArrayDataset, cfg: PartitionConfig, num_clients: int, seed: int,
                   test_fraction: float = 0.25, global_test_fraction: float = 0.0, public_size: int = 0,
                   long_tail_ratio: Optional[float] = None) -> Partition:
    """Hold samples out, assign the rest to ``num_clients`` clients with ``cfg.name``, split each share.

    In order: (a) ``public_size`` samples drawn uniformly at random become the public
    unlabelled proxy set (``public_idx``); (b) ``global_test_fraction`` of the rest, stratified
    by (domain, class), becomes the global test set (``global_test_idx``); (c) with
    ``long_tail_ratio`` (rho) the remaining pool is subsampled per class to an exponential long
    tail (see :func:`long_tail_counts`; the dropped samples are unused, the global test set is
    untouched); (d) the partitioner deals the pool out. Each client's share is then split
    stratified by class with ``test_fraction`` per class, unless the dataset has an
    ``is_train`` column, which then decides train vs test. (e) With
    ``cfg.unlabelled_per_client`` each client also gets a separate unlabelled pool of its
    classes from the samples nobody holds (:func:`_unlabelled_pools`). Deterministic in ``seed``; with the
    defaults (no holdout) the result is exactly that of the partitioner on the whole dataset.

    n-way k-shot (``nway_kshot``, also as ``by_domain``'s ``within_domain``) instead follows
    FedProto's code (lib/utils.py ``get_dataset``: the shots from the train split, each client's
    test set from the test split, ``--test_shots`` per class of its classes): the k shots are all
    training samples and ``test_fraction`` is not used. With an ``is_train`` column the shots come
    from its train side and the test sets from its test side; without one, ``min(test_shots,
    n - 1)`` samples of each class (of each domain and class) are first set aside where no client
    trains (:func:`_test_reserve`, own stream), the shots are drawn from the rest, then any
    unlabelled pools (never from the reserve), and last each client's ``test_shots`` test
    samples per class of its classes from the samples no client trains on or holds unlabelled
    (:func:`_kshot_test_sets`).
    """
    if num_clients < 1:
        raise ValueError(f"federation.num_clients must be >= 1, got {num_clients}")
    partitioner = PARTITIONERS.get(cfg.name)
    holdouts = public_size != 0 or global_test_fraction != 0 or long_tail_ratio is not None
    if holdouts:
        pool, global_test, public = _holdouts(dataset, cfg, num_clients, seed, global_test_fraction, public_size,
                                              long_tail_ratio)
    else:
        pool, global_test, public = None, _empty_index(), _empty_index()
    rng = np.random.default_rng(seed)
    everyone = np.arange(len(dataset), dtype=np.int64) if pool is None else pool
    kshot = _is_kshot(cfg)
    test_shots = cfg.test_shots if cfg.test_shots is not None else kshot_test_shots(dataset.name)
    trainable = pool  # what the partitioner deals out (None: the whole dataset)
    if kshot and dataset.is_train is not None:
        trainable = everyone[dataset.is_train[everyone]]
    elif kshot:
        reserve = _test_reserve(everyone, dataset, test_shots, np.random.default_rng([seed, 5]))
        trainable = np.setdiff1d(everyone, reserve)
    if trainable is None:
        parts = partitioner(dataset.labels, num_clients, rng, cfg, dataset)
    else:
        view = _view(dataset, trainable)
        parts = [trainable[np.asarray(p, dtype=np.int64)] for p in partitioner(view.labels, num_clients, rng, cfg, view)]
    if len(parts) != num_clients:
        raise RuntimeError(f"partitioner {cfg.name!r} returned {len(parts)} clients, expected {num_clients}")
    clients = _split_shares(parts, dataset, kshot, test_fraction, rng)
    if cfg.unlabelled_per_client:
        held = np.concatenate([np.concatenate([c.train_idx, c.test_idx]) for c in clients])
        free = np.setdiff1d(trainable if kshot else everyone, held)  # k-shot: never the test side or reserve
        pools = _unlabelled_pools(clients, free, dataset.labels, cfg.unlabelled_per_client,
                                  np.random.default_rng([seed, 4]))  # own stream: the rest is unchanged
        for client, idx in zip(clients, pools, strict=True):
            client.unlabelled_idx = idx
    if kshot:
        _assign_kshot_tests(clients, everyone, dataset, test_shots, rng)
    return Partition(clients=clients, num_classes=dataset.num_classes, partitioner=cfg.name, seed=seed,
                     labels=dataset.labels, global_test_idx=global_test, public_idx=public,
                     client_domains=_client_domains(dataset, clients),
                     domain_names=list(dataset.domain_names) if dataset.domains is not None else [])
