"""In-memory dataset type shared by every loader, partitioner and client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class ArrayDataset:
    """Images and labels held as numpy arrays.

    ``images`` is (N, C, H, W), either uint8 (0..255) or float32 (already in [0, 1]);
    :meth:`tensors` converts a subset to normalised float32 torch tensors. ``client_ids`` and
    ``is_train`` are optional columns carried by users' own data: the ``natural`` partitioner
    uses ``client_ids`` as the partition and ``is_train`` replaces the stratified split.

    Multi-domain sets also carry ``domains``, the int64 index of each sample's domain into
    ``domain_names`` (the ``by_domain`` partitioner, per-domain evaluation). ``domain_names``
    defaults to ``"0"``, ``"1"``, ... when only ``domains`` is given.
    """

    name: str
    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    client_ids: Optional[np.ndarray] = None
    is_train: Optional[np.ndarray] = None
    domains: Optional[np.ndarray] = None
    domain_names: list[str] = field(default_factory=list)
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise ValueError(f"{self.name}: images must be (N, C, H, W), got shape {self.images.shape}")
        n = len(self.images)
        self.labels = np.asarray(self.labels, dtype=np.int64)
        if self.labels.shape != (n,):
            raise ValueError(f"{self.name}: {n} images but labels of shape {self.labels.shape}")
        for col in ("client_ids", "is_train"):
            v = getattr(self, col)
            if v is not None and len(v) != n:
                raise ValueError(f"{self.name}: column {col} has {len(v)} rows for {n} images")
        self._check_domains(n)
        if not self.class_names:
            self.class_names = [str(c) for c in range(self.num_classes)]
        if not self.mean:
            x = self._float(self.images[: min(n, 5000)])
            self.mean = tuple(float(m) for m in x.mean(axis=(0, 2, 3)))
            self.std = tuple(float(max(s, 1e-6)) for s in x.std(axis=(0, 2, 3)))

    def _check_domains(self, n: int) -> None:
        if self.domains is None:
            if self.domain_names:
                raise ValueError(f"{self.name}: domain_names {self.domain_names} given without a domains column")
            return
        d = np.asarray(self.domains)
        if d.shape != (n,):
            raise ValueError(f"{self.name}: column domains has shape {d.shape} for {n} images")
        if not np.issubdtype(d.dtype, np.integer):
            raise ValueError(f"{self.name}: column domains must hold integer domain indices, got dtype {d.dtype}")
        self.domains = d.astype(np.int64, copy=False)
        if n and self.domains.min() < 0:
            raise ValueError(f"{self.name}: column domains must be >= 0, found {self.domains.min()}")
        if not self.domain_names:
            self.domain_names = [str(i) for i in range(int(self.domains.max()) + 1 if n else 0)]
        self.domain_names = [str(x) for x in self.domain_names]
        if len(set(self.domain_names)) != len(self.domain_names):
            raise ValueError(f"{self.name}: domain_names must be distinct, got {self.domain_names}")
        if n and self.domains.max() >= len(self.domain_names):
            raise ValueError(f"{self.name}: column domains goes up to {self.domains.max()} but there are only "
                             f"{len(self.domain_names)} domain_names {self.domain_names}")

    @property
    def num_domains(self) -> int:
        """Number of domains (0 when the dataset has no ``domains`` column)."""
        return len(self.domain_names) if self.domains is not None else 0

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[2])

    @staticmethod
    def _float(images: np.ndarray) -> np.ndarray:
        if images.dtype == np.uint8:
            return images.astype(np.float32) / 255.0
        return images.astype(np.float32, copy=False)

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return ArrayDataset(
            name=self.name, images=self.images[idx], labels=self.labels[idx],
            num_classes=self.num_classes, class_names=self.class_names,
            client_ids=None if self.client_ids is None else self.client_ids[idx],
            is_train=None if self.is_train is None else self.is_train[idx],
            domains=None if self.domains is None else self.domains[idx], domain_names=list(self.domain_names),
            mean=self.mean, std=self.std,
        )

    def tensors(self, indices: Optional[np.ndarray] = None):
        """(x, y) as torch tensors: x float32 normalised (N, C, H, W), y int64."""
        import torch

        imgs = self.images if indices is None else self.images[np.asarray(indices, dtype=np.int64)]
        labels = self.labels if indices is None else self.labels[np.asarray(indices, dtype=np.int64)]
        x = self._float(imgs)
        mean = np.asarray(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
        x = (x - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(labels.copy())
