"""Datasets and partitioners.

``DATASETS``: name -> loader ``(cfg: DataConfig, seed: int) -> ArrayDataset``.
``PARTITIONERS``: name -> ``(labels, num_clients, rng, cfg: PartitionConfig, dataset) -> list[np.ndarray]``
(sample indices per client, before the per-client train/test split).
``DOMAIN_NAMES``: multi-domain dataset name -> its domain names (what ``data.domains`` may list).

Importing this package also registers the config checks of ``data.name`` and
``data.partition.name`` (``rayfed_proto.config.register_check``), datasets first, and last
imports every entry point of group ``rayfed_proto.datasets`` (``registry.load_plugins``): a
plug-in module registers its loaders in ``DATASETS`` when imported. The package is imported
with ``rayfed_proto`` itself, so a plug-in should import heavy libraries inside its loader.
"""

from rayfed_proto.registry import Registry, load_plugins

DATASETS: Registry = Registry("dataset")
PARTITIONERS: Registry = Registry("partitioner")

from rayfed_proto.data import datasets as _datasets  # noqa: E402,F401  (registers loaders, then the data.name check)
from rayfed_proto.data import domains as _domains  # noqa: E402,F401  (registers multi-domain loaders)
from rayfed_proto.data import partition as _partition  # noqa: E402,F401  (registers partitioners, data.partition.name check)
from rayfed_proto.data.base import ArrayDataset  # noqa: E402
from rayfed_proto.data.datasets import DatasetNotFoundError, load_dataset  # noqa: E402
from rayfed_proto.data.domains import DOMAIN_NAMES  # noqa: E402
from rayfed_proto.data.partition import ClientSplit, Partition, make_partition  # noqa: E402

# last, so plug-ins can import every name above from here
load_plugins("rayfed_proto.datasets", "dataset")

__all__ = ["DATASETS", "PARTITIONERS", "DOMAIN_NAMES", "ArrayDataset", "DatasetNotFoundError", "load_dataset",
           "make_partition", "Partition", "ClientSplit"]
