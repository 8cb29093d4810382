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
    """

    name: str
    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    client_ids: Optional[np.ndarray] = None
    is_train: Optional[np.ndarray] = None
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
        if not self.class_names:
            self.class_names = [str(c) for c in range(self.num_classes)]
        if not self.mean:
            x = self._float(self.images[: min(n, 5000)])
            self.mean = tuple(float(m) for m in x.mean(axis=(0, 2, 3)))
            self.std = tuple(float(max(s, 1e-6)) for s in x.std(axis=(0, 2, 3)))

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
