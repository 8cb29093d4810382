"""Typed messages between clients and the server, and their validation at the border.

Payloads are numpy arrays (Ray passes them zero-copy through the object store). Nothing here
imports ray or torch: the algorithms produce these objects, the runtime moves and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

ArrayDict = dict[str, np.ndarray]


def _nbytes(d: Optional[ArrayDict]) -> int:
    return int(sum(np.asarray(v).nbytes for v in (d or {}).values()))


def _payload_nbytes(msg: ClientUpdate | GlobalState) -> int:
    """Bytes of what a message carries (prototypes, weights, extras): the communication metric."""
    return (msg.prototypes.nbytes if msg.prototypes is not None else 0) + _nbytes(msg.weights) + _nbytes(msg.extras)


@dataclass
class PrototypeSet:
    """One vector per class: ``class_ids`` (m,), ``vectors`` (m, D), ``counts`` (m,).

    For an upload, ``counts`` are the client's samples per class; for a global bank they are
    the total weight behind each vector (informational).
    """

    class_ids: np.ndarray
    vectors: np.ndarray
    counts: np.ndarray

    @classmethod
    def empty(cls, dim: int) -> PrototypeSet:
        return cls(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(len(self.class_ids))

    @property
    def nbytes(self) -> int:
        return int(self.class_ids.nbytes + self.vectors.nbytes + self.counts.nbytes)

    def as_dict(self) -> dict[int, np.ndarray]:
        return {int(c): self.vectors[i] for i, c in enumerate(self.class_ids)}


@dataclass
class ClientUpdate:
    """What a client uploads after local training against server version ``base_version``."""

    client_id: int
    base_version: int
    # the client's training-set size; optional: a method whose server never reads it (FedProtoKD,
    # whose paper drops counts for privacy) leaves it out. FedAvg's weighting needs it.
    num_samples: Optional[int] = None
    prototypes: Optional[PrototypeSet] = None
    weights: Optional[ArrayDict] = None
    extras: ArrayDict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return _payload_nbytes(self)


@dataclass
class GlobalState:
    """What the server broadcasts at ``version``: a guidance bank and/or weights, plus extras."""

    version: int
    prototypes: Optional[PrototypeSet] = None
    weights: Optional[ArrayDict] = None
    extras: ArrayDict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return _payload_nbytes(self)


@dataclass
class UpdateSchema:
    """What a valid update looks like, known to the server before any update arrives."""

    num_clients: int
    num_classes: int
    feature_dim: int
    weight_shapes: Optional[dict[str, tuple[int, ...]]] = None  # set for weight-exchanging methods
    extras_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # required extras, if any


def _finite(a: np.ndarray) -> bool:
    a = np.asarray(a)
    return not np.issubdtype(a.dtype, np.floating) or bool(np.isfinite(a).all())


def validate_update(update: object, schema: UpdateSchema, current_version: int) -> Optional[str]:
    """Return why ``update`` must be refused, or None if it is acceptable."""
    if not isinstance(update, ClientUpdate):
        return f"not a ClientUpdate but {type(update).__name__}"
    if not (0 <= update.client_id < schema.num_clients):
        return f"unknown client id {update.client_id} (clients are 0..{schema.num_clients - 1})"
    if update.base_version > current_version:
        return f"version from the future: trained on {update.base_version}, server is at {current_version}"
    if update.base_version < 0:
        return f"negative base version {update.base_version}"
    if update.num_samples is not None and update.num_samples <= 0:
        return f"num_samples must be positive when given, got {update.num_samples}"
    p = update.prototypes
    if p is not None:
        ids = np.asarray(p.class_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            return f"class_ids must be a 1-d integer array, got dtype {ids.dtype} shape {ids.shape}"
        if len(ids) and (ids.min() < 0 or ids.max() >= schema.num_classes):
            bad = sorted({int(c) for c in ids if c < 0 or c >= schema.num_classes})
            return f"unknown class ids {bad} (classes are 0..{schema.num_classes - 1})"
        if len(np.unique(ids)) != len(ids):
            return "duplicate class ids in prototypes"
        if np.shape(p.vectors) != (len(ids), schema.feature_dim):
            return f"prototype shape {np.shape(p.vectors)} != ({len(ids)}, {schema.feature_dim})"
        if np.shape(p.counts) != (len(ids),) or (len(ids) and np.min(p.counts) <= 0):
            return "prototype counts must be positive, one per class id"
        if not _finite(p.vectors):
            return "non-finite values (NaN or inf) in prototypes"
    if update.weights is not None:
        expected = schema.weight_shapes
        if expected is not None:
            if set(update.weights) != set(expected):
                missing, extra = set(expected) - set(update.weights), set(update.weights) - set(expected)
                return f"weight keys differ from the global model (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
            for k, v in update.weights.items():
                if tuple(np.shape(v)) != tuple(expected[k]):
                    return f"weight {k!r} has shape {tuple(np.shape(v))}, expected {tuple(expected[k])}"
        for k, v in update.weights.items():
            if not _finite(v):
                return f"non-finite values (NaN or inf) in weight {k!r}"
    if schema.extras_shapes:
        if set(update.extras) != set(schema.extras_shapes):
            return f"extras {sorted(update.extras)} differ from the expected {sorted(schema.extras_shapes)}"
        for k, shape in schema.extras_shapes.items():
            if tuple(np.shape(update.extras[k])) != tuple(shape):
                return f"extra {k!r} has shape {tuple(np.shape(update.extras[k]))}, expected {tuple(shape)}"
    for k, v in update.extras.items():
        if not _finite(v):
            return f"non-finite values (NaN or inf) in extra {k!r}"
    return None
