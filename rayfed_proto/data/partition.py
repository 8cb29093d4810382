"""Partitioners and the per-client train/test split: which samples each client owns.

A partitioner (registered in ``PARTITIONERS``) decides the samples of each client; then
:func:`make_partition` splits every client's share into train and test, stratified by class
(or by the dataset's own ``is_train`` column when it has one). The result, a
:class:`Partition`, is plain sample indices into the dataset, so it can be saved as Parquet,
logged as an artifact and replayed exactly, independent of how the images are stored.

Everything is driven by one ``np.random.Generator`` seeded from the run's seed: the same
dataset, config and seed always give the same partition.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayfed_proto.config import PartitionConfig
from rayfed_proto.data import PARTITIONERS
from rayfed_proto.data.base import ArrayDataset

_SPLITS = ("train", "test")


@dataclass(eq=False)
class ClientSplit:
    """One client's samples: int64 indices into the dataset."""

    client_id: int
    train_idx: np.ndarray
    test_idx: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClientSplit):
            return NotImplemented
        return (self.client_id == other.client_id and np.array_equal(self.train_idx, other.train_idx)
                and np.array_equal(self.test_idx, other.test_idx))


@dataclass(eq=False)
class Partition:
    """Every client's train/test indices, plus what is needed to read and describe them.

    ``clients[i].client_id == i``. ``labels`` are the dataset's labels (indexed by sample);
    only the labels of samples some client holds are meaningful after :meth:`load_parquet`
    (the others read back as -1), which is why equality compares :meth:`to_table`.
    """

    clients: list[ClientSplit]
    num_classes: int
    partitioner: str
    seed: int
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.clients)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return ((self.num_classes, self.partitioner, self.seed, len(self.labels))
                == (other.num_classes, other.partitioner, other.seed, len(other.labels))
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

    def to_table(self) -> pa.Table:
        """One row per (client, sample): client_id int32, sample_index int64, split, label int64."""
        client_ids, indices, splits = [], [], []
        for c in self.clients:
            for split, idx in zip(_SPLITS, (c.train_idx, c.test_idx), strict=True):
                client_ids.append(np.full(len(idx), c.client_id, dtype=np.int32))
                indices.append(idx)
                splits.extend([split] * len(idx))
        index = np.concatenate(indices).astype(np.int64) if indices else np.empty(0, dtype=np.int64)
        return pa.table({
            "client_id": pa.array(np.concatenate(client_ids) if client_ids else [], type=pa.int32()),
            "sample_index": pa.array(index, type=pa.int64()),
            "split": pa.array(splits, type=pa.string()),
            "label": pa.array(self.labels[index], type=pa.int64()),
        })

    def save_parquet(self, path: str | Path) -> None:
        meta = {"num_classes": self.num_classes, "partitioner": self.partitioner, "seed": self.seed,
                "num_samples": len(self.labels), "num_clients": len(self.clients)}
        table = self.to_table()
        table = table.replace_schema_metadata({f"rayfed_proto.{k}": str(v) for k, v in meta.items()})
        pq.write_table(table, str(path))

    @classmethod
    def load_parquet(cls, path: str | Path) -> Partition:
        table = pq.read_table(str(path))
        raw = table.schema.metadata or {}
        meta = {k.decode().removeprefix("rayfed_proto."): v.decode() for k, v in raw.items()
                if k.startswith(b"rayfed_proto.")}
        needed = {"num_classes", "partitioner", "seed", "num_samples", "num_clients"}
        if not needed <= set(meta):
            raise ValueError(f"{path}: not a partition written by Partition.save_parquet "
                             f"(missing metadata {', '.join(sorted(needed - set(meta)))})")
        client_id = table.column("client_id").to_numpy()
        index = table.column("sample_index").to_numpy().astype(np.int64)
        is_train = np.asarray(table.column("split").to_pylist()) == "train"
        labels = np.full(int(meta["num_samples"]), -1, dtype=np.int64)
        labels[index] = table.column("label").to_numpy()
        clients = [ClientSplit(i, index[(client_id == i) & is_train], index[(client_id == i) & ~is_train])
                   for i in range(int(meta["num_clients"]))]
        return cls(clients=clients, num_classes=int(meta["num_classes"]), partitioner=meta["partitioner"],
                   seed=int(meta["seed"]), labels=labels)


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


@PARTITIONERS.register("nway_kshot", help="FedProto: n_way random classes per client, k_shot samples each")
def nway_kshot(labels: np.ndarray, num_clients: int, rng: np.random.Generator, cfg: PartitionConfig,
               dataset: ArrayDataset) -> list[np.ndarray]:
    """FedProto's protocol: every client draws ``n_way`` classes and ``k`` samples of each.

    ``k`` is ``k_shot``, or per client ``round(N(k_shot, k_shot_std))`` (at least 1). Samples
    are drawn without replacement across clients; once a class is used up, its later clients
    draw from the whole class again (so clients can share samples; a warning says so), still
    without repeating a sample within a client. Samples no client draws stay unused.
    """
    by_class = _class_indices(labels)
    classes = np.array(sorted(by_class))
    if cfg.n_way > len(classes):
        raise ValueError(f"data.partition.n_way = {cfg.n_way} exceeds the {len(classes)} classes in the dataset")
    pools = {c: rng.permutation(idx) for c, idx in by_class.items()}  # unused samples, drawn from the front
    reused: set[int] = set()
    capped: set[int] = set()
    parts = []
    for _ in range(num_clients):
        k = cfg.k_shot if cfg.k_shot_std == 0 else max(1, int(round(rng.normal(cfg.k_shot, cfg.k_shot_std))))
        chosen = []
        for c in rng.choice(classes, size=cfg.n_way, replace=False):
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
        warnings.warn(f"nway_kshot: classes {sorted(capped)} have fewer samples than the k drawn for some clients; "
                      f"those clients got the whole class instead", stacklevel=2)
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
    return [np.flatnonzero(dataset.client_ids == i) for i in ids]


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


def make_partition(dataset: ArrayDataset, cfg: PartitionConfig, num_clients: int, seed: int,
                   test_fraction: float = 0.25) -> Partition:
    """Assign samples to ``num_clients`` clients with ``cfg.name``, then split each client's share.

    The split is stratified by class with ``test_fraction`` per class, unless the dataset has an
    ``is_train`` column, which then decides train vs test. Deterministic in ``seed``.
    """
    if num_clients < 1:
        raise ValueError(f"federation.num_clients must be >= 1, got {num_clients}")
    partitioner = PARTITIONERS.get(cfg.name)
    rng = np.random.default_rng(seed)
    parts = partitioner(dataset.labels, num_clients, rng, cfg, dataset)
    if len(parts) != num_clients:
        raise RuntimeError(f"partitioner {cfg.name!r} returned {len(parts)} clients, expected {num_clients}")
    clients = []
    for client_id, idx in enumerate(parts):
        idx = np.asarray(idx, dtype=np.int64)
        if dataset.is_train is not None:
            mask = dataset.is_train[idx]
            train, test = np.sort(idx[mask]), np.sort(idx[~mask])
        else:
            train, test = _stratified_split(idx, dataset.labels, test_fraction, rng)
        clients.append(ClientSplit(client_id, train, test))
    return Partition(clients=clients, num_classes=dataset.num_classes, partitioner=cfg.name, seed=seed,
                     labels=dataset.labels)
